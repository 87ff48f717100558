"""Scheduler without a model: token budget, chunking, FCFS admission, preemption order, static policy."""

from __future__ import annotations

from lmserve.config.engine import SchedulerConfig
from lmserve.core.kv_cache_manager import KVCacheManager
from lmserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from lmserve.core.scheduler import Scheduler
from lmserve.request import Request, RequestStatus
from lmserve.sampling_params import SamplingParams

MAX_LEN = 1024


def make_scheduler(budget=64, max_seqs=8, num_blocks=64, block_size=4, chunked=True, policy="continuous"):
    cfg = SchedulerConfig(max_seqs, budget, MAX_LEN, chunked, policy)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size))


def make_request(rid: str, prompt_len: int, max_tokens: int = 4) -> Request:
    tokens = [hash((rid, i)) % 1000 for i in range(prompt_len)]
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens=max_tokens)


def run_step(s: Scheduler) -> SchedulerOutput:
    """Schedule, then pretend the model sampled token 7 for every request that reached its end."""
    out = s.schedule()
    sampled = {x.request.request_id: 7 for x in out.scheduled if x.samples}
    s.update_from_output(out, ModelRunnerOutput(sampled), MAX_LEN)
    return out


def tokens_by_request(out: SchedulerOutput) -> dict[str, int]:
    return {x.request.request_id: x.num_new_tokens for x in out.scheduled}


def test_budget_respected_and_long_prompt_chunked() -> None:
    s = make_scheduler(budget=16)
    s.add_request(make_request("a", 40))
    chunks = []
    while s.running or s.waiting:
        out = run_step(s)
        assert out.num_batched_tokens <= 16
        chunks.append(tokens_by_request(out).get("a"))
        if len(chunks) > 20:
            break
    assert chunks[:3] == [16, 16, 8], "40-token prompt is split 16 + 16 + 8"
    assert chunks[3:] == [1, 1, 1], "then one token per decode step (first token came with the last chunk)"


def test_decodes_are_served_before_new_prefills() -> None:
    s = make_scheduler(budget=10)
    s.add_request(make_request("a", 6, max_tokens=10))
    run_step(s)  # a prefilled
    s.add_request(make_request("b", 30))
    out = run_step(s)
    assert tokens_by_request(out) == {"a": 1, "b": 9}, "the decode first, then b's chunk fills the budget"


def test_fcfs_admission_and_max_num_seqs() -> None:
    s = make_scheduler(budget=1000, max_seqs=2)
    for rid in "abc":
        s.add_request(make_request(rid, 5))
    out = run_step(s)
    assert list(tokens_by_request(out)) == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_admission_stops_when_blocks_run_out() -> None:
    s = make_scheduler(budget=1000, num_blocks=4, block_size=4)
    s.add_request(make_request("a", 12))  # 3 blocks
    s.add_request(make_request("b", 8))  # 2 blocks: does not fit beside a
    s.add_request(make_request("c", 2))  # would fit, but FCFS keeps it behind b
    out = run_step(s)
    assert list(tokens_by_request(out)) == ["a"]
    assert [r.request_id for r in s.waiting] == ["b", "c"]


def test_preemption_picks_most_recently_admitted_and_recomputes() -> None:
    s = make_scheduler(budget=1000, num_blocks=6, block_size=4)
    for rid in "abc":
        s.add_request(make_request(rid, 7, max_tokens=10))  # 2 blocks each: 6 blocks, the pool is full
    run_step(s)
    assert [r.request_id for r in s.running] == ["a", "b", "c"]
    out = run_step(s)  # each decode at position 7 needs... 8 tokens fit 2 blocks: no growth yet
    assert out.preempted_ids == []
    out = run_step(s)  # position 8 needs a third block each: c, the newest, is preempted for a and b
    assert out.preempted_ids == ["c"]
    assert [r.request_id for r in s.running] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"], "the preempted request waits at the front"
    c = next(r for r in s.waiting if r.request_id == "c")
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert s.num_preemptions_total == 1
    while s.running or s.waiting:
        run_step(s)
    assert s.kv.pool.num_free_blocks == 6


def test_no_admission_in_a_step_that_preempted() -> None:
    s = make_scheduler(budget=1000, num_blocks=4, block_size=4)
    s.add_request(make_request("a", 7, max_tokens=8))
    s.add_request(make_request("b", 7, max_tokens=8))
    run_step(s)
    run_step(s)
    out = run_step(s)
    assert out.preempted_ids == ["b"]
    assert "b" not in tokens_by_request(out)


def test_static_policy_admits_a_batch_and_nothing_joins() -> None:
    s = make_scheduler(budget=1000, max_seqs=2, policy="static")
    s.add_request(make_request("a", 5, max_tokens=2))
    s.add_request(make_request("b", 5, max_tokens=6))
    s.add_request(make_request("c", 5, max_tokens=2))
    run_step(s)
    seen_c_while_b_running = False
    while s.running or s.waiting:
        running_ids = {r.request_id for r in s.running}
        out = run_step(s)
        if "c" in tokens_by_request(out) and "b" in running_ids:
            seen_c_while_b_running = True
    assert not seen_c_while_b_running, "c may only start after the whole first batch finished"


def test_static_policy_admits_whole_batch_even_when_budget_is_small() -> None:
    s = make_scheduler(budget=8, max_seqs=4, policy="static")
    for rid in "abc":
        s.add_request(make_request(rid, 6))
    run_step(s)
    assert {r.request_id for r in s.running} == {"a", "b", "c"}
    assert not s.waiting


