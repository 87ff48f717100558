"""BlockPool and KVCacheManager: allocation, ref counts, LRU eviction, prefix hits, and invariants
under random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserve.core.block_pool import BlockPool, block_key
from lmserve.core.kv_cache_manager import NULL_BLOCK, KVCacheManager
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
@given(
    ops=ops,
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(1, 24),
    window=st.sampled_from([None, None, 1, 3, 8]),
)
def test_random_operations_keep_invariants(ops, block_size: int, num_blocks: int, window: int | None) -> None:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size, sliding_window=window)
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
        kv.pool.check_invariants(kv.live_tables())
        # every indexed block holds the tokens its key names: check through the tables that own them
        for rid, table in kv.req_to_blocks.items():
            req = live[rid]
            for i, blk in enumerate(table):
                if blk.key is not None:
                    assert blk.key[1] == tuple(req.all_token_ids[i * block_size : (i + 1) * block_size])
            # freed entries are exactly the leading blocks outside the window of the next query (none without one)
            num_freed = sum(b is NULL_BLOCK for b in table)
            assert all(b is NULL_BLOCK for b in table[:num_freed]), "freed entries form a prefix of the table"
            assert num_freed <= (max(0, req.num_computed_tokens - window + 1) // block_size if window else 0)
    for req in list(live.values()):
        kv.free(req)
    assert kv.pool.num_free_blocks == num_blocks
    kv.pool.check_invariants([])


# ---- sliding windows: blocks outside every future query's window go back to the pool ---------------------


def test_blocks_outside_the_window_are_freed_and_stay_cached() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, sliding_window=8)
    a = make_request("a", list(range(20)))
    table, _ = admit(kv, a)  # 5 blocks, 20 computed
    first_blocks = table[:3]
    assert kv.pool.num_free_blocks == 11
    a.append_output_token(99)
    table = kv.allocate_slots(a, 1)  # query at position 20 reads keys 13..20: blocks 0-2 (positions 0..11) are dead
    assert table is not None and table[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in table[3:]
    assert kv.block_ids(a)[:4] == [-1, -1, -1, table[3].block_id]
    assert kv.pool.num_free_blocks == 11 + 3 - 1, "three freed, one taken for position 20"
    assert all(b.ref_cnt == 0 and b.key is not None for b in first_blocks), "freed, still in the prefix index"
    kv.pool.check_invariants(kv.live_tables())
    kv.free(a)
    assert kv.pool.num_free_blocks == 16
    kv.pool.check_invariants([])


def test_prefix_hit_outside_the_window_is_not_claimed() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, sliding_window=8)
    admit(kv, make_request("a", list(range(24))))
    b = make_request("b", list(range(24)) + [7, 7])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 24
    table = kv.allocate_slots(b, 2, hits)
    # b's first query is at position 24 and reads keys 17..: its blocks 0-3 are not needed
    assert table is not None and table[:4] == [NULL_BLOCK] * 4 and table[4] is hits[4] and hits[4].ref_cnt == 2
    assert all(h.ref_cnt == 1 for h in hits[:4]), "only a holds them"
    kv.pool.check_invariants(kv.live_tables())


def test_prefix_hit_stops_at_a_block_evicted_from_the_middle_of_a_chain() -> None:
    """a frees its first three blocks out of the window; another request then takes one of them (its cached
    contents evicted). A later request with a's prefix hits only the blocks before the gap, never the ones after
    it, although those are still indexed (and held by a)."""
    kv = KVCacheManager(num_blocks=8, block_size=4, sliding_window=8)
    a = make_request("a", list(range(20)))
    table, _ = admit(kv, a)
    keys = [blk.key for blk in table]
    a.append_output_token(99)
    kv.allocate_slots(a, 1)  # frees blocks 0-2 of a (tail-first: block 2 is evicted first)
    held_by_a = [blk for blk in kv.req_to_blocks["a"] if blk is not NULL_BLOCK]
    assert kv.pool.num_free_blocks == 5  # 2 never used, then a's blocks 2, 1, 0
    other = make_request("other", [500 + i for i in range(12)])
    admit(kv, other)  # 3 blocks: the 2 unused ones, then a's block 2
    assert kv.pool.lookup(keys[2]) is None, "a's block 2 was handed out: its contents are gone"
    assert all(kv.pool.lookup(k) is blk for k, blk in zip(keys, table, strict=True) if k is not keys[2])
    b = make_request("b", list(range(20)) + [1])
    hits, num_hit = kv.get_computed_blocks(b)
    assert hits == table[:2] and num_hit == 8, "the chain stops at the evicted block"
    assert not set(map(id, hits)) & set(map(id, held_by_a))
    kv.pool.check_invariants(kv.live_tables())
