"""The simulator against the real server on the same workloads: an error table.

    python benchmarks/validate_sim.py --step-model step-model.json [--quick] [--out benchmarks/results]

For every point the same requests (token ids from bench/datasets.py) with the same arrival offsets (the load
generator's arrival_offsets_s, same seed) and the same client concurrency cap go to `lmserve serve` (started here on
the bundled model, through the bench load generator) and to `lmserve.sim` with the same engine flags. Points: the
six seed experiments' configurations (bench/experiments.py: prompt sweep and output sweep one at a time, the
concurrency sweep, the burst the HF comparison uses, static vs continuous batching, prefix cache on vs off), plus
Poisson arrivals at three rates up to saturation (the saturation throughput is the simulator's own estimate for the
workload sent all at once: what batching sustains; the engine is busy far more of the time than that fraction, and
the busy fractions of both sides are printed: on the 2-core machine the server's read 70 / 94 / 99 % at 30 / 60 / 90
%). Errors are (simulated − measured) / measured of mean and P99 TTFT and TPOT and of the output throughput; the
simulator runs deterministic, with the step model's measured step noise, and with the step model rescaled per point
by the server's traced steps' total time over the step model's on those same steps (the mean over the point's runs;
the server's mean step over the simulated one where no trace was read, e.g. rescoring another step model) and the
API / core-loop overheads read again on each server before its points (calibrate's procedure): that takes the
machine's drift since calibration out, leaving the scheduling / queueing model's own error. (A mean step over a
mean step is not a speed: an open loop's server that batches into fewer, longer steps than the simulator reads
slower by that alone, and near saturation the rescaled run then queues without end.) The engine step
counts of both sides are printed too, and per point: its own noise (2 standard errors of the measured mean TTFT and
TPOT over its requests: the points have enough requests that it is below the 10 % judged, except the 8-request
burst), the server's traced steps (LMSERVE_STEP_TRACE) against the step model on the same steps (their total time /
the model's with its API stretch: 1.00 when the model fits what the server ran, so that the rest of an error is
batching and queueing) and the share of them the engine core ran with one torch thread (its CPU back-off: other
processes were using the CPUs, and the point measured the machine's load).

`--poisson-repeats N` measures each Poisson point N times on the server (the same requests and arrivals) and judges
the simulator against the server's own spread: per metric the measured min – max over the N runs beside the
simulated value (deterministic and rescaled) and how far outside that range it falls (0: inside). On the 2-core
development machine the server's Poisson figures moved 15-70 % between two clean runs, more than the 10 % judged;
the error tables keep comparing with the first run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np

from lmserve.bench.datasets import BenchRequest, DatasetConfig, build_requests, load_tokenizer
from lmserve.bench.harness import lmserve_server
from lmserve.bench.loadgen import LoadConfig, arrival_offsets_s, finalize_all, run_load
from lmserve.bench.metrics import BenchSummary, request_latency, summarize
from lmserve.bench.report import json_safe
from lmserve.observability.step_trace import ENV
from lmserve.sim.api_costs import held_sends, process_cpu_s
from lmserve.sim.inputs import engine_config
from lmserve.sim.served_steps import overheads_on_server, scrape_step_counters
from lmserve.sim.sim_config import SimConfig
from lmserve.sim.simulator import Simulator
from lmserve.sim.step_features import Overheads
from lmserve.sim.step_model import StepProfile
from lmserve.sim.workload import Workload

METRICS = (
    ("TTFT mean", "ttft_ms", "mean"),
    ("TTFT P99", "ttft_ms", "p99"),
    ("TPOT mean", "tpot_ms", "mean"),
    ("TPOT P99", "tpot_ms", "p99"),
    ("out tok/s", "output_throughput_tok_s", None),
)
SIM_COLUMNS = (  # the simulated columns a point holds: (what the tables call them, the Point attribute)
    ("deterministic", "sim"),
    ("with the step noise", "sim_noise"),
    ("rescaled", "sim_rescaled"),
    ("rescaled with the step noise", "sim_rescaled_noise"),
)
# issue #37's targets: how far outside the server's own range (its repeats) a simulated value may lie
TARGET_PCT = {"TTFT mean": 10.0, "TTFT P99": 20.0, "TPOT mean": 10.0, "TPOT P99": 20.0, "out tok/s": 5.0}
BASE_FLAGS = ["--kv-cache-memory-gib", "0.25"]
BACKED_OFF_PCT = 10.0  # a point whose server steps ran on one thread more than this often is measured again
OTHERS_MAX = 0.15  # ... and one while which other processes used more than this many cores' worth of CPU
SERVERS = {  # name → extra `lmserve serve` flags (and the engine keywords the simulator gets for them)
    "default": ([], {}),
    "static": (["--scheduling-policy", "static", "--max-num-seqs", "4"],
               {"scheduling_policy": "static", "max_num_seqs": 4}),
    "no-prefix-cache": (["--no-prefix-caching"], {"enable_prefix_caching": False}),
}  # fmt: skip


@dataclass
class Point:
    name: str
    server: str
    requests: list[BenchRequest]
    rate_rps: float = math.inf
    max_concurrency: int | None = None
    real: BenchSummary | None = None
    sim: BenchSummary | None = None
    sim_noise: BenchSummary | None = None
    sim_rescaled: BenchSummary | None = None  # the step model scaled by `rescale_factor` (the machine's drift)
    # the same with the step noise (drift out, the tail kept: a deterministic step model has none)
    sim_rescaled_noise: BenchSummary | None = None
    server_steps: int | None = None  # engine steps the server took for the point (its /metrics counters)
    server_step_s: float | None = None  # their mean wall time
    sim_steps: int | None = None
    sim_step_s: float | None = None
    # the point's own noise: 2 standard errors of the measured mean TTFT (from the send) / TPOT over its requests,
    # % of the mean
    noise_pct: tuple[float | None, float | None] = (None, None)
    # the server's traced steps (LMSERVE_STEP_TRACE) for the point: the fraction taken with one torch thread (the
    # core's back-off: other processes used its CPUs), and their total time / the step model's (with its API
    # stretch) on the same steps: 1 when the model fits the served steps, whatever the batching
    one_thread_pct: float | None = None
    served_fit_ratio: float | None = None
    served_fit_ratios: list[float] = field(default_factory=list)  # the same, each run of the point (its repeats)
    # the engine's busy fraction over the point (its traced iterations' time / first send → last step end) and the
    # simulator's (its steps' time / the run's duration)
    server_busy: float | None = None
    sim_busy: float | None = None
    trace_rows: tuple[int, int] = (0, 0)  # the point's rows in its server's step trace
    send_times: list[float] = field(default_factory=list)
    # cores' worth of CPU other processes (not this one, not its servers) used while the point ran: another
    # developer's work on the machine slows the server, never the simulator
    others_cores: float | None = None  # its requests' send times, wall clock (--keep-trace)
    notes: list[str] = field(default_factory=list)
    # every measurement of it (--poisson-repeats; the first is `real`)
    repeats: list[BenchSummary] = field(default_factory=list)


def _value(s: BenchSummary, attr: str, q: str | None) -> float | None:
    v = getattr(s, attr)
    return v if q is None else getattr(v, q)


def error_pct(sim: BenchSummary, real: BenchSummary, attr: str, q: str | None) -> float | None:
    a, b = _value(sim, attr, q), _value(real, attr, q)
    if a is None or b is None or b == 0:
        return None
    return 100.0 * (a - b) / b


def build_points(tok: Any, quick: bool, seed: int) -> list[Point]:
    n = 0

    def reqs(num: int, input_len: int, output_len: int, **kw: Any) -> list[BenchRequest]:
        nonlocal n
        n += 1
        return build_requests(DatasetConfig(num_requests=num, input_len=input_len, output_len=output_len,
                                             seed=seed * 1000 + n, **kw), tok)  # fmt: skip

    # enough requests per point that the point's own noise (2 standard errors of its mean, printed) is below the
    # 10 % being judged: one-at-a-time points vary 5-15 % request to request (24 requests: ±3-6 %), closed-loop
    # points batch differently from request to request (4 × the concurrency); the quick points are a smoke test
    per = 3 if quick else 24
    pts: list[Point] = []
    for p in (16, 64, 256) if quick else (32, 128, 256, 512):
        pts.append(Point(f"1 prompt {p}, one at a time", "default", reqs(per, p, 4), max_concurrency=1))
    for o in (4, 16, 48) if quick else (16, 64, 128):
        pts.append(Point(f"2 output {o}, one at a time", "default", reqs(per if o < 128 else per // 2, 32, o),
                         max_concurrency=1))  # fmt: skip
    for c in (1, 2, 4, 8) if quick else (1, 4, 16, 32):
        pts.append(Point(f"3 concurrency {c}", "default", reqs(max(per, (2 if quick else 4) * c), 32, 16),
                         max_concurrency=c))  # fmt: skip
    pts.append(Point("4 burst of 8 (HF comparison's)", "default", reqs(8, 32, 16)))
    mixed = reqs(12 if quick else 64, 32, 24, range_ratio=0.6)
    pts.append(Point("5 continuous, mixed lengths", "default", mixed))
    pts.append(Point("5 static (max-num-seqs 4)", "static", mixed))
    prefix = build_requests(DatasetConfig(name="prefix", num_requests=8 if quick else 48, input_len=16, output_len=8,
                                          prefix_len=384, seed=seed * 1000 + 99), tok)  # fmt: skip
    pts.append(Point("6 prefix cache on, shared 384-token prefix", "default", prefix, max_concurrency=1))
    pts.append(Point("6 prefix cache off", "no-prefix-cache", prefix, max_concurrency=1))
    return pts


def poisson_points(tok: Any, profile: StepProfile, config: Any, quick: bool, seed: int) -> list[Point]:
    num = 30 if quick else 300  # (100 Poisson requests: ±15-30 % from one run to the next near saturation)
    base = build_requests(DatasetConfig(num_requests=num, input_len=64, output_len=32, seed=seed * 1000 + 500), tok)
    burst, _ = simulate(profile, config, base, math.inf, None, seed, False)
    sat = burst.request_throughput_rps
    pts = []
    for frac in (0.3, 0.6, 0.9):
        p = Point(f"Poisson {frac:.0%} of saturation ({frac * sat:.2f} req/s)", "default", base, rate_rps=frac * sat)
        pts.append(p)
    return pts


def busy_fraction(result: Any) -> float:
    """The simulated engines' busy time over the run's duration (their mean, with several)."""
    return float(result.stats_dict()["mean_replica_utilization"])


def simulate(profile: StepProfile, config: Any, requests: list[BenchRequest], rate: float, cap: int | None,
             seed: int, noise: bool) -> tuple[BenchSummary, Any]:  # fmt: skip
    arrivals = arrival_offsets_s(len(requests), rate, 1.0, seed)
    w = Workload([r.prompt_token_ids for r in requests], [r.output_len for r in requests], arrivals)
    result = Simulator(profile, SimConfig(config, max_concurrency=cap, step_noise=noise, seed=seed)).run(w)
    return summarize(result.records, result.duration_s or None, rate, cap), result


def measure(
    url: str, p: Point, tok: Any, seed: int, timeout_s: float, trace: Path | None = None,
    profile: StepProfile | None = None,
) -> tuple[BenchSummary, dict[str, float]]:  # fmt: skip
    """The point on the server; with the change of its engine's step counters over the run, its own noise and,
    with the server's step trace, its served steps against the step model (Point.one_thread_pct, served_fit_ratio).
    The server's prefix cache is reset first: a repeat (or a retry) sends the same prompts, which would otherwise
    be cached from the run before, where the simulator starts each run cold."""
    r = httpx.post(url + "/reset_prefix_cache", timeout=timeout_s)
    if r.status_code != 200:
        raise RuntimeError(f"POST /reset_prefix_cache: HTTP {r.status_code} {r.text[:200]}")
    cfg = LoadConfig(base_url=url, request_rate_rps=p.rate_rps, max_concurrency=p.max_concurrency, seed=seed,
                     timeout_s=timeout_s)  # fmt: skip
    first_row = len(trace_rows(trace)) if trace is not None else 0
    busy0, own0, t0 = *others_cpu_s(), time.perf_counter()
    p.trace_rows = (first_row, first_row)
    before = scrape_step_counters(url)
    result = asyncio.run(run_load(p.requests, cfg))
    after = scrape_step_counters(url)
    busy1, own1 = others_cpu_s()
    p.others_cores = max(0.0, (busy1 - busy0) - (own1 - own0)) / max(1e-9, time.perf_counter() - t0)
    records = finalize_all(result, p.requests, cfg, tok)
    if result.fatal_error:
        raise RuntimeError(result.fatal_error)
    lats = [request_latency(r) for r in records]
    # (TTFT from the send: from the scheduled arrival it also holds the client's queue, which is not noise: with one
    # request at a time the k-th waits for k − 1 others by design)
    p.noise_pct = tuple(_noise_pct([getattr(x, a) for x in lats]) for a in ("ttft_from_send_s", "tpot_s"))  # type: ignore
    if trace is not None and profile is not None:
        time.sleep(0.1)  # the core writes a step's line after sending its outputs
        all_rows = trace_rows(trace)
        p.trace_rows = (first_row, len(all_rows))
        rows = [r for r in all_rows[first_row:] if r[6] > 0]
        p.send_times = [result.start_wall_time + r.send_s for r in result.raw if r.send_s is not None]
        held = held_sends(result.raw, result.start_wall_time, p.max_concurrency is not None)
        if rows:
            p.one_thread_pct = 100.0 * sum(r[7] == 1 for r in rows) / len(rows)
            p.served_fit_ratio = served_fit(profile, rows, p.send_times, held)
            span = rows[-1][10] - min(p.send_times, default=rows[0][10] - rows[0][6])
            p.server_busy = sum(r[6] for r in rows) / span if span > 0 else None
    return summarize(records, result.duration_s or None, p.rate_rps, p.max_concurrency), {
        k: after[k] - before[k] for k in after
    }


def others_cpu_s() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, of them this process's and the lmserve servers' it started: API
    processes and their engine cores) so far; the difference over a point is what other processes took."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = (sum(v[:8]) - v[3] - v[4]) / tick  # all but idle and iowait
    ours = {os.getpid()}
    frontier = [os.getpid()]
    while frontier:  # this process's descendants (the servers, their engine cores)
        pid = frontier.pop()
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            continue
        ours.update(kids)
        frontier += kids
    own = 0.0
    for pid in ours:
        try:
            own += process_cpu_s(pid)
        except (OSError, ValueError, IndexError):
            pass
    return busy, own


def simulate_point(p: Point, profile: StepProfile, cfg: Any, seed: int, sim_overheads: Any, served: bool) -> None:
    """The point on the simulator: deterministic, with the step noise, and (with the server's mean step,
    p.server_step_s) each rescaled by the server's mean step / its own; `sim_overheads` for the rescaled runs (the
    core-loop overhead dropped when the profile was fitted on served steps, which hold it)."""
    p.sim, result = simulate(profile, cfg, p.requests, p.rate_rps, p.max_concurrency, seed, False)
    noisy = None
    if profile.noise_quantiles:
        p.sim_noise, noisy = simulate(profile, cfg, p.requests, p.rate_rps, p.max_concurrency, seed, True)
    if served:
        sim_overheads = dataclasses.replace(sim_overheads, core_step_overhead_s=0.0)
    p.sim_steps = result.num_steps
    p.sim_step_s = mean_step_s(result)
    p.sim_busy = busy_fraction(result)
    factor, _ = rescale_factor(p, p.sim_step_s)
    if factor:
        rescaled = dataclasses.replace(profile.scaled(factor), overheads=sim_overheads)
        p.sim_rescaled, _ = simulate(rescaled, cfg, p.requests, p.rate_rps, p.max_concurrency, seed, False)
    noisy_factor = rescale_factor(p, mean_step_s(noisy))[0] if noisy is not None else None
    if noisy_factor:
        rescaled = dataclasses.replace(profile.scaled(noisy_factor), overheads=sim_overheads)
        p.sim_rescaled_noise, _ = simulate(rescaled, cfg, p.requests, p.rate_rps, p.max_concurrency, seed, True)


def rescale_factor(p: Point, sim_step_s: float | None) -> tuple[float | None, str]:
    """How much slower the machine ran the point's steps than the step model says, and from what: the server's traced
    steps over the model on the same steps, averaged over the point's runs (whatever the batching: each side's own
    steps), else the server's mean step over the simulated run's (`sim_step_s`; where the two batch alike, as in a
    closed loop, the same figure; in an open loop the server's fewer, longer steps read as a slower machine). The
    noise sampler has mean 1, so the noisy run takes the traced figure as it is; by the mean step it is judged on its
    own steps (its draws' sample mean is not exactly 1)."""
    if p.served_fit_ratios:
        return statistics.fmean(p.served_fit_ratios), "served steps / model"
    if p.server_step_s and sim_step_s:
        return p.server_step_s / sim_step_s, "mean step / simulated mean step"
    return None, "no server steps"


def _namespace(x: Any) -> Any:
    """A JSON object as attributes (a BenchSummary as validate_sim reads one), recursively."""
    if isinstance(x, dict):
        return SimpleNamespace(**{k: _namespace(v) for k, v in x.items()})
    return [_namespace(v) for v in x] if isinstance(x, list) else x


def _plain(x: Any) -> Any:
    """_namespace's inverse (a rescored run's measurements back to JSON); anything else as it is."""
    if isinstance(x, SimpleNamespace):
        return {k: _plain(v) for k, v in vars(x).items()}
    return [_plain(v) for v in x] if isinstance(x, list) else x


def load_measured(path: str, points: list[Point], step_model_source: str | None = None) -> dict[str, Overheads]:
    """--rescore: an earlier run's measurements (its JSON) onto `points`, matched by name (a Poisson point's by its
    fraction of saturation, taking the run's rate: it depends on the step model that run had); the overheads it read
    on each server, by server name. The served steps over the model (the rescaled columns' factor) are the step
    model's that run had: kept when `step_model_source` is that model's file, else the rescale falls back to the
    mean steps."""
    doc = json.loads(Path(path).read_text())
    if doc.get("benchmark") != "validate_sim":
        raise ValueError(f"{path} is not a validate_sim JSON")
    def key(name: str) -> str:  # (a Poisson point's name ends in its rate, which depends on the run's step model)
        return name.split(" (")[0] if name.startswith("Poisson") else name

    by_key = {key(x["name"]): x for x in doc["points"]}
    for p in points:
        x = by_key.get(key(p.name))
        if x is None or x.get("measured") is None:
            p.notes.append(f"not measured in {path}")
            continue
        if p.name.startswith("Poisson"):
            p.name, p.rate_rps = x["name"], float(x["rate_rps"])
        if len(p.requests) != x["num_requests"]:
            raise ValueError(f"{p.name} has {x['num_requests']} requests in {path}, {len(p.requests)} here "
                             "(another --seed or --quick?)")  # fmt: skip
        p.real = _namespace(x["measured"])
        p.repeats = [_namespace(r) for r in x.get("measured_repeats") or [x["measured"]]]
        p.server_steps = (x.get("engine_steps") or {}).get("measured")
        p.server_step_s = (x.get("mean_step_s") or {}).get("measured")
        noise = x.get("measured_noise_pct") or {}
        p.noise_pct = (noise.get("ttft_mean"), noise.get("tpot_mean"))
        p.one_thread_pct = x.get("served_steps_one_thread_pct")
        # the served steps over the model are that run's step model's: kept only when rescoring with the same one
        same_model = step_model_source is not None and (doc.get("step_model") or {}).get("source") == step_model_source
        ratio = x.get("served_steps_over_model")
        p.served_fit_ratio = ratio if same_model else None
        runs = x.get("served_steps_over_model_runs") or ([] if ratio is None else [ratio])
        p.served_fit_ratios = list(runs) if same_model else []
        p.server_busy = (x.get("busy_fraction") or {}).get("measured")
        p.others_cores, p.notes = x.get("others_cores"), [f"rescored from {path}"]
    return {k: Overheads(**v) for k, v in (doc.get("overheads_at_validation") or {}).items()}


def mean_step_s(result: Any) -> float:
    """A simulated run's mean engine step (its replicas' step time / its steps)."""
    return sum(r.step_s for r in result.replicas) / max(1, result.num_steps)


def _noise_pct(values: list[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    if len(xs) < 2 or statistics.fmean(xs) <= 0:
        return None
    return 100.0 * 2 * statistics.stdev(xs) / math.sqrt(len(xs)) / statistics.fmean(xs)


def trace_rows(trace: Path) -> list[tuple[float, ...]]:
    from lmserve.observability.step_trace import read_trace

    return [row for path in sorted(trace.parent.glob(trace.name + ".*")) for row in read_trace(str(path))]


def served_fit(
    profile: StepProfile, rows: list[tuple[float, ...]], sends: list[float], held: list[float] | None = None
) -> float:
    """The served iterations' total time / the step model's on their features, with the model's API stretch on the
    API work beside each (api_costs.stretch_inputs: the previous step's chunks, the requests sent while it ran) and
    the sends' stalls on each (the requests sent while it runs; `held`: those a concurrency cap had held)."""
    from lmserve.observability.step_trace import OLD_COLUMNS
    from lmserve.sim.api_costs import api_work, sends_during, stretch_inputs
    from lmserve.sim.step_features import StepFeatures, mark_decode_after_prefill

    ov = profile.overheads
    inputs = stretch_inputs(rows, sends, held or []) if len(rows[0]) > OLD_COLUMNS else [(0,) * 6] * len(rows)
    stalls = np.array([ov.api_arrival_stall_s, ov.api_held_send_stall_s])
    work = api_work(ov, inputs) * ov.api_step_stretch + sends_during(inputs) @ stalls
    after = mark_decode_after_prefill(rows)  # (the post-prefill decode term; 0 s in a model without it)
    fitted = sum(
        profile.step_time_s(StepFeatures(int(r[0]), int(r[1]), int(r[2]), int(r[3]), r[4], a))
        for r, a in zip(rows, after, strict=True)
    )
    return sum(r[6] for r in rows) / (fitted + float(work.sum()))


def format_table(points: list[Point], which: str) -> str:
    head = f"{'point':<48}" + "".join(f"{m:>12}" for m, _, _ in METRICS)
    lines = [head, "-" * len(head)]
    for p in points:
        sim = getattr(p, which)
        if p.real is None or sim is None:
            lines.append(f"{p.name:<48}  (not run: {'; '.join(p.notes) or 'skipped'})")
            continue
        cells = []
        for _, attr, q in METRICS:
            e = error_pct(sim, p.real, attr, q)
            cells.append(f"{'-':>12}" if e is None else f"{e:>+11.1f}%")
        lines.append(f"{p.name:<48}" + "".join(cells))
    return "\n".join(lines)


def outside_pct(value: float | None, lo: float | None, hi: float | None) -> float | None:
    """How far `value` lies outside [lo, hi], % of the nearer end (0.0 inside; None when a number is missing)."""
    if value is None or lo is None or hi is None:
        return None
    if value > hi:
        return 100.0 * (value - hi) / hi if hi else math.inf
    if value < lo:
        return 100.0 * (value - lo) / lo if lo else -math.inf
    return 0.0


def spread(p: Point, attr: str, q: str | None) -> tuple[float | None, float | None]:
    """The measured min and max of one metric over the point's repeats."""
    values = [v for v in (_value(r, attr, q) for r in p.repeats) if v is not None]
    return (min(values), max(values)) if values else (None, None)


def repeats_of(p: Point, args: argparse.Namespace) -> int:
    """How many times the point is measured: --repeats, or --poisson-repeats for a Poisson point if more."""
    return max(args.repeats, args.poisson_repeats if math.isfinite(p.rate_rps) else 1)


def against_run_pairs(points: list[Point], which: str | None) -> tuple[float, int] | None:
    """Judged as format_repeats judges, but against the range of the point's runs less one, averaged over which
    run is left out: the simulated values (`which`: a Point attribute, "sim" …) or, `which` None, the left-out run
    itself. The server's figure is what a simulator that reproduced one run exactly would score: the ceiling the
    machine's run-to-run drift sets on the counts; the simulator's, on the same ranges, compares with it. (count
    within, metrics judged) over the points with three runs or more; None when there are none."""
    within, judged = 0.0, 0
    for p in points:
        sim = getattr(p, which) if which else None
        if len(p.repeats) < 3 or (which and sim is None):
            continue
        for m, attr, q in METRICS:
            values = [_value(r, attr, q) for r in p.repeats]
            if any(v is None for v in values):
                continue
            judged += 1
            for i, v in enumerate(values):  # (each left-out run counts 1 / runs: the mean over runs)
                others = values[:i] + values[i + 1 :]
                out = outside_pct(_value(sim, attr, q) if which else v, min(others), max(others))  # type: ignore[arg-type]
                within += (out is not None and abs(out) <= TARGET_PCT[m]) / len(values)
    return (within, judged) if judged else None


def format_repeats(points: list[Point]) -> str:
    """Per point and metric: the server's min – max over its repeats, the simulated values (deterministic; with
    the step model's measured step noise, which alone can give a tail; rescaled; rescaled with the noise), how far
    outside the range each lies and whether that is within the issue's target for the metric (TARGET_PCT: 10 % for
    means, 20 % for P99s, 5 % for throughput); a count of those within, last."""
    head = (f"{'point':<48}{'metric':<12}{'server: min – max':>22}{'simulated':>11}{'outside':>9}{'w/ noise':>10}"
            f"{'outside':>9}{'rescaled':>10}{'outside':>9}{'resc+noise':>11}{'outside':>9}")  # fmt: skip
    lines = [head, "-" * len(head)]
    within, judged = [0, 0, 0, 0], [0, 0, 0, 0]
    for p in points:
        if len(p.repeats) < 2 or p.sim is None:
            continue
        for m, attr, q in METRICS:
            lo, hi = spread(p, attr, q)
            cells = []
            for k, which in enumerate(getattr(p, col) for _, col in SIM_COLUMNS):
                v = None if which is None else _value(which, attr, q)
                out, ok = outside_pct(v, lo, hi), False
                if out is not None:
                    judged[k] += 1
                    ok = abs(out) <= TARGET_PCT[m]
                    within[k] += ok
                mark = "-" if out is None else ("inside" if out == 0 else f"{out:+.1f}%") + (" " if ok else "!")
                cells.append(f"{_f(v):>{11 if k == 3 else 10}}{mark:>9}")
            name = p.name if m == METRICS[0][0] else ""
            lines.append(f"{name:<48}{m:<12}{_f(lo):>10} – {_f(hi):<9}" + "".join(cells))
    lines.append(f"within the target of the server's own range (! marks a miss; targets "
                 f"{', '.join(f'{m} {t:g} %' for m, t in TARGET_PCT.items())}): deterministic {within[0]} of "
                 f"{judged[0]}, with the step noise {within[1]} of {judged[1]}, rescaled {within[2]} of "
                 f"{judged[2]}, rescaled with the step noise {within[3]} of {judged[3]}")  # fmt: skip
    own = against_run_pairs(points, None)
    if own is not None:
        sims = [(k, against_run_pairs(points, w)) for k, w in SIM_COLUMNS]
        lines.append(f"against the runs less one (each left out in turn, averaged): the left-out run itself (what a "
                     f"simulator that reproduced one run exactly would score) {own[0]:.1f} of {own[1]}; simulated "
                     + ", ".join(f"{k} {c[0]:.1f} of {c[1]}" for k, c in sims if c is not None))  # fmt: skip
    return "\n".join(lines)


def measure_clean(
    url: str, p: Point, tok: Any, args: argparse.Namespace, trace: Path | None, profile: StepProfile
) -> tuple[BenchSummary, dict[str, float]]:
    """measure(), again (up to --retries times) while the engine core backed off or other processes used the CPUs."""
    for attempt in range(1 + args.retries):  # a point the core backed off in measured the machine
        real, counters = measure(url, p, tok, args.seed, args.request_timeout, trace, profile)
        if (p.one_thread_pct or 0.0) <= BACKED_OFF_PCT and (p.others_cores or 0.0) <= OTHERS_MAX:
            break
        p.notes.append(f"try {attempt + 1}: {p.one_thread_pct or 0:.0f} % of its steps on one thread, "
                       f"others used {p.others_cores or 0:.2f} cores")  # fmt: skip
        print(f"  {p.name}: {p.notes[-1]}: measured again", flush=True)
        time.sleep(5)
    return real, counters


def format_values(points: list[Point]) -> str:
    head = f"{'point':<48}{'measured TTFT/TPOT mean (ms)':>30}{'simulated':>22}{'measured tok/s':>16}{'simulated':>11}"
    lines = [head, "-" * len(head)]
    for p in points:
        if p.real is None or p.sim is None:
            continue
        r, s = p.real, p.sim
        lines.append(
            f"{p.name:<48}{_f(r.ttft_ms.mean):>15} / {_f(r.tpot_ms.mean):<12}{_f(s.ttft_ms.mean):>10} / "
            f"{_f(s.tpot_ms.mean):<9}{_f(r.output_throughput_tok_s):>16}{_f(s.output_throughput_tok_s):>11}"
        )
    return "\n".join(lines)


def format_steps(points: list[Point]) -> str:
    head = (f"{'point':<48}{'engine steps measured / simulated':>36}{'mean step (ms) measured / simulated':>38}"
            f"{'served/model':>14}{'busy meas. / sim.':>19}{'1-thread':>10}{'others':>8}"
            f"{'noise TTFT/TPOT':>17}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for p in points:
        if p.server_steps is None:
            continue
        ms = "-" if p.server_step_s is None else f"{1e3 * p.server_step_s:.2f}"
        fit = "-" if p.served_fit_ratio is None else f"{p.served_fit_ratio:.2f}"
        one = "-" if p.one_thread_pct is None else f"{p.one_thread_pct:.0f}%"
        noise = " / ".join("-" if x is None else f"±{x:.0f}%" for x in p.noise_pct)
        others = "-" if p.others_cores is None else f"{p.others_cores:.2f}"
        busy = " / ".join("-" if x is None else f"{100 * x:.0f}%" for x in (p.server_busy, p.sim_busy))
        lines.append(f"{p.name:<48}{p.server_steps:>24} / {p.sim_steps:<9}{ms:>26} / "
                     f"{1e3 * (p.sim_step_s or 0):<10.2f}{fit:>12}{busy:>19}{one:>10}{others:>8}"
                     f"{noise:>17}")  # fmt: skip
    return "\n".join(lines)


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-model", required=True)
    ap.add_argument("--quick", action="store_true", help="fewer, smaller points (a busy 2-core machine)")
    ap.add_argument("--only", default=None, help="comma-separated point-name prefixes to run (e.g. 1,3,Poisson)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--retries", type=int, default=2, help="times a point is measured again when the engine core "
                    f"backed off to one thread on more than {BACKED_OFF_PCT:g} %% of its steps or other processes "
                    f"used more than {OTHERS_MAX:g} cores while it ran (default 2)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=1, metavar="N",
                    help="measure every point N times on the server, in N rounds over the points, and judge the "
                    "simulated values against the server's own min – max (default 1: no such table)")  # fmt: skip
    ap.add_argument("--poisson-repeats", type=int, default=1, metavar="N",
                    help="measure each Poisson point N times on the server and print the simulated values beside the "
                    "server's own min – max over them (default 1: no such table)")  # fmt: skip
    ap.add_argument("--keep-trace", default=None, metavar="DIR",
                    help="keep the servers' step traces here (<server>.0), with each point's first and last row in "
                    "the JSON, to score other step models on the same served steps")  # fmt: skip
    ap.add_argument("--rescore", default=None, metavar="JSON",
                    help="no server: judge the step model against the measurements of an earlier run's JSON "
                    "(validate-sim-*.json; same --seed and --quick): every table, the simulator alone")  # fmt: skip
    args = ap.parse_args()
    for name in ("repeats", "poisson_repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    from lmserve.default_model import default_model_path

    model = default_model_path()
    profile = StepProfile.load(args.step_model)
    tok = load_tokenizer(model)
    base_kwargs = {"kv_cache_memory_gib": 0.25}
    configs = {name: engine_config(profile, {**base_kwargs, **kw}, None) for name, (_, kw) in SERVERS.items()}
    points = build_points(tok, args.quick, args.seed) + poisson_points(tok, profile, configs["default"], args.quick,
                                                                      args.seed)  # fmt: skip
    if args.only:
        prefixes = [x.strip() for x in args.only.split(",") if x.strip()]
        points = [p for p in points if any(p.name.startswith(x) for x in prefixes)]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0]
    t0 = time.perf_counter()
    fresh_overheads: dict[str, Any] = {}
    trace_dir = tempfile.TemporaryDirectory(prefix="validate-sim-trace-")
    if args.keep_trace:
        Path(args.keep_trace).mkdir(parents=True, exist_ok=True)
    trace_base = Path(args.keep_trace or trace_dir.name)
    saved_trace = os.environ.get(ENV)
    served = profile.fit.get("fitted_on") == "served"  # (calibrate's served steps: whole core-loop iterations)
    if args.rescore:  # the measurements of an earlier run, this step model on the simulator
        try:
            fresh_overheads.update(load_measured(args.rescore, points, profile.source))
        except (OSError, ValueError, KeyError) as e:  # (KeyError: a JSON without a field validate_sim writes)
            ap.error(f"--rescore {args.rescore}: {e}")
        for p in points:
            if p.real is not None:
                ov = profile.overheads if profile.overheads.api_queue else fresh_overheads.get(p.server, Overheads())
                simulate_point(p, profile, configs[p.server], args.seed, ov, served)
    for server in SERVERS if not args.rescore else ():
        todo = [p for p in points if p.server == server]
        if not todo:
            continue
        flags = BASE_FLAGS + SERVERS[server][0]
        print(f"server {server}: lmserve serve {' '.join(flags)}", flush=True)
        trace = trace_base / server
        os.environ[ENV] = str(trace)  # the server's engine core traces its steps (the served / model column)
        with lmserve_server(model, flags, out_dir / f"validate-server-{server}.log") as (url, _):
            measure(url, Point("warm-up", server, build_requests(DatasetConfig(num_requests=2, input_len=16,
                                                                                output_len=4, seed=7), tok)),
                    tok, args.seed, args.request_timeout)  # fmt: skip
            fresh = profile.overheads
            try:  # the API/core overheads now, on this server, read as calibrate reads them
                probe = [r for n in (32, 128) for r in build_requests(
                    DatasetConfig(num_requests=2, input_len=n, output_len=16, seed=300 + n), tok)]  # fmt: skip
                fresh = overheads_on_server(url, profile, tok, probe, 16)
                print(f"  overheads now: ingress+egress {1e3 * (fresh.ingress_s + fresh.egress_s):.2f} ms, core loop "
                      f"{1e3 * fresh.core_step_overhead_s:.2f} ms/step (calibration: "
                      f"{1e3 * (profile.overheads.ingress_s + profile.overheads.egress_s):.2f} / "
                      f"{1e3 * profile.overheads.core_step_overhead_s:.2f})", flush=True)  # fmt: skip
            except RuntimeError as e:
                print(f"  overheads not re-read: {e}")
            fresh_overheads[server] = fresh
            # every point once, then (--repeats / --poisson-repeats) the points again in further rounds: a point's
            # repeats are minutes apart, so its spread includes the machine's drift over the run, not one minute's
            counters_of: dict[str, list[dict[str, float]]] = {}  # the server's step counters, every run
            for rnd in range(max(repeats_of(p, args) for p in todo)):
                for p in todo:
                    if rnd >= repeats_of(p, args) or (rnd and p.name not in counters_of):
                        continue
                    q = p if rnd == 0 else dataclasses.replace(p, notes=[], served_fit_ratio=None)  # (columns: run 1's)
                    try:
                        real, counters = measure_clean(url, q, tok, args, trace, profile)
                    except RuntimeError as e:
                        p.notes.append(f"server{'' if rnd == 0 else f', repeat {rnd + 1}'}: {e}")
                        continue
                    if q.served_fit_ratio is not None:  # (this run's: a repeat's q starts with None)
                        p.served_fit_ratios.append(q.served_fit_ratio)
                    if rnd == 0:
                        p.real, p.repeats, counters_of[p.name] = real, [real], [counters]
                        continue
                    p.repeats.append(real)
                    counters_of[p.name].append(counters)
                    p.notes += [f"repeat {rnd + 1}: {n}" for n in q.notes]
                    print(f"  {p.name}, repeat {rnd + 1}: measured TTFT {_f(real.ttft_ms.mean)} ms, TPOT "
                          f"{_f(real.tpot_ms.mean)} ms", flush=True)  # fmt: skip
            for p in todo:
                if p.name not in counters_of:
                    continue
                runs = counters_of[p.name]
                p.server_steps = int(runs[0]["steps"])
                frac = float(profile.calibration.get("counted_fraction") or 1.0)  # counters: execute + update only
                # the mean step over all the point's runs (its repeats lie minutes apart: the machine's speed over
                # the span its min – max is judged on, not the first run's minute)
                steps_all = sum(c["steps"] for c in runs)
                p.server_step_s = sum(c["step_s"] for c in runs) / steps_all / frac if steps_all else None
                # (a profile with the API queue keeps its own overheads: the fresh ones are calibrate's older,
                # TTFT-based reading, which the API costs split into queue and transport)
                sim_overheads = profile.overheads if profile.overheads.api_queue else fresh
                if served and p.server_step_s:  # the fitted steps are core-loop iterations: compare those
                    p.server_step_s += fresh.core_step_overhead_s
                simulate_point(p, profile, configs[server], args.seed, sim_overheads, served)
                e = error_pct(p.sim, p.real, "ttft_ms", "mean")
                print(f"  {p.name}: measured TTFT {_f(p.real.ttft_ms.mean)} ms, TPOT {_f(p.real.tpot_ms.mean)} ms; "
                      f"simulated {_f(p.sim.ttft_ms.mean)} / {_f(p.sim.tpot_ms.mean)} ms"
                      + ("" if e is None else f" (TTFT {e:+.1f} %)")
                      + f"; steps {p.server_steps} / {p.sim_steps}, mean step {_f(1e3 * (p.server_step_s or 0))} / "
                      f"{_f(1e3 * p.sim_step_s)} ms", flush=True)  # fmt: skip
    if saved_trace is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = saved_trace
    trace_dir.cleanup()
    load_end = os.getloadavg()[0]
    text = [
        (f"# simulator vs the measurements of {args.rescore} (rescored: no server ran) " if args.rescore else
         "# simulator vs lmserve serve ")  # fmt: skip
        + f"({'quick, ' if args.quick else ''}load average {load_start:.2f} → "
        f"{load_end:.2f} on {os.cpu_count()} CPUs; {time.perf_counter() - t0:.0f} s)",
        f"step model: {profile.source} — {profile.label}",
        "",
        "errors (simulated − measured) / measured, deterministic step model:",
        format_table(points, "sim"),
        "",
        "with the step model's measured step noise (--step-noise):",
        format_table(points, "sim_noise"),
        "",
        "the step model rescaled, per point, by the server's traced steps / the model on those steps (mean over the "
        "point's runs; where no trace was read, e.g. rescoring another step model, the server's mean step / the "
        "simulated mean step), and the overheads read again on the server before its points (takes the machine's "
        "drift since calibration out; what is left is the scheduling / queueing model's own error):",
        format_table(points, "sim_rescaled"),
        "",
        "rescaled as above, with the step model's measured step noise (the drift out, the steps' tail in):",
        format_table(points, "sim_rescaled_noise"),
        "",
        "served/model: the point's traced server steps' total time / the step model's (with its API stretch) on the "
        "same steps (1.00: the model fits what the server ran; the rest of an error is batching and queueing); "
        "1-thread: its steps the engine core took with one torch thread (its back-off: other processes used its "
        "CPUs); others: cores' worth of CPU other processes used while it ran (points over "
        f"{OTHERS_MAX:g} or over {BACKED_OFF_PCT:g} % one-thread steps were measured again, up to --retries times); "
        "noise: 2 standard errors of the measured mean TTFT (from the send) / TPOT over the point's requests",
        format_steps(points),
        "",
        format_values(points),
    ]
    if any(len(p.repeats) > 1 for p in points):
        text += [
            "",
            f"points against the server's own repeats (--repeats {args.repeats}, --poisson-repeats "
            f"{args.poisson_repeats}: the same requests and arrivals each time, the prefix cache reset before each, "
            "one round over the points after another): the measured min – max, the simulated value (deterministic; "
            "with the step noise, which alone gives steps a tail; rescaled; rescaled with the noise) and how far "
            "outside that range it lies, % of the nearer end:",
            format_repeats(points),
        ]
    report = "\n".join(text)
    print(report)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out_dir / f"validate-sim-{stamp}.txt").write_text(report + "\n")
    doc = {
        "benchmark": "validate_sim",
        "args": vars(args),
        "step_model": {"source": profile.source, "label": profile.label, "machine": profile.machine},
        "load_avg_1m": [load_start, load_end],
        "overheads_at_validation": {k: dataclasses.asdict(v) for k, v in fresh_overheads.items()},
        "against_run_pairs": {  # the counts within target against the runs less one: the server's own ceiling
            k: None if (c := against_run_pairs(points, w)) is None else {"within": c[0], "judged": c[1]}
            for k, w in (("the left-out run", None), *SIM_COLUMNS)
        },
        "points": [
            {
                "name": p.name,
                "server": p.server,
                "server_flags": BASE_FLAGS + SERVERS[p.server][0],
                "num_requests": len(p.requests),
                "rate_rps": p.rate_rps,
                "max_concurrency": p.max_concurrency,
                "measured": _plain(p.real),
                "simulated": p.sim,
                "simulated_with_noise": p.sim_noise,
                "simulated_rescaled": p.sim_rescaled,
                "simulated_rescaled_with_noise": p.sim_rescaled_noise,
                "engine_steps": {"measured": p.server_steps, "simulated": p.sim_steps},
                "mean_step_s": {"measured": p.server_step_s, "simulated": p.sim_step_s},
                "measured_noise_pct": {"ttft_mean": p.noise_pct[0], "tpot_mean": p.noise_pct[1]},
                "served_steps_one_thread_pct": p.one_thread_pct,
                "served_steps_over_model": p.served_fit_ratio,
                "served_steps_over_model_runs": p.served_fit_ratios,
                "rescaled_by": dict(zip(("factor", "from"), rescale_factor(p, p.sim_step_s), strict=True)),
                "busy_fraction": {"measured": p.server_busy, "simulated": p.sim_busy},
                "others_cores": p.others_cores,
                "trace_rows": p.trace_rows,
                "send_times": p.send_times if args.keep_trace else None,
                "errors_pct": {m: error_pct(p.sim, p.real, a, q) for m, a, q in METRICS} if p.real and p.sim else None,
                "errors_rescaled_pct": (
                    {m: error_pct(p.sim_rescaled, p.real, a, q) for m, a, q in METRICS}
                    if p.real and p.sim_rescaled
                    else None
                ),
                "notes": p.notes,
                "measured_repeats": [_plain(r) for r in p.repeats] if len(p.repeats) > 1 else None,
                "outside_repeats_pct": (
                    {m: outside_pct(_value(p.sim, a, q), *spread(p, a, q)) for m, a, q in METRICS}
                    if len(p.repeats) > 1 and p.sim
                    else None
                ),
                "outside_repeats_rescaled_with_noise_pct": (
                    {m: outside_pct(_value(p.sim_rescaled_noise, a, q), *spread(p, a, q)) for m, a, q in METRICS}
                    if len(p.repeats) > 1 and p.sim_rescaled_noise
                    else None
                ),
            }
            for p in points
        ],
    }
    path = out_dir / f"validate-sim-{stamp}.json"
    path.write_text(json.dumps(json_safe(doc), indent=1, allow_nan=False))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
