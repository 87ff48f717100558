"""A served engine core's steps, one line each: what the scheduler put in the step and how long it took there.

Switched on by LMSERVE_STEP_TRACE=<path> (core i appends to `<path>.<i>`); `lmserve simulate calibrate` fits its
step-time model on these lines, which include the API process's contention a lone in-process profile cannot see.
StepTrace writes a core's file, read_trace reads one; the columns are COLUMNS, described in docs/observability.md.
"""

from __future__ import annotations

import os
import time
from typing import IO, Any

from lmserve.core.outputs import step_features

ENV = "LMSERVE_STEP_TRACE"
COLUMNS = (
    "prefill_tokens",
    "prefill_segments",
    "decode_rows",
    "decode_context_tokens",
    "prefill_attention_pairs",
    "step_s",
    "loop_s",
    "threads",
    "sampled",
    "finished",
    "end_time",
)
OLD_COLUMNS = 8  # a trace written before `sampled`, `finished` and `end_time`


def trace_path(engine_index: int) -> str | None:
    """The trace file of core `engine_index`, or None when tracing is off."""
    base = os.environ.get(ENV)
    return f"{base}.{engine_index}" if base else None


class StepTimer:
    """Wraps an engine's scheduler.schedule to read the features of the step it schedules; `step()` runs and times
    engine.step(). (calibrate's in-process profile times its steps with one too.)"""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._features: tuple[int, int, int, int, float] | None = None
        self.num_sampled = 0  # of the last step: the requests whose step reached the end of their tokens
        inner = engine.scheduler.schedule

        def schedule() -> Any:
            out = inner()
            sampling: list[Any] = []
            self._features = None if out.is_empty else step_features(out, sampling)
            self.num_sampled = len(sampling)
            return out

        engine.scheduler.schedule = schedule

    def step(self) -> tuple[list, tuple[int, int, int, int, float] | None, float]:
        """(engine.step()'s outputs, the features of the step it took or None when it scheduled none, its wall
        time in seconds)."""
        self._features = None
        t = time.perf_counter()
        outputs = self.engine.step()
        return outputs, self._features, time.perf_counter() - t


class StepTrace:
    """A core's trace file: `step()` runs and times engine.step() (a StepTimer); the loop's begin_iteration /
    end_iteration around it give the iteration's time, and end_iteration writes the step's line."""

    def __init__(self, engine: Any, path: str) -> None:
        self._timer = StepTimer(engine)
        self._file: IO[str] = open(path, "w", buffering=1)  # noqa: SIM115 (line-buffered: read while serving)
        # the last step: (features, step_s, threads, sampled, finished, the wall time it ended)
        self._pending: tuple[tuple, float, int, int, int, float] | None = None
        self._loop_start = time.perf_counter()

    def step(self) -> list:
        import torch

        outputs, features, dt = self._timer.step()
        if features is not None:
            finished = sum(1 for o in outputs if o.finished)
            self._pending = (features, dt, torch.get_num_threads(), self._timer.num_sampled, finished, time.time())
        return outputs

    def begin_iteration(self) -> None:
        """The core loop starts an iteration (before draining its input socket)."""
        self._loop_start = time.perf_counter()
        self._pending = None

    def end_iteration(self) -> None:
        """The core loop finished an iteration (after sending its outputs): write the step it took, if any."""
        if self._pending is not None:
            (prefill, segments, rows, context, pairs), step_s, threads, sampled, finished, end = self._pending
            loop_s = time.perf_counter() - self._loop_start
            self._file.write(f"{prefill} {segments} {rows} {context} {pairs:.0f} {step_s:.7f} {loop_s:.7f} {threads} "
                             f"{sampled} {finished} {end:.6f}\n")  # fmt: skip
            self._pending = None

    def close(self) -> None:
        self._file.close()


def read_trace(path: str) -> list[tuple[float, ...]]:
    """The rows of a trace file (COLUMNS order; an older file's rows have its first OLD_COLUMNS), skipping a last
    line cut short by the core's exit."""
    rows = []
    width = None  # the file's, from its first line
    with open(path) as f:
        for line in f:
            parts = line.split()
            if width is None and len(parts) in (OLD_COLUMNS, len(COLUMNS)):
                width = len(parts)
            if len(parts) == width:
                rows.append(tuple(float(x) for x in parts))
    return rows
