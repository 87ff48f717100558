"""benchmarks/bench_kv_tiering.py at tiny sizes on the tiny random Llama: both modes run, the disk tier serves the
returning prefixes, the table and the JSON (with the machine's CPU flags) are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kv_tiering.py"


@pytest.mark.slow  # (~30 s: four engines in a subprocess)
def test_quick_run_writes_both_modes(llama_dir: Path, tmp_path: Path) -> None:
    argv = [sys.executable, str(SCRIPT), "--quick", "--model", str(llama_dir), "--threads", "1", "--conversations",
            "6", "--prefix-len", "64", "--turns", "2", "--out", str(tmp_path / "results")]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no tier" in proc.stdout and "disk tier" in proc.stdout
    (path,) = (tmp_path / "results").glob("kv-tiering-*-quick.json")
    doc = json.loads(path.read_text())
    none, tier = doc["rows"]["no tier"], doc["rows"]["disk tier"]
    assert none["cached_tokens"] == 0 and tier["prefix_cache_disk_hits_total"] > 0
    assert tier["cached_tokens"] == tier["prefix_cache_hits_total"] == 6 * 64, "every second turn hits its prefix"
    assert doc["machine"] and doc["ratios"]["returning_ttft_disk_over_recompute"] > 0
