"""The prefix cache's disk tier end to end (engine/kv_tier.py over worker/kv_disk.py): the issue's reproduction,
greedy identity with and without the tier, restarts, fingerprints, corruption, int8 KV, a full disk, reset."""

from __future__ import annotations

import errno
import random
import threading
from pathlib import Path

import pytest

from lmserve import LLM, SamplingParams
from lmserve.config.engine import EngineArgs
from lmserve.memory.ledger import KV_DISK_HEADER_BYTES, kv_disk_blocks
from lmserve.worker import kv_disk

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
POOL = 40  # blocks of 16: one 420-token prompt (27 blocks) at a time, six others evict it


def _prompts() -> tuple[list[int], list[list[int]]]:
    rng = random.Random(0)
    return [rng.randrange(3, 500) for _ in range(420)], [[rng.randrange(3, 500) for _ in range(420)] for _ in range(6)]


def _llm(model: Path, disk: Path | None, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", POOL)
    return LLM(str(model), block_size=kw.pop("block_size", 16), kv_cache_disk_dir=None if disk is None else str(disk),
               **kw)  # fmt: skip


def _run(llm: LLM, prompt: list[int]) -> tuple[int, list[int]]:
    out = llm.generate([prompt], PARAMS, use_tqdm=False)[0]
    return out.num_cached_tokens, out.outputs[0].token_ids


def _session(llm: LLM) -> list[tuple[int, list[int]]]:
    """The issue's reproduction: the prompt twice, six others, the prompt again."""
    a, others = _prompts()
    runs = [_run(llm, a), _run(llm, a)]
    for p in others:
        _run(llm, p)
    return runs + [_run(llm, a)]


def test_evicted_prefix_hits_from_disk_with_the_same_tokens_and_after_a_restart(llama_dir: Path, tmp_path) -> None:
    plain = _llm(llama_dir, None)
    without = _session(plain)
    plain.close()
    assert [c for c, _ in without] == [0, 416, 0], "RAM alone: the returning prompt was evicted"
    tiered = _llm(llama_dir, tmp_path)
    with_tier = _session(tiered)
    assert [c for c, _ in with_tier] == [0, 416, 416], "the returning prompt hits from disk"
    assert [t for _, t in with_tier] == [t for _, t in without], "greedy tokens identical with and without the tier"
    m = tiered.engine.get_metrics()
    assert m["prefix_cache_disk_hits_total"] == 416 and m["prefix_cache_hits_total"] == 2 * 416
    assert m["kv_disk_blocks_read_total"] == 26 and m["kv_disk_blocks_written_total"] >= 26
    assert m["kv_disk_usage_bytes"] > 0 and sum(m["kv_disk_read_latency_seconds_buckets"].values()) == 26
    assert m["kv_disk_prefetches_total"] == 1 and m["kv_disk_blocks_read_sync_total"] == 0, "read in the background"
    tiered.close()
    a, _ = _prompts()
    restarted = _llm(llama_dir, tmp_path)  # a new engine on the same directory reuses the blocks
    assert _run(restarted, a) == (416, without[0][1])
    restarted.close()


@pytest.mark.parametrize("other", [{"block_size": 32}, {"kv_cache_dtype": "bfloat16"}, {"model": "qwen2"}])
def test_another_fingerprint_never_hits(model_dirs, llama_dir: Path, tmp_path, other: dict) -> None:
    a, _ = _prompts()
    first = _llm(llama_dir, tmp_path)
    _run(first, a)
    first.close()  # its blocks saved
    assert list(tmp_path.glob("*/*.kv"))
    kw = dict(other)
    model = model_dirs[kw.pop("model")] if "model" in kw else llama_dir
    second = _llm(model, tmp_path, **kw)
    assert _run(second, a)[0] == 0
    assert second.engine.get_metrics()["kv_disk_bad_files_total"] == 0, "other keys: its files are never read"
    second.close()


def test_corrupted_and_truncated_blocks_are_recomputed(llama_dir: Path, tmp_path) -> None:
    a, _ = _prompts()
    first = _llm(llama_dir, tmp_path)
    expected = _run(first, a)[1]
    first.close()
    files = sorted(tmp_path.glob("*/*.kv"))
    for i, f in enumerate(files):
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2] if i % 2 else data[:-9] + bytes([data[-9] ^ 0x40]) + data[-8:])
    again = _llm(llama_dir, tmp_path)
    cached, tokens = _run(again, a)
    assert tokens == expected and cached < 416
    assert again.engine.get_metrics()["kv_disk_bad_files_total"] >= 1
    again.close()


