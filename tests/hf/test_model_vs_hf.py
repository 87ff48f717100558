"""lmserve against HF transformers on tiny random models: logits and greedy tokens, under every
scheduling path (batched, chunked prefill, prefix-cache hits, preemption, static batching)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmserve import LLM, SamplingParams
from tests.conftest import MODEL_SPECS
from tests.hf_reference import hf_greedy, hf_last_logits

PROMPTS = [
    "The capital of France is",
    "def fib(n):",
    "import json\nimport os\n\nclass Decoder(object):\n    def __init__(self, strict=True):",
    "床前明月光，疑是地上霜。",
    "a",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def assert_greedy_matches_hf(llm: LLM, model_dir: Path, prompts: list[str], max_tokens: int = 24) -> list:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt == prompt
        expected = hf_greedy(model_dir, out.prompt_token_ids, max_tokens)
        assert out.outputs[0].token_ids == expected, f"greedy mismatch for {prompt!r}"
        assert out.outputs[0].finish_reason == "length"
    return outs


@pytest.mark.parametrize("name", sorted(MODEL_SPECS))
def test_last_logits_match_hf(model_dirs: dict[str, Path], name: str) -> None:
    llm = LLM(str(model_dirs[name]), num_kv_blocks=64)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=1, temperature=0.0))
    sched = engine.scheduler.schedule()
    assert len(sched.scheduled) == len(PROMPTS), "all prompts should share one step"
    out = engine.runner.execute(sched)
    for row, s in enumerate(sched.scheduled):
        expected = hf_last_logits(model_dirs[name], s.request.prompt_token_ids)
        torch.testing.assert_close(out.logits[row], expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(MODEL_SPECS))
def test_greedy_batch_matches_hf(model_dirs: dict[str, Path], name: str) -> None:
    llm = LLM(str(model_dirs[name]), num_kv_blocks=64)
    assert_greedy_matches_hf(llm, model_dirs[name], PROMPTS)


def test_chunked_prefill_matches_hf(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=64, max_num_batched_tokens=8, block_size=4)
    long_prompt_ids = llm.get_tokenizer().encode(PROMPTS[2])
    assert len(long_prompt_ids) > 3 * 8, "the prompt must need several chunks"
    assert_greedy_matches_hf(llm, llama_dir, PROMPTS)
    # The 8-token budget forces the long prompt into >= 4 prefill steps.
    assert llm.get_metrics()["num_steps_total"] >= len(long_prompt_ids) // 8 + 24


def test_prefix_cache_hits_and_matches_hf(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=128, block_size=4)
    system = "You are a helpful assistant. Answer in one line.\nimport json\nimport os\n"
    first = assert_greedy_matches_hf(llm, llama_dir, [system + "Q: what?"])
    assert first[0].num_cached_tokens == 0
    outs = assert_greedy_matches_hf(llm, llama_dir, [system + "Q: why not?", system + "Q: where"])
    prefix_len = len(llm.get_tokenizer().encode(system))
    for out in outs:
        assert out.num_cached_tokens >= (prefix_len // 4 - 1) * 4, "shared prefix blocks should be reused"
        assert out.num_cached_tokens < len(out.prompt_token_ids)
    metrics = llm.get_metrics()
    assert metrics["prefix_cache_hits_total"] == sum(o.num_cached_tokens for o in outs)
    assert metrics["prefix_cache_queries_total"] == sum(len(o.prompt_token_ids) for o in first + outs)


def test_whole_prompt_cached_still_computes_one_token(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=64, block_size=4)
    prompt_ids = list(range(10, 26))  # exactly 4 full blocks
    a = llm.generate([prompt_ids], GREEDY, use_tqdm=False)[0]
    b = llm.generate([prompt_ids], GREEDY, use_tqdm=False)[0]
    assert b.num_cached_tokens == 12, "the last block is recomputed so the prompt's last token has logits"
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == hf_greedy(llama_dir, prompt_ids, 24)


def test_preemption_matches_hf(llama_dir: Path) -> None:
    # 6 requests × ~4 blocks each need more than the 12-block pool: some must be preempted and recomputed.
    llm = LLM(str(llama_dir), num_kv_blocks=12, block_size=16)
    prompts = [f"Request number {i}: import json, os, sys" for i in range(6)]
    assert_greedy_matches_hf(llm, llama_dir, prompts, max_tokens=30)
    assert llm.get_metrics()["num_preemptions_total"] > 0
    assert llm.engine.kv.pool.num_free_blocks == 12, "every block is free again at the end"


def test_preemption_without_prefix_cache(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=12, block_size=16, enable_prefix_caching=False)
    prompts = [f"Request number {i}: import json, os, sys" for i in range(6)]
    assert_greedy_matches_hf(llm, llama_dir, prompts, max_tokens=30)
    assert llm.get_metrics()["num_preemptions_total"] > 0


def test_static_batching_matches_hf(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=64, scheduling_policy="static", max_num_seqs=2)
    assert_greedy_matches_hf(llm, llama_dir, PROMPTS)


def test_chunked_prefill_disabled_matches_hf(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=64, enable_chunked_prefill=False, max_model_len=256)
    assert_greedy_matches_hf(llm, llama_dir, PROMPTS)


def test_sharded_checkpoint_loads(tmp_path: Path, llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llama_dir)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    for f in llama_dir.glob("tokenizer*"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    llm = LLM(str(tmp_path), num_kv_blocks=64)
    assert_greedy_matches_hf(llm, llama_dir, PROMPTS[:2])


def test_bfloat16_runs(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=64, dtype="bfloat16")
    assert llm.engine.runner.kv_caches[0].k.dtype == torch.bfloat16
    out = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in out)


def _shared_prefix_prompts(n: int) -> list[list[int]]:
    prefix = [(37 * i + 11) % 500 + 1 for i in range(64)]
    return [prefix + [(7 * i + 3 * j) % 500 + 1 for j in range(3 + i % 4)] for i in range(n)]


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(num_kv_blocks=64, block_size=16),
        dict(num_kv_blocks=64, block_size=16, max_num_batched_tokens=40),  # the prefix spans two steps
        dict(num_kv_blocks=12, block_size=16),  # 6 requests × (5 prefix-shared + own) blocks: preemption
    ],
    ids=["one-step", "chunked", "preemption"],
)
def test_burst_computes_shared_prefix_once(llama_dir: Path, engine_args: dict) -> None:
    n = 6
    llm = LLM(str(llama_dir), **engine_args)
    prompts = _shared_prefix_prompts(n)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(llama_dir, prompt, 30)
    assert sum(o.num_cached_tokens for o in outs) >= (n - 1) * 64, "one request computes the prefix"
    assert llm.get_metrics()["prefix_cache_hits_total"] >= (n - 1) * 64
    if engine_args["num_kv_blocks"] == 12:
        assert llm.get_metrics()["num_preemptions_total"] > 0
    llm.engine.kv.pool.check_invariants([])
    assert llm.engine.kv.pool.num_free_blocks == engine_args["num_kv_blocks"]


@pytest.mark.parametrize("name", sorted(MODEL_SPECS))
def test_chunked_prefill_and_prefix_hits_match_hf(model_dirs: dict[str, Path], name: str) -> None:
    """Every family under 8-token chunks and 4-token blocks: prompts cross the 12-token sliding windows of
    the *-swa / gemma specs, the second round hits the first round's blocks (and its own, within the step)."""
    model_dir = model_dirs[name]
    llm = LLM(str(model_dir), num_kv_blocks=96, block_size=4, max_num_batched_tokens=8)
    system = "import json\nimport os\n\nclass Decoder(object):\n"
    assert_greedy_matches_hf(llm, model_dir, [system + "    pass"], max_tokens=16)
    outs = assert_greedy_matches_hf(llm, model_dir, [system + "    x = 1", system + "    def f(self):"], 16)
    assert all(o.num_cached_tokens >= 16 for o in outs), "the shared prefix is reused"
