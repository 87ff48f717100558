"""`lmserve simulate calibrate`: time real LLMEngine steps over a grid, fit the step-time model, measure the
server's overheads, save a StepProfile.

The grid is a set of engine states and the steps taken from them:

    for each decode batch D and context L:   D requests with L-token prompts are prefilled (those prefill steps
                                             are samples too), then `decode_steps` pure decode steps are timed,
        for each prefill P and cached context c:   one request of c cached + P new tokens joins the D decodes:
                                             a mixed step (c > 0 reuses an earlier prompt's cached blocks)

Each step's features are read from the SchedulerOutput the engine actually ran (a wrapped schedule()), so a
point that came out differently from the plan (a prefix block evicted, say) is still a correct sample. The time
is LLMEngine.step()'s wall time: schedule, the model, update, detokenize. A separate mixed workload (Poisson-like
arrivals of random lengths through the same engine) is the held-out check of the fitted model.

Overheads: with a server (`lmserve serve` on the same flags, started here unless --no-server), requests sent one
at a time give TTFT = ingress + prefill step + egress and TPOT = decode step + the core loop's own per-step cost;
the fitted step times are subtracted. The client cannot tell ingress from egress: the sum is split evenly.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmserve.sim.step_model import (
    LinearStepModel,
    Overheads,
    StepFeatures,
    StepProfile,
    choose_form,
    mark_decode_after_prefill,
    model_description,
    ratio_quantiles,
    term_value,
)


@dataclass(frozen=True)
class Grid:
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    prefills: tuple[int, ...]
    prefill_contexts: tuple[int, ...]
    decode_steps: int = 4
    repeats: int = 2
    workload_requests: int = 24

    @staticmethod
    def quick() -> Grid:
        return Grid((0, 1, 4, 8, 16, 32), (64, 384), (16, 128, 384), (0, 256), decode_steps=3, repeats=2,
                    workload_requests=16)  # fmt: skip

    @staticmethod
    def full() -> Grid:
        return Grid((0, 1, 2, 4, 8, 12, 16, 24, 32, 64), (32, 256, 640), (8, 32, 128, 256, 512), (0, 128, 384), 4, 3,
                    48)  # fmt: skip

    def max_tokens_per_step(self) -> int:
        return max(self.prefills) + max(self.decode_batches) + 1


def machine_description(device: str) -> dict[str, Any]:
    """The repo's machine description (benchmarks/machine.py or bench/machine.py: CPU model, ISA flags, memory,
    versions, commit, load) when this is a checkout, else its minimal fields."""
    import platform

    repo = Path(__file__).resolve().parents[3]
    for folder in ("benchmarks", "bench"):
        path = repo / folder / "machine.py"
        if path.is_file():
            try:
                import importlib.util

                spec = importlib.util.spec_from_file_location("_lmserve_machine", path)
                assert spec is not None and spec.loader is not None
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                info = dict(mod.machine_info())
                break
            except Exception:  # noqa: BLE001 - a broken checkout file must not stop calibration
                continue
    else:
        info = {
            "cpu_model": platform.processor() or platform.machine(),
            "logical_cpus": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        }
    import torch

    info["device"] = device
    info["torch_threads"] = torch.get_num_threads()
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    info["load_avg_1m_end"] = os.getloadavg()[0]
    return info


def _row(f: StepFeatures) -> tuple[Any, ...]:
    """A sample's features as sent from the profiling process (StepFeatures(*row) rebuilds it)."""
    return (*f.as_tuple(), f.decode_after_prefill)


def _sample(row: list[float]) -> tuple[StepFeatures, float]:
    """A saved sample: [five features, time, decode_after_prefill] (older files: without the flag)."""
    return StepFeatures(*row[:5], int(row[6]) if len(row) > 6 else 0), row[5]


