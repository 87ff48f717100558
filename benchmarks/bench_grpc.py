"""gRPC vs HTTP on the same server and engine: concurrent streams through `lmserve bench serve`'s load generator.

    python benchmarks/bench_grpc.py [--prompt-len 128] [--output-len 128] [--concurrency 32] [--requests 64]
        [--rounds 2] [--threads 2] [--model DIR] [--out DIR] [--quick]

One `lmserve serve --grpc-port` process (the benchmark model of benchmarks/benchmark_model.py unless --model); every
request a different prompt of exactly --prompt-len random token ids (sent as ids over both frontends, so neither
tokenizes), --output-len tokens forced (ignore_eos, greedy), at most --concurrency in flight (closed loop). Each
round runs --requests over HTTP (SSE /v1/completions) and over gRPC (GenerateStream on one channel), alternating
which goes first (ABBA), after an untimed warm-up of both. Reports per frontend the output tok/s, TTFT P50/P99
and TPOT / E2E (client-side, from send), the median over rounds; writes benchmarks/results/grpc-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from benchmark_model import CONFIG, add_size_args, build_benchmark_model, random_prompts, resolve_size_args
from machine import write_result

from lmserve.bench.harness import ServerError, free_loopback_port, running_server

FULL = dict(prompt_len=128, output_len=128, concurrency=32, requests=64, rounds=2)
QUICK = dict(prompt_len=16, output_len=8, concurrency=4, requests=8, rounds=1)
FRONTENDS = ("http", "grpc")


@contextlib.contextmanager
def server(model_dir: Path, args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """`lmserve serve` with both frontends on free loopback ports: (http base URL, grpc:// URL)."""
    port, grpc_port = free_loopback_port(), free_loopback_port()
    cmd = [sys.executable, "-m", "lmserve.entrypoints.cli", "serve", "--model", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc_port), "--no-access-log"]
    cmd += ["--log-level", "warning", "--no-prefix-caching", "--max-num-seqs", str(args.concurrency)]
    cmd += ["--max-model-len", str(args.prompt_len + args.output_len + 16)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    with running_server(cmd, f"http://127.0.0.1:{port}", "lmserve serve", args.server_timeout, env=env) as url:
        yield url, f"grpc://127.0.0.1:{grpc_port}"


def load(url: str, backend: str, prompts: list[list[int]], args: argparse.Namespace, concurrency: int) -> Any:
    """Stream `prompts` through one frontend; the BenchSummary. Every output must have exactly --output-len tokens."""
    from lmserve.bench.datasets import BenchRequest
    from lmserve.bench.loadgen import LoadConfig, finalize_all, run_load
    from lmserve.bench.metrics import summarize

    cfg = LoadConfig(base_url=url, backend=backend, max_concurrency=concurrency, timeout_s=1800.0)
    reqs = [BenchRequest(prompt=cast(str, p), prompt_token_ids=p, output_len=args.output_len) for p in prompts]
    result = asyncio.run(run_load(reqs, cfg))
    if result.fatal_error:
        raise ServerError(result.fatal_error)
    summary = summarize(finalize_all(result, reqs, cfg), result.duration_s or None, math.inf, concurrency)
    if summary.num_failed or summary.output_len_matched_pct != 100.0:
        exact = summary.output_len_matched_pct
        raise ServerError(f"{backend}: {summary.num_failed} failed, {exact:.0f}% exact length: {summary.errors[:3]}")
    return summary


def row(s: Any) -> dict[str, float | None]:
    return {
        "output_tok_s": s.output_throughput_tok_s,
        "ttft_p50_ms": s.ttft_from_send_ms.p50,
        "ttft_p99_ms": s.ttft_from_send_ms.p99,
        "tpot_mean_ms": s.tpot_ms.mean,
        "e2e_p50_ms": s.e2e_from_send_ms.p50,
    }


def median_rows(rows: list[dict[str, float | None]]) -> dict[str, float | None]:
    return {k: statistics.median(r[k] for r in rows if r[k] is not None) for k in rows[0]}  # type: ignore[misc]


def format_table(result: dict[str, dict[str, float | None]]) -> str:
    keys = list(result["http"])
    lines = [f"{'metric':<14} {'http':>10} {'grpc':>10} {'grpc/http':>10}"]
    for k in keys:
        h, g = result["http"][k], result["grpc"][k]
        ratio = f"{g / h:.3f}" if h and g is not None else "-"
        lines.append(f"{k:<14} {h:>10.2f} {g:>10.2f} {ratio:>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_args(ap, FULL, QUICK)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    ap.add_argument("--model", type=Path, default=None, help="HF model directory (default: the benchmark model)")
    ap.add_argument("--server-timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)
    resolve_size_args(ap, args, FULL, QUICK)
    from lmserve.entrypoints.grpc import missing_grpc

    if (error := missing_grpc()) is not None:
        ap.error(error)
    model_dir = args.model or build_benchmark_model()
    vocab = CONFIG["vocab_size"] if args.model is None else None
    if vocab is None:
        import json

        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rounds: dict[str, list[dict[str, float | None]]] = {f: [] for f in FRONTENDS}
    with server(model_dir, args) as (http_url, grpc_url):
        urls = {"http": http_url, "grpc": grpc_url}
        warm = random_prompts(args.concurrency, args.prompt_len, vocab, seed=1000)
        for frontend in FRONTENDS:  # untimed: both paths, every batch size up to the concurrency
            load(urls[frontend], "openai" if frontend == "http" else "grpc", warm, args, args.concurrency)
        for r in range(args.rounds):
            order = FRONTENDS if r % 2 == 0 else FRONTENDS[::-1]
            for i, frontend in enumerate(order):
                prompts = random_prompts(args.requests, args.prompt_len, vocab, seed=2 * r + i)
                s = load(urls[frontend], "openai" if frontend == "http" else "grpc", prompts, args, args.concurrency)
                rounds[frontend].append(row(s))
                print(f"round {r} {frontend}: {row(s)}", flush=True)
    result = {f: median_rows(rounds[f]) for f in FRONTENDS}
    print(
        f"\n{args.requests} requests x {args.rounds} rounds, {args.concurrency} concurrent streams, "
        f"{args.prompt_len}/{args.output_len} tokens (median over rounds)"
    )
    print(format_table(result))
    write_result(args.out, "grpc", args, {"result": result, "rounds": rounds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
