"""A hybrid model's prefix cache without a model: the snapshot pool alone (reserve, commit, LRU eviction, reset), the
scheduler cutting a prefix hit to the longest block whose state snapshot is kept, and a model check in which a fake
worker's state is the exact token prefix it covers, so a restore of a snapshot into a request whose prefix differs,
or a chunk starting from the wrong state, fails an assert (random workloads with shared prefixes, chunked prefill,
preemption and aborts)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserve.config.engine import SchedulerConfig
from lmserve.core.block_pool import KVCacheBlock, block_key
from lmserve.core.kv_cache_manager import KVCacheManager
from lmserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from lmserve.core.scheduler import Scheduler
from lmserve.core.state_pool import StateSlotPool
from lmserve.core.state_snapshots import NO_SNAPSHOT, StateSnapshotPool
from lmserve.request import Request
from lmserve.sampling_params import SamplingParams

MAX_LEN = 1024


def key(i: int) -> tuple:
    return block_key(None, (i,))


def make_scheduler(num_snapshots: int | None, budget=64, max_seqs=8, num_blocks=64, block_size=4, slots=8,
                   policy="continuous") -> Scheduler:  # fmt: skip
    cfg = SchedulerConfig(max_seqs, budget, MAX_LEN, True, policy)
    snapshots = StateSnapshotPool(num_snapshots) if num_snapshots else None
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, True), state_slots=StateSlotPool(slots),
                     state_snapshots=snapshots)  # fmt: skip


def make_request(rid: str, tokens: list[int], max_tokens: int = 3) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens=max_tokens)


class FakeStateWorker:
    """Each state slot and snapshot holds the tuple of tokens its state covers: restores first, then every chunk
    checks it starts from exactly its request's prefix, saving at its StateSave's position."""

    def __init__(self) -> None:
        self.slots: dict[int, tuple[int, ...]] = {}
        self.snapshots: dict[int, tuple[int, ...]] = {}
        self.num_restored_tokens = 0
        self.starts: list[int] = []  # the last step's chunk starts, in scheduled order

    def run(self, out: SchedulerOutput) -> None:
        self.starts = [s.start for s in out.scheduled]
        for s in out.scheduled:
            if s.state_restore != NO_SNAPSHOT:
                self.slots[s.request.state_slot] = self.snapshots[s.state_restore]
                self.num_restored_tokens += s.start
        for s in out.scheduled:
            r, start = s.request, s.start
            have = () if start == 0 else self.slots[r.state_slot]
            assert have == tuple(r.all_token_ids[:start]), f"{r.request_id}: a chunk at {start} from another state"
            if s.state_save is not None:
                assert start < s.state_save.position <= start + s.num_new_tokens
                self.snapshots[s.state_save.slot] = tuple(r.all_token_ids[: s.state_save.position])
            self.slots[r.state_slot] = tuple(r.all_token_ids[: start + s.num_new_tokens])


def step(s: Scheduler, worker: FakeStateWorker) -> SchedulerOutput:
    out = s.schedule()
    worker.run(out)
    sampled = {x.request.request_id: 7 for x in out.scheduled if x.samples}
    s.update_from_output(out, ModelRunnerOutput(sampled), MAX_LEN)
    s.state_snapshots.check_invariants()
    return out


def drain(s: Scheduler, worker: FakeStateWorker) -> None:
    while s.has_unfinished_requests():
        step(s, worker)


# ---- the pool --------------------------------------------------------------------------------------------------


def test_reserve_commit_lookup_and_lru_eviction() -> None:
    pool = StateSnapshotPool(2)
    blocks = [KVCacheBlock(i, key=key(i)) for i in range(3)]
    a = pool.reserve(key(0))
    assert a != NO_SNAPSHOT and pool.reserve(key(0)) == NO_SNAPSHOT, "pending: not reserved twice"
    assert pool.longest_hit(blocks) == (0, NO_SNAPSHOT), "pending: not findable before its step ran"
    pool.commit()
    b = pool.reserve(key(1))
    pool.commit()
    assert {a, b} == {0, 1} and pool.num_cached == 2
    assert pool.longest_hit(blocks) == (2, b), "the longest run whose last block has a snapshot"
    assert pool.longest_hit(blocks[:1]) == (1, a)  # key 0 now the most recently used
    c = pool.reserve(key(2))
    assert c == b, "full: the least recently used snapshot (key 1) gives its slot"
    pool.check_invariants()
    pool.commit()
    assert pool.longest_hit(blocks) == (3, c) and pool.longest_hit(blocks[:2]) == (1, a)
    assert (pool.num_saves_total, pool.num_evictions_total) == (3, 1)
    pool.reset()
    pool.check_invariants()
    assert pool.num_cached == 0 and pool.longest_hit(blocks) == (0, NO_SNAPSHOT)


def test_every_slot_pending_reserves_nothing() -> None:
    pool = StateSnapshotPool(1)
    assert pool.reserve(key(0)) == 0 and pool.reserve(key(1)) == NO_SNAPSHOT
    pool.check_invariants()
    pool.reset()  # a pending snapshot is written by the running step: it stays and is registered after it
    pool.commit()
    assert pool.longest_hit([KVCacheBlock(0, key=key(0))]) == (1, 0)


# ---- the scheduler's decision ----------------------------------------------------------------------------------


def test_hit_is_cut_to_the_longest_block_with_a_snapshot() -> None:
    """A's prompt (21 tokens) is prefilled in chunks of 8: snapshots at 8, 16 and 20. B shares 14 tokens: the KV holds
    3 blocks (12 tokens) of it, the state only the first 8; the hit, cached_tokens and the metrics count 8."""
    s, worker = make_scheduler(num_snapshots=4, budget=8), FakeStateWorker()
    a = list(range(100, 121))
    s.add_request(make_request("a", a))
    drain(s, worker)
    assert s.state_snapshots.num_saves_total == 3  # each chunk at its last boundary before the last token
    b = make_request("b", a[:14] + [1, 2, 3, 4, 5])
    s.add_request(b)
    assert len(s.kv.get_computed_blocks(b)[0]) == 3
    hits_before = s.prefix_cache_hits_total
    out = step(s, worker)
    assert worker.starts == [8] and out.scheduled[0].state_restore != NO_SNAPSHOT
    assert b.num_cached_tokens == 8 and s.prefix_cache_hits_total - hits_before == 8
    drain(s, worker)
    assert worker.num_restored_tokens == 8


def test_no_snapshot_means_no_hit_and_a_whole_prompt_snapshots_its_last_full_block() -> None:
    s, worker = make_scheduler(num_snapshots=4, budget=64), FakeStateWorker()
    a = list(range(100, 118))  # 18 tokens in one step: one snapshot, at 16 (and its decode's at 20)
    s.add_request(make_request("a", a))
    drain(s, worker)
    assert s.state_snapshots.num_cached == 2
    s.add_request(make_request("b", a[:15] + [9, 9, 9]))  # KV hits 3 blocks (12 tokens), no snapshot there
    out = step(s, worker)
    assert worker.starts[0] == 0 and out.scheduled[0].state_restore == NO_SNAPSHOT
    assert s.prefix_cache_hits_total == 0
    drain(s, worker)
    s.add_request(make_request("c", a + [1]))  # a's 16 first tokens and its snapshot: hit 16, 3 tokens computed
    out = step(s, worker)
    assert worker.starts[0] == 16 and s.prefix_cache_hits_total == 16


def test_a_follow_up_turn_hits_the_output_through_the_latest_decode_snapshot() -> None:
    """A's decode tokens that complete a block snapshot the state after them, the request keeping only its latest:
    a follow-up prompt holding A's prompt and output hits through that block; A's prompt snapshot stays too."""
    s, worker = make_scheduler(num_snapshots=4, budget=64), FakeStateWorker()
    a = make_request("a", list(range(100, 110)), max_tokens=9)  # 10 + 9 tokens: blocks end at 12 and 16 in decode
    s.add_request(a)
    saves = []
    while s.has_unfinished_requests():
        saves += [x.state_save.position for x in step(s, worker).scheduled if x.state_save is not None]
    assert saves == [8, 12, 16] and s.state_snapshots.num_cached == 2, "the prompt's at 8, the decode's latest"
    assert a.decode_snapshot is not None
    b = make_request("b", a.all_token_ids + [1, 2])
    s.add_request(b)
    step(s, worker)
    assert worker.starts == [16] and b.num_cached_tokens == 16
    c = make_request("c", a.all_token_ids[:14] + [3, 3, 3])  # 12 was released: back to the prompt's 8
    s.add_request(c)
    step(s, worker)
    assert worker.starts[-1] == 8
    drain(s, worker)


def test_a_hybrid_without_snapshots_and_static_joiners_take_no_hit() -> None:
    s = make_scheduler(num_snapshots=None)  # prefix caching on in the KV manager, but no snapshots kept
    a = list(range(50, 70))
    for rid in "ab":
        s.add_request(make_request(rid, a))
    out = s.schedule()  # (b would hit a's blocks, shared within the step, for a model without state)
    assert [x.start for x in out.scheduled] == [0, 0] and all(x.state_save is None for x in out.scheduled)
    assert s.prefix_cache_hits_total == 0
    static, worker = make_scheduler(num_snapshots=4, budget=4, policy="static"), FakeStateWorker()
    static.add_request(make_request("a", a))
    drain(static, worker)
    for rid in "bc":  # b takes the whole budget (4 tokens past its hit), c joins without computing: zero state
        static.add_request(make_request(rid, a))
    out = step(static, worker)
    assert worker.starts == [16]
    drain(static, worker)
    assert static.prefix_cache_hits_total == 16


# ---- the model check -------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), budget=st.sampled_from([5, 8, 13, 64]), num_snapshots=st.integers(1, 4),
       num_blocks=st.sampled_from([12, 20, 64]))  # fmt: skip
def test_every_chunk_starts_from_its_own_prefix(seed: int, budget: int, num_snapshots: int, num_blocks: int) -> None:
    """Prompts drawn from a few shared stems; small pools preempt, some requests are aborted mid-way: every chunk's
    state is its own prefix, every restore cuts a real hit, and the pools keep their invariants."""
    rng = random.Random(seed)
    s = make_scheduler(num_snapshots, budget=budget, num_blocks=num_blocks, max_seqs=3, slots=3)
    worker = FakeStateWorker()
    stems = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    n = 0
    for _ in range(30):
        if rng.random() < 0.4 and n < 12:
            tail = [rng.randrange(50) for _ in range(rng.randrange(1, 8))]
            s.add_request(make_request(f"r{n}", rng.choice(stems) + tail, max_tokens=rng.randrange(1, 6)))
            n += 1
        if rng.random() < 0.1 and s.running:
            s.abort_requests([rng.choice(s.running).request_id])
        step(s, worker)
        s.state_slots.check_invariants({r.request_id for r in s.running})
        s.kv.pool.check_invariants(s.kv.live_tables())
    drain(s, worker)
    assert s.state_slots.num_used == 0 and s.kv.pool.num_free_blocks == num_blocks
    assert worker.num_restored_tokens == s.prefix_cache_hits_total


@pytest.mark.parametrize("reset", [False, True])
def test_reset_prefix_cache_forgets_snapshots(reset: bool) -> None:
    s, worker = make_scheduler(num_snapshots=2), FakeStateWorker()
    a = list(range(30, 50))
    s.add_request(make_request("a", a))
    drain(s, worker)
    if reset:
        s.kv.pool.reset_prefix_cache()
        s.state_snapshots.reset()
    s.add_request(make_request("b", a))
    step(s, worker)
    assert worker.starts[0] == (0 if reset else 16)