class _StepRecorder:
    """Keeps each step's features and wall time (engine/step_trace.StepTimer). Between steps it applies the served
    engine core's thread back-off (engine/cpu_share.py), as the core's loop does."""

    def __init__(self, engine: Any, backoff: Any = None) -> None:
        from lmserve.engine.step_trace import StepTimer

        self.engine = engine
        self.backoff = backoff
        self.samples: list[tuple[StepFeatures, float]] = []
        self.counted: list[float] = []  # per sample, the part the engine's own step counter times (execute + update)
        self.threads_used: dict[int, int] = {}  # torch threads → steps taken with them
        self._timer = StepTimer(engine)
        self._prev_prefill = False  # whether the engine's latest step computed prompt tokens (kept or not)

    def step(self, keep: bool = True) -> float:
        import torch

        if self.backoff is not None and (threads := self.backoff.poll()) is not None:
            torch.set_num_threads(threads)
        counted = self.engine.counters.step_time_s_total
        _, features, dt = self._timer.step()
        if features is not None:  # mark_decode_after_prefill's rule, one step at a time
            after_prefill = int(self._prev_prefill and features[0] == 0 and features[2] > 0)
            self._prev_prefill = features[0] > 0
        if keep and features is not None and dt > 0:
            self.samples.append((StepFeatures(*features, decode_after_prefill=after_prefill), dt))
            self.counted.append(self.engine.counters.step_time_s_total - counted)
            n = torch.get_num_threads()
            self.threads_used[n] = self.threads_used.get(n, 0) + 1
        return dt


def _ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(1, vocab, n).tolist()


