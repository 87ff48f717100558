"""lmserve.observability.diagnose: each rule on a real engine driven into its state (tiny random Llama, in-process
AsyncEngine,
its metrics read from the server's own registry before and after), and the rules on synthetic windows."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmserve import SamplingParams
from lmserve.config.engine import EngineArgs
from lmserve.engine.async_engine import AsyncEngine
from lmserve.engine.llm_engine import LLMEngine
from lmserve.observability.diagnose import (
    GAUGES,
    Diagnosis,
    Dist,
    Scrape,
    Thresholds,
    Window,
    diagnose,
    diagnose_report,
    window_between,
    window_from_report,
)
from lmserve.observability.prometheus import Metrics

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ANY_TTFT = Thresholds(ttft_s=0.0, tpot_s=0.0)  # every TTFT / TPOT counts as high: the tests look at the cause


class Rig:
    """A started AsyncEngine with the server's Metrics attached (what /metrics renders)."""

    def __init__(self, model_dir: Path, **kwargs) -> None:
        args = dict(num_kv_blocks=64, block_size=16, max_model_len=512)
        args.update(kwargs)
        self.engine = AsyncEngine(LLMEngine.from_engine_args(EngineArgs.from_kwargs(str(model_dir), **args)))
        self.metrics = Metrics("tiny", self.engine.snapshot)
        self.engine.stat_loggers.append(self.metrics)
        self.engine.start()

    def scrape(self) -> Scrape:
        return Scrape.from_registry(self.metrics.registry)

    def close(self) -> None:
        self.engine.shutdown()


@pytest.fixture
def rig_factory(llama_dir: Path) -> Iterator:
    rigs: list[Rig] = []

    def make(**kwargs) -> Rig:
        rigs.append(Rig(llama_dir, **kwargs))
        return rigs[-1]

    yield make
    for r in rigs:
        r.close()


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def _run(engine: AsyncEngine, prompt: list[int], max_tokens: int, first_token: asyncio.Event | None = None):
    async for out in engine.generate(prompt, _params(max_tokens)):
        if first_token is not None and out.outputs[0].token_ids:
            first_token.set()
    return out


def _prompt(n: int, offset: int = 1) -> list[int]:
    return [(offset + i) % 500 + 1 for i in range(n)]


def _rules(d: Diagnosis) -> set[str]:
    return {f.rule for f in d.findings}


def _window(rig: Rig, scenario) -> Window:
    before = rig.scrape()
    asyncio.run(scenario(rig.engine))
    return window_between(before, rig.scrape())


# ---- a real engine in each state --------------------------------------------------------------------


def test_tiny_kv_pool_preempts_and_is_diagnosed_kv_full(rig_factory) -> None:
    rig = rig_factory(num_kv_blocks=10, max_model_len=128)  # 160 tokens; 4 requests grow to 4 × 100

    async def scenario(engine: AsyncEngine) -> None:
        await asyncio.gather(*(_run(engine, _prompt(40, 7 * i), 60) for i in range(4)))

    w = _window(rig, scenario)
    assert w.counters["preemptions"] > 0
    d = diagnose(w)
    kv = next(f for f in d.findings if f.rule == "kv_cache_full")
    assert "preempted" in kv.cause
    assert any("preemptions in" in e for e in kv.evidence)
    assert any("KV pool 160 tokens" in e for e in kv.evidence)
    assert "--kv-cache-dtype int8" in kv.change and "--max-num-seqs" in kv.change


def _burst_behind_a_running_batch(num_burst: int):
    async def scenario(engine: AsyncEngine) -> None:
        started = asyncio.Event()
        long = [asyncio.ensure_future(_run(engine, _prompt(20, 3 * i), 80, started)) for i in range(2)]
        await started.wait()
        await asyncio.gather(*(_run(engine, _prompt(20, 100 + 5 * i), 4) for i in range(num_burst)), *long)

    return scenario


def test_static_policy_burst_is_diagnosed_as_static_batching(rig_factory) -> None:
    w = _window(rig_factory(scheduling_policy="static"), _burst_behind_a_running_batch(8))
    d = diagnose(w, ANY_TTFT)
    f = next(f for f in d.findings if f.rule == "ttft_static_batching")
    assert f.change == "--scheduling-policy continuous"
    assert w.dists["queue"].mean > 0.5 * w.dists["ttft"].mean


