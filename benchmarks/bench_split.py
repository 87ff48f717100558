"""The process split's figures (issue 15), one run: /health latency during a 200-stream burst, single-stream
decode through HTTP vs the in-process engine, and 32 concurrent streams for the in-process-engine server,
the split with DP = 1 (--threads threads) and DP = 2 (--threads / 2 threads each).

    python benchmarks/bench_split.py [--threads 2] [--prompt-len 128] [--output-len 128] [--concurrency 32]
        [--burst 200] [--repeats 2] [--model DIR] [--out benchmarks/results] [--quick]

The phases run in turn, --repeats rounds of them (in-process engine, then each server), and each figure is the
mean over the rounds: on a shared 2-vCPU guest one phase alone swings by 5-10 % between minutes, as much as the
differences measured, and alternating spreads a slow window over all of them alike.

Reuses bench_cpu's workloads, server launcher and load generator (lmserve.bench.loadgen). Prints a table
and writes benchmarks/results/split-<timestamp>.json (benchmarks/machine.write_result).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from bench_cpu import FULL, QUICK, Workloads, http_load, lmserve_server, read_hf_config, run_lmserve_offline
from benchmark_model import CONFIG, build_benchmark_model
from machine import write_result

REPO = Path(__file__).resolve().parent.parent


def health_during_burst(url: str, w: Workloads, burst: int) -> dict[str, float]:
    """GET /health every 20 ms from its own thread while `burst` streams run at once."""
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=url, timeout=30) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                assert c.get("/health").status_code == 200
                latencies.append(time.perf_counter() - t0)
                stop.wait(0.02)

    t = threading.Thread(target=probe)
    t.start()
    try:
        prompts = (w.concurrent * (burst // len(w.concurrent) + 1))[:burst]
        http_load(url, None, prompts, min(32, w.output_len), None)
    finally:
        stop.set()
        t.join()
    lat = sorted(latencies)
    return {"samples": len(lat), "p50_ms": 1e3 * lat[len(lat) // 2], "p99_ms": 1e3 * lat[int(0.99 * (len(lat) - 1))],
            "max_ms": 1e3 * lat[-1]}  # fmt: skip


def serve_phase(model_dir: Path, w: Workloads, args: argparse.Namespace, threads: int, flags: list[str],
                burst: bool) -> dict[str, Any]:  # fmt: skip
    num_seqs = max(256, args.burst)
    blocks = w.kv_blocks(num_seqs, args.max_model_len)
    flags = [*flags, "--num-threads", str(threads)]
    with lmserve_server(model_dir, args.max_model_len, num_seqs, blocks, threads, 600, flags) as url:
        http_load(url, None, w.warmup[:4], 2, None, warmup=w.warmup)
        out: dict[str, Any] = {"flags": flags}
        s, _ = http_load(url, None, [w.single], w.output_len, 1)
        out["single_decode_tok_s"] = 1e3 / s.tpot_ms.mean if s.tpot_ms.mean else None
        s, _ = http_load(url, None, w.concurrent, w.output_len, w.concurrency)
        out["concurrent_output_tok_s"] = s.output_throughput_tok_s
        out["concurrent_tpot_p99_ms"] = s.tpot_ms.p99
        if burst:
            out["health_during_burst"] = health_during_burst(url, w, args.burst)
    return out


def _means(rounds: list[dict[str, Any]], phases: list[str]) -> dict[str, Any]:
    """Each figure averaged over the rounds (the /health P99: the worst round)."""
    out: dict[str, Any] = {
        "offline_single_decode_tok_s": statistics.mean(r["offline"]["single"]["decode_tok_s"] for r in rounds)
    }
    for name in phases:
        runs = [r[name] for r in rounds]
        out[name] = {k: statistics.mean(x[k] for x in runs) for k in ("single_decode_tok_s", "concurrent_output_tok_s")}
        if "health_during_burst" in runs[0]:
            out[name]["health_p99_ms"] = max(x["health_during_burst"]["p99_ms"] for x in runs)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    for k, v in FULL.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=None, help=f"default {v} ({QUICK[k]} quick)")
    p.add_argument("--burst", type=int, default=None, help="streams of the /health burst (default 200, 16 quick)")
    p.add_argument("--repeats", type=int, default=2, help="rounds of all phases, alternating (1 quick)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the script runs, not a measurement")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    base = QUICK if args.quick else FULL
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.burst = args.burst or (16 if args.quick else 200)
    torch.set_num_threads(args.threads)
    model_dir = args.model.resolve() if args.model else build_benchmark_model()
    vocab = CONFIG["vocab_size"] if args.model is None else read_hf_config(model_dir)["vocab_size"]
    w = Workloads.build(args, vocab)
    half = max(1, args.threads // 2)
    phases = {
        "http_in_process_engine": (args.threads, ["--in-process-engine"], True),
        "http_split_dp1": (args.threads, [], True),
        "http_split_dp2": (half, ["--data-parallel-size", "2"], False),
    }
    rounds: list[dict[str, Any]] = []
    for i in range(1 if args.quick else args.repeats):
        r: dict[str, Any] = {}
        print(f"round {i + 1}: in-process engine (LLM.generate) ...", flush=True)
        r["offline"] = run_lmserve_offline(model_dir, w, args.max_model_len, True, False, {})
        for name, (threads, flags, burst) in phases.items():
            print(f"round {i + 1}: {name} ...", flush=True)
            r[name] = serve_phase(model_dir, w, args, threads, flags, burst)
        rounds.append(r)
    res = {"rounds": rounds, "mean": _means(rounds, list(phases))}
    m = res["mean"]
    offline_tok_s = m["offline_single_decode_tok_s"]
    print(f"\nmeans of {len(rounds)} alternating rounds; single-stream decode, in-process: {offline_tok_s:.1f} tok/s")
    print(f"{'server':26} {'single tok/s':>12} {'vs in-process':>13} {'32-stream tok/s':>15} {'/health P99 ms':>14}")
    for name in phases:
        r = m[name]
        h = r.get("health_p99_ms")
        print(f"{name:26} {r['single_decode_tok_s']:12.1f} {r['single_decode_tok_s'] / offline_tok_s:13.2%} "
              f"{r['concurrent_output_tok_s']:15.1f} {'' if h is None else f'{h:14.1f}'}")  # fmt: skip
    write_result(args.out, "split", args, {"results": res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
