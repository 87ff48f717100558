"""`lmserve simulate calibrate`'s in-process profile: real LLMEngine steps timed over a grid of engine states
(decode batch x context x prefill x cached context) and a held-out mixed workload, each step's features read from
the SchedulerOutput it ran; run in an engine-core-like child process so the timing matches a served core."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmserve.sim.step_features import StepFeatures
from lmserve.sim.step_model import StepProfile


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


def sample_of_row(row: list[float]) -> tuple[StepFeatures, float]:
    """A saved sample: [five features, time, decode_after_prefill] (older files: without the flag)."""
    return StepFeatures(*row[:5], int(row[6]) if len(row) > 6 else 0), row[5]


class _StepRecorder:
    """Keeps each step's features and wall time (engine/step_trace.StepTimer). Between steps it applies the served
    engine core's thread back-off (engine/cpu_share.py), as the core's loop does."""

    def __init__(self, engine: Any, backoff: Any = None) -> None:
        from lmserve.observability.step_trace import StepTimer

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


def fit_quality(profile: StepProfile, samples: list[tuple[StepFeatures, float]]) -> dict[str, float]:
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