def test_continuous_policy_same_burst_is_not_queueing(rig_factory) -> None:
    w = _window(rig_factory(scheduling_policy="continuous"), _burst_behind_a_running_batch(8))
    d = diagnose(w, ANY_TTFT)
    assert not _rules(d) & {"ttft_static_batching", "ttft_queueing"}, d.format()


def _decodes_with_long_prompts_mixed_in(engine: AsyncEngine):
    async def scenario(engine: AsyncEngine) -> None:
        started = asyncio.Event()
        decodes = [asyncio.ensure_future(_run(engine, _prompt(8, 11 * i), 120, started)) for i in range(4)]
        await started.wait()
        for i in range(6):  # one long prompt at a time, each computed beside the four decodes
            await _run(engine, _prompt(440, 50 * i), 1)
        await asyncio.gather(*decodes)

    return scenario(engine)


def test_chunked_prefill_off_with_long_prompts_is_prefill_interference(rig_factory) -> None:
    rig = rig_factory(enable_chunked_prefill=False)
    w = _window(rig, _decodes_with_long_prompts_mixed_in)
    assert w.counters["mixed_steps"] >= 6 and w.counters["mixed_step_prefill_tokens"] >= 6 * 440
    d = diagnose(w, ANY_TTFT)
    f = next(f for f in d.findings if f.rule == "tpot_prefill_interference")
    assert "--enable-chunked-prefill" in f.change
    assert "enable_chunked_prefill=False" in f.evidence


def test_chunked_prefill_with_a_small_budget_interferes_less(rig_factory) -> None:
    rig = rig_factory(enable_chunked_prefill=True, max_num_batched_tokens=16)
    w = _window(rig, _decodes_with_long_prompts_mixed_in)
    per_step = w.counters["mixed_step_prefill_tokens"] / w.counters["mixed_steps"]
    # The budget is what bounds a mixed step's prompt work: 16 tokens minus at least one decode, on any machine.
    # (Not 16 minus four: the four decodes start and finish a step apart, since the budget admits two 8-token
    # prompts a step, so a prompt chunk computed beside two or three of them takes 13-14 tokens; CI read 12.009.)
    assert per_step <= 15
    assert w.counters["mixed_steps"] >= 3  # enough for the rule to judge
    # Whether the rule fires is a judgement on wall-clock step times, which another process on the machine can
    # skew either way; what must hold on any machine is that it fires exactly when the measured ratio says so.
    # (No decode-only step at all, when the next prompt always arrived in time, leaves nothing to compare with.)
    mixed = w.counters["mixed_step_time_s"] / w.counters["mixed_steps"]
    d_steps = w.counters["decode_steps"]
    decode = w.counters["decode_step_time_s"] / d_steps if d_steps else None
    fired = "tpot_prefill_interference" in _rules(diagnose(w, ANY_TTFT))
    assert fired == (decode is not None and mixed >= Thresholds().interference_ratio * decode), (mixed, decode)


def _shared_system_prompt(engine: AsyncEngine):
    system = _prompt(96, 200)

    async def scenario(engine: AsyncEngine) -> None:
        for i in range(8):  # one after the other: no queueing, TTFT is all prefill
            await _run(engine, system + _prompt(10, 7 * i), 2)

    return scenario(engine)


def test_shared_prompt_without_prefix_caching_is_prefix_misses(rig_factory) -> None:
    w = _window(rig_factory(enable_prefix_caching=False), _shared_system_prompt)
    assert w.counters["prefix_hits"] == 0 and w.counters["prefix_shareable"] == 7 * 96
    f = next(f for f in diagnose(w, ANY_TTFT).findings if f.rule.startswith("ttft_"))
    assert f.rule == "ttft_prefix_misses"
    assert "--enable-prefix-caching" in f.change


def test_shared_prompt_with_prefix_caching_is_not_prefix_misses(rig_factory) -> None:
    w = _window(rig_factory(enable_prefix_caching=True), _shared_system_prompt)
    assert w.counters["prefix_hits"] == w.counters["prefix_shareable"] == 7 * 96
    assert "ttft_prefix_misses" not in _rules(diagnose(w, ANY_TTFT))


