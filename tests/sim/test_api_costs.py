"""lmserve.sim.api_costs: the API process's costs read back from a synthetic step trace and client records with
known latencies, CPU costs and step stretch; and calibrate's fit of the model with the stretch on such steps."""

from __future__ import annotations

import numpy as np
import pytest

from lmserve.sim.api_costs import (
    api_work,
    chunk_latencies,
    cpu_costs,
    fit_stretch,
    overheads_from,
    sends_during,
    stall_per_send,
    stretch_inputs,
)
from lmserve.sim.calibrate import _fit_into
from lmserve.sim.linear_fit import LinearStepModel
from lmserve.sim.step_features import Overheads, StepFeatures
from lmserve.sim.step_model import StepProfile

MS = 1e-3


def _row(features, step_s, loop_s, sampled, end_time, threads=2, finished=0):
    return (*features, step_s, loop_s, threads, sampled, finished, end_time)


def test_chunk_latencies_by_position() -> None:
    """Two requests one at a time, 4 tokens each: steps of 10 ms (prefill) and 2 ms (decodes) inside iterations
    0.5 ms longer; the client gets the first chunk 1.5 ms after its step, the middle ones 0.3 ms, the last 0.9 ms;
    each request's first iteration starts 2 ms after its send. A stray row (another load's) comes first."""
    rows = [_row((0, 0, 1, 40, 0), 0.002, 0.0025, 1, 99.0)]
    requests = []
    t = 100.0
    for _ in range(2):
        send = t
        start = send + 2 * MS  # its first iteration starts 2 ms after the send
        chunks = []
        for k, (step, feats) in enumerate([(10 * MS, (16, 1, 0, 0, 136))] + [(2 * MS, (0, 0, 1, 17, 0))] * 3):
            end = start + step  # LLMEngine.step() returns: the trace's end_time (its iteration goes on 0.5 ms)
            rows.append(_row(feats, step, step + 0.5 * MS, 1, end))
            chunks.append(end + (1.5, 0.3, 0.3, 0.9)[k] * MS)
            start = end + 0.5 * MS
        requests.append((send, chunks))
        t = chunks[-1] + 0.05
    lat = chunk_latencies(rows, requests)
    assert lat.num_requests == 2
    # ingress: send → the end of its first step (12 ms) − that iteration (10.5 ms): 1.5 ms, so that ingress + the
    # iteration + the first chunk's latency = 1.5 + 10.5 + 1.5 = 13.5 ms, the TTFT (2 + 10 + 1.5)
    assert (lat.ingress_s, lat.first_s, lat.middle_s, lat.last_s) == pytest.approx((1.5 * MS, 1.5 * MS, 0.3 * MS,
                                                                                    0.9 * MS))  # fmt: skip
    # CPU: 1.9 ms per request (0.2 of it the arrival, 1.2 the first chunk's extra, 0.6 the last's), 0.1 per chunk
    loads = [(n, c, n * 1.9 * MS + c * 0.1 * MS) for n, c in ((12, 192), (80, 80), (6, 960))]
    per_request, per_chunk = cpu_costs(loads)
    assert (per_request, per_chunk) == pytest.approx((1.9 * MS, 0.1 * MS))
    f = overheads_from(lat, per_request, per_chunk)
    assert f == pytest.approx({"ingress_s": 1.4 * MS, "egress_s": 0.2 * MS, "api_request_s": 0.1 * MS,
                               "api_chunk_s": 0.1 * MS, "api_first_chunk_s": 1.2 * MS,
                               "api_last_chunk_s": 0.6 * MS})  # fmt: skip
    assert Overheads(**f).api_queue


