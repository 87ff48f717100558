"""lmserve.engine.core_client: routing and aggregation on their own, then two real engine-core processes
(data parallel, one thread each): outputs as the in-process engine's, both cores used, prefix affinity
visible in per-engine metrics, and kill -9 of a core mid-stream."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lmserve.config.engine import EngineArgs
from lmserve.engine import core_client
from lmserve.engine.async_engine import Admission, EngineDeadError, EngineSnapshot
from lmserve.engine.core_client import (
    AFFINITY_SLACK,
    CoreView,
    EngineCoreClient,
    aggregate_snapshots,
    cpu_slices,
)
from lmserve.engine.llm_engine import LLMEngine
from lmserve.observability.prometheus import Metrics
from lmserve.sampling_params import SamplingParams

BLOCK = 16


def _snap(running: int = 0, waiting: int = 0, usage: float = 0.0, **extra) -> EngineSnapshot:
    metrics = {"num_requests_running": running, "num_requests_waiting": waiting, "kv_cache_usage": usage,
               "num_kv_blocks": 64, "prefix_cache_hits_total": 0, "kv_cache_dtype": "float32",
               "kv_cache_bytes_per_token": 512, "finished_requests_by_reason": {"stop": 1, "abort": 0}}  # fmt: skip
    metrics.update(extra)
    return EngineSnapshot(metrics, num_batched_tokens=3, num_aborted_requests_total=1, time=1.0)


def _client_with_fake_cores(snaps: list[EngineSnapshot], llama_dir: Path) -> EngineCoreClient:
    config = EngineArgs.from_kwargs(str(llama_dir), num_kv_blocks=64, block_size=BLOCK).create_engine_config()
    client = EngineCoreClient(config, data_parallel_size=len(snaps))
    client._cores = [CoreView(i, None, None, Admission(None), 1, snapshot=s) for i, s in enumerate(snaps)]
    return client


def test_route_least_loaded_then_kv_usage(llama_dir: Path) -> None:
    client = _client_with_fake_cores([_snap(running=3), _snap(running=1, waiting=1), _snap(running=2)], llama_dir)
    assert client._route([1, 2, 3]).index == 1
    client._cores[1].pending["x"] = (2, 2)  # added, not yet acknowledged: counts as load
    assert client._route([1, 2, 3]).index == 2
    client = _client_with_fake_cores([_snap(running=1, usage=0.5), _snap(running=1, usage=0.2)], llama_dir)
    assert client._route([1]).index == 1
    client._cores[1].alive = False  # a dead core is never chosen
    assert client._route([1]).index == 0


def test_prefix_affinity_unless_overloaded(llama_dir: Path) -> None:
    client = _client_with_fake_cores([_snap(), _snap(running=1)], llama_dir)
    shared = list(range(100, 100 + BLOCK))
    assert client._route(shared + [1]).index == 0  # least loaded; remembered for this first block
    client._cores[1].snapshot = _snap()
    client._cores[0].snapshot = _snap(running=AFFINITY_SLACK)
    assert client._route(shared + [2, 3]).index == 0  # affine, within the slack
    assert client._route(list(range(200, 200 + BLOCK))).index == 1  # another prefix: load decides
    client._cores[0].snapshot = _snap(running=AFFINITY_SLACK + 1)
    assert client._route(shared + [4]).index == 1  # overloaded: routed away, and now remembered there
    client._cores[0].snapshot = _snap()
    assert client._route(shared + [5]).index == 1
    assert client._route(shared[:-1]).index == 0  # shorter than a block: no affinity


def test_cpu_slices_are_disjoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    assert cpu_slices(1, 8) is None
    assert cpu_slices(2, 2) == [(0, 1), (2, 3)]
    assert cpu_slices(2, 8) == [(0, 1, 2, 3), (4, 5, 6, 7)]  # more threads than fit: an even split
    assert cpu_slices(3, 1) == [(0,), (1,), (2,)]
    assert cpu_slices(9, 1) is None  # more cores than CPUs: no pinning
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    assert core_client.default_num_threads(2) == 3 and core_client.default_num_threads(8) == 1


def test_aggregate_snapshots_sum_counters_and_keep_each_core() -> None:
    a = _snap(running=2, usage=0.5, prefix_cache_hits_total=10)
    b = _snap(running=1, usage=0.25, prefix_cache_hits_total=4)
    agg = aggregate_snapshots([a, b])
    m = agg.metrics
    assert m["num_requests_running"] == 3 and m["prefix_cache_hits_total"] == 14
    assert m["kv_cache_usage"] == pytest.approx(0.375) and m["num_kv_blocks"] == 128
    assert m["kv_cache_dtype"] == "float32" and m["kv_cache_bytes_per_token"] == 512
    assert m["finished_requests_by_reason"] == {"stop": 2, "abort": 0}
    assert agg.num_aborted_requests_total == 2 and agg.num_batched_tokens == 6 and agg.engines == (a, b)
    from tests.observability.test_prometheus import _snapshot as full_snapshot

    full = aggregate_snapshots([full_snapshot(num_requests_running=2), full_snapshot(num_requests_running=1)])
    samples = {}
    for fam in text_string_to_metric_families(Metrics("m", lambda: full).render()[0].decode()):
        for s in fam.samples:
            samples[(s.name, s.labels.get("engine"))] = s.value
    assert samples[("lmserve:num_requests_running", None)] == 3
    assert samples[("lmserve:num_requests_running", "0")] == 2
    assert samples[("lmserve:num_requests_running", "1")] == 1
    assert samples[("lmserve:prefix_cache_hits_total", None)] == 64
    assert samples[("lmserve:prefix_cache_hits_total", "1")] == 32


# ---- two engine-core processes ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def dp2(llama_dir: Path) -> Iterator[EngineCoreClient]:
    config = EngineArgs.from_kwargs(
        str(llama_dir), num_kv_blocks=128, max_model_len=256, block_size=BLOCK
    ).create_engine_config()
    client = EngineCoreClient(config, data_parallel_size=2, num_threads=1).start()
    try:
        yield client
    finally:
        client.shutdown()
        for pid in client.core_pids:
            assert not Path(f"/proc/{pid}").exists(), f"engine core {pid} outlived shutdown"


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


async def _final(client: EngineCoreClient, rid: str, prompt, params: SamplingParams):
    last = None
    async for out in client.add_request(rid, prompt, params):
        last = out
    return last


def test_dp2_greedy_outputs_equal_the_in_process_engine_and_both_cores_serve(dp2: EngineCoreClient) -> None:
    prompts = [[(7 * i + j) % 400 + 3 for j in range(5 + i)] for i in range(8)]

    async def run():
        return await asyncio.gather(*(_final(dp2, f"eq-{i}", p, greedy(6)) for i, p in enumerate(prompts)))

    outs = asyncio.run(run())
    ref = LLMEngine(dp2.config)  # what a single engine core (DP = 1) runs
    for i, p in enumerate(prompts):
        ref.add_request(f"eq-{i}", p, greedy(6))
    expected = {}
    while ref.has_unfinished_requests():
        for o in ref.step():
            expected[o.request_id] = o
    for i, out in enumerate(outs):
        assert out.finished and out.prompt_token_ids == prompts[i]
        assert out.outputs[0].token_ids == expected[f"eq-{i}"].outputs[0].token_ids
        assert out.outputs[0].text == expected[f"eq-{i}"].outputs[0].text
    per_core = [e.metrics["num_requests_total"] for e in dp2.snapshot().engines]
    assert all(n > 0 for n in per_core), per_core  # concurrent requests spread over both cores


def test_prefix_affinity_hits_on_the_core_that_has_the_prefix(dp2: EngineCoreClient) -> None:
    system = [300 + j for j in range(2 * BLOCK)]  # a shared "system prompt" of two full blocks

    async def run():
        # a running request keeps one core busy (until it is aborted below: 250 tokens, ignore_eos), so the first
        # system-prompt request goes to the other one
        hog = dp2.add_request("hog", [9, 9, 9], greedy(250))
        assert not (await hog.__anext__()).finished  # running on its core, in that core's snapshot
        hog_core = dp2._streams["hog"].core.index
        first = await _final(dp2, "sys-0", system + [1, 2], greedy(2))
        hog.abort()
        return hog_core, first

    hog_core, first = asyncio.run(run())
    other = 1 - hog_core
    before = [e.metrics["prefix_cache_hits_total"] for e in dp2.snapshot().engines]
    # both cores idle now (a tie that load alone would give to core 0); affinity sends the prefix where it is
    for i in range(3):
        out = asyncio.run(_final(dp2, f"sys-{i + 1}", system + [10 + i], greedy(2)))
        assert out.num_cached_tokens == 2 * BLOCK
    after = [e.metrics["prefix_cache_hits_total"] for e in dp2.snapshot().engines]
    assert after[other] - before[other] == 3 * 2 * BLOCK
    assert after[hog_core] == before[hog_core]
    assert first.num_cached_tokens == 0


def test_kill_one_core_mid_stream_then_the_other(dp2: EngineCoreClient) -> None:
    async def run():
        stream = dp2.add_request("victim", [5, 6, 7], greedy(200))
        first = await stream.__anext__()
        assert not first.finished
        core = dp2._streams["victim"].core
        t0 = time.monotonic()
        os.kill(core.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=f"engine core {core.index} died"):
            async for _ in stream:
                pass
        detected_s = time.monotonic() - t0
        assert detected_s < 1.0, detected_s
        assert dp2.dead_error is None and f"engine core {core.index}" in dp2.degraded_error
        # the dead core reads dead: its gauges 0 (it was running the victim), the victim counted as failed
        samples = {}
        for fam in text_string_to_metric_families(Metrics("m", dp2.snapshot).render()[0].decode()):
            for s in fam.samples:
                samples[(s.name, s.labels.get("engine"))] = s.value
        dead = str(core.index)
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "engine_alive"):
            assert samples[(f"lmserve:{name}", dead)] == 0, name
        assert samples[("lmserve:engine_alive", None)] == 1  # the aggregate: cores alive
        assert samples[("lmserve:engine_alive", str(1 - core.index))] == 1
        assert samples[("lmserve:num_failed_requests_total", dead)] == 1
        assert samples[("lmserve:num_failed_requests_total", None)] == 1
        # the other core serves the next requests
        outs = await asyncio.gather(*(_final(dp2, f"after-{i}", [5, 6, i + 3], greedy(3)) for i in range(3)))
        assert all(o.finished and len(o.outputs[0].token_ids) == 3 for o in outs)
        survivor = next(c for c in dp2._cores if c.alive)
        os.kill(survivor.pid, signal.SIGKILL)
        t0 = time.monotonic()
        while dp2.dead_error is None:
            assert time.monotonic() - t0 < 1.0, "the second death was not noticed within 1 s"
            await asyncio.sleep(0.01)
        with pytest.raises(EngineDeadError):
            dp2.add_request("late", [5], greedy(2))

    asyncio.run(run())
