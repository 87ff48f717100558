"""lmserve.observability.step_trace: an engine core started with LMSERVE_STEP_TRACE writes one line per step it took,
with the features the simulator's step model reads and the step's and the loop iteration's times."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lmserve.engine.messages import AddRequest
from lmserve.observability.step_trace import COLUMNS, ENV, read_trace, trace_path
from tests.engine.test_core import Harness, greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_traced_core_writes_each_step_with_its_features(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = tmp_path / "steps"
    monkeypatch.setenv(ENV, str(base))
    h = Harness(llama_dir)  # engine index 3
    try:
        h.send(AddRequest("a", [5, 6, 7, 8, 9], greedy(4), 1.0))
        while not any(o.finished for o in h.recv().outputs):
            pass
    finally:
        h.close()
    assert trace_path(3) == f"{base}.3"
    rows = read_trace(f"{base}.3")
    assert all(len(r) == len(COLUMNS) for r in rows)
    # the prefill (one segment of 5 tokens: 15 query-key pairs), then 3 one-row decodes attending to 6, 7, 8 keys
    assert [r[:5] for r in rows] == [(5, 1, 0, 0, 15), (0, 0, 1, 6, 0), (0, 0, 1, 7, 0), (0, 0, 1, 8, 0)]
    for r in rows:
        step_s, loop_s, threads, sampled = r[5], r[6], r[7], r[8]
        assert 0 < step_s <= loop_s and threads == 1 and sampled == 1  # one request: each step samples its token
    assert [r[9] for r in rows] == [0, 0, 0, 1]  # finished: the last step's
    ends = [r[10] for r in rows]  # wall-clock ends of the steps, in order, as far apart as the steps at least
    assert all(b - a >= r[5] * 0.99 for a, b, r in zip(ends, ends[1:], rows[1:], strict=False))
    assert abs(ends[-1] - time.time()) < 60


def test_no_trace_without_the_variable(llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert trace_path(0) is None
    h = Harness(llama_dir)
    try:
        assert h.core._trace is None
    finally:
        h.close()


def test_read_trace_skips_a_line_cut_short(tmp_path: Path) -> None:
    path = tmp_path / "t.0"  # an older trace: 8 columns
    path.write_text("16 1 0 0 136 0.01 0.011 2\n0 0 1 17 0 0.002 0.0025 2\n0 0 1 1")
    assert read_trace(str(path)) == [(16, 1, 0, 0, 136, 0.01, 0.011, 2), (0, 0, 1, 17, 0, 0.002, 0.0025, 2)]
    new = "16 1 0 0 136 0.01 0.011 2 1 0 100.5\n0 0 1 17 0 0.002 0.0025 2 1 1 100.6\n"
    path.write_text(new + "0 0 1 17 0 0.002 0.0025 2")
    assert read_trace(str(path)) == [(16, 1, 0, 0, 136, 0.01, 0.011, 2, 1, 0, 100.5), (0, 0, 1, 17, 0, 0.002, 0.0025,
                                                                                       2, 1, 1, 100.6)]  # fmt: skip
