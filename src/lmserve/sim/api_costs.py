"""The API process's costs, measured on a served engine (calibrate): step_model.Overheads.api_*.

The API process (HTTP, tokenizing, SSE) queues chunks and arrivals, and its CPU work stretches the engine's steps.
chunk_latencies, cpu_costs and fit_stretch measure these from a traced served engine and the client's records;
overheads_from assembles them. The method is in docs/simulator.md.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

# a step that starts this long after the previous one ended followed an idle core: the API work of the previous
# step ran while the core idled (it stretched nothing)
IDLE_GAP_S = 0.001


@dataclass(frozen=True)
class ChunkLatencies:
    """Medians over requests sent one at a time (seconds)."""

    ingress_s: float  # send → the start of the request's first core-loop iteration
    first_s: float  # the end of the step that sampled the first token → the chunk at the client
    middle_s: float  # the same for the chunks between the first and the last
    last_s: float  # and for the last
    num_requests: int


def find_api_pid(url: str) -> int | None:
    """The pid of the `lmserve serve` listening on url's port (its command line names the port), None if not found
    (not Linux, or another kind of server)."""
    port = url.rstrip("/").rsplit(":", 1)[-1]
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(b"lmserve" in a for a in argv) and b"serve" in argv and b"--port" in argv:
            i = argv.index(b"--port")
            if i + 1 < len(argv) and argv[i + 1].decode(errors="replace") == port:
                return int(name)
    return None


def process_cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def chunk_latencies(rows: list[tuple[float, ...]], requests: list[tuple[float, list[float]]]) -> ChunkLatencies:
    """Requests served one at a time: `requests` are (send, chunk arrival times) in wall-clock seconds, in the
    order they were sent; `rows` the trace's rows (engine/step_trace.COLUMNS, with end_time) of the core's
    iterations over them, in order. Each request has one iteration per chunk: its prefill (where the request's rows
    start: a stray row before it, another load's last, is skipped), then its decodes."""
    ingress, first, middle, last = [], [], [], []
    k = 0
    for send, chunks in requests:
        n = len(chunks)
        while k < len(rows) and (rows[k][1] < 1 or rows[k][10] < send):  # its prefill, after its send
            k += 1
        steps = rows[k : k + n]
        assert len(steps) == n, f"the trace has {len(rows)} iterations; request {len(ingress)} needs {k + n}"
        assert all(int(r[8]) == 1 for r in steps), "one request at a time: every iteration samples one token"
        ends = [r[10] for r in steps]
        ingress.append(steps[0][10] - steps[0][6] - send)
        lat = [c - e for c, e in zip(chunks, ends, strict=True)]
        first.append(lat[0])
        if n > 2:
            middle.extend(lat[1:-1])
        if n > 1:
            last.append(lat[-1])
        k += n
    med = lambda xs: float(np.median(xs)) if xs else math.nan  # noqa: E731
    return ChunkLatencies(med(ingress), med(first), med(middle), med(last), len(requests))


def cpu_costs(loads: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(CPU seconds per request, per chunk) from loads of (requests, chunks, CPU seconds): least squares on
    cpu = per_request · requests + per_chunk · chunks, both clamped at 0."""
    a = np.array([[r, c] for r, c, _ in loads], dtype=np.float64)
    y = np.array([s for _, _, s in loads], dtype=np.float64)
    (per_request, per_chunk), *_ = np.linalg.lstsq(a, y, rcond=None)
    if per_chunk < 0:
        per_chunk, per_request = 0.0, float(y.sum() / a[:, 0].sum())
    if per_request < 0:
        per_request, per_chunk = 0.0, float(y.sum() / a[:, 1].sum())
    return max(0.0, float(per_request)), max(0.0, float(per_chunk))


def stretch_inputs(
    rows: list[tuple[float, ...]], sends: list[float], held: list[float] | tuple[float, ...] = ()
) -> list[tuple[int, ...]]:
    """Per trace row, what its API work beside it is made of: (the chunks the previous iteration sampled, of those
    the requests' first ones (sampled − decode rows), the requests it finished, the requests sent while it ran),
    all 0 after an idle core (a gap over IDLE_GAP_S before the iteration); then the requests sent while this
    iteration runs, fifth those sent on their own schedule and sixth those the client's concurrency cap had held
    (the stalls), counted after an idle gap too. `sends`: every request's send time, wall clock; `held`: the send
    times among them that the cap had held (held_sends). An iteration runs [end_time − step_s, that + loop_s] (its
    drain is put after its step: the same length)."""
    s = np.sort(np.asarray(sends, dtype=np.float64))
    h = np.sort(np.asarray(held, dtype=np.float64))
    out: list[tuple[int, ...]] = []
    prev: tuple[float, float] | None = None  # the previous iteration's (start, end)
    chunks = (0, 0, 0)  # and its (sampled, first chunks, finished)
    for r in rows:
        start = r[10] - r[5]
        sent = int(np.searchsorted(s, start + r[6]) - np.searchsorted(s, start))
        sent_held = int(np.searchsorted(h, start + r[6]) - np.searchsorted(h, start))
        if prev is None or start - prev[1] > IDLE_GAP_S:
            out.append((0, 0, 0, 0, sent - sent_held, sent_held))
        else:
            arrived = int(np.searchsorted(s, prev[1]) - np.searchsorted(s, prev[0]))
            out.append((*chunks, arrived, sent - sent_held, sent_held))
        prev, chunks = (start, start + r[6]), (int(r[8]), max(0, int(r[8]) - int(r[2])), int(r[9]))
    return out


HELD_AFTER_S = 0.001  # a send this much later than its scheduled time, with a concurrency cap: the cap held it


def held_sends(records: list[Any], start_wall: float, capped: bool) -> list[float]:
    """The wall-clock send times of the requests a client's concurrency cap held until another finished (sent over
    HELD_AFTER_S after their scheduled time; none without a cap: a late send there is the client's own lag).
    `records`: the load generator's RawResponses (scheduled_s, send_s from the run's start)."""
    if not capped:
        return []
    return [start_wall + r.send_s for r in records if r.send_s is not None and r.send_s - r.scheduled_s > HELD_AFTER_S]


def api_work(ov: Any, inputs: list[tuple[int, ...]]) -> np.ndarray:
    """The API seconds beside each step (Overheads `ov`'s costs on stretch_inputs' first four columns), as the
    simulator counts them."""
    cost = np.array([ov.api_chunk_s, ov.api_first_chunk_s, ov.api_last_chunk_s, ov.api_request_s])
    return np.array([x[:4] for x in inputs], dtype=np.float64).reshape(-1, 4) @ cost


def sends_during(inputs: list[tuple[int, ...]]) -> np.ndarray:
    """Per step, the requests sent while it ran: (steps, 2), on their own schedule and held by the cap
    (stretch_inputs' fifth and sixth columns; 0 where a row is older and shorter)."""
    return np.array([[x[4] if len(x) > 4 else 0, x[5] if len(x) > 5 else 0] for x in inputs],
                    dtype=np.float64).reshape(-1, 2)  # fmt: skip


def stall_per_send(residual: np.ndarray, sent: np.ndarray, lengths: np.ndarray | None = None) -> list[float]:
    """Seconds per send of each kind (sent's columns), by least squares of the steps' residuals (centred) on their
    sends; means, not medians: sums of steps need them. A kind no step has, or one fitted below 0, is 0 (and the
    others fitted again without it).

    With the steps' `lengths` (their measured time), on the sends' surprise instead: sent − λ · length, λ a kind's
    sends per second of step. A send that lands at a random time lands in a step with a probability in proportion
    to its length, so the steps that are long for any reason (the noise the model does not explain) hold more of
    them, and a plain comparison reads that as a stall (traced on the 2-core machine: half of it). The surprise is
    uncorrelated with the length, so only a send's own effect moves it; and since the stall itself lengthens the
    step (slope = g / (1 − λ g)), g = slope / (1 + λ · slope)."""
    sent = sent.reshape(len(residual), -1)
    out = [0.0] * sent.shape[1]
    if not sent.any() or sent.sum(axis=1).all():
        return out
    y = residual - residual.mean()
    rate = np.zeros(sent.shape[1])
    if lengths is not None:
        rate = sent.sum(axis=0) / float(np.sum(lengths))
        sent = sent - rate[None, :] * np.asarray(lengths, dtype=np.float64)[:, None]
    active = [k for k in range(sent.shape[1]) if sent[:, k].any()]
    while active:
        coef, *_ = np.linalg.lstsq(sent[:, active], y, rcond=None)
        if (coef >= 0).all():
            for k, c in zip(active, coef, strict=True):
                out[k] = float(c / (1.0 + rate[k] * c))
            break
        del active[int(np.argmin(coef))]
    return out


def fit_stretch(
    x: np.ndarray, work: np.ndarray, measured: np.ndarray, iterations: int = 40, sent: np.ndarray | None = None
) -> tuple[float, list[float], float, list[float]]:
    """The step model's coefficients and the stretch fitted together: measured ≈ c0 + x · c + f · work + sent · g,
    least absolute relative error (IRLS, as the step model's own fit), every coefficient >= 0 (the most negative one
    dropped and the fit redone; f = 0 when no step had API work beside it, a g = 0 when no step had such a send).
    g (one per column of sent: sends_during's kinds) is then taken again by stall_per_send on the residual of the
    rest of the fit: the stall is heavy-tailed, and the fit follows the median. x: (steps, terms) term values.
    Returns (c0, c, f, g)."""
    n, k = x.shape
    sent = np.zeros((n, 2)) if sent is None else np.asarray(sent, dtype=np.float64).reshape(n, -1)
    m = sent.shape[1]
    full = np.column_stack([np.ones(n), x, work, sent]) / measured[:, None]
    active = [*range(k + 1), *([k + 1] if (work > 0).any() else []),
              *(k + 2 + j for j in range(m) if (sent[:, j] > 0).any())]  # fmt: skip
    while True:
        design = full[:, active]
        w = np.ones(n)
        coef = np.zeros(len(active))
        for _ in range(iterations):
            coef, *_ = np.linalg.lstsq(design * w[:, None], w, rcond=None)
            w = 1.0 / np.sqrt(np.maximum(np.abs(design @ coef - 1.0), 1e-4))
        negative = [i for i, c in enumerate(coef) if c < 0 and active[i] != 0]
        if not negative:
            break
        del active[min(negative, key=lambda i: coef[i])]
    values = dict(zip(active, coef, strict=True))
    c0, c, f = max(0.0, float(values.get(0, 0.0))), [float(values.get(1 + j, 0.0)) for j in range(k)], float(
        values.get(k + 1, 0.0))  # fmt: skip
    return c0, c, f, stall_per_send(measured - (c0 + x @ np.array(c) + f * work), sent, measured)


def overheads_from(lat: ChunkLatencies, per_request_s: float, per_chunk_s: float) -> dict[str, Any]:
    """The Overheads fields: the middle chunks' latency is the per-chunk CPU + the way on (egress_s); the first and
    the last chunk's extra latency are their own costs; the per-request CPU beyond those is the request's arrival
    (api_request_s), and the ingress latency beyond it the way in (ingress_s)."""
    chunk = max(0.0, min(per_chunk_s, lat.middle_s))
    first = max(0.0, lat.first_s - lat.middle_s)
    last = max(0.0, lat.last_s - lat.middle_s)
    request = min(max(0.0, per_request_s - first - last), max(0.0, lat.ingress_s))
    return {
        "ingress_s": max(0.0, lat.ingress_s - request),
        "egress_s": max(0.0, lat.middle_s - chunk),
        "api_request_s": request,
        "api_chunk_s": chunk,
        "api_first_chunk_s": first,
        "api_last_chunk_s": last,
    }
