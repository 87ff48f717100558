"""Offline throughput and TTFT: lmserve vs HF transformers `generate`, same model, same prompts, one run.

    python benchmarks/bench_offline.py [--prompt-len 128] [--output-len 128] [--batch 32] [--skip-hf-single]

Prints a table and writes benchmarks/results/offline-<timestamp>.json. Ratios are against HF measured in the
same invocation; absolute times on a shared machine drift.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from benchmark_model import CONFIG, build_benchmark_model, random_prompts, timed_generate
from machine import write_result


def run_lmserve(model_dir: Path, prompts: list[list[int]], output_len: int) -> dict:
    from lmserve import LLM

    llm = LLM(str(model_dir), max_model_len=1024, enable_prefix_caching=False)
    outs, wall, n_out = timed_generate(llm, prompts, output_len)
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    return {"wall_s": wall, "output_tok_s": n_out / wall, "ttft_mean_s": sum(ttfts) / len(ttfts)}


@torch.inference_mode()
def run_hf(model_dir: Path, prompts: list[list[int]], output_len: int) -> dict:
    """HF generate as a static batch of all prompts (same length: no padding needed)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    model.generate(ids[:1, :16], max_new_tokens=2, **kw)  # warm-up
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kw)
    wall = time.perf_counter() - t0
    n_out = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"wall_s": wall, "output_tok_s": n_out / wall, "ttft_mean_s": ttft}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = build_benchmark_model()
    rows = []
    for n in (1, args.batch):
        prompts = random_prompts(n, args.prompt_len, CONFIG["vocab_size"], seed=n)
        ours = run_lmserve(model_dir, prompts, args.output_len)
        hf = run_hf(model_dir, prompts, args.output_len)
        rows.append(
            {
                "requests": n,
                "lmserve": ours,
                "hf": hf,
                "ratio_tok_s": ours["output_tok_s"] / hf["output_tok_s"],
            }
        )
    print(f"\nprompt {args.prompt_len}, output {args.output_len}, fp32, {args.threads} threads")
    header = ("requests", "lmserve tok/s", "HF tok/s", "ratio", "lmserve TTFT ms", "HF TTFT ms")
    print(" | ".join(f"{h:>{w}}" for h, w in zip(header, (8, 13, 9, 6, 15, 10), strict=True)))
    for r in rows:
        print(
            f"{r['requests']:>8} | {r['lmserve']['output_tok_s']:>13.1f} | {r['hf']['output_tok_s']:>9.1f} | "
            f"{r['ratio_tok_s']:>5.2f}x | {1000 * r['lmserve']['ttft_mean_s']:>15.0f} | "
            f"{1000 * r['hf']['ttft_mean_s']:>10.0f}"
        )
    write_result(args.out, "offline", args, {"rows": rows})


if __name__ == "__main__":
    main()