def _prefix_cache_run(policy: str) -> tuple[list[int], tuple[int, int], int]:
    """Token budget 16, a warmed 64-token prefix, then 3 prompts sharing it (16 new tokens each: the first
    fills the budget, so under `static` the other two join the batch before computing anything). Returns their
    cached-token counts, the prefix-cache (queries, hits) they added, and the steps they took."""
    s = make_scheduler(budget=16, block_size=16, policy=policy)
    prefix = list(range(100, 164))

    def request(rid: str, suffix: list[int]) -> Request:
        return Request(rid, prefix + suffix, SamplingParams(max_tokens=2, ignore_eos=True), max_tokens=2)

    s.add_request(request("warm", [1]))
    while s.running or s.waiting:
        run_step(s)
    queries, hits = s.prefix_cache_queries_total, s.prefix_cache_hits_total
    batch = [request(rid, list(range(16 * i, 16 * i + 16))) for i, rid in enumerate("abc")]
    for r in batch:
        s.add_request(r)
    steps = 0
    while s.running or s.waiting:
        out = run_step(s)
        assert out.num_batched_tokens <= 16
        steps += 1
    assert [r.num_output_tokens for r in batch] == [2, 2, 2]
    assert s.kv.pool.num_free_blocks == 64
    counted = (s.prefix_cache_queries_total - queries, s.prefix_cache_hits_total - hits)
    return [r.num_cached_tokens for r in batch], counted, steps


def test_every_admitted_request_looks_up_the_prefix_cache() -> None:
    """Static batches look up (and count) the prefix cache for every member as it joins, as continuous
    batching does for every admission: the policies differ in batching, not in cache use."""
    # 48 uncached prompt tokens + 6 samples through a budget of 16: a | a+b | b+c | b+c | c, 5 steps
    expected = ([64, 64, 64], (3 * 80, 3 * 64), 5)
    assert _prefix_cache_run("continuous") == _prefix_cache_run("static") == expected


def test_chunked_prefill_disabled_waits_for_whole_prompt() -> None:
    s = make_scheduler(budget=10, chunked=False)
    s.add_request(make_request("a", 6, max_tokens=8))
    s.add_request(make_request("b", 6))
    out = run_step(s)
    assert tokens_by_request(out) == {"a": 6}, "b's 6 tokens do not fit the 4 left: it waits, unchunked"


def test_abort_frees_blocks() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 10, max_tokens=50))
    s.add_request(make_request("b", 10, max_tokens=50))
    run_step(s)
    aborted = s.abort_requests(["a", "missing"])
    assert [r.finish_reason.value for r in aborted] == ["abort"]
    assert "a" not in s.kv.req_to_blocks
    s.kv.pool.check_invariants(list(s.kv.req_to_blocks.values()))


def test_finished_request_frees_blocks_and_stats() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 5, max_tokens=3))
    steps = 0
    while s.running or s.waiting:
        run_step(s)
        steps += 1
    assert steps == 3 and s.kv.pool.num_free_blocks == 64
    stats = s.stats()
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0


def test_request_larger_than_pool_is_an_invariant_error_not_a_livelock() -> None:
    import pytest

    s = make_scheduler(budget=1000, num_blocks=2, block_size=4)
    s.add_request(make_request("a", 7, max_tokens=8))  # grows past 8 tokens = the whole pool
    with pytest.raises(AssertionError, match="more KV blocks than the pool"):
        for _ in range(10):
            run_step(s)


def _burst(prefix_len: int, n: int, suffix_len: int = 5) -> list[Request]:
    prefix = [hash(("sys", i)) % 1000 for i in range(prefix_len)]
    return [
        Request(str(i), prefix + [1000 + 10 * i + j for j in range(suffix_len)], SamplingParams(max_tokens=2), 2)
        for i in range(n)
    ]


def test_burst_shares_prefix_blocks_within_one_step() -> None:
    s = make_scheduler(budget=256, block_size=4)
    for r in _burst(64, 4):
        s.add_request(r)
    out = s.schedule()
    assert tokens_by_request(out) == {"0": 69, "1": 5, "2": 5, "3": 5}, "later requests hit the first one's blocks"
    first = s.kv.req_to_blocks["0"][:16]
    for rid in "123":
        assert s.kv.req_to_blocks[rid][:16] == first, "the prefix blocks are shared, not copies"
        assert s.requests[rid].num_cached_tokens == 64
    assert s.prefix_cache_hits_total == 3 * 64
    s.kv.pool.check_invariants(list(s.kv.req_to_blocks.values()))
    s.update_from_output(out, ModelRunnerOutput({x.request.request_id: 7 for x in out.scheduled}), MAX_LEN)
    s.kv.pool.check_invariants(list(s.kv.req_to_blocks.values()))


def test_burst_shares_blocks_of_a_chunk_in_flight() -> None:
    s = make_scheduler(budget=48, block_size=4)
    for r in _burst(64, 3):
        s.add_request(r)
    out = run_step(s)
    assert tokens_by_request(out) == {"0": 48}
    out = run_step(s)
    # "0" finishes its prompt (21 tokens; blocks 12..15 computed now), "1" hits all 16 prefix blocks
    assert tokens_by_request(out) == {"0": 21, "1": 5, "2": 5}
    assert s.prefix_cache_hits_total == 2 * 64
    s.kv.pool.check_invariants(list(s.kv.req_to_blocks.values()))


def test_in_step_sharing_can_be_disabled() -> None:
    cfg = SchedulerConfig(8, 256, MAX_LEN, True, "continuous", share_prefix_in_step=False)
    s = Scheduler(cfg, KVCacheManager(64, 4))
    for r in _burst(64, 3):
        s.add_request(r)
    out = s.schedule()
    assert tokens_by_request(out) == {"0": 69, "1": 69, "2": 69}
    assert s.prefix_cache_hits_total == 0
