"""KV tiering: a multi-turn workload whose prefixes are 4-8x the RAM pool, served without and with the disk tier.

    python benchmarks/bench_kv_tiering.py [--conversations 24] [--prefix-len 4096] [--ratio 6] [--turns 3]
        [--concurrency 4] [--disk-dir DIR] [--threads N] [--model DIR] [--quick]

Each conversation has its own prefix (a long document or agent context) and returns `--turns` times, each turn the
prefix plus a new question; the turns go round-robin, so a conversation returns after the others evicted it from a
RAM pool sized to 1/ratio of the prefixes. Per mode (no tier / disk tier):
- TTFT of a returning prefix, requests one at a time (recompute vs read from disk), the target being disk <= 0.2x;
- goodput at the chat SLO (TTFT < 500 ms, TPOT < 50 ms) with `--concurrency` conversations in flight, and the
  decode TPOT P99 of the requests decoding meanwhile; the engine's step time P99; the disk tier's read time and
  the blocks read synchronously (in a step's scheduling, not in the background: that step's stall);
- the disk's read bandwidth, measured on the tier's own files with their pages dropped from the page cache first.
Prints a table and writes benchmarks/results/kv-tiering-<timestamp>.json (with the machine's CPU and its flags).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from benchmark_model import CONFIG, DEFAULT_DIR, build_benchmark_model, random_prompts
from machine import write_result

TTFT_SLO_S, TPOT_SLO_S = 0.5, 0.05


def _conversations(n: int, prefix_len: int, question_len: int, turns: int, vocab: int) -> list[list[list[int]]]:
    """conversations[c][t]: the prompt of conversation c's turn t (its prefix, then a question of its own)."""
    prefixes = random_prompts(n, prefix_len, vocab, seed=1)
    questions = random_prompts(n * turns, question_len, vocab, seed=2)
    return [[prefixes[c] + questions[c * turns + t] for t in range(turns)] for c in range(n)]


def _p(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def _serve(engine, prompts: list[list[int]], concurrency: int, output_len: int) -> dict:
    """Closed loop: `concurrency` requests in flight, the next prompt added when one finishes. Per request TTFT and
    TPOT (from the engine's timestamps), step times."""
    from lmserve import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    todo, live, done, steps = list(prompts), {}, [], []
    start = time.perf_counter()
    while todo or live:
        while todo and len(live) < concurrency:
            rid = engine.add_request(None, todo.pop(0), params)
            live[rid] = time.time()
        t0 = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - t0)
        for o in outs:
            if o.finished:
                m, arrival = o.metrics, live.pop(o.request_id)
                ttft = m.first_token_time - arrival
                tpot = (m.finished_time - m.first_token_time) / max(1, len(o.outputs[0].token_ids) - 1)
                done.append({"ttft_s": ttft, "tpot_s": tpot, "cached": o.num_cached_tokens})
    wall = time.perf_counter() - start
    good = sum(1 for d in done if d["ttft_s"] < TTFT_SLO_S and d["tpot_s"] < TPOT_SLO_S)
    return {
        "wall_s": wall,
        "goodput_req_s": good / wall,
        "num_good": good,
        "num_requests": len(done),
        "ttft_p50_ms": 1e3 * _p([d["ttft_s"] for d in done], 0.5),
        "tpot_p99_ms": 1e3 * _p([d["tpot_s"] for d in done], 0.99),
        "step_p99_ms": 1e3 * _p(steps, 0.99),
        "cached_tokens": sum(d["cached"] for d in done),
    }


def _returning_ttft(engine, convs: list[list[list[int]]], output_len: int) -> list[float]:
    """Every conversation's first turn (filling RAM and, with the tier, the disk), then each second turn alone: the
    TTFT of a prefix that returns after the others evicted it from RAM."""
    from lmserve import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for conv in convs:
        engine.add_request(None, conv[0], params)
        while engine.has_unfinished_requests():
            engine.step()
    ttfts = []
    for conv in convs:
        t0 = time.perf_counter()
        engine.add_request(None, conv[1], params)
        first = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if first is None and o.outputs[0].token_ids:
                    first = time.perf_counter() - t0
        ttfts.append(first)
    return ttfts


