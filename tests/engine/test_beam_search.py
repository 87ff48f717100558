"""Beam search (LLM.beam_search) against HF generate(num_beams=k, do_sample=False, length_penalty=...) token for
token, on tiny random Llama and Qwen2 models.

The bundled models' EOS (id 0) is practically never a candidate, so to exercise finishing on EOS each family
gets a copy whose EOS is the token its beams produce most often (found by an ignore_eos run): same weights, only
eos_token_id changed in config.json and generation_config.json, which both lmserve and HF read.
"""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from lmserve import LLM
from lmserve.engine.beam_search import BeamSearchOutput, BeamSearchParams
from tests.hf_reference import hf_greedy, hf_model

PROMPTS = ["The capital of France is", "def fib(n):", "a", "x = 1"]
FAMILIES = ["llama-gqa", "qwen2"]


@torch.inference_mode()
def hf_beam(
    model_dir: Path,
    prompt_ids: list[int],
    params: BeamSearchParams,
    num_return_sequences: int,
) -> tuple[list[list[int]], list[float]]:
    """HF's returned sequences (generated tokens only, padding cut) and their sequences_scores."""
    out = hf_model(model_dir).generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        num_beams=params.beam_width,
        do_sample=False,
        length_penalty=params.length_penalty,
        early_stopping=params.early_stopping,
        max_new_tokens=params.max_tokens,
        num_return_sequences=num_return_sequences,
        return_dict_in_generate=True,
        output_scores=True,
        pad_token_id=0,
    )
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    seqs = out.sequences[:, len(prompt_ids) :]
    return [s[:n].tolist() for s, n in zip(seqs, lengths, strict=True)], out.sequences_scores.tolist()


def assert_matches_hf(model_dir: Path, outs: list[BeamSearchOutput], params: BeamSearchParams) -> None:
    for out in outs:
        expected, scores = hf_beam(model_dir, out.prompt_token_ids, params, params.beam_width)
        got = [s.token_ids for s in out.sequences]
        assert got == expected, f"beam search mismatch for prompt {out.prompt!r}"
        for seq, score in zip(out.sequences, scores, strict=True):
            assert seq.score == pytest.approx(score, rel=1e-5, abs=1e-5)
            assert seq.score == pytest.approx(
                seq.cumulative_logprob / len(seq.token_ids) ** params.length_penalty, rel=1e-5
            )
            assert seq.cumulative_logprob == pytest.approx(sum(seq.logprobs), rel=1e-5, abs=1e-5)
            assert len(seq.logprobs) == len(seq.token_ids)


def with_eos(src: Path, dst: Path, eos: int | list[int]) -> Path:
    shutil.copytree(src, dst)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((dst / name).read_text())
        cfg["eos_token_id"] = eos
        (dst / name).write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def llms(model_dirs: dict[str, Path]) -> dict[str, LLM]:
    return {name: LLM(str(model_dirs[name]), num_kv_blocks=256) for name in FAMILIES}


@pytest.fixture(scope="module")
def frequent_tokens(llms: dict[str, LLM]) -> dict[str, list[int]]:
    """Per family: the tokens its beams produce, most frequent first."""
    out = {}
    for name in FAMILIES:
        base = llms[name].beam_search(PROMPTS, BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True))
        counts = Counter(t for o in base for s in o.sequences for t in s.token_ids)
        out[name] = [t for t, _ in counts.most_common()]
    return out


@pytest.fixture(scope="module")
def eos_models(
    model_dirs: dict[str, Path], frequent_tokens: dict[str, list[int]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, LLM]]:
    """Per family: a copy of the model whose EOS is its beams' most frequent token, and an LLM on it."""
    root = tmp_path_factory.mktemp("eos_models")
    out = {}
    for name in FAMILIES:
        eos = frequent_tokens[name][0]
        path = with_eos(model_dirs[name], root / name, eos)
        llm = LLM(str(path), num_kv_blocks=256)
        assert llm.engine.eos_token_ids == (eos,)
        out[name] = (path, llm)
    return out