def test_healthy_server_has_no_bottleneck(rig_factory) -> None:
    rig = rig_factory()
    idle = window_between(rig.scrape(), rig.scrape())
    d = diagnose(idle)
    assert d.healthy and "no bottleneck found" in d.format()

    async def scenario(engine: AsyncEngine) -> None:
        for i in range(3):
            await _run(engine, _prompt(12, i), 6)

    w = _window(rig, scenario)
    assert w.dists["ttft"].count == 3
    d = diagnose(w)
    assert d.healthy, d.format()
    assert "3 requests finished" in d.format()


# ---- the rules on synthetic windows -------------------------------------------------------------------


def _synthetic(**kw) -> Window:
    cfg = dict(
        scheduling_policy="continuous", enable_chunked_prefill="True", enable_prefix_caching="True",
        max_num_seqs="64", max_num_batched_tokens="2048", max_model_len="4096", block_size="16",
        num_layers="32", num_kv_heads="8", head_dim="128", kv_cache_dtype="bfloat16",
    )  # fmt: skip
    w = Window(duration_s=30.0, config=cfg)
    w.gauges = dict(running=8, waiting=0, kv_usage=0.3, kv_capacity_tokens=65536, kv_bytes_per_token=131072)
    w.counters = dict(preemptions=0, prompt_tokens=10000, prefix_hits=0, prefix_shareable=0, generation_tokens=5000)
    w.dists = {
        "ttft": Dist(100, 0.2, 0.2, 0.3, 0.35),
        "queue": Dist(100, 0.01, 0.01, 0.02, 0.02),
        "prefill": Dist(100, 0.19, 0.19, 0.25, 0.3),
        "tpot": Dist(100, 0.02, 0.02, 0.03, 0.03),
        "itl": Dist(5000, 0.02, 0.02, 0.03, 0.04),
        "prompt_len": Dist(100, 100, 100, 120, 130),
        "output_len": Dist(100, 50, 50, 50, 50),
    }
    for k, v in kw.items():
        target = w.dists if isinstance(v, Dist) else w.gauges if k in GAUGES else w.counters
        if k in ("config",):
            w.config.update(v)
        else:
            target[k] = v
    return w


def test_synthetic_healthy() -> None:
    assert diagnose(_synthetic()).healthy


def test_synthetic_queueing_causes() -> None:
    slow_queue = dict(ttft=Dist(100, 0.9, 0.9, 1.2, 1.3), queue=Dist(100, 0.7, 0.7, 0.9, 1.0))
    d = diagnose(_synthetic(running=64, waiting=30, **slow_queue))
    f = next(f for f in d.findings if f.rule == "ttft_queueing")
    assert "max_num_seqs" in f.cause and "--max-num-seqs 128" in f.change
    d = diagnose(_synthetic(running=20, waiting=30, kv_usage=0.97, **slow_queue))
    assert "KV blocks" in next(f for f in d.findings if f.rule == "ttft_queueing").cause
    assert "kv_cache_full" in _rules(d)  # full and requests waiting
    d = diagnose(_synthetic(config={"scheduling_policy": "static"}, **slow_queue))
    assert "ttft_static_batching" in _rules(d)
    # a hybrid model whose budget holds 40 state slots (max_num_seqs capped to them): named as the state slots
    d = diagnose(_synthetic(running=40, waiting=30, state_slots_used=40, state_slots_total=40, **slow_queue))
    f = next(f for f in d.findings if f.rule == "ttft_queueing")
    assert "recurrent-state slot" in f.cause and "--kv-cache-memory-gib" in f.change, f
    assert "state slots 40 of 40" in f.evidence


def test_synthetic_long_prefill() -> None:
    d = diagnose(_synthetic(ttft=Dist(100, 0.9, 0.9, 1.0, 1.1), prompt_len=Dist(100, 3000, 3000, 3500, 3900)))
    f = next(f for f in d.findings if f.rule == "ttft_long_prefill")
    assert "3000 tokens" in f.evidence[-1]


