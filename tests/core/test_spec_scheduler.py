"""Speculative decoding in the scheduler, without a model: proposals scheduled as tentatively appended tokens,
rejected ones rolled back, lookahead slots, and the block-pool invariants after every random step."""

from __future__ import annotations

import random

from lmserve.config.engine import SchedulerConfig
from lmserve.core.kv_cache_manager import KVCacheManager
from lmserve.core.outputs import ModelRunnerOutput
from lmserve.core.scheduler import Scheduler
from lmserve.request import Request
from lmserve.sampling_params import SamplingParams

MAX_LEN = 1024


def make(budget=64, num_blocks=64, block_size=4, lookahead=0, max_seqs=8) -> Scheduler:
    cfg = SchedulerConfig(max_seqs, budget, MAX_LEN, True, "continuous")
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size), num_lookahead_tokens=lookahead)


def make_request(rid: str, prompt: list[int], max_tokens: int = 20) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens=max_tokens)


def check(s: Scheduler) -> None:
    s.kv.pool.check_invariants(list(s.kv.req_to_blocks.values()))
    for r in s.running:
        assert r.num_computed_tokens <= r.num_tokens - 1 or r.num_computed_tokens < r.num_prompt_tokens
        table = s.kv.req_to_blocks.get(r.request_id, [])
        assert len(table) >= s.kv.num_blocks_for(r.num_computed_tokens), "computed tokens outside the table"


def test_proposals_are_scheduled_and_rejected_ones_rolled_back() -> None:
    s = make(block_size=4)
    r = make_request("a", [1, 2, 3, 4, 5])
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput({"a": 6}, spec_token_ids={"a": [7, 8, 9]}), MAX_LEN)
    assert r.spec_token_ids == [7, 8, 9] and r.num_computed_tokens == 5
    out = s.schedule()
    (x,) = out.scheduled
    assert (x.num_new_tokens, x.num_spec_tokens, x.samples) == (4, 3, True), "1 + k tokens, the last k proposals"
    assert len(x.block_ids) == 3, "positions 0..8 need 3 blocks of 4"
    # the target accepted 7, rejected 8 (and so 9) and sampled 10 instead
    s.update_from_output(out, ModelRunnerOutput({"a": 10}, accepted_token_ids={"a": [7]}), MAX_LEN)
    assert r.output_token_ids == [6, 7, 10]
    assert r.num_computed_tokens == 7, "5 prompt + 6 + 7 computed; the rejected positions are not"
    assert len(s.kv.req_to_blocks["a"]) == 2, "the block that only held rejected positions is freed"
    assert (s.spec_num_drafts_total, s.spec_num_draft_tokens_total, s.spec_num_accepted_tokens_total) == (1, 3, 1)
    check(s)


def test_budget_trims_proposals_and_lookahead_is_held() -> None:
    s = make(budget=3, block_size=4, lookahead=4)
    r = make_request("a", [1, 2, 3])
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput({"a": 6}, spec_token_ids={"a": [7, 8, 9, 10]}), MAX_LEN)
    out = s.schedule()
    (x,) = out.scheduled
    assert (x.num_new_tokens, x.num_spec_tokens) == (3, 2) and r.spec_token_ids == [7, 8]
    # positions up to 3 + 3 = 6 computed, plus 4 lookahead slots for the draft: 10 slots = 3 blocks
    assert len(x.block_ids) == 3
    check(s)


def test_stop_inside_accepted_run_keeps_nothing_after_it() -> None:
    s = make()
    r = make_request("a", [1, 2, 3], max_tokens=3)
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput({"a": 6}, spec_token_ids={"a": [7, 8, 9]}), MAX_LEN)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput({"a": 10}, accepted_token_ids={"a": [7, 8, 9]}), MAX_LEN)
    assert r.output_token_ids == [6, 7, 8] and r.is_finished, "max_tokens=3 stops inside the accepted run"
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks
    check(s)


def test_random_speculation_keeps_block_invariants_and_frees_everything() -> None:
    """Random prompts (sharing prefixes), proposals, acceptances, a small pool (preemption), lookahead: after
    every step ref counts match the block tables; at the end every block is free."""
    rng = random.Random(0)
    for trial in range(6):
        s = make(budget=rng.choice([4, 8, 32]), num_blocks=rng.choice([12, 24, 64]), lookahead=rng.choice([0, 3]))
        base = [rng.randrange(50) for _ in range(12)]
        for i in range(6):
            prompt = base[: rng.randrange(1, 12)] + [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
            s.add_request(make_request(f"{trial}-{i}", prompt, max_tokens=rng.randrange(1, 12)))
        for _ in range(500):
            if not s.has_unfinished_requests():
                break
            out = s.schedule()
            sampled, accepted, proposals = {}, {}, {}
            for x in out.scheduled:
                if not x.samples:
                    continue
                rid = x.request.request_id
                sampled[rid] = rng.randrange(50)
                drafts = x.request.spec_token_ids[: x.num_spec_tokens]
                accepted[rid] = drafts[: rng.randrange(len(drafts) + 1)]
                proposals[rid] = [rng.randrange(50) for _ in range(rng.randrange(4))]
            s.update_from_output(out, ModelRunnerOutput(sampled, None, {}, {}, accepted, {}, proposals), MAX_LEN)
            check(s)
        assert not s.has_unfinished_requests()
        assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks, "a block leaked"
