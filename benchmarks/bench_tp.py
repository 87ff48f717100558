"""Tensor parallelism on the CPU: what splitting the benchmark model across 2 processes costs, in one run.

    python benchmarks/bench_tp.py [--quick] [--tp 2] [--threads 2]

The benchmark model has 9 attention heads, which 2 ranks cannot split (refused, as vLLM does); this runs its
TP-friendly twin (benchmarks/.cache/smollm-135m-shaped-tp): hidden 576, 12 heads x 48, 4 KV heads, the same
parameter count and bytes per step (q/k/v/o keep their shapes: 12 x 48 = 9 x 64, 4 x 48 = 3 x 64).

1. all-reduce us per call between 2 processes, 1 thread each: gloo vs the shared-memory all-reduce, for a decode
   row (576 floats), a 32-row decode batch and a 1,024-token prefill; plus the logits' gather on rank 0 for 1 and 32
   rows (V/2 floats each, gloo vs shared memory) against a gather of 2 floats per row (the floor of sampling from
   sharded logits).
2. the engine: decode step (batch 1 and 32) and a 1,024-token prefill step at TP = 1 (--threads threads) vs TP = N
   (--threads / N per rank), with the shared-memory all-reduce and with gloo (LMSERVE_TP_ALL_REDUCE=backend).
3. HTTP: 32 concurrent streams against `lmserve serve` at TP = 1 vs TP = N (output tok/s).

Targets (issue #34, on 2 cores: TP cannot be faster, it must cost almost nothing): TP decode step <= 1.15x TP = 1,
prefill <= 1.1x, 32-stream throughput >= 0.85x. Prints a table and writes benchmarks/results/tp-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

import torch
from benchmark_model import CONFIG, DEFAULT_DIR, add_size_args, build_benchmark_model, random_prompts, resolve_size_args
from machine import write_result

TP_OVERRIDES = {"num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 48}
TP_DIR = DEFAULT_DIR.parent / "smollm-135m-shaped-tp"
FULL = {"allreduce_iters": 2000, "decode_steps": 32, "prefill_len": 1024, "prefill_reps": 3, "http_tokens": 64}
# (the HTTP run keeps 64 tokens in quick mode too: with 16, the 32 streams' prefills were most of its time and
# the TP = 2 / TP = 1 ratio read 0.57-0.97x from run to run; with 64, 0.96x and 0.97x)
QUICK = {"allreduce_iters": 300, "decode_steps": 6, "prefill_len": 1024, "prefill_reps": 1, "http_tokens": 64}
HIDDEN, VOCAB = CONFIG["hidden_size"], CONFIG["vocab_size"]


# ---- 1. collectives ---------------------------------------------------------------------------------------------


def _collective_rank(rank: int, port: int, mode: str, iters: int, queue) -> None:  # noqa: ANN001
    os.environ["LMSERVE_TP_ALL_REDUCE"] = mode
    torch.set_num_threads(1)
    from lmserve.distributed.group import Rendezvous, TPGroup

    group = TPGroup(Rendezvous("127.0.0.1", port, 2), rank)
    out = {}

    def timed(name: str, fn, n: int) -> None:  # noqa: ANN001
        for _ in range(min(50, n)):
            fn()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        ts.sort()
        out[name] = {"median_us": 1e6 * ts[len(ts) // 2], "p10_us": 1e6 * ts[len(ts) // 10], "calls": n}

    for rows in (1, 32, 1024):
        t = torch.randn(rows * HIDDEN)
        timed(f"all_reduce {rows}x{HIDDEN}", lambda t=t: group.all_reduce(t), iters if rows < 1024 else iters // 10)
    for rows in (1, 32):  # the logits' gather on rank 0: gloo's, or the shared memory's beside its all-reduce
        t = torch.randn(rows, VOCAB // 2)
        timed(f"gather logits {rows}x{VOCAB // 2}", lambda t=t: group.gather(t), iters // 4)
        pairs = torch.randn(rows, 2)
        timed(f"gather top-1 pairs {rows}x2", lambda p=pairs: group.gather(p), iters // 4)
    group.barrier_backend()
    if rank == 0:
        queue.put((group.all_reduce_kind, out))
    group.close()


def bench_collectives(iters: int) -> dict:
    from lmserve.distributed.group import free_port

    results = {}
    ctx = mp.get_context("spawn")
    for mode in ("backend", "shm"):
        queue, port = ctx.Queue(), free_port()
        procs = [ctx.Process(target=_collective_rank, args=(r, port, mode, iters, queue)) for r in range(2)]
        for p in procs:
            p.start()
        kind, out = queue.get(timeout=600)
        for p in procs:
            p.join(60)
        results[kind] = out
    return results


# ---- 2. engine steps ----------------------------------------------------------------------------------------------


def bench_engine(model_dir: Path, tp: int, threads: int, all_reduce: str, args: argparse.Namespace) -> dict:
    from lmserve import LLM, SamplingParams

    saved = os.environ.get("LMSERVE_TP_ALL_REDUCE")
    os.environ["LMSERVE_TP_ALL_REDUCE"] = all_reduce  # (restored below: the HTTP servers inherit the environment)
    torch.set_num_threads(threads)
    n = 32
    llm = LLM(
        str(model_dir), tensor_parallel_size=tp, num_kv_blocks=n * 8 + 128, max_num_seqs=n, max_model_len=2048,
        enable_prefix_caching=False, max_num_batched_tokens=max(2048, args.prefill_len),
    )  # fmt: skip
    engine = llm.engine
    try:
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up (paths chosen)
        out = {}
        for batch in (1, n):
            params = SamplingParams(max_tokens=args.decode_steps + 4, temperature=0, ignore_eos=True)
            ids = {engine.add_request(None, p, params) for p in random_prompts(batch, 64, VOCAB, seed=batch)}
            started: set[str] = set()
            while started != ids:
                started |= {o.request_id for o in engine.step()}
            steps = []
            for _ in range(args.decode_steps):
                t0 = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - t0)
            while engine.has_unfinished_requests():
                engine.step()
            out[f"decode_step_ms_batch{batch}"] = 1e3 * statistics.median(steps)
        prefill = []
        for rep in range(args.prefill_reps):
            (prompt,) = random_prompts(1, args.prefill_len, VOCAB, seed=100 + rep)
            engine.add_request(None, prompt, SamplingParams(max_tokens=1))
            t0 = time.perf_counter()
            engine.step()
            prefill.append(time.perf_counter() - t0)
            while engine.has_unfinished_requests():
                engine.step()
        out[f"prefill_ms_{args.prefill_len}"] = 1e3 * statistics.median(prefill)
        return out
    finally:
        engine.close()
        if saved is None:
            os.environ.pop("LMSERVE_TP_ALL_REDUCE", None)
        else:
            os.environ["LMSERVE_TP_ALL_REDUCE"] = saved


# ---- 3. HTTP ------------------------------------------------------------------------------------------------------


async def _streams(url: str, prompts: list[list[int]], max_tokens: int) -> int:
    import httpx

    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:

        async def one(p: list[int]) -> int:
            body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            r = await client.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        return sum(await asyncio.gather(*(one(p) for p in prompts)))


def bench_http(model_dir: Path, tp: int, threads: int, max_tokens: int, out_dir: Path) -> dict:
    from lmserve.bench.harness import lmserve_server

    flags = ["--tensor-parallel-size", str(tp), "--num-threads", str(threads), "--max-model-len", "1024"]
    with lmserve_server(str(model_dir), flags, out_dir / f"tp-serve-{tp}.log") as (url, _):
        asyncio.run(_streams(url, random_prompts(4, 32, VOCAB, seed=7), 4))  # warm-up
        prompts = random_prompts(32, 128, VOCAB, seed=8)
        t0 = time.perf_counter()
        tokens = asyncio.run(_streams(url, prompts, max_tokens))
        wall = time.perf_counter() - t0
    mode = os.environ.get("LMSERVE_TP_ALL_REDUCE") or "auto"  # (the server's: shared memory on one host)
    return {"streams": 32, "output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall, "all_reduce": mode}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_args(ap, FULL, QUICK)
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size compared with 1 (default 2)")
    ap.add_argument("--threads", type=int, default=2, help="TP = 1's threads; TP = N runs threads / N per rank")
    ap.add_argument("--skip-http", action="store_true", help="no HTTP run")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)
    resolve_size_args(ap, args, FULL, QUICK)
    if args.threads % args.tp:
        ap.error(f"--threads ({args.threads}) must be a multiple of --tp ({args.tp})")
    model_dir = build_benchmark_model(TP_DIR, TP_OVERRIDES)
    t_start = time.perf_counter()

    collectives = bench_collectives(args.allreduce_iters)
    print("collective (2 processes, 1 thread each)        gloo median / p10 us    shm median / p10 us")
    for name, g in collectives["gloo"].items():
        s = collectives.get("shm", {}).get(name)
        shm = f"{s['median_us']:9.1f} / {s['p10_us']:7.1f}" if s else "        -"
        print(f"  {name:<44} {g['median_us']:9.1f} / {g['p10_us']:7.1f}    {shm}", flush=True)

    runs = {"tp1": (1, args.threads, "auto"), f"tp{args.tp}-shm": (args.tp, args.threads, "shm"),
            f"tp{args.tp}-gloo": (args.tp, args.threads, "backend")}  # fmt: skip
    engine = {}
    for name, (tp, threads, mode) in runs.items():
        engine[name] = bench_engine(model_dir, tp, threads, mode, args)
        print(f"{name}: {engine[name]}", flush=True)
    base = engine["tp1"]
    print(f"\nengine steps ({args.threads} threads at TP = 1; {args.threads // args.tp} per rank at TP = {args.tp})")
    keys = list(base)
    print(f"  {'run':<12}" + "".join(f"{k:>24}" for k in keys))
    for name, row in engine.items():
        cells = "".join(f"{row[k]:>14.2f} ({row[k] / base[k]:.2f}x)" for k in keys)
        print(f"  {name:<12}{cells}")

    http = {}
    if not args.skip_http:
        for tp in (1, args.tp):
            http[f"tp{tp}"] = bench_http(model_dir, tp, args.threads, args.http_tokens, args.out)
        ratio = http[f"tp{args.tp}"]["output_tok_s"] / http["tp1"]["output_tok_s"]
        print(f"\nHTTP, 32 streams x {args.http_tokens} tokens: " + ", ".join(
            f"{k} {v['output_tok_s']:.1f} tok/s" for k, v in http.items()) + f" (TP {args.tp} / TP 1 = {ratio:.2f}x)")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    payload = {"model": str(model_dir), "model_overrides": TP_OVERRIDES, "collectives": collectives,
               "engine": engine, "http": http, "load_avg_end": os.getloadavg()}  # fmt: skip
    write_result(args.out, "tp", args, payload, "-quick" if args.quick else "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