CASES = [
    # family, beam_width, max_tokens, length_penalty, early_stopping
    ("llama-gqa", 2, 10, 1.0, False),
    ("llama-gqa", 4, 12, 0.0, False),
    ("llama-gqa", 3, 12, 2.0, False),
    ("llama-gqa", 3, 12, 2.0, "never"),
    ("qwen2", 3, 10, 1.0, False),
    ("qwen2", 4, 12, 0.0, False),
    ("qwen2", 2, 12, 2.0, False),
    ("qwen2", 3, 16, 0.0, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "{}-k{}-n{}-lp{}-es{}".format(*c))
def test_matches_hf_with_eos(eos_models: dict[str, tuple[Path, LLM]], case: tuple) -> None:
    name, width, max_tokens, length_penalty, early_stopping = case
    path, llm = eos_models[name]
    params = BeamSearchParams(width, max_tokens, length_penalty, early_stopping=early_stopping)
    outs = llm.beam_search(PROMPTS, params)
    assert [o.prompt for o in outs] == PROMPTS
    assert_matches_hf(path, outs, params)
    eos = llm.engine.eos_token_ids
    for out in outs:
        assert len(out.sequences) == width
        scores = [s.score for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        for seq in out.sequences:
            assert seq.finish_reason == ("stop" if seq.token_ids[-1] in eos else "length")
            assert seq.finish_reason == "stop" or len(seq.token_ids) == max_tokens
            assert eos[0] not in seq.token_ids[:-1]
    if length_penalty <= 1.0:
        assert any(s.finish_reason == "stop" for o in outs for s in o.sequences), "EOS should end some beams"
    if early_stopping is True:
        # Stops once beam_width hypotheses are finished, before max_tokens for some prompt.
        assert any(all(s.finish_reason == "stop" for s in o.sequences) for o in outs)


@pytest.mark.parametrize("name", FAMILIES)
def test_best_sequence_matches_hf_num_return_1(eos_models: dict[str, tuple[Path, LLM]], name: str) -> None:
    path, llm = eos_models[name]
    params = BeamSearchParams(beam_width=5, max_tokens=10, length_penalty=1.0)
    for out in llm.beam_search(PROMPTS[:2], params):
        best, _ = hf_beam(path, out.prompt_token_ids, params, num_return_sequences=1)
        assert [out.sequences[0].token_ids] == best


@pytest.mark.parametrize("name", FAMILIES)
def test_ignore_eos_matches_hf_without_eos(
    eos_models: dict[str, tuple[Path, LLM]], model_dirs: dict[str, Path], name: str
) -> None:
    """ignore_eos on the EOS copy equals beam search on the original weights, where EOS never comes up."""
    _, llm = eos_models[name]
    params = BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=1.0, ignore_eos=True)
    outs = llm.beam_search(PROMPTS[:3], params)
    assert_matches_hf(model_dirs[name], outs, params)
    assert all(s.finish_reason == "length" and len(s.token_ids) == 12 for o in outs for s in o.sequences)


def test_multiple_eos_ids(model_dirs: dict[str, Path], frequent_tokens: dict[str, list[int]], tmp_path: Path) -> None:
    """Two EOS ids: HF keeps max(2, 1 + #eos) * k = 3k candidates per step; so do we (and cap k at 6)."""
    path = with_eos(model_dirs["qwen2"], tmp_path / "m", frequent_tokens["qwen2"][1:3])
    llm = LLM(str(path), num_kv_blocks=256)
    params = BeamSearchParams(beam_width=4, max_tokens=12, length_penalty=0.0)
    outs = llm.beam_search(PROMPTS, params)
    assert_matches_hf(path, outs, params)
    assert any(s.finish_reason == "stop" for o in outs for s in o.sequences)
    with pytest.raises(ValueError, match="beam_width must be <= 6"):
        llm.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=7, max_tokens=4))


