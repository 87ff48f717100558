"""lmserve.engine.step_trace: an engine core started with LMSERVE_STEP_TRACE writes one line per step it took,
with the features the simulator's step model reads and the step's and the loop iteration's times."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmserve.engine.messages import AddRequest
from lmserve.engine.step_trace import COLUMNS, ENV, read_trace, trace_path
from tests.test_engine_core import Harness, greedy

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
        step_s, loop_s, threads = r[5], r[6], r[7]
        assert 0 < step_s <= loop_s and threads == 1


def test_no_trace_without_the_variable(llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert trace_path(0) is None
    h = Harness(llama_dir)
    try:
        assert h.core._trace is None
    finally:
        h.close()


def test_read_trace_skips_a_line_cut_short(tmp_path: Path) -> None:
    path = tmp_path / "t.0"
    path.write_text("16 1 0 0 136 0.01 0.011 2\n0 0 1 17 0 0.002 0.0025 2\n0 0 1 1")
    assert read_trace(str(path)) == [(16, 1, 0, 0, 136, 0.01, 0.011, 2), (0, 0, 1, 17, 0, 0.002, 0.0025, 2)]
