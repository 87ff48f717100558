"""AsyncEngine: the step loop on its own thread, per-request streams, abort, backpressure, engine death."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmserve import SamplingParams
from lmserve.config.engine import EngineArgs
from lmserve.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError, num_unstartable
from lmserve.engine.llm_engine import LLMEngine
from tests.helpers import steps_held_after_first

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(model_dir: Path, **kwargs) -> LLMEngine:
    args = dict(num_kv_blocks=64, block_size=16, max_model_len=128)
    args.update(kwargs)
    return LLMEngine.from_engine_args(EngineArgs.from_kwargs(str(model_dir), **args))


@pytest.fixture(scope="module")
def aengine(llama_dir: Path) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(_engine(llama_dir)).start()
    yield engine
    engine.shutdown()


async def _wait_for(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_stream_matches_offline_engine(aengine: AsyncEngine, llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=2, ignore_eos=True)
    ref = _engine(llama_dir)
    ref.add_request("r", "The capital of France is", params)
    ref_final = None
    while ref.has_unfinished_requests():
        ref_final = next((o for o in ref.step() if o.finished), ref_final)

    async def run():
        deltas = {0: "", 1: ""}
        final = None
        async for out in aengine.generate("The capital of France is", params):
            for c in out.outputs:
                deltas[c.index] += c.delta_text
            final = out
        return deltas, final

    deltas, final = asyncio.run(run())
    assert final is not None and final.finished
    assert [c.token_ids for c in final.outputs] == [c.token_ids for c in ref_final.outputs]
    assert [deltas[0], deltas[1]] == [c.text for c in final.outputs]


def test_many_concurrent_requests_all_complete(aengine: AsyncEngine) -> None:
    async def one(i: int) -> int:
        n = 0
        async for out in aengine.generate(f"prompt {i}", SamplingParams(max_tokens=3, ignore_eos=True)):
            n += len(out.outputs[0].delta_token_ids)
        return n

    async def run():
        return await asyncio.gather(*(one(i) for i in range(40)))

    assert asyncio.run(run()) == [3] * 40
    assert aengine.snapshot().metrics["kv_cache_usage"] == 0.0


def test_consumer_that_stops_iterating_aborts(aengine: AsyncEngine) -> None:
    aborted_before = aengine.snapshot().num_aborted_requests_total

    async def run():
        agen = aengine.generate("hello there", SamplingParams(max_tokens=100, ignore_eos=True))
        async for out in agen:
            assert not out.finished
            break
        await agen.aclose()
        await _wait_for(lambda: aengine.snapshot().num_aborted_requests_total == aborted_before + 1)
        await _wait_for(lambda: aengine.snapshot().metrics["kv_cache_usage"] == 0.0)

    asyncio.run(run())
    assert aengine.snapshot().metrics["finished_requests_by_reason"]["abort"] >= 1


def test_task_cancelled_while_waiting_aborts(aengine: AsyncEngine) -> None:
    """The consumer is cancelled while the request is mid-generation: held there by construction (every step
    after the first waits for the cancel), not by a request too long for the engine to finish in time."""
    before = aengine.snapshot().num_aborted_requests_total

    async def run(cancelled: threading.Event):
        stream = aengine.add_request(None, "cancel me", SamplingParams(max_tokens=100, ignore_eos=True))
        first = asyncio.Event()

        async def consume():
            try:
                async for out in stream:
                    assert not out.finished
                    first.set()
                    await asyncio.sleep(0)
            finally:
                stream.abort()

        task = asyncio.ensure_future(consume())
        await first.wait()  # running: one token out, 99 to go, the next step held
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        cancelled.set()  # the abort is queued: it applies before the step after the held one
        await _wait_for(lambda: aengine.snapshot().num_aborted_requests_total == before + 1)
        await _wait_for(lambda: aengine.snapshot().metrics["kv_cache_usage"] == 0.0)

    with steps_held_after_first(aengine.engine) as cancelled:
        asyncio.run(run(cancelled))


def test_bad_input_raises_before_queueing(aengine: AsyncEngine) -> None:
    async def run():
        with pytest.raises(ValueError, match="prompt is empty"):
            aengine.add_request(None, [], SamplingParams())
        with pytest.raises(ValueError, match="prompt is 300 tokens, but max_model_len is 128"):
            aengine.add_request(None, [5] * 300, SamplingParams())

    asyncio.run(run())
    assert aengine.is_running


def test_duplicate_id_fails_only_that_request(aengine: AsyncEngine) -> None:
    async def run():
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        first = aengine.add_request("same", "a", params)
        second = aengine.add_request("same", "b", params)
        with pytest.raises(ValueError, match="already in use"):
            async for _ in second:
                pass
        outs = [o async for o in first]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 20

    asyncio.run(run())
    assert aengine.is_running


def test_waiting_queue_bound(llama_dir: Path) -> None:
    engine = AsyncEngine(_engine(llama_dir, max_num_seqs=1), max_queued_requests=2, retry_after_s=3).start()
    try:

        async def run():
            params = SamplingParams(max_tokens=30, ignore_eos=True)
            accepted, rejected = [], []
            for i in range(8):
                try:
                    accepted.append(engine.add_request(None, f"p{i}", params))
                except QueueFullError as e:
                    rejected.append(e)
            # one can start (max_num_seqs=1) and two may wait for it, whether or not it started yet
            assert len(accepted) == 3 and len(rejected) == 5
            assert rejected[0].retry_after_s == 3 and "max_queued_requests=2" in str(rejected[0])
            results = [[o async for o in s][-1] for s in accepted]
            assert all(len(r.outputs[0].token_ids) == 30 for r in results)
            # once the queue drains, requests are accepted again
            again = engine.add_request(None, "later", SamplingParams(max_tokens=2))
            assert [o async for o in again][-1].finished

        asyncio.run(run())
    finally:
        engine.shutdown()


def test_num_unstartable() -> None:
    assert num_unstartable(num_free_slots=8, num_queued_seqs=0, num_queued_blocks=0, num_free_blocks=0) == 0
    assert num_unstartable(8, 8, 8, 8) == 0
    assert num_unstartable(8, 10, 10, 100) == 2, "beyond the free sequence slots"
    assert num_unstartable(0, 3, 3, 100) == 3, "the batch is full"
    assert num_unstartable(-2, 3, 3, 100) == 3, "preemption can leave more running than max_num_seqs"
    assert num_unstartable(100, 10, 20, 10) == 5, "blocks for 5 of them at their average 2 blocks each"
    assert num_unstartable(100, 10, 20, 0) == 10


def gate_steps(engine: AsyncEngine) -> threading.Event:
    """Hold the engine thread before its next step until the returned event is set: adds are applied to the
    scheduler's waiting queue, but nothing starts or finishes."""
    gate, real_step = threading.Event(), engine.engine.step

    def gated_step():
        assert gate.wait(60), "the test did not open the gate"
        return real_step()

    engine.engine.step = gated_step  # type: ignore[method-assign]
    return gate