def _read_bandwidth(disk_dir: Path) -> float | None:
    """GB/s reading the tier's block files after dropping their pages (posix_fadvise DONTNEED)."""
    files = sorted(disk_dir.glob("*/*.kv"))
    if not files:
        return None
    total, start = 0, time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    start = time.perf_counter()
    for f in files:
        total += len(f.read_bytes())
    return total / (time.perf_counter() - start) / 1e9


def _benchmark_model(max_len: int) -> Path:
    """The benchmark model; one with longer positions (else identical config) when a prompt passes its 2,048."""
    if max_len <= CONFIG["max_position_embeddings"]:
        return build_benchmark_model()
    positions = 1 << (max_len - 1).bit_length()
    out = DEFAULT_DIR.with_name(f"{DEFAULT_DIR.name}-{positions // 1024}k")
    return build_benchmark_model(out, overrides={"max_position_embeddings": positions})


def run_mode(model_dir: Path, disk_dir: Path | None, convs, args, num_blocks: int) -> dict:
    from lmserve.config.engine import EngineArgs
    from lmserve.engine.llm_engine import LLMEngine

    def engine():
        kw = dict(num_kv_blocks=num_blocks, block_size=16, max_num_seqs=args.concurrency,
                  max_model_len=args.prefix_len + args.question_len + args.output_len + 16)  # fmt: skip
        if disk_dir is not None:
            shutil.rmtree(disk_dir, ignore_errors=True)
            kw.update(kv_cache_disk_dir=str(disk_dir), kv_cache_disk_gib=args.disk_gib)
        return LLMEngine.from_engine_args(EngineArgs.from_kwargs(str(model_dir), **kw))

    e = engine()
    print(f"[{'disk tier' if disk_dir else 'no tier'}] returning TTFT ...", flush=True)
    ttfts = _returning_ttft(e, convs, args.output_len)
    row = {"returning_ttft_ms": [1e3 * t for t in ttfts], "returning_ttft_median_ms": 1e3 * statistics.median(ttfts)}
    e.close()
    e = engine()
    print(f"[{'disk tier' if disk_dir else 'no tier'}] serving {len(convs) * args.turns} turns ...", flush=True)
    order = [conv[t] for t in range(args.turns) for conv in convs]  # round-robin: each returns after the others
    row.update(_serve(e, order, args.concurrency, args.output_len))
    m = e.get_metrics()
    row["prefix_cache_hits_total"] = m["prefix_cache_hits_total"]
    if disk_dir is not None:
        row.update({k: m[k] for k in ("prefix_cache_disk_hits_total", "kv_disk_blocks_read_total",
                                      "kv_disk_blocks_written_total", "kv_disk_usage_bytes",
                                      "kv_disk_blocks_read_sync_total", "kv_disk_prefetches_total")})  # fmt: skip
        row["disk_read_s_total"] = m["kv_disk_read_latency_seconds_sum"]
        row["disk_load_s_total"] = m["kv_disk_load_time_s_total"]
        row["read_bandwidth_gb_s"] = _read_bandwidth(disk_dir)
    e.close()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=None, help="default 24 (quick 12)")
    ap.add_argument("--prefix-len", type=int, default=None, help="default 4096 (quick 256)")
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=None, help="default 32 (quick 4)")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--ratio", type=float, default=6.0, help="prefix working set / RAM pool (default 6)")
    ap.add_argument("--concurrency", type=int, default=None, help="default 4 (quick 1)")
    ap.add_argument("--disk-dir", type=Path, default=None, help="the tier's directory (default: a temporary one)")
    ap.add_argument("--disk-gib", type=float, default=64.0)
    ap.add_argument("--model", type=Path, default=None, help="default: the benchmark model")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--quick", action="store_true", help="smoke run: 12 conversations of 256 tokens, 4 output tokens")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)
    sizes = (("conversations", 24, 12), ("prefix_len", 4096, 256), ("output_len", 32, 4), ("concurrency", 4, 1))
    for name, full, quick in sizes:
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    torch.set_num_threads(args.threads)
    model_dir = args.model or _benchmark_model(args.prefix_len + args.question_len + args.output_len + 16)
    vocab = CONFIG["vocab_size"] if args.model is None else _vocab(model_dir)
    convs = _conversations(args.conversations, args.prefix_len, args.question_len, args.turns, vocab)
    prefix_blocks = args.conversations * args.prefix_len // 16
    request_blocks = -(-(args.prefix_len + args.question_len + args.output_len) // 16)
    num_blocks = max(int(prefix_blocks / args.ratio), args.concurrency * request_blocks + 8)
    tmp = Path(tempfile.mkdtemp(prefix="lmserve-kv-tier-")) if args.disk_dir is None else None
    disk_dir = args.disk_dir or tmp
    try:
        rows = {mode: run_mode(model_dir, d, convs, args, num_blocks)
                for mode, d in (("no tier", None), ("disk tier", disk_dir))}  # fmt: skip
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    base, tier = rows["no tier"], rows["disk tier"]
    ratios = {
        "returning_ttft_disk_over_recompute": tier["returning_ttft_median_ms"] / base["returning_ttft_median_ms"],
        "goodput_tier_over_none": tier["goodput_req_s"] / base["goodput_req_s"] if base["goodput_req_s"] else None,
        "tpot_p99_tier_over_none": tier["tpot_p99_ms"] / base["tpot_p99_ms"] if base["tpot_p99_ms"] else None,
    }
    print(f"\n{args.conversations} conversations x {args.turns} turns, prefix {args.prefix_len} tokens, working set "
          f"{prefix_blocks} blocks over a RAM pool of {num_blocks} ({prefix_blocks / num_blocks:.1f}x), "
          f"concurrency {args.concurrency}, {args.threads} threads")  # fmt: skip
    header = ("mode", "returning TTFT ms", "goodput req/s", "TTFT p50 ms", "TPOT p99 ms", "step p99 ms", "cached tok")
    print(" | ".join(f"{h:>17}" for h in header))
    for mode, r in rows.items():
        cells = (mode, f"{r['returning_ttft_median_ms']:.1f}", f"{r['goodput_req_s']:.3f}", f"{r['ttft_p50_ms']:.1f}",
                 f"{r['tpot_p99_ms']:.1f}", f"{r['step_p99_ms']:.1f}", str(r["cached_tokens"]))  # fmt: skip
        print(" | ".join(f"{c:>17}" for c in cells))
    bw = tier.get("read_bandwidth_gb_s")
    print(f"disk tier: {tier['kv_disk_blocks_read_total']} blocks read in {tier['disk_read_s_total']:.3f} s "
          f"({tier['kv_disk_blocks_read_sync_total']} of them in a step's scheduling, the rest in the background), "
          f"loaded into the pool in {tier['disk_load_s_total']:.3f} s; "
          f"disk read bandwidth {'n/a' if bw is None else f'{bw:.2f} GB/s'} (page cache dropped)")  # fmt: skip
    print("ratios: " + ", ".join(f"{k} {v:.2f}" if v is not None else f"{k} n/a" for k, v in ratios.items()))
    write_result(args.out, "kv_tiering", args, {"num_kv_blocks": num_blocks, "rows": rows, "ratios": ratios},
                 "-quick" if args.quick else "")  # fmt: skip
    return 0


def _vocab(model_dir: Path) -> int:
    import json

    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


if __name__ == "__main__":
    raise SystemExit(main())
