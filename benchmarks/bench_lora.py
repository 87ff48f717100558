"""Multi-LoRA cost on the benchmark model (issue #35's closing note), in one run.

    python benchmarks/bench_lora.py [--output-len 128] [--prompt-len 64] [--streams 32] [--adapters 8] [--rank 16]
                                    [--threads N] [--quick]

Rank-`--rank` adapters on all seven projections (q/k/v/o/gate/up/down, random A and B, written in PEFT's format
without PEFT). Offline greedy decode tok/s (EOS ignored) for:

    single stream   an adapter vs the base (LoRA disabled)                               target >= 0.85x
    many streams    --streams requests over --adapters adapters vs as many base requests  target >= 0.80x
    unused          LoRA enabled, no request with an adapter, vs LoRA disabled (1 stream
                    and --streams streams)                                                target >= 0.98x
    merged          one adapter merged into the base weights, 1 stream: what the batched path costs over none

Prints a table and writes benchmarks/results/lora-<timestamp>.json (the machine's CPU flags included), with the
run's wall time. The full sizes are the issue's (32 streams over 8 rank-16 adapters); --quick is a smoke run of
every comparison at tiny sizes (4 output tokens, 4 streams over 2 adapters) that must finish in 4 minutes on a
quiet 2-core machine, the benchmark model's one-time build included: its ratios are noise, not results.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from benchmark_model import CONFIG, add_size_args, build_benchmark_model, random_prompts, resolve_size_args
from machine import write_result

FULL = {"output_len": 128, "prompt_len": 64, "streams": 32, "adapters": 8, "rank": 16}
QUICK = {"output_len": 4, "prompt_len": 8, "streams": 4, "adapters": 2, "rank": 16}
QUICK_BUDGET_S = 240.0  # --quick on a quiet 2-core machine
TARGETS = {"single stream": 0.85, "many streams": 0.80, "unused, 1 stream": 0.98, "unused, many streams": 0.98}
MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def module_shapes() -> dict[str, tuple[int, int]]:
    """PEFT module name → (out_features, in_features) of the benchmark model."""
    h, inter = CONFIG["hidden_size"], CONFIG["intermediate_size"]
    head_dim = h // CONFIG["num_attention_heads"]
    kv = CONFIG["num_key_value_heads"] * head_dim
    return {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}  # fmt: skip


def write_adapter(out_dir: Path, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A PEFT LoRA directory (lora_alpha = 2 r) with random A and B; returns its tensors."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(CONFIG["num_hidden_layers"]):
        for block, names in MODULES.items():
            for name in names:
                out_f, in_f = module_shapes()[name]
                prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * in_f**-0.5
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.01
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
              "target_modules": [n for names in MODULES.values() for n in names], "task_type": "CAUSAL_LM"}  # fmt: skip
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    return tensors


def write_merged(base_dir: Path, out_dir: Path, tensors: dict[str, torch.Tensor], scaling: float) -> Path:
    """The base with one adapter merged into its weights (W + scaling · B A)."""
    from safetensors.torch import load_file, save_file

    if out_dir.exists():
        shutil.rmtree(out_dir)
    shutil.copytree(base_dir, out_dir)
    weights = load_file(str(base_dir / "model.safetensors"))
    for key in list(weights):
        prefix = "base_model.model." + key.removesuffix(".weight")
        a, b = tensors.get(prefix + ".lora_A.weight"), tensors.get(prefix + ".lora_B.weight")
        if a is not None:
            weights[key] = (weights[key].float() + scaling * (b @ a)).contiguous()
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def decode_tok_s(llm, prompts: list[list[int]], output_len: int, loras: list | None = None) -> float:
    """Output tokens per second of greedy generation (EOS ignored), after an untimed warm-up of the same mix."""
    from lmserve import SamplingParams

    loras = loras or [None] * len(prompts)
    llm.generate([p[:8] for p in prompts], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=loras)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == len(prompts) * output_len, "every request must produce exactly output_len tokens"
    return n_out / wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_args(ap, FULL, QUICK)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)
    resolve_size_args(ap, args, FULL, QUICK)
    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    from lmserve import LLM, LoRARequest

    base = build_benchmark_model()
    root = Path(__file__).resolve().parent / ".cache" / f"lora-r{args.rank}"
    loras, tensors0 = [], None
    for i in range(args.adapters):
        path = root / f"adapter{i}"
        t = write_adapter(path, args.rank, seed=i)
        tensors0 = tensors0 if tensors0 is not None else t
        loras.append(LoRARequest(f"a{i}", i + 1, str(path)))
    merged = write_merged(base, root / "merged", tensors0, scaling=2.0)

    one = random_prompts(1, args.prompt_len, CONFIG["vocab_size"], seed=1)
    many = random_prompts(args.streams, args.prompt_len, CONFIG["vocab_size"], seed=2)
    spread = [loras[i % len(loras)] for i in range(args.streams)]
    max_len = args.prompt_len + args.output_len + 16
    blocks = (args.streams + 1) * -(-max_len // 16) + 16
    common = dict(num_kv_blocks=blocks, max_num_seqs=args.streams, max_model_len=max_len, enable_prefix_caching=False)

    tok_s: dict[str, float] = {}
    plain = LLM(str(base), **common)
    tok_s["base, 1 stream"] = decode_tok_s(plain, one, args.output_len)
    tok_s["base, many streams"] = decode_tok_s(plain, many, args.output_len)
    del plain
    lora_llm = LLM(str(base), enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, **common)
    tok_s["unused, 1 stream"] = decode_tok_s(lora_llm, one, args.output_len)
    tok_s["unused, many streams"] = decode_tok_s(lora_llm, many, args.output_len)
    tok_s["adapter, 1 stream"] = decode_tok_s(lora_llm, one, args.output_len, [loras[0]])
    tok_s["adapters, many streams"] = decode_tok_s(lora_llm, many, args.output_len, spread)
    del lora_llm
    merged_llm = LLM(str(merged), **common)
    tok_s["merged, 1 stream"] = decode_tok_s(merged_llm, one, args.output_len)
    del merged_llm

    ratios = {
        "single stream": ("adapter, 1 stream", "base, 1 stream"),
        "many streams": ("adapters, many streams", "base, many streams"),
        "unused, 1 stream": ("unused, 1 stream", "base, 1 stream"),
        "unused, many streams": ("unused, many streams", "base, many streams"),
        "adapter vs merged, 1 stream": ("adapter, 1 stream", "merged, 1 stream"),
    }
    rows = []
    for name, (num, den) in ratios.items():
        target = TARGETS.get(name)
        rows.append({"comparison": name, "tok_s": tok_s[num], "reference_tok_s": tok_s[den],
                     "ratio": tok_s[num] / tok_s[den], "target": target})  # fmt: skip
    print(
        f"\nbenchmark model, rank-{args.rank} adapters on all projections, prompt {args.prompt_len}, output "
        f"{args.output_len}, many = {args.streams} streams over {args.adapters} adapters, {args.threads} threads"
    )
    header = ("comparison", "tok/s", "reference tok/s", "ratio", "target")
    widths = (28, 9, 15, 6, 6)
    print(" | ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
    for r in rows:
        cells = (r["comparison"], f"{r['tok_s']:.1f}", f"{r['reference_tok_s']:.1f}", f"{r['ratio']:.2f}",
                 "-" if r["target"] is None else f"{r['target']:.2f}")  # fmt: skip
        print(" | ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    wall_s = time.perf_counter() - start
    budget = f" (--quick budget on a quiet 2-core machine: {QUICK_BUDGET_S:.0f} s)" if args.quick else ""
    print(f"wall time {wall_s:.0f} s{budget}")
    write_result(args.out, "lora", args, {"tok_s": tok_s, "rows": rows, "wall_s": wall_s},
                 "-quick" if args.quick else "")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
