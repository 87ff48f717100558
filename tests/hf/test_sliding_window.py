"""Sliding-window attention through the engine: every layer reads only its window, and when every layer slides
(Mistral v0.1, Qwen2 with use_sliding_window over all layers) the blocks that fall out of the window go back to
the pool while the request runs. Greedy tokens equal HF's across decode, chunked prefill, prefix hits and
preemption; hybrid models (Gemma 2/3: global layers need everything) free nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmserve import LLM, SamplingParams, kernels
from lmserve.config.engine import EngineArgs
from lmserve.core.kv_cache_manager import NULL_BLOCK, KVCacheManager
from tests.helpers import build_model
from tests.hf_reference import hf_greedy

WINDOW = 8


@pytest.fixture(scope="module")
def swa_dirs(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("swa")
    return {
        "mistral": build_model(root / "mistral", "mistral", tokenizer_dir, sliding_window=WINDOW),
        "qwen2-all-sliding": build_model(
            root / "qwen2", "qwen2", tokenizer_dir, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0
        ),
    }


class HeldBlocks:
    """Records, for every allocate_slots call, how many real blocks the request holds and whether any entry of
    its table was freed (NULL_BLOCK)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.max_live, self.num_freed_seen = 0, 0
        real = KVCacheManager.allocate_slots

        def spy(kv, request, *args, **kwargs):
            table = real(kv, request, *args, **kwargs)
            if table is not None:
                self.max_live = max(self.max_live, sum(b is not NULL_BLOCK for b in table))
                self.num_freed_seen = max(self.num_freed_seen, sum(b is NULL_BLOCK for b in table))
            return table

        monkeypatch.setattr(KVCacheManager, "allocate_slots", spy)


def _prompts(n: int, length: int) -> list[list[int]]:
    shared = [(29 * i + 5) % 400 + 1 for i in range(20)]  # a 20-token prefix: hits across requests
    return [shared + [(11 * i + 7 * j) % 400 + 1 for j in range(length - 20)] for i in range(n)]


def _assert_greedy(llm: LLM, model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list:
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, max_tokens)
    return outs


def test_free_window_only_when_every_layer_slides(swa_dirs: dict[str, Path], model_dirs: dict[str, Path]) -> None:
    for name in ("mistral", "qwen2-all-sliding"):
        cfg = EngineArgs(str(swa_dirs[name]), num_kv_blocks=32).create_engine_config()
        assert cfg.model.layer_sliding_windows == (WINDOW, WINDOW) and cfg.cache.sliding_window == WINDOW
    for name in ("gemma2", "gemma3", "qwen2-swa", "mistral", "llama-gqa"):  # hybrid, or no window at all
        cfg = EngineArgs(str(model_dirs[name]), num_kv_blocks=32).create_engine_config()
        assert cfg.model.kv_free_window is None and cfg.cache.sliding_window is None, name


