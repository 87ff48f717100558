"""benchmarks/bench_cpu.py end to end at tiny sizes on the tiny random Llama: lmserve engine, HF, the lmserve server
and a peer (a second lmserve server standing in for vLLM); every row of the table gets positive numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lmserve.bench.harness import lmserve_server

pytestmark = pytest.mark.slow  # runs the benchmark end to end: in `-m slow` (CI runs it), out of the default run

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_cpu.py"
TINY = ["--prompt-len", "8", "--output-len", "12", "--concurrency", "2", "--offline-requests", "4", "--hf-batch", "2"]


@pytest.mark.slow
def test_quick_run_writes_every_row(llama_dir: Path, tmp_path: Path):
    peer_flags = ["--num-kv-blocks", "64", "--max-model-len", "256", "--served-model-name", "peer-llama"]
    with lmserve_server(str(llama_dir), peer_flags, tmp_path / "peer.log", startup_timeout_s=120) as (peer_url, _):
        argv = [sys.executable, str(SCRIPT), "--quick", *TINY, "--threads", "1", "--model", str(llama_dir)]
        argv += ["--peer-url", peer_url, "--out", str(tmp_path / "results")]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "lmserve/peer" in proc.stdout and "peer peer-llama" in proc.stdout
    (path,) = (tmp_path / "results").glob("cpu-*.json")
    doc = json.loads(path.read_text())

    seen = {(r["workload"], r["metric"], r["peer"]) for r in doc["rows"]}
    for workload, metric, peer in [
        ("single-stream decode, 1 request (engine)", "decode tok/s", "HF generate batch 1"),
        ("single-stream e2e, 1 request (engine)", "output tok/s", "HF generate batch 1"),
        ("single-stream decode, 1 request (HTTP)", "decode tok/s", "peer peer-llama"),
        ("TTFT, 8-token prompt, idle server (HTTP)", "median ms (lower better)", "HF generate max_new_tokens=1"),
        ("TTFT, 8-token prompt, idle server (HTTP)", "median ms (lower better)", "peer peer-llama"),
        ("2 concurrent streams (HTTP)", "output tok/s", "HF static batch 2"),
        ("2 concurrent streams (HTTP)", "output tok/s", "peer peer-llama"),
        ("2 concurrent streams (HTTP)", "mean TPOT ms (lower better)", "peer peer-llama"),
        ("2 concurrent streams (HTTP)", "P99 TPOT ms (lower better)", "peer peer-llama"),
        ("offline, 4 requests (engine)", "output tok/s", "HF static batches of 2"),
    ]:
        assert (workload, metric, peer) in seen, (workload, metric, peer, sorted(seen))
    for r in doc["rows"]:
        assert r["lmserve"] > 0 and r["peer_value"] > 0 and r["ratio"] > 0, r

    res = doc["results"]
    assert res["lmserve_offline"]["offline"]["num_preemptions"] == 0
    assert res["lmserve_server"]["concurrent"]["requests"] == 4
    assert res["peer"]["model"] == "peer-llama" and doc["errors"] == {}
    m = doc["machine"]
    assert m["cpu_model"] and m["logical_cpus"] >= 1 and m["mem_total_gib"] > 0 and m["torch_threads"] == 1
    assert m["torch"] and m["transformers"] and "load_avg_1m_end" in m and "commit" in m["git"]


def test_llama_cpp_peer_compares_with_the_faster_setting_per_workload() -> None:
    """bench_cpu.py's llama.cpp runs (default settings and --no-repack): each workload from the faster of the two,
    the settings named; a setting that failed is absent."""
    sys.path.insert(0, str(SCRIPT.parent))
    import llama_cpp_peer

    def run(single: float, ttft: float, streams: float) -> dict:
        return {
            "single": {"decode_tok_s": single, "tpot_ms": 1e3 / single},
            "ttft": {"median_ms": ttft},
            "concurrent": {"output_tok_s": streams},
        }

    best = llama_cpp_peer.best_of({"default": run(190.0, 70.0, 480.0), "no-repack": run(200.0, 75.0, 680.0)})
    assert best["single"] == run(200.0, 0, 0)["single"] and best["ttft"] == {"median_ms": 70.0}
    assert best["concurrent"] == {"output_tok_s": 680.0}
    assert best["settings"] == {"single": "no-repack", "ttft": "default", "concurrent": "no-repack"}
    only = llama_cpp_peer.best_of({"no-repack": run(1.0, 2.0, 3.0)})
    assert set(only["settings"].values()) == {"no-repack"}
    assert llama_cpp_peer.REPACK_SETTINGS == {"default": [], "no-repack": ["--no-repack"]}


def test_repeats_take_each_numbers_median() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    import bench_cpu

    runs = [
        {"single": {"tpot_ms": 5.0, "url": "a"}, "n": 1, "flag": True},
        {"single": {"tpot_ms": 9.0, "url": "b"}, "n": 3, "flag": False},
        {"single": {"tpot_ms": 4.0}, "n": 2},
    ]
    assert bench_cpu.median_run(runs) == {"single": {"tpot_ms": 5.0, "url": "a"}, "n": 2, "flag": True}
    with pytest.raises(SystemExit):
        bench_cpu.parse_args(["--repeats", "0"])


def test_gguf_type_without_a_model_quantizes_the_benchmark_model(tmp_path: Path) -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    import bench_cpu

    args = bench_cpu.parse_args(["--llama-cpp-dir", str(tmp_path), "--gguf-type", "Q4_K_M", "--skip-hf"])
    assert args.gguf_type == "Q4_K_M" and args.llama_cpp_settings == "both"
    with pytest.raises(SystemExit):  # llama-quantize makes the file: it needs the llama.cpp tree
        bench_cpu.parse_args(["--gguf-type", "Q4_K_M"])
    with pytest.raises(SystemExit):  # lmserve serves the file's own types
        bench_cpu.parse_args(["--llama-cpp-dir", str(tmp_path), "--gguf-type", "Q4_K_M", "--quantization", "int4"])