def test_synthetic_decode_causes() -> None:
    slow = dict(tpot=Dist(100, 0.12, 0.12, 0.13, 0.14), itl=Dist(5000, 0.12, 0.12, 0.13, 0.14))
    oversub = dict(decode_steps=1000, decode_step_time_s=120.0, decode_step_seqs=2000, decode_step_time_min_s=0.02)
    d = diagnose(_synthetic(**slow, **oversub))
    assert "tpot_cpu_oversubscribed" in _rules(d) and "tpot_large_batch" not in _rules(d)
    big = dict(decode_steps=1000, decode_step_time_s=120.0, decode_step_seqs=48000, decode_step_time_min_s=0.02)
    f = next(f for f in diagnose(_synthetic(**slow, **big)).findings if f.rule == "tpot_large_batch")
    assert "--max-num-seqs 24 (now 64)" in f.change
    normal = dict(decode_steps=1000, decode_step_time_s=110.0, decode_step_seqs=2000, decode_step_time_min_s=0.1)
    assert _rules(diagnose(_synthetic(**slow, **normal))) == {"tpot_slow_step"}


def test_synthetic_jitter_causes() -> None:
    jitter = dict(itl=Dist(5000, 0.03, 0.02, 0.15, 0.2), prompt_len=Dist(100, 500, 100, 3000, 4000))
    f = next(f for f in diagnose(_synthetic(**jitter)).findings if f.rule == "itl_jitter")
    assert "mixed prompt lengths" in f.cause and "10.0x" in f.symptom
    f = next(f for f in diagnose(_synthetic(preemptions=12, **jitter)).findings if f.rule == "itl_jitter")
    assert f.cause.startswith("preemptions")
    few = dict(itl=Dist(3, 0.03, 0.02, 0.15, 0.2))
    assert "itl_jitter" not in _rules(diagnose(_synthetic(**few)))


def test_histogram_quantiles_match_prometheus_interpolation() -> None:
    d = Dist.from_histogram([0.1, 0.2, 0.4, float("inf")], [0, 50, 100, 100], 15.0)
    assert d.count == 100 and d.mean == 0.15
    assert d.p50 == pytest.approx(0.2) and d.p95 == pytest.approx(0.38) and d.p99 == pytest.approx(0.396)
    assert d.buckets == [(0.1, 0), (0.2, 50), (0.4, 50), (float("inf"), 0)]


def test_report_window(tmp_path: Path) -> None:
    def dist(mean, p50, p95, p99):
        return dict(count=30, mean=mean, p50=p50, p90=p95, p95=p95, p99=p99, max=p99, min=p50)

    requests = [
        dict(success=True, scheduled_s=0.1 * i, chunk_times_s=[0.1 * i + 0.1 + 0.05 * i], chunk_num_tokens=[1])
        for i in range(30)
    ]
    doc = {
        "args": {},
        "summary": dict(
            duration_s=10.0,
            total_prompt_tokens=3000,
            total_output_tokens=1500,
            ttft_ms=dist(900, 800, 1500, 1700),
            tpot_ms=dist(20, 20, 25, 30),
            itl_ms=dist(20, 20, 25, 30),
            e2e_ms=dist(2000, 1900, 2500, 2600),
            prompt_len=dist(100, 100, 110, 120),
            output_len=dist(50, 50, 50, 50),
        ),  # fmt: skip
        "requests": requests,
    }
    w = window_from_report(doc)
    assert w.dists["ttft"].p50 == pytest.approx(0.8) and w.ttft_growth > 2
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    d = diagnose_report(path)
    assert "ttft_queueing" in _rules(d) and d.source == "report"
    with pytest.raises(ValueError, match="summary"):
        window_from_report({"args": {}})


def test_thresholds_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Thresholds().ttft_s = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("mixed_step_s, fires", [(0.03, False), (0.039, False), (0.041, True), (0.09, True)])
def test_synthetic_prefill_interference_is_the_mixed_to_decode_step_ratio(mixed_step_s: float, fires: bool) -> None:
    w = _synthetic(tpot=Dist(100, 0.05, 0.05, 0.06, 0.07), decode_steps=1000, decode_step_time_s=20.0,
                   mixed_steps=50, mixed_step_time_s=50 * mixed_step_s, mixed_step_prefill_tokens=50 * 300)  # fmt: skip
    findings = [f for f in diagnose(w, ANY_TTFT).findings if f.rule == "tpot_prefill_interference"]
    assert bool(findings) == fires  # 2x the 20 ms decode step is the threshold
    if fires:
        assert "a smaller --max-num-batched-tokens (now 2048)" in findings[0].change  # chunked prefill is on
        assert "300 prompt tokens each" in findings[0].evidence[0]
