"""Engine arguments as command-line flags, shared by `generate`, `serve` and `bench offline`."""

from __future__ import annotations

import argparse
from typing import Any


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="HF model directory, or a Hub id (org/name) fetched into the HF cache (default: the bundled model)",
    )
    g.add_argument("--revision", default=None, help="Hub branch, tag or commit of a Hub-id model (default: main)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory or Hub id (default: the model's)")
    g.add_argument(
        "--generation-config",
        default="auto",
        choices=["auto", "vllm"],
        help="auto: the model's generation_config.json supplies sampling defaults (temperature, top_p, top_k, "
        "repetition_penalty) a request leaves unset; vllm: ignore it, lmserve's own defaults apply",
    )
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument(
        "--weight-dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="bfloat16: keep the linear weights in bf16 and compute in fp32 on the CPU (faster decode, "
        "weights rounded to bf16); default: the model dtype",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3"],
        help="dtype of the paged KV cache: auto = the model dtype; int8 / fp8_e4m3 store a float32 scale per "
        "(token, KV head) and fit ~4x the tokens of float32 in the same memory, bfloat16 ~2x",
    )
    g.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4", "none"],
        help="int8: W8A8 (int8 weights per output channel, int8 activations per token); int4: 4-bit weights with "
        "group-wise scales (see --int4-compute). CPU, float32 compute; embeddings stay float32. A checkpoint written "
        "by `lmserve quantize` needs no flag; a GGUF file's Q8_0/Q4_0/Q4_1 tensors run as they are unless "
        "none (dequantized to float32 at load)",
    )
    g.add_argument("--quantization-group-size", type=int, default=32, help="int4: inputs per scale (default 32)")
    g.add_argument(
        "--int4-compute",
        default="w4a8",
        choices=["w4a8", "weight-only"],
        help="int4 and GGUF Q4_0/Q4_1 weights: w4a8 (default) quantizes the activations to int8 per block of 32 "
        "and runs integer dot products (VNNI / AVX2, chosen by the CPU at run time; llama.cpp's Q4_0 x Q8_0); "
        "weight-only keeps them float32 (more accurate, slower)",
    )
    g.add_argument("--device", default="cpu", help="cpu or cuda")
    if "--tensor-parallel-size" not in parser._option_string_actions:  # (simulate has its own: a step-time factor)
        _add_tensor_parallel(parser, g)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory-gib", type=float, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument(
        "--kv-cache-disk-dir", default=None,
        help="the prefix cache's disk tier: KV blocks evicted from RAM are saved in DIR and read back when a prompt "
        "returns (also after a restart); keyed by the model, dtypes, block size and LoRA adapter",
    )  # fmt: skip
    g.add_argument(
        "--kv-cache-disk-gib",
        type=float,
        default=None,
        help="the disk tier's size in GiB, least recently used blocks deleted past it (default 16)",
    )
    g.add_argument(
        "--state-snapshot-memory-gib", type=float, default=None,
        help="a hybrid (linear-attention) model's prefix cache: GiB of recurrent-state snapshots kept at cached block "
        "boundaries (default 1/8 of the KV budget; 0 turns prefix caching off for it)",
    )  # fmt: skip
    g.add_argument(
        "--state-cache-dtype", default="float32", choices=["float32", "bfloat16"],
        help="a hybrid (linear-attention) model's recurrent state and its snapshots: bfloat16 halves their bytes "
        "(the decode step then runs on torch, not the C kernels)",
    )  # fmt: skip
    g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    g.add_argument(
        "--no-in-step-prefix-sharing",
        dest="share_prefix_in_step",
        action="store_false",
        help="requests arriving in one step compute their shared prefix each (for A/B measurements)",
    )
    g.add_argument("--scheduling-policy", default="continuous", choices=["continuous", "static"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding as JSON, vLLM\'s keys: {"method": "draft_model", "model": DIR, '
        '"num_speculative_tokens": 4} or {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5}; '
        'also "disable_by_batch_size" (default 8)',
    )
    g.add_argument(
        "--structured-outputs-allow-additional-properties",
        action="store_true",
        help="JSON schemas (response_format, tools, structured_outputs): an object schema that declares properties "
        "but says nothing of additionalProperties admits further keys, JSON Schema's default. Without this flag such "
        "an object closes after its declared properties, as xgrammar (vLLM's default backend) does; an explicit "
        "additionalProperties (true, or a schema) is honoured either way",
    )
    g.add_argument(
        "--kv-transfer-config",
        default=None,
        help='prefill/decode disaggregation across servers, vLLM\'s keys as JSON: {"kv_connector": "lmserve", '
        '"kv_role": "kv_producer" | "kv_consumer"}, also kv_ip, kv_port (the producer\'s KV server), kv_lease_s '
        '(default 30), kv_load_failure_policy (fail | recompute), kv_transfer_timeout_s; put `lmserve router` in front',
    )

    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (per request) on the base model")
    g.add_argument("--max-loras", type=int, default=1, help="LoRA adapters one step can mix (compute slots; default 1)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted (default 16)")
    g.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept loaded in RAM (default: --max-loras)")
    g.add_argument(
        "--runner", choices=["auto", "generate", "pooling"], default="auto",
        help="generate: completions and chat; pooling: embeddings, /score and /rerank (POST /v1/embeddings, "
        "/api/embed); auto (default): pooling for an embedding checkpoint (sentence-transformers' modules.json, "
        "or an architecture without an LM head such as Qwen3Model), else generate",
    )  # fmt: skip
    g.add_argument(
        "--pooler-config", default=None,
        help='the pooling runner\'s settings over the checkpoint\'s, as JSON: {"pooling_type": "last" | "mean" | '
        '"cls", "normalize": true | false, "score_tokens": ["no", "yes"]} (score_tokens: a yes/no reranker such as '
        "Qwen3-Reranker, scored by p(the last token) among them at the prompt's end)",
    )  # fmt: skip


ENGINE_ARG_NAMES = (
    "tokenizer",
    "dtype",
    "weight_dtype",
    "kv_cache_dtype",
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
    "revision",
    "generation_config",
    "share_prefix_in_step",
    "quantization",
    "quantization_group_size",
    "int4_compute",
    "speculative_config",
    "structured_outputs_allow_additional_properties",
    "kv_transfer_config",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
    "runner",
    "pooler_config",
    "kv_cache_disk_dir",
    "kv_cache_disk_gib",
    "state_snapshot_memory_gib",
    "state_cache_dtype",
)


def _add_tensor_parallel(parser: argparse.ArgumentParser, g: Any) -> None:
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model across this many processes (Megatron-style, torch.distributed: gloo on the CPU, NCCL "
        "on CUDA); with serve, --num-threads is the group's, divided between its ranks, each pinned to its own CPUs",
    )
    parser.set_defaults(engine_tensor_parallel=True)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = {name: getattr(args, name) for name in ENGINE_ARG_NAMES}
    if getattr(args, "engine_tensor_parallel", False):
        kwargs["tensor_parallel_size"] = args.tensor_parallel_size
    return kwargs


def model_path(args: argparse.Namespace) -> str:
    """--model, or the positional model of `lmserve serve MODEL` (as `vllm serve`); both given must agree."""
    positional = getattr(args, "model_tag", None)
    if positional and args.model and positional != args.model:
        raise ValueError(f"model given twice: positional {positional!r} and --model {args.model!r}")
    if positional:
        args.model = positional
    if args.model:
        return args.model
    from lmserve.default_model import default_model_path

    return default_model_path()