def test_prefix_cache_computes_only_new_tokens(model_dirs: dict[str, Path]) -> None:
    """Each step re-submits every beam; prefix caching leaves under one block per beam to compute."""
    path = model_dirs["llama-gqa"]
    llm = LLM(str(path), num_kv_blocks=256, block_size=4)
    params = BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=1.0)
    outs = llm.beam_search(PROMPTS[:2], params)
    assert_matches_hf(path, outs, params)
    m = llm.get_metrics()
    computed = m["prefix_cache_queries_total"] - m["prefix_cache_hits_total"]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    # The first step computes the prompts; every later request recomputes only its uncached tail (< 1 block + 1).
    assert computed <= prompt_tokens + 4 * (m["num_requests_total"] - len(outs))
    assert m["prefix_cache_hits_total"] > 3 * computed
    # All beams of all prompts batch into one engine step per beam-search step.
    assert m["num_steps_total"] == params.max_tokens
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.pool.num_free_blocks == 256


def test_beam_width_1_is_greedy(llms: dict[str, LLM], model_dirs: dict[str, Path]) -> None:
    llm = llms["qwen2"]
    prompt_ids = llm.get_tokenizer().encode(PROMPTS[1])
    out = llm.beam_search(prompt_ids, BeamSearchParams(beam_width=1, max_tokens=12, ignore_eos=True))
    assert len(out) == 1 and out[0].prompt is None and out[0].prompt_token_ids == prompt_ids
    assert out[0].sequences[0].token_ids == hf_greedy(model_dirs["qwen2"], prompt_ids, 12)


def test_output_text_and_token_prompts(llms: dict[str, LLM]) -> None:
    llm = llms["llama-gqa"]
    tok = llm.get_tokenizer()
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    by_text = llm.beam_search(PROMPTS[0], params)
    by_ids = llm.beam_search([tok.encode(PROMPTS[0])], params)
    assert [s.token_ids for s in by_text[0].sequences] == [s.token_ids for s in by_ids[0].sequences]
    for seq in by_text[0].sequences:
        assert seq.text == tok.decode(seq.token_ids, skip_special_tokens=True)
        assert all(math.isfinite(lp) and lp <= 0 for lp in seq.logprobs)
    assert llm.beam_search([], params) == []


def test_max_tokens_capped_by_max_model_len(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["qwen2"]
    llm = LLM(str(path), num_kv_blocks=64, max_model_len=32)
    prompt_ids = llm.get_tokenizer().encode("import json\nimport os\n" * 4)[:28]
    params = BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True)
    outs = llm.beam_search([prompt_ids], params)
    assert all(len(s.token_ids) == 4 for s in outs[0].sequences), "room for 32 - 28 tokens only"
    assert_matches_hf(path, outs, BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": 11}, "beam_width"),
        ({"beam_width": True}, "beam_width"),
        ({"beam_width": 2.0}, "beam_width"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": None}, "max_tokens"),
        ({"length_penalty": float("nan")}, "length_penalty"),
        ({"length_penalty": float("inf")}, "length_penalty"),
        ({"length_penalty": "1"}, "length_penalty"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"early_stopping": "always"}, "early_stopping"),
        ({"early_stopping": 1}, "early_stopping"),
    ],
)
def test_params_validation(kwargs: dict, field: str) -> None:
    args = {"beam_width": 2, "max_tokens": 8} | kwargs
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**args)


def test_params_accept_valid_values() -> None:
    p = BeamSearchParams(beam_width=10, max_tokens=1, length_penalty=2, early_stopping="never")
    assert p.length_penalty == 2.0 and isinstance(p.length_penalty, float)


def test_bad_prompt_rejected_before_anything_runs(llms: dict[str, LLM]) -> None:
    llm = llms["llama-gqa"]
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt is empty"):
        llm.beam_search([PROMPTS[0], []], BeamSearchParams(beam_width=2, max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
