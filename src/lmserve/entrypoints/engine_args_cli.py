"""Engine arguments as command-line flags, shared by `generate`, `serve` and `bench offline`."""

from __future__ import annotations

import argparse
from typing import Any


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF model directory (default: the bundled model)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument(
        "--weight-dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="bfloat16: keep the linear weights in bf16 and compute in fp32 on the CPU (faster decode, "
        "weights rounded to bf16); default: the model dtype",
    )
    g.add_argument("--device", default="cpu", help="cpu or cuda")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory-gib", type=float, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    g.add_argument("--scheduling-policy", default="continuous", choices=["continuous", "static"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding as JSON, vLLM\'s keys: {"method": "draft_model", "model": DIR, '
        '"num_speculative_tokens": 4} or {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5}; '
        'also "disable_by_batch_size" (default 8)',
    )


ENGINE_ARG_NAMES = (
    "tokenizer",
    "dtype",
    "weight_dtype",
    "device",
    "block_size",
    "num_kv_blocks",
    "kv_cache_memory_gib",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "scheduling_policy",
    "seed",
    "speculative_config",
)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in ENGINE_ARG_NAMES}


def model_path(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from lmserve.default_model import default_model_path

    return default_model_path()
