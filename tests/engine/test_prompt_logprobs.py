"""Prompt logprobs and scoring in the engine (what /v1/completions' echo and prompt_logprobs stand on).

Against HF transformers' log_softmax of the whole prompt's forward (float32, 1e-4): scoring only
(max_tokens 0: nothing generated), a prompt that fills max_model_len, n > 1 (the prompt is scored once and
the other sequences read its blocks from the prefix cache), prefix-cache hits before and after a scoring
request, and the log_softmax computed a slice of rows at a time. Quantized configurations (KV int8 / fp8,
int8 / int4 weights), chunked or not, against their own generation path: entry L of the prompt logprobs is
log_softmax of the logits at position L - 1, which are also the logits the sampler reads when the prompt
stops at L, computed by the same chunks (L at a chunk's end).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lmserve import LLM, SamplingParams
from lmserve.worker import model_runner
from tests.hf_reference import hf_model

PROMPT = "import json\nimport os\nclass Foo:\n    def bar(self):\n        return 42\n" * 3  # 105 tokens
TOL = 1e-4


@torch.inference_mode()
def hf_log_softmax(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """Row p: HF's log_softmax of the logits at position p (it scores token p + 1)."""
    return torch.log_softmax(hf_model(model_dir)(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_matches_hf(prompt_logprobs: list[Any], ids: list[int], ref: torch.Tensor, k: int) -> None:
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids), "one entry per prompt token"
    for pos in range(1, len(ids)):
        e = prompt_logprobs[pos]
        assert e.token_id == ids[pos]
        assert abs(e.logprob - float(ref[pos - 1, ids[pos]])) < TOL, f"position {pos}"
        assert e.rank == int((ref[pos - 1] > ref[pos - 1, ids[pos]]).sum()) + 1
        top = ref[pos - 1].topk(k)
        assert [t for t, _ in e.top_logprobs] == top.indices.tolist(), f"position {pos}"
        assert [v for _, v in e.top_logprobs] == pytest.approx(top.values.tolist(), abs=TOL)


def test_scoring_only_generates_nothing_and_is_counted(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=32, block_size=16, max_num_batched_tokens=16)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=3), use_tqdm=False)[0]
    assert [(c.text, c.token_ids, c.finish_reason) for c in out.outputs] == [("", [], "length")]
    assert out.finished and out.metrics.first_token_time is None, "no token was generated"
    ids = out.prompt_token_ids
    assert_matches_hf(out.prompt_logprobs, ids, hf_log_softmax(llama_dir, ids), 3)
    m = llm.get_metrics()
    assert (m["prompt_tokens_total"], m["generation_tokens_total"]) == (len(ids), 0)
    assert m["finished_requests_by_reason"]["length"] == 1 and m["num_requests_running"] == 0
    assert m["kv_cache_usage"] == 0.0, "its blocks are freed"


def test_scoring_a_prompt_that_fills_max_model_len(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=32, block_size=16, max_model_len=64)
    ids = llm.engine.tokenize(PROMPT)[1][:64]
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)[0]
    assert_matches_hf(out.prompt_logprobs, ids, hf_log_softmax(llama_dir, ids), 1)
    with pytest.raises(ValueError, match="prompt is 64 tokens, but max_model_len is 64"):
        llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)


