"""benchmarks/bench_long_prefill.py on the tiny random Llama and Qwen3.5 at a 64-token prompt: both models run, the
table and the JSON (the dense model's ratio 1, the machine recorded) are written; a family list without dense is
refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_long_prefill.py"


@pytest.mark.slow  # (~30 s: two engines in a subprocess)
def test_quick_run_times_both_models(llama_dir: Path, hybrid_dirs: dict[str, Path], tmp_path: Path) -> None:
    argv = [sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--model", f"dense={llama_dir}",
            "--model", f"hybrid={hybrid_dirs['qwen3_5']}", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "TTFT of a 64-token prompt" in proc.stdout
    (path,) = tmp_path.glob("long-prefill-*-quick.json")
    doc = json.loads(path.read_text())
    assert doc["rows"]["dense"]["ratio_to_dense"] == 1.0 and doc["rows"]["hybrid"]["ttft_s"] > 0
    assert doc["machine"]["cpu_isa_flags"] is not None
    bad = subprocess.run([sys.executable, str(SCRIPT), "--families", "hybrid"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--families must include dense" in bad.stderr