def profile_grid(rec: _StepRecorder, grid: Grid, seed: int = 0, log: Any = None) -> list[tuple[StepFeatures, float]]:
    from lmserve.sampling_params import SamplingParams

    engine = rec.engine
    vocab = engine.config.model.vocab_size
    rng = np.random.default_rng(seed)
    block = engine.config.cache.block_size
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    seeds = {c: _ids(rng, c, vocab) for c in grid.prefill_contexts if c > 0}

    def drain(keep: bool = True) -> None:
        while engine.has_unfinished_requests():
            rec.step(keep)

    # warm-up: the first steps pick kernels and fault in memory; not samples
    engine.add_request(None, _ids(rng, 64, vocab), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    drain(keep=False)
    for ids in seeds.values():  # the cached contexts (their blocks stay findable while the pool has room)
        engine.add_request(None, ids + _ids(rng, block, vocab), one)
    drain()
    states = [(d, ctx) for d in grid.decode_batches for ctx in (grid.decode_contexts if d else (0,))]
    # a shuffled order: a busy machine's load drifts over minutes, and in grid order the drift would be read as the
    # effect of whatever the last states have most of (long contexts, large batches)
    states = [states[i] for i in rng.permutation(len(states))]
    injections = [(p, c) for p in grid.prefills for c in grid.prefill_contexts]
    for k, (d, ctx) in enumerate(states):
        t0 = time.perf_counter()
        long = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
        ids = [engine.add_request(None, _ids(rng, ctx, vocab), long) for _ in range(d)]
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
            rec.step()
        for _ in range(grid.decode_steps if d else 0):
            rec.step()
        for _ in range(grid.repeats):
            for j in rng.permutation(len(injections)):
                p, c = injections[j]
                if p + c < engine.config.scheduler.max_model_len:
                    prompt = (seeds[c] if c else []) + _ids(rng, p, vocab)
                    engine.add_request(None, prompt, one)
                    rec.step()  # the decodes and this prefill in one step (the budget holds them)
                    while any(r.max_tokens == 1 for r in engine.scheduler.requests.values()):
                        rec.step()
                    if d:
                        rec.step()  # and a decode-only step: those make TPOT, spread over the run's time
        engine.abort_request(ids)
        if log:
            log(f"  state {k + 1}/{len(states)}: {d} decodes at context {ctx}: {time.perf_counter() - t0:.1f} s, "
                f"{len(rec.samples)} steps so far")  # fmt: skip
    return rec.samples


def profile_workload(rec: _StepRecorder, num_requests: int, seed: int = 1) -> list[tuple[StepFeatures, float]]:
    """A mixed workload (random prompt / output lengths, a few arrivals per step): held-out steps."""
    from lmserve.sampling_params import SamplingParams

    engine = rec.engine
    rec.samples, rec.counted = [], []
    rng = np.random.default_rng(seed)
    vocab = engine.config.model.vocab_size
    max_len = engine.config.scheduler.max_model_len
    added = 0
    while added < num_requests or engine.has_unfinished_requests():
        for _ in range(int(rng.poisson(0.5)) if added < num_requests else 0):
            p = int(rng.integers(8, min(512, max_len // 2)))
            o = int(rng.integers(4, 64))
            engine.add_request(
                None, _ids(rng, p, vocab), SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True)
            )
            added += 1
        if engine.has_unfinished_requests():
            rec.step()
    return rec.samples


def _profile_child(config: Any, grid: Grid, num_threads: int, backoff: bool, conn: Any) -> None:
    """In a process started like an engine core (its OpenMP environment, threads, back-off): profile, send back."""
    import torch

    torch.set_num_threads(num_threads)
    try:
        from lmserve.engine.cpu_share import CpuShare, ThreadBackoff
        from lmserve.engine.llm_engine import LLMEngine

        tp = config.tensor_parallel_size  # a TP group: rank 0 here, its workers spawned on the same CPUs, split
        engine = LLMEngine(config, num_threads, tuple(sorted(os.sched_getaffinity(0))) if tp > 1 else None)
        policy = None
        if backoff and num_threads > 1 and engine.executor is None:  # (a TP core does not back off: core.py)
            pids = (os.getpid(), os.getppid())
            policy = ThreadBackoff(num_threads, CpuShare(os.sched_getaffinity(0), pids))
        rec = _StepRecorder(engine, policy)
        grid_samples = list(profile_grid(rec, grid, log=lambda m: conn.send(("log", m))))
        counted = [c / t for c, (_, t) in zip(rec.counted, grid_samples, strict=True)]
        held = list(profile_workload(rec, grid.workload_requests))
        conn.send(("done", ([(_row(f), t) for f, t in grid_samples], [(_row(f), t) for f, t in held],
                            rec.threads_used, float(np.median(counted)) if counted else 1.0,
                            decode_stack_rows(engine))))  # fmt: skip
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def decode_stack_rows(engine: Any) -> int:
    """The most decode rows the engine's one-call decode stack takes (model/decode_stack.py), 0 without one."""
    decoder = getattr(getattr(engine.runner, "model", None), "model", None)
    stack = getattr(decoder, "_decode_stack", None)
    return int(stack.max_rows) if stack is not None else 0


def profile_in_core_process(
    config: Any, grid: Grid, num_threads: int, cpu_policy: str, log: Any
) -> tuple[list[tuple[StepFeatures, float]], list[tuple[StepFeatures, float]], dict[int, int], float, int]:
    """Profile in a spawned process with an engine core's environment (engine/core_client.py: OMP_NUM_THREADS and
    the --cpu-wait-policy's OpenMP settings, read by the child before anything runs; `adaptive` also backs off to
    one thread while other processes use the CPUs): the steps are timed as a served core would take them."""
    import multiprocessing

    from lmserve.engine.core_client import CPU_POLICIES
    from lmserve.engine.core_handles import start_with_env

    env = {"OMP_NUM_THREADS": str(num_threads), **CPU_POLICIES[cpu_policy]}
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_profile_child, args=(config, grid, num_threads, cpu_policy == "adaptive", child),
                       name="lmserve-calibrate", daemon=True)  # fmt: skip
    start_with_env(proc, env)
    child.close()
    try:
        while True:
            try:
                kind, payload = parent.recv()
            except EOFError:
                raise RuntimeError(f"the profiling process died (exit code {proc.exitcode})") from None
            if kind == "log":
                log(payload)
            elif kind == "error":
                raise RuntimeError(f"profiling failed: {payload}")
            else:
                grid_raw, held_raw, threads, counted, stack_rows = payload
                return ([(StepFeatures(*f), t) for f, t in grid_raw], [(StepFeatures(*f), t) for f, t in held_raw],
                        threads, counted, stack_rows)  # fmt: skip
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def _quality(profile: StepProfile, samples: list[tuple[StepFeatures, float]]) -> dict[str, float]:
    if not samples:
        return {}
    pred = np.array([profile.step_time_s(f) for f, _ in samples])
    y = np.array([t for _, t in samples])
    ape = 100 * np.abs(pred - y) / y
    total = float(((y - y.mean()) ** 2).sum())
    return {
        "num_steps": len(samples),
        "r2": 1 - float(((y - pred) ** 2).sum()) / total if total > 0 else math.nan,
        "mape_pct": float(ape.mean()),
        "median_ape_pct": float(np.median(ape)),
        "sum_error_pct": float(100 * (pred.sum() - y.sum()) / y.sum()),  # the total time of the run
    }


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
    from lmserve.bench.experiments import lmserve_server
    from lmserve.bench.loadgen import LoadConfig, run_load
    from lmserve.engine.step_trace import ENV

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
    from lmserve.engine.step_trace import read_trace

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
    from lmserve.engine.step_trace import OLD_COLUMNS
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
    from lmserve.engine.step_trace import OLD_COLUMNS
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


def time_kv_pulls(src: list[Any], dst: list[Any], address: str, n: int, repeats: int) -> list[float]:
    """Seconds of each of `repeats` pulls of blocks 0..n-1 from `src` into `dst`'s blocks n..2n-1 (`dst` holds at
    least 2n), through the disaggregated engines' own KVServer (bound at `address`: ipc://... or tcp://host:*) and
    KVPuller, the blocks written by import_blocks as a decode engine writes them. A first pull sets the connection
    up and is not counted."""
    from types import SimpleNamespace

    from lmserve.engine.kv_transfer import KVLeases, KVPuller, KVServer, import_blocks

    leases = KVLeases(60.0)
    server = KVServer(address, leases, src, {})
    bound = server.start()
    puller = KVPuller(30.0)
    times = []
    try:
        for r in range(repeats + 1):
            req = SimpleNamespace(request_id=f"timed-{n}-{r}")
            leases.grant(req, list(range(n)))
            t0 = time.perf_counter()
            ticket = puller.pull(bound, req.request_id, list(range(n)))
            results = []
            while not results:
                results = puller.poll(100)
            assert results[0].ticket == ticket and results[0].frames is not None, results[0].error
            import_blocks(dst, list(range(n, 2 * n)), results[0].frames)
            if r:
                times.append(time.perf_counter() - t0)
            leases.collect(lambda _: None)
    finally:
        puller.close()
        server.stop()
    return times


def measure_kv_transfer(config: Any, repeats: int = 5, sizes: tuple[int, int] = (1, 32)) -> tuple[float, float]:
    """(seconds per pull, seconds per block) of a KV pull between two engines on this machine (time_kv_pulls over
    ZeroMQ ipc, on KV caches of the config's geometry and dtype): the median of `repeats` pulls at two sizes, fitted
    as a line (what the simulator's disaggregation charges per pull)."""
    import statistics
    import tempfile

    import torch

    from lmserve.model.kv_cache import KVCache

    m, cc = config.model, config.cache
    n_max = max(sizes)
    src, dst = ([KVCache.allocate(2 * n_max, cc.block_size, m.num_kv_heads, m.head_dim, cc.kv_cache_dtype,
                                  torch.device("cpu")) for _ in range(m.num_layers)] for _ in range(2))  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        t0_s, t1_s = (statistics.median(time_kv_pulls(src, dst, f"ipc://{tmp}/kv-{n}", n, repeats)) for n in sizes)
    n0, n1 = sizes
    block_s = max(0.0, (t1_s - t0_s) / (n1 - n0))
    return max(0.0, t0_s - n0 * block_s), block_s


def add_calibrate_args(p: argparse.ArgumentParser) -> None:
    from lmserve.entrypoints.engine_args_cli import add_engine_args

    p.add_argument("--out", default="step-model.json", help="the step model JSON to write (default step-model.json)")
    p.add_argument("--quick", action="store_true", help="a small grid (minutes on the bundled model)")
    p.add_argument(
        "--refit",
        default=None,
        metavar="STEP_MODEL",
        help="fit again from the steps saved in this step model (no profiling)",
    )
    p.add_argument("--repeats", type=int, default=None, help="times each mixed step is taken (default: the grid's)")
    p.add_argument(
        "--no-server",
        dest="server",
        action="store_false",
        help="do not start `lmserve serve` to measure the API/network overheads (they stay 0)",
    )
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: as a served engine core)")
    p.add_argument(
        "--cpu-wait-policy",
        default="adaptive",
        choices=["adaptive", "bounded", "spin", "passive"],
        help="the OpenMP wait policy of the profiling process, as lmserve serve's (default adaptive)",
    )
    add_engine_args(p)


def refit(path: str, out: str) -> int:
    """The fit again from a step model's saved samples (its overheads, machine and grid kept)."""
    try:
        profile = StepProfile.load(path)
        cal = profile.calibration
        samples = [_sample(row) for row in cal.get("samples") or []]
        held = [_sample(row) for row in cal.get("workload_samples") or []]
        served = [_sample(row) for row in cal.get("served_samples") or []]
        if len(samples) < 10:
            raise ValueError(f"--refit: {path} holds {len(samples)} profiled steps; at least 10 are needed")
    except ValueError as e:
        print(f"lmserve simulate calibrate: error: {e}", file=sys.stderr)
        return 2
    # (four numbers a row in a file from before the sends' stalls: no sends counted, none measured)
    inputs = [tuple(int(v) for v in x) for x in cal.get("served_api_inputs") or []]
    stretch = _fit_into(profile, samples, held, int(cal.get("decode_stack_rows") or 0), served, inputs,
                        profile.overheads)  # fmt: skip
    if profile.overheads.api_queue:
        import dataclasses

        profile.overheads = dataclasses.replace(profile.overheads, api_step_stretch=stretch)
    profile.calibration = {**cal, "refit_of": path, "refit_time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    out_path = profile.save(out)
    print(format_profile(profile))
    print(f"wrote {out_path}")
    return 0


MIN_SERVED_STEPS = 40  # served steps enough to fit on (else the in-process grid is the training set)


def _fit_into(
    profile: StepProfile,
    samples: list[tuple[StepFeatures, float]],
    held: list[tuple[StepFeatures, float]],
    stack_rows: int = 0,
    served: list[tuple[StepFeatures, float]] | None = None,
    inputs: list[tuple[int, ...]] | None = None,
    overheads: Overheads | None = None,
) -> float:
    """Fit the profile's linear model: on the served steps (core-loop iterations of a real server) when there are
    MIN_SERVED_STEPS of them, else on the in-process grid; the other sets are scored against it. With the served
    steps' API-work inputs (api_costs.stretch_inputs) and measured API costs (`overheads`), the model, the API's
    step stretch are fitted together (api_costs.fit_stretch), and the sends' stalls measured beside them, recorded in
    profile.fit and not applied (why_send_stalls). Returns the stretch (0 without)."""
    from lmserve.sim.api_costs import api_work, fit_stretch, sends_during

    on_served = served is not None and len(served) >= MIN_SERVED_STEPS
    train = served if on_served else samples
    assert train is not None
    linear, quality, comparison = choose_form(train, stack_rows=stack_rows)
    profile.kind, profile.linear = "linear", linear
    correction, stretch, stalls = 1.0, 0.0, None
    work = np.zeros(len(train))
    if on_served and inputs and overheads is not None and overheads.api_queue and len(inputs) == len(train):
        work = api_work(overheads, inputs)
        terms, rows = linear.terms, linear.stack_rows  # the chosen form, refitted with the stretch beside it
        x = np.array([[term_value(f, t, rows) for t in terms] for f, _ in train], dtype=np.float64)
        measured = np.array([t for _, t in train])
        c0, coefs, stretch, _ = fit_stretch(x, work, measured)
        profile.linear = linear = LinearStepModel(c0, dict(zip(terms, coefs, strict=True)), rows)
        sent = sends_during(inputs)
        if sent.any():  # measured beside the model, not applied (why_send_stalls)
            stalls = fit_stretch(x, work, measured, sent=sent)[3]
    beside = stretch * work  # what the API's work adds to each step
    if on_served:  # the fit follows the typical step; the served total has a tail (GC, first shapes) it misses
        base = sum(linear.step_time_s(f) for f, _ in train)
        correction = (sum(t for _, t in train) - float(beside.sum())) / base
        correction = correction if correction > 0 else 1.0
        profile.linear = linear = profile.scaled(correction).linear
    if stretch:  # measured / (model + the stretch): the noise of what the simulator times
        pred = np.array([linear.step_time_s(f) for f, _ in train]) + beside
        ratios = np.array([t for _, t in train]) / pred
        profile.noise_quantiles = [float(v) for v in np.quantile(ratios, np.linspace(0, 1, 201))]
    else:
        profile.noise_quantiles = ratio_quantiles(linear, train)
    profile.fit = {
        **comparison,
        "fitted_on": "served" if on_served else "in-process grid",
        "heldout_grid" if not on_served else "heldout_served": asdict(quality),
        "heldout_workload": _quality(profile, held),
        "weighting": "least absolute relative error (IRLS), coefficients >= 0",
    }
    if stretch:
        profile.fit["api_step_stretch"] = stretch
        profile.fit["why_api_stretch"] = (
            "served steps ≈ model + f · (the API work beside the step: the previous step's chunks × api_chunk_s + "
            "the requests sent while it ran × their API costs), the model's coefficients and f fitted together "
            "(least absolute relative error, all >= 0); the simulator adds f × the API work it queues beside a "
            "replica's step (Overheads.api_step_stretch)"
        )
    if stalls is not None:
        profile.fit["send_stalls_measured_s"] = {"arrival": stalls[0], "held_by_the_cap": stalls[1]}
        profile.fit["why_send_stalls"] = (
            "a send stalls the engine step in progress (the load generator's and the API's work for it take a core "
            "from the OpenMP team): served steps ≈ model + f · W + g · (requests sent on their own schedule while the "
            "step runs) + h · (those the client's concurrency cap held), g and h by least squares on the sends' "
            "surprise, sent − λ · length (api_costs.stall_per_send: steps that are long for any reason collect more "
            "sends). Measured, not applied: added per send (Overheads.api_arrival_stall_s / api_held_send_stall_s, "
            "which the simulator supports) they left the validation's end-to-end figures no better on the 2-core "
            "machine (benchmarks/validate_sim.py --rescore, docs/performance.md): the model fitted without them "
            "carries their mean in its other terms"
        )
    if on_served:
        profile.fit["total_time_correction"] = correction
        profile.fit["why_correction"] = (
            "the fit follows the typical step (median-like); every coefficient is then scaled by the served steps' "
            "total measured / total fitted time, so that sums of steps (throughput, mean TTFT / TPOT) keep the tail"
        )
        profile.fit["in_process_grid"] = _quality(profile, samples)
        profile.fit["why_served"] = (
            "the steps are a served engine core's loop iterations (engine/step_trace.py): they include the API "
            "process taking turns on the step's cores and the loop's own work, which an in-process profile misses; "
            "the in-process grid's steps are scored against the fit (in_process_grid)"
        )
    return stretch


def run_calibrate(args: argparse.Namespace) -> int:
    if args.refit:
        return refit(args.refit, args.out)
    import dataclasses
    import shlex

    from lmserve.config import EngineArgs
    from lmserve.entrypoints.engine_args_cli import engine_kwargs, model_path

    def log(msg: str) -> None:
        print(msg, flush=True)

    try:
        grid = Grid.quick() if args.quick else Grid.full()
        if args.repeats is not None:
            if args.repeats < 1:
                raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
            grid = dataclasses.replace(grid, repeats=args.repeats)
        if args.num_threads is not None and args.num_threads < 1:
            raise ValueError(f"--num-threads must be >= 1, got {args.num_threads}")
        model = model_path(args)
        kwargs = engine_kwargs(args)
        # the grid's steps must fit one step's budget and the sequence limit; the KV pool must hold the states
        kwargs["max_num_batched_tokens"] = max(kwargs["max_num_batched_tokens"] or 0, grid.max_tokens_per_step())
        kwargs["max_num_seqs"] = max(kwargs["max_num_seqs"], max(grid.decode_batches) + 2)
        engine_args = EngineArgs.from_kwargs(model, **kwargs)
        config = engine_args.create_engine_config()
        max_len = config.scheduler.max_model_len
        grid = dataclasses.replace(grid, decode_contexts=tuple(c for c in grid.decode_contexts if c + 200 < max_len))
        if not grid.decode_contexts:
            raise ValueError(f"max_model_len {max_len} is too short for the calibration grid (needs > 232)")
        if config.speculative is not None:
            raise ValueError("--speculative-config: the simulator does not model speculative decoding")
    except ValueError as e:
        print(f"lmserve simulate calibrate: error: {e}", file=sys.stderr)
        return 2
    from lmserve.engine.core_client import default_num_threads

    num_threads = args.num_threads or default_num_threads(1)
    log(f"calibrating {model} ({config.model.dtype}, KV {config.cache.kv_cache_dtype}, "
        f"quantization {config.quantization.method if config.quantization else None}) in a process set up as an "
        f"engine core: {num_threads} threads, --cpu-wait-policy {args.cpu_wait_policy}; "
        f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]
    try:
        samples, held, threads_used, counted_fraction, stack_rows = profile_in_core_process(
            config, grid, num_threads, args.cpu_wait_policy, log
        )
    except RuntimeError as e:
        print(f"lmserve simulate calibrate: error: {e}", file=sys.stderr)
        return 1
    log(f"profiled {len(samples)} grid steps and {len(held)} workload steps in {time.perf_counter() - t0:.0f} s "
        f"(steps by torch threads: {threads_used})")  # fmt: skip
    if len(samples) < 10:
        print("lmserve simulate calibrate: error: too few steps profiled to fit", file=sys.stderr)
        return 1
    name = args.model or "bundled (lmserve/default_model/target)"
    profile = StepProfile(
        kind="linear",
        model=model_description(config, name),
        dtype=config.model.dtype,
        kv_cache_dtype=config.cache.kv_cache_dtype,
        quantization=config.quantization.method if config.quantization else None,
        weight_dtype=config.weight_dtype,
        device=config.device,
        machine={},
        linear=LinearStepModel(0.0, {}),
        tensor_parallel_size=config.tensor_parallel_size,
    )
    _fit_into(profile, samples, held, stack_rows)
    profile.calibration = {"counted_fraction": counted_fraction}
    overheads = Overheads()
    served: list[tuple[StepFeatures, float]] = []
    inputs: list[tuple[int, ...]] = []
    if args.server:
        flags = _server_flags(args)
        log(f"serving the calibration loads and measuring API/network overheads: lmserve serve {shlex.join(flags)}")
        try:
            overheads, served, inputs = measure_on_server(
                profile, model, flags, config.tokenizer, Path(args.out).resolve().parent, grid, max_len
            )
            log(f"served {len(served)} traced steps")
        except Exception as e:  # noqa: BLE001 - the fit is still worth saving
            log(f"warning: overheads not measured ({type(e).__name__}: {e}); they stay 0")
    stretch = _fit_into(profile, samples, held, stack_rows, served, inputs, overheads)
    if overheads.api_queue:
        overheads = dataclasses.replace(overheads, api_step_stretch=stretch)
        log(f"API step stretch: {stretch:.2f} s of step per s of API work beside it")
    if profile.fit["fitted_on"] == "served":  # the fitted steps are whole core-loop iterations
        overheads = dataclasses.replace(
            overheads,
            core_step_overhead_s=0.0,
            how=overheads.how + "; the core loop's per-step cost is inside the fitted (served) steps: 0 here",
        )
    try:
        latency_s, block_s = measure_kv_transfer(config)
        overheads = dataclasses.replace(overheads, kv_transfer_latency_s=latency_s, kv_transfer_block_s=block_s)
        log(f"KV transfer (ZeroMQ ipc, {config.cache.kv_cache_dtype}): {latency_s * 1e6:.0f} µs per pull + "
            f"{block_s * 1e6:.1f} µs per block")  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the fit is still worth saving
        log(f"warning: KV transfer not measured ({type(e).__name__}: {e}); the simulator's defaults apply")
    profile.overheads = overheads
    profile.machine = machine_description(config.device)
    profile.calibration = {
        # median of (the engine's own step counter: execute + update) / LLMEngine.step()'s wall time: what a server's
        # /metrics step times are of the step model's steps (schedule, detokenize and outputs are outside them)
        "counted_fraction": counted_fraction,
        "grid": asdict(grid),
        "num_threads": num_threads,
        "cpu_wait_policy": args.cpu_wait_policy,
        "steps_by_torch_threads": threads_used,
        "load_avg_1m_start": load_start,
        "elapsed_s": time.perf_counter() - t0,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "decode_stack_rows": stack_rows,
        # a sample: the five features, the time, then decode_after_prefill (older files: six numbers, flag 0)
        "samples": [[*f.as_tuple(), t, f.decode_after_prefill] for f, t in samples],
        "workload_samples": [[*f.as_tuple(), t, f.decode_after_prefill] for f, t in held],
        # (a served sample's time: the core loop's iteration)
        "served_samples": [[*f.as_tuple(), t, f.decode_after_prefill] for f, t in served],
        # per served sample: the previous step's chunks, first chunks, finished requests, the requests sent while
        # it ran, and those sent while this one ran on their own schedule and held by the cap (stretch_inputs)
        "served_api_inputs": [list(x) for x in inputs],
        "sample_columns": [
            "prefill_tokens",
            "prefill_segments",
            "decode_rows",
            "decode_context_tokens",
            "prefill_attention_pairs",
            "step_time_s",
        ],  # fmt: skip
    }
    out = profile.save(args.out)
    print(format_profile(profile))
    print(f"wrote {out}")
    return 0


def _server_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags of this calibration as `lmserve serve` arguments."""
    from lmserve.entrypoints.engine_args_cli import ENGINE_ARG_NAMES

    defaults = argparse.ArgumentParser()
    from lmserve.entrypoints.engine_args_cli import add_engine_args

    add_engine_args(defaults)
    base = vars(defaults.parse_args([]))
    flags: list[str] = []
    negated = {"enable_prefix_caching": "--no-prefix-caching", "enable_chunked_prefill": "--no-chunked-prefill",
               "share_prefix_in_step": "--no-in-step-prefix-sharing"}  # fmt: skip
    for name in ENGINE_ARG_NAMES:
        value = getattr(args, name)
        if value == base.get(name):
            continue
        if name in negated:
            flags.append(negated[name])
        else:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    if args.cpu_wait_policy != "adaptive":
        flags += ["--cpu-wait-policy", args.cpu_wait_policy]
    if args.num_threads is not None:
        flags += ["--num-threads", str(args.num_threads)]
    if args.num_kv_blocks is None and args.kv_cache_memory_gib is None:
        flags += ["--kv-cache-memory-gib", "0.25"]  # the measurement needs little KV; do not reserve the default pool
    return flags


def format_profile(profile: StepProfile) -> str:
    lines = [f"step model ({profile.label}): kind {profile.kind}"]
    if profile.linear is not None:
        lines.append("  " + profile.linear.formula())
    fit = profile.fit
    if fit:
        lines.append(f"  form: {fit.get('chosen')} — {fit.get('why')}")
        lines.append(f"  fitted on: {fit.get('fitted_on', 'in-process grid')} steps")
        for key, what in (("heldout_grid", "grid"), ("heldout_served", "served")):
            g = fit.get(key) or {}
            if g:
                lines.append(
                    f"  held-out {what} steps: R² {g['r2_heldout']:.3f}, median |error| "
                    f"{g['median_ape_heldout_pct']:.1f} %, mean {g['mape_heldout_pct']:.1f} % (train R² "
                    f"{g['r2_train']:.3f}, mean {g['mape_train_pct']:.1f} %; {g['num_train']} / {g['num_heldout']} "
                    "steps)"
                )
        for key, what in (("heldout_workload", "in-process workload"), ("in_process_grid", "in-process grid")):
            w = fit.get(key) or {}
            if w:
                lines.append(
                    f"  {what} steps against it: R² {w['r2']:.3f}, median |error| {w['median_ape_pct']:.1f} %, mean "
                    f"{w['mape_pct']:.1f} %, total time {w['sum_error_pct']:+.1f} % ({w['num_steps']} steps)"
                )
    ov = profile.overheads
    lines.append(
        f"  overheads: ingress {ov.ingress_s * 1e3:.2f} ms, egress {ov.egress_s * 1e3:.2f} ms, core loop "
        f"{ov.core_step_overhead_s * 1e3:.2f} ms/step ({'measured' if ov.measured else 'not measured'})"
    )
    if ov.api_queue:
        lines.append(
            f"  API queue: request {ov.api_request_s * 1e3:.2f} ms, chunk {ov.api_chunk_s * 1e3:.3f} ms (+ first "
            f"{ov.api_first_chunk_s * 1e3:.2f}, + last {ov.api_last_chunk_s * 1e3:.2f} ms); step stretch "
            f"{ov.api_step_stretch:.2f} × the API work beside a step"
        )
    stalls = profile.fit.get("send_stalls_measured_s")
    if ov.api_arrival_stall_s or ov.api_held_send_stall_s:
        lines.append(f"  a send stalls the step in progress {ov.api_arrival_stall_s * 1e3:.2f} ms (one the client's "
                     f"cap held {ov.api_held_send_stall_s * 1e3:.2f} ms)")  # fmt: skip
    elif stalls:
        lines.append(f"  measured, not applied (fit.why_send_stalls): a send stalls the step in progress "
                     f"{stalls['arrival'] * 1e3:.2f} ms (one the client's cap held "
                     f"{stalls['held_by_the_cap'] * 1e3:.2f} ms)")  # fmt: skip
    if ov.kv_transfer_block_s is not None and ov.kv_transfer_latency_s is not None:
        lines.append(f"  KV transfer (disaggregation): {ov.kv_transfer_latency_s * 1e6:.0f} µs per pull + "
                     f"{ov.kv_transfer_block_s * 1e6:.1f} µs per block")  # fmt: skip
    return "\n".join(lines)