@pytest.mark.parametrize("budget", [None, 7], ids=["whole", "chunked"])
def test_n_sequences_score_the_prompt_once_and_share_its_blocks(llama_dir: Path, budget: int | None) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=64, block_size=16, max_num_batched_tokens=budget)
    params = SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=5, ignore_eos=True, prompt_logprobs=2)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    ids = out.prompt_token_ids
    assert_matches_hf(out.prompt_logprobs, ids, hf_log_softmax(llama_dir, ids), 2)
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 4 for c in out.outputs)
    # sequences 1 and 2 found the prompt's full blocks (computed by sequence 0) in the prefix cache
    assert llm.get_metrics()["prefix_cache_hits_total"] == 2 * (len(ids) // 16) * 16


def test_prefix_cache_hits_around_a_scoring_request(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=64, block_size=16, max_num_batched_tokens=16)
    plain = SamplingParams(max_tokens=1, temperature=0)
    first = llm.generate([PROMPT], plain, use_tqdm=False)[0]  # caches the prompt's blocks
    ids = first.prompt_token_ids
    scored = llm.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=2), use_tqdm=False)[0]
    # the cached prefix has no logits: the scoring request computes every position itself
    assert scored.num_cached_tokens == 0
    assert_matches_hf(scored.prompt_logprobs, ids, hf_log_softmax(llama_dir, ids), 2)
    # its own blocks serve the requests after it (registered like any request's)
    llm.engine.kv.pool.reset_prefix_cache()
    llm.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)
    again = llm.generate([PROMPT], plain, use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(ids) - 1) // 16 * 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_log_softmax_runs_a_slice_of_rows_at_a_time(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole prompt in one step, yet no logits tensor of more than 16 rows: [prompt_len, vocab] never exists."""
    llm = LLM(str(llama_dir), num_kv_blocks=64, block_size=16, max_num_batched_tokens=512, max_model_len=512)
    vocab = llm.engine.config.model.vocab_size
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_SLICE_ELEMENTS", 16 * vocab)
    model = llm.engine.runner.model
    rows: list[int] = []
    compute_logits = model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return compute_logits(hidden)

    monkeypatch.setattr(model, "compute_logits", recording)
    ids = (llm.engine.tokenize(PROMPT)[1] * 4)[:400]
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=5), use_tqdm=False)[0]
    assert llm.get_metrics()["num_steps_total"] == 1, "the 400 prompt tokens ran in one step"
    assert max(rows) == 16 and sum(rows) == len(ids) - 1, rows
    assert_matches_hf(out.prompt_logprobs, ids, hf_log_softmax(llama_dir, ids), 5)


QUANTIZED = [
    {"kv_cache_dtype": "int8"},
    {"kv_cache_dtype": "fp8_e4m3"},
    {"quantization": "int8"},
    {"quantization": "int4"},
]


@pytest.mark.parametrize("budget", [None, 7], ids=["whole", "chunked"])
@pytest.mark.parametrize("config", QUANTIZED, ids=lambda c: "-".join(map(str, c.values())))
def test_quantized_prompt_logprobs_are_the_logits_the_sampler_reads(
    llama_dir: Path, config: dict[str, str], budget: int | None
) -> None:
    """Entry L scores token L with the logits at position L - 1: exactly the distribution the sampler reads when
    the prompt ends at L. With chunks of 7, prompts cut at chunk ends are computed by the same chunks."""
    # no prefix cache: a hit would change the chunks that compute a cut prompt
    llm = LLM(
        str(llama_dir), num_kv_blocks=64, block_size=16, max_num_batched_tokens=budget, enable_prefix_caching=False,
        **config,
    )  # fmt: skip
    ids = llm.engine.tokenize(PROMPT)[1]
    k = 5
    scored = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=k), use_tqdm=False)[0]
    cuts = [7, 14, 49, 98] if budget else [len(ids) - 1]  # whole: the same single chunk minus its last token
    sampled = llm.generate(
        [ids[:cut] for cut in cuts], SamplingParams(max_tokens=1, temperature=0, logprobs=k), use_tqdm=False
    )
    for cut, out in zip(cuts, sampled, strict=True):
        expected = out.outputs[0].logprobs[0].top_logprobs
        got = scored.prompt_logprobs[cut].top_logprobs
        assert [t for t, _ in got] == [t for t, _ in expected], f"cut {cut}"
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], abs=TOL), f"cut {cut}"


@pytest.mark.parametrize(
    "config, tol",
    [({"kv_cache_dtype": "int8"}, 0.2), ({"quantization": "int8"}, 0.02), ({"quantization": "int4"}, TOL)],
    ids=["kv-int8", "int8", "int4"],
)
def test_quantized_chunked_prompt_logprobs_near_the_whole_prompt(
    llama_dir: Path, config: dict[str, str], tol: float
) -> None:
    """Chunked against whole-prompt scoring in the same configuration. Only int4 (weight-only) computes the same
    math both ways; a chunk reads its cached context dequantized (KV int8) and int8 activations round per token,
    so a float32 rounding difference can move a value one quantum: the bounds are that noise on this random model
    (measured: KV int8 0.08, int8 weights 0.005), well below a real error's size."""
    scores = []
    for budget in (None, 7):
        llm = LLM(str(llama_dir), num_kv_blocks=64, block_size=16, max_num_batched_tokens=budget, **config)
        out = llm.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)[0]
        scores.append(torch.tensor([e.logprob for e in out.prompt_logprobs[1:]]))
    assert float((scores[0] - scores[1]).abs().max()) < tol