def _burst(engine: AsyncEngine, num: int, params: SamplingParams) -> tuple[int, int]:
    """Add `num` requests back to back; open the gate; every accepted one must complete. (accepted, refused)"""
    gate = gate_steps(engine)

    async def run() -> tuple[int, int]:
        accepted, refused = [], 0
        for i in range(num):
            try:
                accepted.append(engine.add_request(None, f"p{i}", params))
            except QueueFullError:
                refused += 1
            if i % 8 == 0:
                await asyncio.sleep(0)  # let the engine thread apply adds between some of them
        gate.set()
        finals = [[o async for o in s][-1] for s in accepted]
        assert all(len(c.token_ids) == params.max_tokens for f in finals for c in f.outputs)
        return len(accepted), refused

    return asyncio.run(run())


def test_admission_counts_only_what_the_full_engine_cannot_start(llama_dir: Path) -> None:
    engine = AsyncEngine(_engine(llama_dir, max_num_seqs=32), max_queued_requests=4).start()
    try:
        # 32 can start at once (free slots, blocks to spare) and 4 may wait: the rest are refused
        assert _burst(engine, 50, SamplingParams(max_tokens=4, ignore_eos=True)) == (36, 14)
        # n=3 is three sequences
        assert _burst(engine, 20, SamplingParams(n=3, max_tokens=4, ignore_eos=True)) == (12, 8)
    finally:
        engine.shutdown()


def test_admission_counts_kv_blocks(llama_dir: Path) -> None:
    # each request needs one 16-token block to start; 8 blocks → 8 can start, 2 may wait
    engine = AsyncEngine(_engine(llama_dir, num_kv_blocks=8, max_num_seqs=64), max_queued_requests=2).start()
    try:
        assert _burst(engine, 30, SamplingParams(max_tokens=4, ignore_eos=True)) == (10, 20)
    finally:
        engine.shutdown()


def test_engine_death_fails_pending_and_refuses_new(llama_dir: Path) -> None:
    engine = AsyncEngine(_engine(llama_dir)).start()
    real_step = engine.engine.step
    calls = 0

    def flaky_step():
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("simulated kernel failure")
        return real_step()

    engine.engine.step = flaky_step  # type: ignore[method-assign]

    async def run():
        stream = engine.add_request(None, "doomed", SamplingParams(max_tokens=50, ignore_eos=True))
        with pytest.raises(EngineDeadError, match="simulated kernel failure"):
            async for _ in stream:
                pass
        assert not engine.is_running and engine.dead_error is not None
        with pytest.raises(EngineDeadError):
            engine.add_request(None, "after", SamplingParams(max_tokens=2))

    asyncio.run(run())


def test_shutdown_fails_pending(llama_dir: Path) -> None:
    engine = AsyncEngine(_engine(llama_dir)).start()

    async def run():
        stream = engine.add_request(None, "x", SamplingParams(max_tokens=120, ignore_eos=True))
        await stream.__anext__()
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass

    asyncio.run(run())


def test_engine_thread_sets_its_own_torch_threads(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="num_threads"):
        AsyncEngine(_engine(llama_dir), num_threads=0)
    inner = _engine(llama_dir)
    seen: list[int] = []
    step = inner.step

    def recording_step():
        seen.append(torch.get_num_threads())
        return step()

    inner.step = recording_step  # type: ignore[method-assign]
    engine = AsyncEngine(inner, num_threads=2).start()
    assert torch.get_num_threads() == 1, "the caller's thread keeps its own setting (module fixture: 1)"

    async def run():
        async for _ in engine.generate("x", SamplingParams(max_tokens=2, ignore_eos=True)):
            pass

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
        torch.set_num_threads(1)  # torch's setting is process-wide for threads started later
    assert seen and set(seen) == {2}, seen