def test_stretch_inputs_and_fit() -> None:
    """Iterations back to back, each the model's 2 ms + 1.0 × the API work beside it (0.1 ms per chunk of the
    previous iteration, + 0.4 ms per first chunk, + 0.3 ms per request it finished, + 1 ms per request sent while it
    ran) + a 3 ms stall per request sent while it runs; after an idle gap only the stall counts."""
    ov = Overheads(api_request_s=1.0 * MS, api_chunk_s=0.1 * MS, api_first_chunk_s=0.4 * MS,
                   api_last_chunk_s=0.3 * MS)  # fmt: skip
    rng = np.random.default_rng(0)
    # per iteration: (decode rows, prefill segments that sample, requests it finishes, requests sent while it runs)
    plan = [tuple(int(rng.integers(0, k)) for k in (8, 3, 2, 3)) for _ in range(200)]
    out, sends, t, last = [], [], 10.0, None
    for i, (decodes, prefills, finished, arrivals) in enumerate(plan):
        if i == 100:
            t += 0.05  # the core idles
            last = None
        inputs = (0, 0, 0, 0) if last is None else last
        loop = 2 * MS + float(api_work(ov, [inputs])[0]) + 3 * MS * arrivals
        out.append(_row((16 * prefills, prefills, decodes, 10 * decodes, 0), loop, loop, decodes + prefills, t + loop,
                        finished=finished))  # fmt: skip
        sends += list(t + loop * (np.arange(arrivals) + 0.5) / max(arrivals, 1))
        last = (decodes + prefills, prefills, finished, arrivals)
        t += loop
    got = stretch_inputs(out, sends)
    expected = [(0, 0, 0, 0)] + [(d + p, p, f, a) for d, p, f, a in plan[:-1]]
    expected[100] = (0, 0, 0, 0)  # after the idle gap
    # fifth and sixth: sent while it runs, on their own schedule / held by a cap (none held here)
    assert got == [(*e, step[3], 0) for e, step in zip(expected, plan, strict=True)]
    work = api_work(ov, got)
    measured = np.array([r[6] for r in out])
    c0, coefs, f, g = fit_stretch(np.zeros((len(out), 0)), work, measured, sent=sends_during(got))
    assert (c0, f) == pytest.approx((2 * MS, 1.0), rel=1e-3) and coefs == [] and g[1] == 0.0
    # (the stall from the sends' surprise, sent − λ · length: a few % low where lengths vary for modelled reasons)
    assert g[0] == pytest.approx(3 * MS, rel=0.05)
    c0, coefs, f, g = fit_stretch(np.ones((3, 1)), np.zeros(3), np.full(3, 4 * MS))  # nothing beside: f = g = 0
    assert c0 + coefs[0] == pytest.approx(4 * MS) and f == 0.0 and g == [0.0, 0.0]
    # the same sends, every other one held by a cap: counted in the sixth column
    held = sends[1::2]
    split = stretch_inputs(out, sends, held)
    assert [x[4] + x[5] for x in split] == [x[4] for x in got] and sum(x[5] for x in split) == len(held)


def _poisson_steps(stall: float, seed: int, n: int = 20000, rate: float = 40.0) -> tuple[np.ndarray, ...]:
    """Steps of 1 ms + 0.2 ms/row, one in ten longer by an exponential 8 ms the model does not explain, with sends
    at `rate` a second landing in them at random times (a step's count: Poisson in its length, the stall's own
    lengthening included), each lengthening its step by `stall`. (residuals over the model, sends, lengths)."""
    rng = np.random.default_rng(seed)
    base = 1 * MS + 0.2 * MS * rng.integers(1, 9, n)
    length = base + np.where(rng.random(n) < 0.1, rng.exponential(8 * MS, n), 0.0)
    sent = extra = rng.poisson(rate * length)
    for _ in range(8):  # sends that land in the time the stalls added
        extra = rng.poisson(rate * stall * extra)
        sent = sent + extra
    length = length + stall * sent
    return length - base, sent.astype(np.float64), length


