"""BlockPool and KVCacheManager: allocation, ref counts, LRU eviction, prefix hits, and invariants
under random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserve.core.block_pool import BlockPool, block_key
from lmserve.core.kv_cache_manager import KVCacheManager
from lmserve.request import Request
from lmserve.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8), max_tokens=8)


def admit(kv: KVCacheManager, req: Request, num_new: int | None = None):
    hits, num_hit = kv.get_computed_blocks(req)
    num_new = req.num_tokens - num_hit if num_new is None else num_new
    table = kv.allocate_slots(req, num_new, hits)
    if table is not None:
        req.num_computed_tokens = num_hit + num_new
        kv.cache_blocks(req)
    return table, num_hit


def test_pool_allocate_free_and_lru_order() -> None:
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    assert [b.block_id for b in a] == [0, 1] and pool.num_free_blocks == 2
    pool.free_blocks(list(reversed(a)))
    # freed tail-first: block 1 goes to the free list before block 0
    b = pool.get_new_blocks(4)
    assert [x.block_id for x in b] == [2, 3, 1, 0]
    pool.check_invariants([b])


def test_pool_rejects_overallocation_and_double_free() -> None:
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    with pytest.raises(AssertionError):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(AssertionError):
        pool.free_blocks(blocks)


def test_cached_block_survives_free_until_reused() -> None:
    pool = BlockPool(2)
    (blk,) = pool.get_new_blocks(1)
    key = block_key(None, (1, 2, 3, 4))
    pool.cache_block(blk, key)
    pool.free_blocks([blk])
    assert pool.lookup(key) is blk, "a freed full block stays findable"
    pool.touch([blk])
    assert blk.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([blk])
    pool.get_new_blocks(2)  # reuses both blocks: the cached one is evicted
    assert pool.lookup(key) is None
    pool.check_invariants()


def test_prefix_hit_shares_blocks_and_never_covers_whole_prompt() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", list(range(12)))
    table_a, hit_a = admit(kv, a)
    assert hit_a == 0 and len(table_a) == 3
    b = make_request("b", list(range(12)))  # identical prompt: 3 full blocks cached
    table_b, hit_b = admit(kv, b)
    assert hit_b == 8, "at most num_tokens - 1 tokens come from the cache, rounded to blocks"
    assert table_b[:2] == table_a[:2] and table_b[2] is not table_a[2]
    assert table_a[0].ref_cnt == 2
    c = make_request("c", list(range(8)) + [99, 98, 97, 96, 95])
    _, hit_c = admit(kv, c)
    assert hit_c == 8
    kv.pool.check_invariants(list(kv.req_to_blocks.values()))
    for r in (a, b, c):
        kv.free(r)
    assert kv.pool.num_free_blocks == 16
    kv.pool.check_invariants([])


def test_different_prefix_same_block_tokens_do_not_hit() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    admit(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Block 2 has the same tokens (5..8) but a different parent: the chain must not match.
    _, hit = admit(kv, make_request("b", [0, 0, 0, 0, 5, 6, 7, 8, 9]))
    assert hit == 0


def test_allocate_returns_none_and_changes_nothing_when_full() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", list(range(8)))
    assert admit(kv, a)[0] is not None
    b = make_request("b", list(range(100, 108)))
    free_before = kv.pool.num_free_blocks
    assert kv.allocate_slots(b, 8) is None
    assert kv.pool.num_free_blocks == free_before and "b" not in kv.req_to_blocks


def test_prefix_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    admit(kv, make_request("a", list(range(9))))
    _, hit = admit(kv, make_request("b", list(range(9))))
    assert hit == 0


# ---- property test: random admit / grow / free sequences keep every invariant -----------------

ops = st.lists(
    st.tuples(st.sampled_from(["admit", "grow", "free"]), st.integers(0, 7), st.integers(1, 20)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(1, 24))
def test_random_operations_keep_invariants(ops, block_size: int, num_blocks: int) -> None:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    live: dict[str, Request] = {}
    counter = 0
    for op, which, length in ops:
        if op == "admit":
            counter += 1
            # prompts drawn from few prefixes so that hits happen
            tokens = [which % 3] * (length // 2) + list(range(length - length // 2))
            req = make_request(f"r{counter}", tokens)
            table, hit = admit(kv, req)
            if table is not None:
                live[req.request_id] = req
                assert hit < req.num_tokens
                assert len(table) * block_size >= req.num_tokens
        elif op == "grow" and live:
            req = list(live.values())[which % len(live)]
            req.append_output_token(which)
            if kv.allocate_slots(req, 1) is not None:
                req.num_computed_tokens += 1
                kv.cache_blocks(req)
        elif op == "free" and live:
            req = live.pop(list(live)[which % len(live)])
            kv.free(req)
        kv.pool.check_invariants(list(kv.req_to_blocks.values()))
        # every indexed block holds the tokens its key names: check through the tables that own them
        for rid, table in kv.req_to_blocks.items():
            req = live[rid]
            for i, blk in enumerate(table):
                if blk.key is not None:
                    assert blk.key[1] == tuple(req.all_token_ids[i * block_size : (i + 1) * block_size])
    for req in list(live.values()):
        kv.free(req)
    assert kv.pool.num_free_blocks == num_blocks
    kv.pool.check_invariants([])