@pytest.mark.parametrize("kernels_on", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("name", ["mistral", "qwen2-all-sliding"])
def test_blocks_outside_the_window_are_freed_and_greedy_matches_hf(
    swa_dirs: dict[str, Path], name: str, kernels_on: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """40-token prompts (5 windows), 8-token prefill chunks, 4-token blocks, 24 decoded tokens: each request holds
    at most the window's blocks plus a chunk's, the second round hits the first round's blocks."""
    held = HeldBlocks(monkeypatch)
    if not kernels_on:
        kernels.set_enabled(False)
        monkeypatch.setattr(kernels, "paged_decode_attention", None)  # the torch path only
    try:
        llm = LLM(str(swa_dirs[name]), num_kv_blocks=64, block_size=4, max_num_batched_tokens=8)
        prompts = _prompts(3, 40)
        _assert_greedy(llm, swa_dirs[name], prompts[:1], 24)
        outs = _assert_greedy(llm, swa_dirs[name], prompts[1:], 24)
    finally:
        kernels.set_enabled(True)
    assert all(o.num_cached_tokens >= 16 for o in outs), "the shared prefix is still hit after being freed"
    bound = llm.engine.kv.num_blocks_held(64, 8)  # window 8 + 8-token chunks + slack: 5 blocks, of 16
    assert held.num_freed_seen >= (64 - WINDOW) // 4 - 1 and held.max_live <= bound == 5
    llm.engine.kv.pool.check_invariants([])
    assert llm.engine.kv.pool.num_free_blocks == 64


def test_request_longer_than_the_pool_runs_with_preemption(swa_dirs: dict[str, Path]) -> None:
    """A 12-block pool (48 tokens) serves four 70-token requests: each holds only its window's blocks, and the
    four together still run out, so some are preempted and recomputed; tokens equal HF's."""
    model_dir = swa_dirs["mistral"]
    llm = LLM(str(model_dir), num_kv_blocks=12, block_size=4, max_num_batched_tokens=8, max_model_len=128)
    prompts = [[(13 * i + 3 * j) % 400 + 1 for j in range(40)] for i in range(4)]
    _assert_greedy(llm, model_dir, prompts, 30)
    assert llm.get_metrics()["num_preemptions_total"] > 0
    llm.engine.kv.pool.check_invariants([])
    assert llm.engine.kv.pool.num_free_blocks == 12


def test_without_freeing_the_same_pool_refuses_the_request(model_dirs: dict[str, Path]) -> None:
    """The same 12-block pool on a model with a full-attention layer (Gemma 2 hybrid) cannot hold 128 tokens."""
    args = dict(num_kv_blocks=12, block_size=4, max_num_batched_tokens=8, max_model_len=128)
    with pytest.raises(ValueError, match="max_model_len=128 does not fit the KV pool"):
        EngineArgs(str(model_dirs["gemma2"]), **args).create_engine_config()


def test_hybrid_model_reads_only_its_windows_but_frees_nothing(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldBlocks(monkeypatch)
    model_dir = model_dirs["gemma3"]
    llm = LLM(str(model_dir), num_kv_blocks=64, block_size=4, max_num_batched_tokens=8)
    _assert_greedy(llm, model_dir, _prompts(2, 36), 12)
    assert held.num_freed_seen == 0 and held.max_live == 12


def test_pool_fit_of_max_model_len_counts_the_freed_blocks(swa_dirs: dict[str, Path]) -> None:
    """max_model_len need not fit the pool when the window plus one prefill chunk does (8 + 16 tokens: 7 blocks
    of 4); a smaller pool falls back to capping max_model_len at what it holds, as without a window."""
    args = dict(block_size=4, max_num_batched_tokens=16)
    cfg = EngineArgs(str(swa_dirs["mistral"]), num_kv_blocks=7, **args).create_engine_config()
    assert cfg.scheduler.max_model_len > cfg.cache.num_tokens == 28, "max_model_len is not capped by the pool"
    assert cfg.cache.max_concurrent_requests(cfg.scheduler.max_model_len) == 7 // 3  # 8 + 4 - 1 tokens: 3 blocks
    small = EngineArgs(str(swa_dirs["mistral"]), num_kv_blocks=6, **args).create_engine_config()
    assert small.scheduler.max_model_len == small.cache.num_tokens == 24
    with pytest.raises(ValueError, match="max_model_len=100 does not fit the KV pool"):
        EngineArgs(str(swa_dirs["mistral"]), num_kv_blocks=6, max_model_len=100, **args).create_engine_config()


def test_engine_and_ledger_agree_on_concurrency(swa_dirs: dict[str, Path]) -> None:
    from lmserve.memory.ledger import load_model_shape
    from lmserve.memory.report import memory_report

    model_dir = swa_dirs["mistral"]
    llm = LLM(str(model_dir), num_kv_blocks=40, block_size=4, max_num_batched_tokens=8)
    cache, max_len = llm.engine.config.cache, llm.engine.config.scheduler.max_model_len
    shape = load_model_shape(model_dir)
    weights = memory_report(shape, weight_dtype="fp32").weight_bytes
    report = memory_report(
        shape, seq_len=max_len, block_size=4, kv_dtype="fp32", weight_dtype="fp32",
        memory_bytes=weights + 40 * 4 * cache.kv_bytes_per_token,
    )  # fmt: skip
    assert report.num_kv_blocks == 40 and report.kv_freed_outside_window
    assert report.max_concurrent_requests == llm.get_metrics()["kv_cache_max_concurrent_requests"] == 40 // 3
