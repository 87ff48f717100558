"""worker/kv_pool.py: the KV pool's pages are committed as blocks are first used, in chunks, with a clear error when
the machine cannot hold the next chunk; and the engine built on it generates as before."""

from __future__ import annotations

import psutil
import pytest
import torch

from lmserve import LLM, SamplingParams
from lmserve.memory.ledger import kv_committed_bytes
from lmserve.model.kv_cache import KVCache
from lmserve.model.kv_pool import KVCommitError, KVPoolMemory, lazy_zeros, pool_tensors

MIB = 2**20


def _rss() -> int:
    return psutil.Process().memory_info().rss


def test_lazy_zeros_reads_zero_and_commits_nothing_until_written() -> None:
    before = _rss()
    t = lazy_zeros((256, 1024, 256), torch.float32, torch.device("cpu"))  # 256 MiB
    assert _rss() - before < 32 * MIB, "allocating commits no pages"
    assert t.shape == (256, 1024, 256) and t.dtype == torch.float32
    assert torch.count_nonzero(t[::17]) == 0, "unwritten rows read as zeros"
    t[3].fill_(1.5)
    assert t[3].sum().item() == 1.5 * 1024 * 256 and t[4].abs().sum().item() == 0
    assert lazy_zeros((4, 8), torch.float8_e4m3fn, "cpu").view(torch.uint8).sum().item() == 0


def test_ensure_commits_whole_chunks_in_block_order() -> None:
    blocks, row = 64, 2 * MIB  # 2 MiB per block per tensor, 2 tensors: 4 MiB a block
    tensors = [lazy_zeros((blocks, row // 4), torch.float32, "cpu") for _ in range(2)]
    pool = KVPoolMemory(blocks, tensors, chunk_bytes=32 * MIB, available=lambda: None)
    assert pool.block_bytes == 4 * MIB and pool.pool_bytes == 256 * MIB and pool.committed_bytes == 0
    before = _rss()
    pool.ensure(0)
    assert pool.committed_blocks == 8, "one chunk: 32 MiB of 4 MiB blocks"
    grown = _rss() - before
    assert 28 * MIB < grown < 48 * MIB, f"the chunk's pages are resident: {grown / MIB:.1f} MiB"
    pool.ensure(7)
    assert pool.committed_blocks == 8, "inside the committed range: nothing more"
    pool.ensure(20)
    assert pool.committed_blocks == 24 and pool.committed_bytes == 96 * MIB
    pool.ensure(63)
    assert pool.committed_blocks == 64, "the last chunk stops at the pool's end"
    assert pool.committed_bytes == kv_committed_bytes(64, 64, 4 * MIB)
    assert kv_committed_bytes(9, 64, 4 * MIB) == 64 * MIB, "the ledger rounds as the pool does"


def test_commit_keeps_what_was_written_before_it() -> None:
    # a block a KV transfer imported before the step that counts it: committing must not zero it
    t = lazy_zeros((32, 1024), torch.float32, "cpu")
    t[5].fill_(2.0)
    t[5, 0] = -3.0
    KVPoolMemory(32, [t], chunk_bytes=4096, available=lambda: None).ensure(31)
    assert t[5, 0].item() == -3.0 and t[5, 1:].eq(2.0).all() and t[6].abs().sum().item() == 0


def test_a_chunk_the_machine_cannot_hold_is_a_clear_error() -> None:
    tensors = [lazy_zeros((16, 1024), torch.float32, "cpu")]
    # a machine with 24 KiB above the reserve, less what the pool has committed: one 16 KiB chunk fits, two do not
    pool = KVPoolMemory(16, tensors, chunk_bytes=16 * 1024, reserve_bytes=MIB)
    pool._available = lambda: MIB + 24 * 1024 - pool.committed_bytes
    pool.ensure(1)
    assert pool.committed_blocks == 4
    with pytest.raises(KVCommitError, match=r"blocks 4\.\.7 .*cannot be committed.*kv_cache_memory_gib"):
        pool.ensure(5)
    assert pool.committed_blocks == 4, "nothing more counted as committed"
    assert isinstance(KVCommitError("x"), MemoryError)


def test_added_tensors_are_committed_as_far_as_the_others() -> None:
    target = KVCache.allocate(40, 4, 2, 8, "int8", torch.device("cpu"))
    assert target.k_scale is not None and target.k_scale.abs().sum().item() == 0
    pool = KVPoolMemory(40, pool_tensors([target]), chunk_bytes=1024, available=lambda: None)
    pool.ensure(9)
    draft = KVCache.allocate(40, 4, 1, 8, "float32", torch.device("cpu"))
    pool.add(pool_tensors([draft]))
    assert pool.block_bytes == 2 * (4 * 2 * 8) + 2 * (4 * 2 * 4) + 2 * (4 * 8 * 4)
    assert pool.committed_blocks >= 10


def test_default_pool_is_committed_as_requests_use_it() -> None:
    # the default pool (a quarter of free RAM, at most 4 GiB) on the bundled model: one small request, one chunk
    before = _rss()
    with LLM(max_model_len=256) as llm:
        m = llm.get_metrics()
        assert m["kv_cache_committed_bytes"] == 0, "nothing committed before the first request"
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        m = llm.get_metrics()
        pool = llm.engine.runner.kv_pool
        blocks = llm.engine.config.cache.num_blocks
        assert m["kv_cache_committed_bytes"] == pool.committed_bytes == kv_committed_bytes(1, blocks, pool.block_bytes)
        assert 0 < m["kv_cache_committed_bytes"] <= 64 * MIB and pool.pool_bytes == m["kv_cache_capacity_bytes"]
        grown = _rss() - before
        assert grown < 64 * MIB + m["kv_cache_capacity_bytes"] / 4, f"RSS grew {grown / MIB:.0f} MiB"


def test_engine_step_that_cannot_commit_raises_kv_commit_error() -> None:
    llm = LLM(num_kv_blocks=64, max_model_len=256)
    llm.engine.runner.kv_pool._available = lambda: 0  # a machine whose memory went elsewhere since the start
    with pytest.raises(KVCommitError, match="cannot be committed"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    engine = llm.engine
    del llm  # the last reference: its collection closes the engine
    assert engine.closed and engine.runner is None
