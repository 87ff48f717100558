"""Steps timed on a live `lmserve serve`: its step counters and trace read back as (features, seconds) samples,
and the API overheads (ingress, egress, the core loop's own per-step cost) measured against the fitted model."""

from __future__ import annotations

import asyncio
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

from lmserve.sim.grid_profile import Grid
from lmserve.sim.step_features import Overheads, StepFeatures, mark_decode_after_prefill
from lmserve.sim.step_model import StepProfile

SERVER_STEP_COUNTERS = {
    "lmserve:engine_step_time_seconds_total": "step_s",
    "lmserve:decode_step_time_seconds_total": "decode_s",
    "lmserve:num_decode_steps_total": "decode_steps",
    "lmserve:num_steps_total": "steps",
}


def scrape_step_counters(base_url: str) -> dict[str, float]:
    """The engine's step-time counters from a server's /metrics (unlabelled by engine: the aggregate)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {v: 0.0 for v in SERVER_STEP_COUNTERS.values()}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            key = SERVER_STEP_COUNTERS.get(sample.name)
            if key is not None and "engine" not in sample.labels:
                out[key] += sample.value
    return out


def measure_on_server(
    profile: StepProfile,
    model: str,
    flags: list[str],
    tokenizer_path: str,
    out_dir: Path,
    grid: Grid | None = None,
    max_len: int = 0,
    num_requests: int = 6,
) -> tuple[Overheads, list[tuple[StepFeatures, float]], list[tuple[int, ...]]]:
    """`lmserve serve` on the same flags, started with its engine core tracing its steps (engine/step_trace.py).
    With a grid: its served_loads first, giving the served steps (each with its core-loop iteration's time). Then
    requests one at a time; around each, the engine's own step-time counters (/metrics) give its prefill step and
    its decode steps, so: TTFT − that prefill step = ingress + egress, and TPOT − its mean decode step = the core
    loop's per-step cost (not from the fit: exact even when the fit is off). The counters time execute + update
    only; they are divided by the calibration's counted_fraction to stand for whole LLMEngine.step()s. The fitted
    model's error on those server steps is reported beside them. Then the API process's costs (sim/api_costs.py:
    chunk latencies from the trace and the client, CPU per request and per chunk): when they are measured, the
    overheads are those (ingress and egress only the way in and out beyond the API's own work). Returns
    (overheads, served steps, each served step's API-work inputs (api_costs.stretch_inputs))."""
    import dataclasses
    import tempfile

    from lmserve.bench.datasets import DatasetConfig, build_requests, load_tokenizer
    from lmserve.bench.harness import lmserve_server
    from lmserve.bench.loadgen import LoadConfig, run_load
    from lmserve.observability.step_trace import ENV

    tok = load_tokenizer(tokenizer_path)
    out_len = 16
    reqs = []
    for i, n in enumerate((32, 128, 256)):
        reqs += build_requests(DatasetConfig(num_requests=max(1, num_requests // 3), input_len=n, output_len=out_len,
                                             seed=100 + i), tok)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="lmserve-calibrate-") as tmp:
        trace = Path(tmp) / "steps"
        saved = os.environ.get(ENV)
        os.environ[ENV] = str(trace)  # the server (and its engine core) inherit it
        try:
            with lmserve_server(model, flags, out_dir / "calibrate-server.log") as (url, _):
                cfg = LoadConfig(base_url=url, max_concurrency=1, seed=0)
                warm = build_requests(DatasetConfig(num_requests=2, input_len=16, output_len=4, seed=99), tok)
                asyncio.run(run_load(warm, cfg))
                served: list[tuple[StepFeatures, float]] = []
                inputs: list[tuple[int, ...]] = []
                if grid is not None:  # (the in-process fit's time of a 64-token prompt's 32-token request alone)
                    alone = profile.step_time_s(StepFeatures(64, 1, 0, 0, 64 * 65 / 2)) + sum(
                        profile.step_time_s(StepFeatures(0, 0, 1, 64 + k, 0.0)) for k in range(31))  # fmt: skip
                    served, inputs = profile_served(url, trace, served_loads(grid, tok, max_len, request_s=alone))
                overheads = overheads_on_server(url, profile, tok, reqs, out_len)
                try:
                    overheads = measure_api_costs(url, trace, tok, overheads)
                except (RuntimeError, OSError, AssertionError) as e:
                    overheads = dataclasses.replace(overheads, how=overheads.how + f"; API costs not measured: {e}")
                return overheads, served, inputs
        finally:
            if saved is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = saved


def _trace_rows(trace: Path) -> list[tuple[float, ...]]:
    from lmserve.observability.step_trace import read_trace

    return [row for path in sorted(trace.parent.glob(trace.name + ".*")) for row in read_trace(str(path))]


def served_loads(
    grid: Grid, tok: Any, max_len: int, seed: int = 7, request_s: float | None = None
) -> list[tuple[list[Any], int | None, float]]:
    """The loads calibrate serves to time served steps: for every decode batch D of the grid, D concurrent streams
    of short prompts and D of long ones (up to the grid's largest prefill; so that the decode rows' context varies
    at every row count, not with it), giving D-row decodes with prefills joining them as streams end and start; and
    one stream of prompts sharing a prefix of the grid's largest cached context (prefills over cached blocks).
    With `request_s` (a 64-token prompt's 32-token request alone, by the in-process fit): two open loops of Poisson
    arrivals, at 1 and 2 such requests per request_s, whose sends land in steps independently of the steps' own
    requests (a closed loop sends as one finishes: its sends and its prefills come together) and stall them more
    (api_costs). (requests, client concurrency or None, arrival rate) each, in a seeded shuffled order: the
    machine's speed drifts over the minute they take, and served in order of batch size that drift would read as a
    cost of the rows (the decode-row coefficient); shuffled, it is noise the fit averages."""
    from lmserve.bench.datasets import DatasetConfig, build_requests

    longest = min(max(grid.prefills), max_len // 2)
    out_len = 32 if grid.repeats < 3 else 48
    loads: list[tuple[list[Any], int | None, float]] = []
    for i, d in enumerate(b for b in grid.decode_batches if b > 0):
        num = max(2 * d, 6 if grid.repeats < 3 else 12)
        for j, input_len in enumerate((min(32, longest), longest)):
            cfg = DatasetConfig(num_requests=num, input_len=max(8, input_len * 3 // 4), output_len=out_len,
                                range_ratio=0.25, seed=seed + 2 * i + j)  # fmt: skip
            loads.append((build_requests(cfg, tok), d, math.inf))
    cached = max(grid.prefill_contexts)
    if cached > 0 and cached + longest < max_len:
        cfg = DatasetConfig(name="prefix", num_requests=6 if grid.repeats < 3 else 12, input_len=max(8, longest // 2),
                            output_len=8, range_ratio=0.9, prefix_len=cached, seed=seed + 100)  # fmt: skip
        loads.append((build_requests(cfg, tok), 1, math.inf))
    if request_s:
        for k, per in enumerate((1.0, 2.0)):
            cfg = DatasetConfig(num_requests=40 * grid.repeats, input_len=min(64, max_len // 4), output_len=32,
                                seed=seed + 200 + k)  # fmt: skip
            loads.append((build_requests(cfg, tok), None, per / request_s))
    random.Random(seed).shuffle(loads)
    return loads


def profile_served(
    url: str, trace: Path, loads: list[tuple[list[Any], int | None, float]]
) -> tuple[list[tuple[StepFeatures, float]], list[tuple[int, ...]]]:
    """Serve `loads` one after another on the server at `url` (started with LMSERVE_STEP_TRACE=trace): the steps
    its engine core took, each with its core-loop iteration's wall time (engine/step_trace.py), and per step the
    inputs of the API work beside it (api_costs.stretch_inputs: the previous step's chunks, the requests sent while
    it ran; empty for an old trace without end times)."""
    from lmserve.bench.loadgen import LoadConfig, run_load
    from lmserve.observability.step_trace import OLD_COLUMNS
    from lmserve.sim.api_costs import held_sends, stretch_inputs

    before = len(_trace_rows(trace))  # (steps served before these loads: a warm-up's)
    sends: list[float] = []
    held: list[float] = []  # of those, the sends a concurrency cap held until another request finished
    for reqs, concurrency, rate in loads:
        cfg = LoadConfig(base_url=url, max_concurrency=concurrency, request_rate_rps=rate, seed=0)
        result = asyncio.run(run_load(reqs, cfg))
        if result.fatal_error:
            raise RuntimeError(f"served profiling failed: {result.fatal_error}")
        sends += [result.start_wall_time + r.send_s for r in result.raw if r.send_s is not None]
        held += held_sends(result.raw, result.start_wall_time, concurrency is not None)
    time.sleep(0.2)  # the core writes a step's line after sending its outputs
    served = _trace_rows(trace)[before:]
    after_prefill = mark_decode_after_prefill(served)  # one core's steps in order (the flag: its previous step's)
    rows = [r for r in served if r[6] > 0]
    after_prefill = [a for a, r in zip(after_prefill, served, strict=True) if r[6] > 0]
    inputs = stretch_inputs(rows, sends, held) if rows and len(rows[0]) > OLD_COLUMNS else []
    # steps the core took with fewer threads than it has (its back-off: other processes were using the CPUs) time
    # another machine; they are left out
    full = max((int(r[7]) for r in rows), default=0)
    keep = [i for i, r in enumerate(rows) if int(r[7]) == full]
    if len(keep) < len(rows):
        print(f"  (left out {len(rows) - len(keep)} of {len(rows)} served steps taken with fewer than {full} "
              "threads: the core backed off while other processes used the CPUs)", flush=True)  # fmt: skip
    samples = [
        (StepFeatures(int(r[0]), int(r[1]), int(r[2]), int(r[3]), r[4], a), r[6])
        for r, a in zip(rows, after_prefill, strict=True)
    ]
    return [samples[i] for i in keep], [inputs[i] for i in keep] if inputs else []


def measure_api_costs(url: str, trace: Path, tok: Any, base: Overheads, seed: int = 11) -> Overheads:
    """The API process's costs on the server at `url` (sim/api_costs.py): requests one at a time give the chunk
    latencies by position and the ingress latency (trace end times against the client's times); a load of one-token
    requests and one of long streams give the CPU per request and per chunk of the API process (/proc) and of this
    process (the load generator). RuntimeError where /proc or the trace's end times are missing."""
    import dataclasses

    from lmserve.bench.datasets import DatasetConfig, build_requests
    from lmserve.bench.loadgen import LoadConfig, finalize_all, run_load
    from lmserve.observability.step_trace import OLD_COLUMNS
    from lmserve.sim.api_costs import chunk_latencies, cpu_costs, find_api_pid, overheads_from, process_cpu_s

    pid = find_api_pid(url)
    if pid is None:
        raise RuntimeError(f"no lmserve serve process found for {url} in /proc")

    def serve(reqs: list[Any], concurrency: int) -> tuple[Any, list[Any], int, float, float]:
        cfg = LoadConfig(base_url=url, max_concurrency=concurrency, seed=0)
        time.sleep(0.1)  # the previous load's last trace line and API writes
        before, api0, own0 = len(_trace_rows(trace)), process_cpu_s(pid), time.process_time()
        result = asyncio.run(run_load(reqs, cfg))
        time.sleep(0.1)  # the core writes a step's line after sending its outputs; the API's last writes
        cpu = process_cpu_s(pid) - api0 + time.process_time() - own0
        if result.fatal_error:
            raise RuntimeError(f"API cost measurement failed: {result.fatal_error}")
        records = finalize_all(result, reqs, cfg, tok)
        if not all(r.success for r in records):
            raise RuntimeError("API cost measurement: a request failed")
        return result, records, before, cpu, sum(len(r.chunk_times_s) for r in records)

    single = [r for i, n in enumerate((24, 96)) for r in build_requests(
        DatasetConfig(num_requests=6, input_len=n, output_len=16, seed=seed + i), tok)]  # fmt: skip
    result, records, before, cpu1, chunks1 = serve(single, 1)
    rows = _trace_rows(trace)[before:]
    if not rows or len(rows[0]) <= OLD_COLUMNS:
        raise RuntimeError("the step trace has no end times (an older engine core)")
    wall0 = result.start_wall_time
    lat = chunk_latencies(rows, [(wall0 + r.send_s, [wall0 + c for c in r.chunk_times_s]) for r in records])
    short = build_requests(DatasetConfig(num_requests=80, input_len=16, output_len=1, seed=seed + 5), tok)
    _, _, _, cpu2, chunks2 = serve(short, 4)
    long = build_requests(DatasetConfig(num_requests=6, input_len=16, output_len=160, seed=seed + 6), tok)
    _, _, _, cpu3, chunks3 = serve(long, 6)
    loads = [(len(single), chunks1, cpu1), (len(short), chunks2, cpu2), (len(long), chunks3, cpu3)]
    per_request, per_chunk = cpu_costs(loads)
    fields = overheads_from(lat, per_request, per_chunk)
    how = (
        f"{base.how}; then from the step trace's end times and the client's ({lat.num_requests} requests one at a "
        f"time): ingress {lat.ingress_s * 1e3:.2f} ms (send → the first step's start), chunk latency first "
        f"{lat.first_s * 1e3:.2f} / middle {lat.middle_s * 1e3:.2f} / last {lat.last_s * 1e3:.2f} ms; CPU of the API "
        f"process + the load generator over {sum(x[0] for x in loads)} requests and {sum(x[1] for x in loads)} "
        f"chunks: {per_request * 1e3:.2f} ms per request, {per_chunk * 1e3:.3f} ms per chunk; so the API queue's "
        f"costs: request {fields['api_request_s'] * 1e3:.2f}, chunk {fields['api_chunk_s'] * 1e3:.3f} (+ first "
        f"{fields['api_first_chunk_s'] * 1e3:.2f}, + last {fields['api_last_chunk_s'] * 1e3:.2f}) ms, the way in "
        f"{fields['ingress_s'] * 1e3:.2f} and out {fields['egress_s'] * 1e3:.2f} ms"
    )
    return dataclasses.replace(base, **fields, how=how)


def overheads_on_server(url: str, profile: StepProfile, tok: Any, reqs: list[Any], out_len: int) -> Overheads:
    """measure_on_server's readings on a running server (validation reads them again before its points)."""
    from lmserve.bench.loadgen import LoadConfig, finalize_all, run_load
    from lmserve.bench.metrics import request_latency

    cfg = LoadConfig(base_url=url, max_concurrency=1, seed=0)
    ttft_extra, tpot_extra, fit_err = [], [], []
    for req in reqs:
        before = scrape_step_counters(url)
        result = asyncio.run(run_load([req], cfg))
        after = scrape_step_counters(url)
        (rec,) = finalize_all(result, [req], cfg, tok)
        if not rec.success:
            raise RuntimeError(f"overhead measurement failed: {result.fatal_error or rec.error}")
        d = {k: after[k] - before[k] for k in after}
        lat = request_latency(rec)
        assert lat.ttft_from_send_s is not None and lat.tpot_s is not None, "a successful request has both"
        if d["steps"] - d["decode_steps"] != 1 or d["decode_steps"] < 1:
            continue  # not one prefill step and its decodes (a stray step): no clean reading
        frac = float(profile.calibration.get("counted_fraction") or 1.0)  # counters time execute + update only
        prefill_s = (d["step_s"] - d["decode_s"]) / frac
        decode_s = d["decode_s"] / d["decode_steps"] / frac
        ttft_extra.append(lat.ttft_from_send_s - prefill_s)
        tpot_extra.append(lat.tpot_s - decode_s)
        p = rec.effective_prompt_len
        fitted_prefill = profile.step_time_s(StepFeatures(p, 1, 0, 0, p * (p + 1) / 2))
        fitted_decode = profile.step_time_s(StepFeatures(0, 0, 1, p + out_len // 2, 0.0))
        fit_err += [(fitted_prefill - prefill_s) / prefill_s, (fitted_decode - decode_s) / decode_s]
    if not ttft_extra:
        raise RuntimeError("no request gave a clean reading of the server's step counters")
    ttft_extra_s = max(0.0, float(np.median(ttft_extra)))
    core_s = max(0.0, float(np.median(tpot_extra)))
    how = (
        f"lmserve serve, {len(ttft_extra)} requests one at a time (prompts 32/128/256, {out_len} output tokens), "
        f"the engine's step-time counters read around each: median TTFT − the prefill step = "
        f"{ttft_extra_s * 1e3:.2f} ms (split evenly into ingress and egress: the client cannot tell them apart), "
        f"median TPOT − the mean decode step = {core_s * 1e3:.2f} ms (the core loop's per-step cost); the fitted "
        f"model's median error on those server steps: {100 * float(np.median(np.abs(fit_err))):.1f} %"
    )
    return Overheads(ttft_extra_s / 2, ttft_extra_s / 2, core_s, measured=True, how=how)
