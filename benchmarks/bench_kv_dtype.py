"""KV cache dtype: float32 vs bfloat16 vs int8 (vs fp8_e4m3) KV on the benchmark model, in one run.

    python benchmarks/bench_kv_dtype.py [--requests 256] [--prompt-len 128] [--output-len 128] [--threads N] [--quick]

Per KV dtype: offline output tok/s for `--requests` requests (prompt/output lengths as given), the decode step time
with the whole batch decoding (every request past its prefill), and the maximum number of concurrent 4096-token
requests a 4 GiB pool holds, from the ledger (lmserve.memory.ledger) and from the engine's configuration (asserted
equal).
Prints a table and writes benchmarks/results/kv-dtype-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from benchmark_model import CONFIG, build_benchmark_model, random_prompts, timed_generate
from machine import write_result

DTYPES = ("float32", "bfloat16", "int8", "fp8_e4m3")


def pool_capacity(model_dir: Path, kv_dtype: str, pool_gib: float, seq_len: int, block_size: int = 16) -> dict:
    """Concurrent seq_len-token requests in a pool_gib pool: the ledger's answer and the engine's must agree."""
    from lmserve.config.engine import EngineArgs
    from lmserve.memory import ledger as memory

    shape = memory.load_model_shape(model_dir)
    per_token = memory.kv_cache_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, kv_dtype)
    ledger = memory.max_concurrent_requests(int(pool_gib * 2**30), seq_len, per_token, block_size)
    cache = (
        EngineArgs(str(model_dir), kv_cache_memory_gib=pool_gib, kv_cache_dtype=kv_dtype, block_size=block_size)
        .create_engine_config()
        .cache
    )
    engine = cache.max_concurrent_requests(seq_len)
    assert cache.kv_bytes_per_token == per_token and engine == ledger, (kv_dtype, per_token, ledger, engine)
    return {"kv_bytes_per_token": per_token, "num_blocks": cache.num_blocks, "max_concurrent_requests": engine}


def run_dtype(model_dir: Path, kv_dtype: str, prompts: list[list[int]], output_len: int, decode_steps: int) -> dict:
    from lmserve import LLM, SamplingParams

    n, prompt_len = len(prompts), len(prompts[0])
    blocks = n * -(-(prompt_len + output_len) // 16) + 16
    llm = LLM(
        str(model_dir), kv_cache_dtype=kv_dtype, num_kv_blocks=blocks, max_num_seqs=n, enable_prefix_caching=False,
        max_model_len=min(CONFIG["max_position_embeddings"], prompt_len + output_len + 16),
    )  # fmt: skip
    outs, wall, n_out = timed_generate(llm, prompts, output_len)

    # decode step time with all n requests decoding: run the prefills, then time whole-batch decode steps
    engine = llm.engine
    long_params = SamplingParams(max_tokens=decode_steps + 2, temperature=0, ignore_eos=True)
    ids = {engine.add_request(None, p, long_params) for p in prompts}
    started: set[str] = set()
    while started != ids:
        started |= {o.request_id for o in engine.step()}
    step_s = []
    for _ in range(decode_steps):
        t0 = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - t0)
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "wall_s": wall,
        "output_tok_s": n_out / wall,
        "decode_step_ms": 1e3 * statistics.median(step_s),
        "decode_batch": n,
        "pool_bytes": engine.config.cache.pool_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=None, help="offline requests = decode batch (default 256)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128")
    ap.add_argument("--output-len", type=int, default=None, help="default 128")
    ap.add_argument("--decode-steps", type=int, default=None, help="timed whole-batch decode steps (default 16)")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {', '.join(DTYPES)}")
    ap.add_argument("--pool-gib", type=float, default=4.0, help="pool for the capacity column (default 4)")
    ap.add_argument("--capacity-seq-len", type=int, default=4096, help="request length for the capacity column")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 requests, 16/8 tokens, 2 timed steps")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)
    sizes = (8, 16, 8, 2) if args.quick else (256, 128, 128, 16)
    for name, default in zip(("requests", "prompt_len", "output_len", "decode_steps"), sizes, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        ap.error(f"--dtypes: unknown {bad}; known: {list(DTYPES)}")
    torch.set_num_threads(args.threads)
    model_dir = build_benchmark_model()
    prompts = random_prompts(args.requests, args.prompt_len, CONFIG["vocab_size"])
    rows = []
    for d in dtypes:
        row = {"kv_cache_dtype": d, **run_dtype(model_dir, d, prompts, args.output_len, args.decode_steps)}
        row["capacity"] = pool_capacity(model_dir, d, args.pool_gib, args.capacity_seq_len)
        rows.append(row)
        print(f"{d}: {row['output_tok_s']:.1f} tok/s, decode step {row['decode_step_ms']:.1f} ms", flush=True)

    print(
        f"\n{args.requests} requests, prompt {args.prompt_len}, output {args.output_len}, {args.threads} threads; "
        f"capacity: {args.capacity_seq_len}-token requests in a {args.pool_gib:g} GiB pool (ledger == engine)"
    )
    header = ("KV dtype", "output tok/s", f"decode step ms (batch {args.requests})", "B/token", "max concurrent")
    widths = (9, 12, len(header[2]), 8, 14)
    print(" | ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
    for r in rows:
        cells = (
            r["kv_cache_dtype"], f"{r['output_tok_s']:.1f}", f"{r['decode_step_ms']:.1f}",
            str(r["capacity"]["kv_bytes_per_token"]), str(r["capacity"]["max_concurrent_requests"]),
        )  # fmt: skip
        print(" | ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    write_result(args.out, "kv_dtype", args, {"rows": rows}, "-quick" if args.quick else "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
