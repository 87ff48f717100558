import math

import pytest

from lmserve import LLM
from lmserve.bench.accuracy import heldout_texts, heldout_windows, score


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=128, max_num_batched_tokens=128)


def test_heldout_sample_has_english_and_chinese() -> None:
    texts = heldout_texts()
    assert len(texts) >= 4
    assert any("\u4e00" <= ch <= "\u9fff" for ch in texts[-1])


def test_windows_respect_size_and_budget(llm: LLM) -> None:
    windows = heldout_windows(llm, window=64, max_tokens=300)
    assert all(2 <= len(w) <= 64 for w in windows)
    assert sum(len(w) for w in windows) == 300


def test_score_matches_bundled_model_quality(llm: LLM) -> None:
    windows = heldout_windows(llm, window=128, max_tokens=512)
    s = score(llm, windows)
    assert s.num_positions == sum(len(w) - 1 for w in windows)
    # the model card reports held-out perplexity 87 (unigram 677; a uniform guess 8000)
    assert 10 < s.perplexity < 200, s.perplexity
    assert s.agreement(s) == 1.0
    assert all(lp <= 0 and math.isfinite(lp) for lp in s.logprobs)
