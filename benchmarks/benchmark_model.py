"""The benchmark models of docs/performance.md: a SmolLM-135M-shaped Llama ("dense"), and shaped like it a
Qwen3-MoE ("moe": 32 experts of 384, top-4) and a Qwen3.5 hybrid ("hybrid": gated-delta linear attention on 3 of
4 layers); random fp32 weights, a byte-level BPE tokenizer trained locally on Python's stdlib sources. Built once,
cached on disk; `python benchmarks/benchmark_model.py --family moe` prints its directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

DEFAULT_DIR = Path(__file__).resolve().parent / ".cache" / "smollm-135m-shaped"

CONFIG = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
    bos_token_id=None,
    eos_token_id=None,  # random weights: never stop early; output length is forced anyway
)


# the other families, shaped like CONFIG (hidden 576, heads of 64): what each changes
FAMILIES: dict[str, dict] = {
    "dense": {},
    "moe": dict(
        num_hidden_layers=24, intermediate_size=1536, moe_intermediate_size=384, num_experts=32,
        num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], head_dim=64,
    ),
    "hybrid": dict(
        num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
    ),
}  # fmt: skip


def family_dir(family: str) -> Path:
    if family not in FAMILIES:
        raise ValueError(f"--family must be one of {sorted(FAMILIES)}, got {family!r}")
    return DEFAULT_DIR if family == "dense" else DEFAULT_DIR.with_name(f"{DEFAULT_DIR.name}-{family}")


def _model_of(family: str, config: dict):
    import transformers

    if family == "moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**config))
    if family == "hybrid":
        config = {**config, "layer_types": config["layer_types"] * (config["num_hidden_layers"] // 4)}
        return transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**config))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))


def build_benchmark_model(out_dir: Path | None = None, overrides: dict | None = None, family: str = "dense") -> Path:
    """overrides: CONFIG keys changed (a variant of the benchmark model, in its own out_dir)."""
    out_dir = out_dir or family_dir(family)
    if (out_dir / "model.safetensors").is_file():
        return out_dir
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sys.modules["os"].__file__).parent
    files = sorted(stdlib.glob("*.py"))[:200]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8192,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((f.read_text(encoding="utf-8", errors="replace") for f in files), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(out_dir)
    torch.manual_seed(0)
    model = _model_of(family, {**CONFIG, **FAMILIES[family], **(overrides or {})})
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def random_prompts(num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Unique prompts of exactly `length` token ids (different prompts: no accidental prefix hits)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab_size, (length,), generator=g).tolist() for _ in range(num)]


def timed_generate(llm, prompts: list[list[int]], output_len: int) -> tuple[list, float, int]:
    """Greedy `output_len` tokens for every prompt (EOS ignored) after a short untimed warm-up: (outputs, wall
    seconds, output tokens). Asserts every request produced exactly output_len tokens."""
    import time

    from lmserve import SamplingParams

    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == len(prompts) * output_len, "every request must produce exactly output_len tokens"
    return outs, wall, n_out


def add_size_args(ap: argparse.ArgumentParser, full: dict[str, int], quick: dict[str, int]) -> None:
    """One integer flag per size key (--num-requests for num_requests, ...): unset, it takes `full`'s value, or
    `quick`'s with --quick (which this adds too); resolve them with resolve_size_args after parsing."""
    for k in full:
        flag, help_ = f"--{k.replace('_', '-')}", f"default {full[k]} (--quick {quick[k]})"
        ap.add_argument(flag, type=int, default=None, help=help_)
    ap.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run")


def resolve_size_args(
    ap: argparse.ArgumentParser, args: argparse.Namespace, full: dict[str, int], quick: dict[str, int]
) -> None:
    """Fill the unset size flags from `full` (or `quick`) and refuse any below 1 (an argparse error naming it)."""
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
        if getattr(args, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="build (once) a benchmark model and print its directory")
    ap.add_argument("--family", default="dense", choices=sorted(FAMILIES))
    print(build_benchmark_model(family=ap.parse_args().family))
