"""A hybrid model (Qwen3.5) through the engine: every state slot held by exactly the running requests across
preemptions and aborts, and back once they end; a slot an aborted request left dirty serves the next one from a zero
state; prefix caching turned off with a log line when no state snapshot is kept (identical prompts still equal HF;
tests/engine/test_hybrid_prefix_cache.py has it on); the combinations that cannot hold the state refused at start-up
naming them."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lmserve import LLM, SamplingParams
from lmserve.checkpoint.shape import load_model_shape
from lmserve.config.engine import EngineArgs
from lmserve.memory import ledger as memory
from tests.config.test_hybrid_config import REFUSED_WITH_STATE
from tests.hybrid_helpers import MAX_TOKENS, PROMPTS, hf_greedy

# (tiny tensors: two intra-op threads spin against each other on a busy 2-core machine)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def qwen3_5_dir(hybrid_dirs: dict[str, Path]) -> Path:
    return hybrid_dirs["qwen3_5"]


def check_slots(llm: LLM) -> None:
    scheduler = llm.engine.scheduler
    running = {r.request_id for r in scheduler.running}
    scheduler.state_slots.check_invariants(running)
    assert all(r.state_slot == scheduler.state_slots.slot_of(r.request_id) >= 0 for r in scheduler.running)


def test_slots_follow_running_requests_through_preemption_and_abort(qwen3_5_dir: Path) -> None:
    llm = LLM(str(qwen3_5_dir), num_kv_blocks=20, block_size=4, max_num_batched_tokens=16, max_num_seqs=3)
    engine, pool = llm.engine, llm.engine.scheduler.state_slots
    assert pool.num_slots == 3
    held_open = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)  # (ended by the pool or abort)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, held_open)
    steps_after_preemption = 0
    for _ in range(40):  # until the pool runs out of blocks and preempts, then two steps more
        engine.step()
        check_slots(llm)
        assert len(engine.scheduler.running) <= 3, "max_num_seqs: one slot each"
        steps_after_preemption += engine.scheduler.num_preemptions_total > 0
        if steps_after_preemption > 2:
            break
    assert engine.scheduler.num_preemptions_total > 0, "20 blocks of 4 cannot hold three growing requests"
    engine.abort_request([engine.scheduler.running[0].request_id])
    check_slots(llm)
    engine.abort_request([f"r{i}" for i in range(len(PROMPTS))])  # running or preempted: their slots come back
    assert pool.num_used == 0 and pool.num_free == 3 and not engine.has_unfinished_requests()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    engine.add_request("fresh", PROMPTS[0], params)  # takes a slot an aborted request left its state in
    done = {}
    while "fresh" not in done:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        check_slots(llm)
    fresh = done["fresh"]
    assert fresh.outputs[0].token_ids == hf_greedy(qwen3_5_dir, fresh.prompt_token_ids, MAX_TOKENS)
    assert pool.num_used == 0 and pool.num_free == 3
    pool.check_invariants(set())


def test_prefix_caching_is_off_without_snapshots_and_identical_prompts_equal_hf(
    qwen3_5_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        llm = LLM(str(qwen3_5_dir), num_kv_blocks=64, block_size=4, max_num_batched_tokens=64,
                  state_snapshot_memory_gib=0)  # fmt: skip
    assert "prefix caching is off" in caplog.text and not llm.engine.config.cache.enable_prefix_caching
    prompt = PROMPTS[1]  # 47 tokens: whole blocks another request could have hit
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate([prompt, prompt], params, use_tqdm=False) + llm.generate([prompt], params, use_tqdm=False)
    expected = hf_greedy(qwen3_5_dir, outs[0].prompt_token_ids, 8)
    assert [o.outputs[0].token_ids for o in outs] == [expected] * 3
    assert llm.engine.scheduler.prefix_cache_hits_total == 0


@pytest.mark.parametrize(("kwargs", "named"), REFUSED_WITH_STATE)
def test_combinations_without_state_support_are_refused_at_start_up(
    qwen3_5_dir: Path, kwargs: dict, named: str
) -> None:
    args = EngineArgs(model=str(qwen3_5_dir), num_kv_blocks=64, **kwargs)
    with pytest.raises(ValueError, match=rf"{named}: not supported with Qwen3_5ForCausalLM"):
        args.create_engine_config()


def test_pools_from_a_budget_are_the_ledgers_to_the_byte(qwen3_5_dir: Path) -> None:
    """kv_cache_memory_gib: the state snapshots are memory.state_snapshot_split's (1/8 of the budget), the KV blocks
    and state slots memory.hybrid_pool_split's of the rest, the worker's state tensors hold the ledger's bytes per
    sequence exactly, and max_num_seqs is capped to the slots."""
    gib = 0.0005  # 536,870 bytes: 6 snapshots of 9,600 B, then slots of 9,600 B + a 4,096 B block each, the rest blocks
    llm = LLM(str(qwen3_5_dir), kv_cache_memory_gib=gib)
    config, runner = llm.engine.config, llm.engine.runner
    shape = load_model_shape(qwen3_5_dir)
    state = memory.linear_state_bytes_per_sequence(shape)
    kv = memory.kv_cache_bytes_per_token(shape.num_kv_layers, shape.num_kv_heads, shape.head_dim, "float32")
    assert (config.cache.state_bytes_per_sequence, config.cache.kv_bytes_per_token) == (state, kv)
    snapshots, left = memory.state_snapshot_split(int(gib * 2**30), state)
    assert snapshots == int(gib * 2**30) // 8 // state and left == int(gib * 2**30) - snapshots * state
    blocks, slots = memory.hybrid_pool_split(left, 16, kv, state, 256)
    assert (config.cache.num_blocks, config.cache.num_state_slots) == (blocks, slots) and slots < 256
    assert config.cache.num_state_snapshots == snapshots > 0
    assert runner.state_cache.nbytes == slots * state and runner.state_cache.snapshot_nbytes == snapshots * state
    kv_tensors = [t for c in runner.kv_caches if hasattr(c, "k") for t in (c.k, c.v)]
    assert sum(t.numel() * t.element_size() for t in kv_tensors) == blocks * 16 * kv
    assert config.scheduler.max_num_seqs == slots == llm.engine.scheduler.state_slots.num_slots


@pytest.mark.parametrize("max_num_seqs", [1, 8])
def test_snapshots_beside_explicit_blocks_take_an_eighth(qwen3_5_dir: Path, max_num_seqs: int) -> None:
    """num_kv_blocks given: a slot per max_num_seqs, and the snapshots (unless sized) 1/8 of the three pools
    together (at least one), not one per sequence on top."""
    config = EngineArgs(model=str(qwen3_5_dir), num_kv_blocks=8, max_num_seqs=max_num_seqs).create_engine_config()
    cache = config.cache
    state, kv = cache.state_bytes_per_sequence, cache.kv_bytes_per_token
    assert (cache.num_blocks, cache.num_state_slots) == (8, max_num_seqs)
    total = 8 * cache.block_size * kv + (max_num_seqs + cache.num_state_snapshots) * state
    assert cache.num_state_snapshots >= 1
    assert cache.num_state_snapshots == 1 or cache.num_state_snapshots * state <= total / 8
    assert (cache.num_state_snapshots + 1) * state > total / 8


def test_metrics_count_the_slots_held(qwen3_5_dir: Path) -> None:
    """get_metrics() and the /metrics exposition: state slots held by the running requests, and in all."""
    from prometheus_client.parser import text_string_to_metric_families

    from lmserve.engine.async_engine import EngineSnapshot
    from lmserve.observability.prometheus import Metrics

    llm = LLM(str(qwen3_5_dir), num_kv_blocks=64, max_num_seqs=4)
    held_open = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for i in range(3):
        llm.engine.add_request(f"r{i}", PROMPTS[i], held_open)
    llm.engine.step()
    m = llm.get_metrics()
    assert (m["num_state_slots_used"], m["num_state_slots"]) == (3, 4)
    assert m["state_bytes_per_sequence"] == llm.engine.config.cache.state_bytes_per_sequence
    snapshot = EngineSnapshot(metrics=m, num_batched_tokens=0, num_aborted_requests_total=0, time=0.0)
    body, _ = Metrics("m", lambda: snapshot).render()
    samples = {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    assert (samples["lmserve:state_slots_used"], samples["lmserve:state_slots_total"]) == (3, 4)
    llm.engine.abort_request([f"r{i}" for i in range(3)])
    assert llm.get_metrics()["num_state_slots_used"] == 0