def test_int8_kv_blocks_with_their_scales_come_back_from_disk(llama_dir: Path, tmp_path) -> None:
    a, others = _prompts()
    plain = _llm(llama_dir, None, kv_cache_dtype="int8")
    _run(plain, a)
    ram_hit = _run(plain, a)  # what a hit reads: the quantized blocks
    plain.close()
    tiered = _llm(llama_dir, tmp_path, kv_cache_dtype="int8")
    _run(tiered, a)
    for p in others:
        _run(tiered, p)
    assert _run(tiered, a) == ram_hit
    m = tiered.engine.get_metrics()
    assert m["prefix_cache_disk_hits_total"] == 416
    tiered.close()
    # a block file is what the ledger counts (lmserve memory --kv-cache-disk-gib): header + the block, scales too
    per_block = 16 * m["kv_cache_bytes_per_token"]
    assert {f.stat().st_size for f in tmp_path.glob("*/*.kv")} == {KV_DISK_HEADER_BYTES + per_block}
    assert kv_disk_blocks(10 * (KV_DISK_HEADER_BYTES + per_block) + 1, 16, m["kv_cache_bytes_per_token"]) == 10


def test_a_full_disk_stops_writing_and_serving_goes_on(llama_dir: Path, tmp_path, monkeypatch) -> None:
    def no_space(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kv_disk.os, "replace", no_space)
    llm = _llm(llama_dir, tmp_path)
    a, others = _prompts()
    _run(llm, a)
    assert [_run(llm, p)[0] for p in others[:2]] == [0, 0], "evictions tried to write; serving went on"
    assert _run(llm, a)[0] == 0
    m = llm.engine.get_metrics()
    assert m["kv_disk_write_disabled"] == 1 and m["kv_disk_blocks_written_total"] == 0
    llm.close()


def test_reset_prefix_cache_with_the_disk_tier(llama_dir: Path, tmp_path) -> None:
    a, others = _prompts()
    llm = _llm(llama_dir, tmp_path)
    _run(llm, a)
    for p in others:
        _run(llm, p)
    llm.engine.reset_prefix_cache()  # RAM only: the disk still has the prompt
    assert _run(llm, a)[0] == 416
    for p in others:
        _run(llm, p)
    llm.engine.reset_prefix_cache(include_disk=True)
    assert _run(llm, a)[0] == 0 and not list(tmp_path.glob("*/*.kv"))
    llm.close()


@pytest.mark.parametrize(
    "kw, named",
    [({"enable_prefix_caching": False}, "enable_prefix_caching=False"),
     ({"kv_transfer_config": {"kv_connector": "lmserve", "kv_role": "kv_producer"}}, "kv_transfer_config"),
     ({"kv_cache_disk_gib": 0}, "kv_cache_disk_gib must be > 0"),
     ({"kv_cache_disk_gib": float("inf")}, "kv_cache_disk_gib must be > 0 and finite")],
)  # fmt: skip
def test_refused_at_start_up(llama_dir: Path, tmp_path, kw: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        EngineArgs(str(llama_dir), num_kv_blocks=POOL, kv_cache_disk_dir=str(tmp_path), **kw).create_engine_config()
    with pytest.raises(ValueError, match="without kv_cache_disk_dir"):
        EngineArgs(str(llama_dir), num_kv_blocks=POOL, kv_cache_disk_gib=1.0).create_engine_config()


@pytest.mark.slow  # (~10 s: two engines generating under preemption)
def test_preempted_requests_come_back_from_disk_with_the_same_tokens(llama_dir: Path, tmp_path) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(100)] for _ in range(3)]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    outs, metrics = [], []
    for disk in (None, tmp_path):
        llm = _llm(llama_dir, disk, num_kv_blocks=20, max_num_batched_tokens=64)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        metrics.append(llm.engine.get_metrics())
        llm.close()
    assert outs[0] == outs[1]
    assert metrics[1]["num_preemptions_total"] > 0 and metrics[1]["prefix_cache_disk_hits_total"] > 0


def test_a_background_read_does_not_hold_up_other_requests(llama_dir: Path, tmp_path) -> None:
    a, others = _prompts()
    llm = _llm(llama_dir, tmp_path)
    _run(llm, a)
    for p in others:
        _run(llm, p)  # a is on disk only now
    engine, tier = llm.engine, llm.engine.kv_disk
    gate = threading.Event()
    read_into = tier._read_into
    # held until b has finished, however long that takes here (the bound only keeps a failed run from hanging)
    tier._read_into = lambda keys, payloads: (gate.wait(600), read_into(keys, payloads))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request("a", a, params)
    engine.add_request("b", list(range(3, 43)), params)  # queued behind a, nothing of it on disk
    finished: dict[str, int] = {}
    while "b" not in finished:
        finished |= {o.request_id: o.num_cached_tokens for o in engine.step() if o.finished}
    assert "a" not in finished and engine.scheduler.waiting[0].request_id == "a", "a waits for its read"
    gate.set()
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o.num_cached_tokens for o in engine.step() if o.finished}
    assert finished["a"] == 416 and engine.get_metrics()["kv_disk_blocks_read_sync_total"] == 0
    llm.close()
