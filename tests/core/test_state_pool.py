"""State slots for hybrid models without a model: the pool alone, and the scheduler admitting by KV blocks and slots,
freeing slots on finish, abort and preemption (slots back to zero), with max_num_seqs above the slot count."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserve.config.engine import SchedulerConfig
from lmserve.core.kv_cache_manager import KVCacheManager
from lmserve.core.outputs import ModelRunnerOutput
from lmserve.core.scheduler import Scheduler
from lmserve.core.state_pool import NO_STATE_SLOT, StateSlotPool
from lmserve.request import RequestStatus
from tests.core.test_scheduler import MAX_LEN, make_request, run_step


def make_scheduler(num_slots: int, budget=64, max_seqs=8, num_blocks=64, block_size=4, policy="continuous"):
    cfg = SchedulerConfig(max_seqs, budget, MAX_LEN, True, policy)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, False), state_slots=StateSlotPool(num_slots))


def check(s: Scheduler) -> None:
    """Exactly the running requests hold slots, each its own, and the request records it."""
    s.state_slots.check_invariants({r.request_id for r in s.running})
    for r in s.running:
        assert r.state_slot == s.state_slots.slot_of(r.request_id) != NO_STATE_SLOT
    for r in s.waiting:
        assert r.state_slot == NO_STATE_SLOT, f"waiting {r.request_id} still holds a state slot"


def test_pool_allocates_distinct_slots_and_refuses_double_use() -> None:
    pool = StateSlotPool(3)
    slots = [pool.allocate(r) for r in "abc"]
    assert sorted(slots) == [0, 1, 2] and not pool.can_allocate() and pool.num_free == 0
    with pytest.raises(AssertionError, match="no free state slot"):
        pool.allocate("d")
    with pytest.raises(AssertionError, match="already holds"):
        pool.free("b") or pool.allocate("a")
    pool.free("b")  # again: holds none, nothing happens
    assert pool.num_used == 2 and pool.allocate("d") == slots[1]
    pool.check_invariants({"a", "c", "d"})


def test_admission_waits_for_a_free_slot_fcfs() -> None:
    s = make_scheduler(num_slots=2, max_seqs=8)
    for rid in "abc":
        s.add_request(make_request(rid, 5, max_tokens=3))
    out = run_step(s)
    assert [x.request.request_id for x in out.scheduled] == ["a", "b"], "two slots: c waits despite blocks and seats"
    check(s)
    while s.running or s.waiting:
        out = run_step(s)
        check(s)
        if "c" in {x.request.request_id for x in out.scheduled}:
            assert not {"a", "b"} & {r.request_id for r in s.running}, "c admitted only once a slot was freed"
    assert s.state_slots.num_used == 0


def test_preemption_and_abort_give_slots_back() -> None:
    s = make_scheduler(num_slots=3, num_blocks=6, block_size=4)
    for rid in "abc":
        s.add_request(make_request(rid, 7, max_tokens=20))
    run_step(s)  # each holds 2 blocks of 6
    check(s)
    assert run_step(s).preempted_ids == []  # 8 tokens still fit 2 blocks
    out = run_step(s)  # position 8 needs a third block each: c is preempted
    assert out.preempted_ids == ["c"]
    check(s)
    assert s.requests["c"].status == RequestStatus.PREEMPTED and s.state_slots.num_used == 2
    s.abort_requests(["a", "c"])
    check(s)
    assert s.state_slots.num_used == 1
    s.abort_requests(["b"])
    assert s.state_slots.num_used == 0 and s.state_slots.num_free == 3


def test_static_batch_joins_only_as_many_as_slots() -> None:
    s = make_scheduler(num_slots=2, policy="static")
    for rid in "abcd":
        s.add_request(make_request(rid, 4, max_tokens=2))
    run_step(s)
    check(s)
    assert sorted(r.request_id for r in s.running) == ["a", "b"]


preempted_any: list[int] = []


@settings(max_examples=40, deadline=None, derandomize=True)  # (fixed examples: the preemption check below holds)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "add", "step", "step", "step", "abort"]), st.integers(1, 30)),
        min_size=10,
        max_size=40,
    ),
    num_slots=st.integers(1, 4),
    num_blocks=st.integers(6, 12),
)
def test_random_adds_steps_aborts_return_every_slot(ops, num_slots: int, num_blocks: int) -> None:
    s = make_scheduler(num_slots, budget=16, max_seqs=6, num_blocks=num_blocks, block_size=2)
    n = 0
    for op, arg in ops:
        if op == "add":
            n += 1
            s.add_request(make_request(f"r{n}", min(arg, 2 * num_blocks - 10), max_tokens=arg % 9 + 1))
        elif op == "abort" and s.requests:
            s.abort_requests([sorted(s.requests)[arg % len(s.requests)]])
        else:
            out = s.schedule()
            check(s)
            sampled = {x.request.request_id: 7 for x in out.scheduled if x.samples}
            s.update_from_output(out, ModelRunnerOutput(sampled), MAX_LEN)
        check(s)
    s.abort_requests(list(s.requests))
    preempted_any.append(s.num_preemptions_total)
    assert s.state_slots.num_used == 0 and s.state_slots.num_free == num_slots
    s.kv.pool.check_invariants([])


def test_the_random_runs_preempt() -> None:
    """The property test above reaches preemption (else it would test only finishes and aborts)."""
    if not preempted_any:
        test_random_adds_steps_aborts_return_every_slot()
    assert sum(preempted_any) > 0
