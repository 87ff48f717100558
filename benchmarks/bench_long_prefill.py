"""TTFT of one long prompt on the dense, hybrid and MoE benchmark models (benchmarks/benchmark_model.py, built with
enough positions), in-process, one at a time, alternating the models each repeat; prints a table (each TTFT and its
ratio to the dense model's) and writes benchmarks/results/long-prefill-<timestamp>.json with the machine.

    python benchmarks/bench_long_prefill.py [--prompt-len 4096] [--repeats 2] [--families dense,hybrid]
        [--quantization int8|int4] [--threads 2] [--model FAMILY=DIR ...] [--out DIR] [--quick]

A hybrid model's linear layers prefill with the chunked delta rule (linear in the prompt), its full-attention layers
and a dense model's attention grow with its square: this is where the two part.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchmark_model import (  # noqa: E402
    CONFIG,
    FAMILIES,
    build_benchmark_model,
    family_dir,
    random_prompts,
)
from machine import write_result  # noqa: E402


def model_for(family: str, prompt_len: int) -> Path:
    """The family's benchmark model, or its variant with enough positions (its own directory) for prompt_len."""
    if prompt_len < CONFIG["max_position_embeddings"]:
        return build_benchmark_model(family=family)
    positions = 1 << prompt_len.bit_length()
    base = family_dir(family)
    out = base.with_name(f"{base.name}-{positions // 1024}k")
    return build_benchmark_model(out, overrides={"max_position_embeddings": positions}, family=family)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--families", default="dense,hybrid", help="comma-separated, from " + ",".join(FAMILIES))
    ap.add_argument("--quantization", choices=["int8", "int4"], default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", action="append", default=[], metavar="FAMILY=DIR", help="a model instead of one built")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--quick", action="store_true", help="a 64-token prompt, one repeat")
    args = ap.parse_args()
    if args.quick:
        args.prompt_len, args.repeats = 64, 1
    if args.prompt_len < 2 or args.repeats < 1:
        ap.error("--prompt-len must be >= 2 and --repeats >= 1")
    families = [f for f in args.families.split(",") if f]
    given = dict(m.split("=", 1) for m in args.model)
    unknown = sorted(set(families) - set(FAMILIES) | set(given) - set(families))
    if unknown or "dense" not in families:
        ap.error(f"--families must include dense and name only {sorted(FAMILIES)}; --model only those (got {unknown})")

    import torch

    from lmserve import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    blocks = args.prompt_len // 16 + 8
    llms = {}
    for fam in families:
        path = Path(given[fam]) if fam in given else model_for(fam, args.prompt_len)
        print(f"{fam}: {path}", flush=True)
        llms[fam] = LLM(str(path), num_kv_blocks=blocks, quantization=args.quantization, enable_prefix_caching=False,
                        max_model_len=args.prompt_len + 8)  # fmt: skip
        llms[fam].generate([[5] * 16], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    ttft: dict[str, list[float]] = {f: [] for f in families}
    for r in range(args.repeats):
        for fam, llm in llms.items():
            vocab = len(llm.get_tokenizer())  # (ids the tokenizer knows: within every model's vocabulary)
            (prompt,) = random_prompts(1, args.prompt_len, vocab, seed=r)
            t0 = time.perf_counter()
            llm.generate([prompt], one, use_tqdm=False)
            ttft[fam].append(time.perf_counter() - t0)
            print(f"  repeat {r + 1} {fam}: {ttft[fam][-1]:.2f} s", flush=True)
    med = {f: statistics.median(v) for f, v in ttft.items()}
    print(f"\nTTFT of a {args.prompt_len}-token prompt, {args.threads} threads, "
          f"{args.quantization or 'float32'} weights, median of {args.repeats}")  # fmt: skip
    print(f"{'model':<8} | {'TTFT s':>8} | {'prefill tok/s':>13} | vs dense")
    rows = {}
    for fam in families:
        rows[fam] = {"ttft_s": med[fam], "samples_s": ttft[fam], "prefill_tok_s": args.prompt_len / med[fam],
                     "ratio_to_dense": med[fam] / med["dense"]}  # fmt: skip
        print(f"{fam:<8} | {med[fam]:8.2f} | {args.prompt_len / med[fam]:13.1f} | {med[fam] / med['dense']:.2f}x")
    write_result(args.out, "long_prefill", args, {"rows": rows}, "-quick" if args.quick else "")


if __name__ == "__main__":
    main()
