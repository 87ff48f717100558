"""CPU sharing (issue 15): 8 concurrent streams through `lmserve serve` on a quiet machine and with one
competing CPU hog (`yes > /dev/null`) per usable core, for each --cpu-wait-policy; prints the table (loaded /
quiet per policy, and each policy's quiet figure vs the 'spin' baseline) and writes
benchmarks/results/cpu-sharing-<timestamp>.json (benchmarks/machine.write_result).

    python benchmarks/bench_cpu_sharing.py [--threads 2] [--streams 8] [--policies bounded,spin,passive]
        [--prompt-len 128] [--output-len 128] [--model DIR] [--out benchmarks/results] [--quick]

Targets: loaded >= 35 % of quiet at 8 streams; the chosen default's quiet figure within 5 % of the best.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench_cpu import FULL, QUICK, Workloads, http_load, lmserve_server, read_hf_config
from benchmark_model import CONFIG, build_benchmark_model
from machine import write_result

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def cpu_hogs(n: int) -> Iterator[None]:
    """n `yes > /dev/null` processes (each a busy core), killed after."""
    procs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--policies", default="adaptive,bounded,spin,passive")
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the script runs, not a measurement")
    args = p.parse_args(argv)
    base = QUICK if args.quick else FULL
    args.prompt_len = args.prompt_len or base["prompt_len"]
    args.output_len = args.output_len or base["output_len"]
    args.concurrency, args.offline_requests, args.hf_batch = args.streams, 1, 1
    model_dir = args.model.resolve() if args.model else build_benchmark_model()
    vocab = CONFIG["vocab_size"] if args.model is None else read_hf_config(model_dir)["vocab_size"]
    w = Workloads.build(args, vocab)
    num_hogs = len(os.sched_getaffinity(0))
    res: dict[str, Any] = {}
    for policy in args.policies.split(","):
        flags = ["--cpu-wait-policy", policy, "--num-threads", str(args.threads)]
        blocks = w.kv_blocks(64, args.max_model_len)
        with lmserve_server(model_dir, args.max_model_len, 64, blocks, args.threads, 600, flags) as url:
            http_load(url, None, w.warmup[:4], 2, None, warmup=w.warmup)
            r: dict[str, Any] = {}
            for load in ("quiet", "loaded"):
                print(f"{policy} {load} ...", flush=True)
                with cpu_hogs(num_hogs if load == "loaded" else 0):
                    s, _ = http_load(url, None, w.concurrent, w.output_len, args.streams)
                r[load] = {"output_tok_s": s.output_throughput_tok_s, "tpot_p99_ms": s.tpot_ms.p99}
            res[policy] = r
    best_quiet = max(r["quiet"]["output_tok_s"] for r in res.values())
    print(f"\n{args.streams} streams, {args.threads} threads, {num_hogs} hog(s) when loaded")
    print(f"{'policy':10} {'quiet tok/s':>12} {'loaded tok/s':>13} {'loaded/quiet':>13} {'quiet/best':>11}")
    for policy, r in res.items():
        q, lo = r["quiet"]["output_tok_s"], r["loaded"]["output_tok_s"]
        print(f"{policy:10} {q:12.1f} {lo:13.1f} {lo / q:13.1%} {q / best_quiet:11.1%}")
    write_result(args.out, "cpu-sharing", args, {"num_hogs": num_hogs, "results": res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