def test_the_stall_is_read_from_the_sends_surprise_not_from_long_steps() -> None:
    """Sends at random times land in long steps more often: with no stall at all, steps with sends are longer than
    the others by a few ms (the plain comparison reads a 3 ms stall); the sends' surprise (sent − λ · length)
    reads 0. With a real 3 ms stall it reads 3 ms (within 10 %), where the plain comparison reads ~5.5 ms."""
    residual, sent, length = _poisson_steps(0.0, 1)
    kinds = np.column_stack([sent, np.zeros_like(sent)])
    assert stall_per_send(residual, kinds)[0] > 2 * MS  # the length bias
    assert stall_per_send(residual, kinds, length) == [0.0, 0.0]
    residual, sent, length = _poisson_steps(3 * MS, 2)
    kinds = np.column_stack([sent, np.zeros_like(sent)])
    assert stall_per_send(residual, kinds, length)[0] == pytest.approx(3 * MS, rel=0.1)
    assert stall_per_send(residual, kinds)[0] > 4.5 * MS
    assert stall_per_send(np.zeros(4), np.zeros((4, 2))) == [0.0, 0.0]  # no sends


def _served(seed: int, n: int, stall: float = 0.0, send_share: float = 0.0) -> tuple[list, list, Overheads]:
    """Served steps t = 1 ms + 0.2 ms/row + 0.5 × the API work beside them, + `stall` for the one in 1 / send_share
    during which an arrival was sent: (steps, their API inputs (four numbers, six with sends), the API costs)."""
    rng = np.random.default_rng(seed)
    ov = Overheads(api_request_s=0.5 * MS, api_chunk_s=0.1 * MS, api_first_chunk_s=0.2 * MS,
                   api_last_chunk_s=0.3 * MS)  # fmt: skip
    served, inputs = [], []
    for _ in range(n):
        rows = int(rng.integers(1, 8))
        c, a, sent = int(rng.integers(0, 8)), int(rng.integers(0, 3)), int(rng.random() < send_share)
        first, done = int(rng.integers(0, c + 1)), int(rng.integers(0, 2))
        work = float(api_work(ov, [(c, first, done, a)])[0])
        context = int(rng.integers(rows, 40 * rows))
        t = 1 * MS + 0.2 * MS * rows + 0.5 * work + stall * sent
        served.append((StepFeatures(0, 0, rows, context, 0.0), t))
        inputs.append((c, first, done, a, sent, 0) if send_share else (c, first, done, a))
    return served, inputs, ov


def _empty_profile() -> StepProfile:
    return StepProfile("linear", {}, "float32", "float32", None, None, "cpu", {}, linear=LinearStepModel(0.0, {}))


def test_calibrate_fits_the_model_and_the_stretch_together() -> None:
    """Served steps t = 1 ms + 0.2 ms/row + 0.5 × API work: _fit_into recovers the model and the stretch."""
    served, inputs, ov = _served(1, 300)
    profile = _empty_profile()
    stretch = _fit_into(profile, served[:50], [], 0, served, inputs, ov)
    assert stretch == pytest.approx(0.5, rel=1e-3)
    assert "send_stalls_measured_s" not in profile.fit  # (four-number inputs: no sends counted)
    lin = profile.linear
    assert lin is not None and lin.intercept_s == pytest.approx(1 * MS, rel=1e-3)
    assert lin.coefficients_s["decode_rows"] == pytest.approx(0.2 * MS, rel=1e-3)
    assert profile.fit["api_step_stretch"] == stretch


def test_calibrate_measures_the_send_stalls_beside_the_model_without_applying_them() -> None:
    """The same served steps, one in ten stalled 3 ms by an arrival sent while it ran: _fit_into records the stall
    in profile.fit (measured ~3 ms) and returns the stretch alone; the model, fitted without the stall, keeps its
    time in the total (the served steps' sum equals the model's with the stretch)."""
    served, inputs, ov = _served(3, 400, stall=3 * MS, send_share=0.1)
    profile = _empty_profile()
    stretch = _fit_into(profile, served[:50], [], 0, served, inputs, ov)
    stalls = profile.fit["send_stalls_measured_s"]
    assert stalls["arrival"] == pytest.approx(3 * MS, rel=0.05) and stalls["held_by_the_cap"] == 0.0
    assert "not applied" in profile.fit["why_send_stalls"]
    work = api_work(ov, inputs)
    total = sum(profile.step_time_s(f) for f, _ in served) + stretch * float(work.sum())
    assert total == pytest.approx(sum(t for _, t in served), rel=1e-6)
