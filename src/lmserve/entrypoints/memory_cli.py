"""`lmserve memory`: how much memory a model's weights and KV cache need, and how many requests
fit in a budget. Pure arithmetic on the model config; needs no GPU and no torch."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from lmserve.memory.ledger import (
    DTYPE_BYTES,
    ModelShape,
    dtype_bytes,
    format_bytes,
    load_model_shape,
    parse_bytes,
)
from lmserve.memory.presets import PRESETS, get_preset, preset_names
from lmserve.memory.report import memory_report

KV_DTYPES = ("fp32", "bf16", "fp16", "fp8_e4m3", "int8")


def add_memory_parser(subparsers: Any) -> None:
    """Add the ``memory`` subcommand to an argparse subparsers object (``func=run_memory``)."""
    p = subparsers.add_parser(
        "memory",
        help="KV-cache and weight memory ledger for a model",
        description=(
            "Weights, KV cache per token/request/batch, and how many requests fit in a memory "
            "budget. Sizes accept KiB/MiB/GiB (binary), KB/MB/GB (decimal); a bare K/M/G means "
            "KiB/MiB/GiB. --memory is per device; with --tp the model is split across devices."
        ),
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="PATH", help="model directory containing config.json, or a .gguf file")
    src.add_argument("--config", metavar="FILE", help="path to an HF config.json")
    src.add_argument("--preset", metavar="NAME", help=f"built-in model: {', '.join(preset_names())}")
    p.add_argument("--list-presets", action="store_true", help="list the built-in presets and exit")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per request (default 4096)")
    p.add_argument("--batch", type=int, default=1, help="concurrent requests (default 1)")
    p.add_argument(
        "--kv-dtype", default="bf16", help=f"KV cache dtype: {', '.join(KV_DTYPES)} (default bf16)"
    )
    p.add_argument(
        "--weight-dtype",
        default=None,
        help="weight dtype in memory (default bf16; fp32 for a GGUF: its Q8_0/Q4_0/Q4_1 projections stay as in "
        "the file, the rest is dequantized to fp32)",
    )
    p.add_argument(
        "--quantization",
        choices=["int8", "int4", "none"],
        default=None,
        help="projections quantized (scales included); the rest stays at --weight-dtype. Default: a "
        "checkpoint's own (`lmserve quantize`, a GGUF file's block-32 tensors), else none",
    )
    p.add_argument("--quantization-group-size", type=int, default=32, help="int4: inputs per scale (default 32)")
    p.add_argument(
        "--int4-compute",
        choices=["w4a8", "weight-only"],
        default="w4a8",
        help="as the engine's flag (default w4a8): a GGUF file's Q4_K / Q5_K projections are then held as W4A8 "
        "panels (a float16 scale and min per 32 weights: 20 / 24 bytes per 32 against the file's 18 / 22)",
    )
    p.add_argument("--memory", default=None, help="memory budget per device, e.g. 80GiB or 80GB")
    p.add_argument("--reserve", default="0", help="memory kept aside per device (default 0)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument(
        "--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
        help="tensor-parallel size (default 1): weights and KV per rank, as `serve --tensor-parallel-size` sizes them",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--kv-cache-disk-gib", type=float, default=None,
                   help="the prefix cache's disk tier: the blocks and prompts this many GiB keeps")  # fmt: skip
    p.add_argument(
        "--disaggregation", default=None, metavar="NPmD",
        help="prefill/decode disaggregation (1P1D, 2P1D, ...): each role's cores, weights and KV pool, the budget "
        "split over the cores, and the transfer buffer",
    )  # fmt: skip
    p.add_argument(
        "--enable-lora", action="store_true",
        help="count the LoRA compute slots (lmserve serve --enable-lora): taken from the budget before the KV",
    )  # fmt: skip
    p.add_argument("--max-loras", type=int, default=1, help="with --enable-lora: compute slots (default 1)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="with --enable-lora: largest rank (default 16)")
    p.add_argument(
        "--lora-dtype", default=None,
        help="with --enable-lora: the slots' dtype, the engine's compute dtype (default: --weight-dtype)",
    )  # fmt: skip
    p.set_defaults(func=run_memory)


def _error(message: str) -> int:
    print(f"lmserve memory: error: {message}", file=sys.stderr)
    return 2


def _resolve_shape(args: argparse.Namespace) -> tuple[ModelShape, str]:
    chosen = [
        (flag, value)
        for flag, value in (
            ("--model", getattr(args, "model", None)),
            ("--config", getattr(args, "config", None)),
            ("--preset", getattr(args, "preset", None)),
        )
        if value
    ]
    if not chosen:
        raise ValueError("give one of --model DIR, --config FILE or --preset NAME")
    if len(chosen) > 1:
        raise ValueError(
            f"give only one of --model, --config, --preset (got {', '.join(f for f, _ in chosen)})"
        )
    flag, value = chosen[0]
    if flag == "--preset":
        preset = get_preset(value)
        return preset.shape(), preset.name
    if flag == "--model" and not Path(value).exists():
        from lmserve.checkpoint.hub import is_repo_id, resolve_model_path

        if is_repo_id(value):  # a Hub id: its config.json alone, through the HF cache
            return load_model_shape(resolve_model_path(value, patterns=("config.json",))), str(value)
    return load_model_shape(value), str(value)


def _list_presets() -> str:
    lines = []
    for name in preset_names():
        s = PRESETS[name].shape()
        lines.append(
            f"{name:<15} {PRESETS[name].hf_id:<38} {s.num_layers} layers, hidden {s.hidden_size}, "
            f"{s.num_attention_heads}/{s.num_kv_heads} heads/KV heads"
        )
    return "\n".join(lines)


def run_memory(args: argparse.Namespace) -> int:
    """Print the memory report for ``args``; 0 on success, 2 (with a message) on bad input."""
    if getattr(args, "list_presets", False):
        print(_list_presets())
        return 0
    try:
        shape, name = _resolve_shape(args)
        kv_dtype = str(getattr(args, "kv_dtype", "bf16"))
        if kv_dtype.strip().lower() not in DTYPE_BYTES:
            raise ValueError(f"--kv-dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
        gguf_file = _gguf_file(args)
        weight_dtype = str(getattr(args, "weight_dtype", None) or ("fp32" if gguf_file else "bf16"))
        try:
            dtype_bytes(weight_dtype)
        except ValueError as e:
            raise ValueError(f"--weight-dtype: {e}") from None
        memory = getattr(args, "memory", None)
        memory_bytes = None
        if memory is not None:
            memory_bytes = _bytes_arg("--memory", memory)
            if memory_bytes <= 0:
                raise ValueError(f"--memory must be positive, got {memory!r}")
        reserve_bytes = _bytes_arg("--reserve", getattr(args, "reserve", 0) or 0)
        ints = {}
        for flag, attr, default in (
            ("--seq-len", "seq_len", 4096),
            ("--batch", "batch", 1),
            ("--block-size", "block_size", 16),
            ("--tp", "tp", 1),
        ):
            value = getattr(args, attr, default)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")
            ints[attr] = value
        if memory_bytes is not None and reserve_bytes > memory_bytes:
            raise ValueError(f"--reserve ({reserve_bytes:,} B) is larger than --memory ({memory_bytes:,} B)")
        quantization, group_size = _quantization(args)
        lora: dict[str, Any] = {}
        if getattr(args, "enable_lora", False):
            for flag, attr in (("--max-loras", "max_loras"), ("--max-lora-rank", "max_lora_rank")):
                value = getattr(args, attr, 1 if attr == "max_loras" else 16)
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{flag} must be a positive integer, got {value!r}")
                lora[attr] = value
            lora_dtype = getattr(args, "lora_dtype", None)
            if lora_dtype is not None:
                try:
                    dtype_bytes(lora_dtype)
                except ValueError as e:
                    raise ValueError(f"--lora-dtype: {e}") from None
            lora["lora_dtype"] = lora_dtype
        exact = None
        keep = getattr(args, "quantization", None) is None and getattr(args, "tp", 1) == 1
        if gguf_file is not None and keep and _keeps_gguf_blocks(gguf_file, weight_dtype):
            from lmserve.checkpoint.gguf import GGUFCheckpoint, resident_weight_bytes

            panels = getattr(args, "int4_compute", "w4a8") == "w4a8"
            exact, _ = resident_weight_bytes(GGUFCheckpoint(gguf_file), dtype_bytes(weight_dtype), True, panels)
            quantization = "gguf"
        disk_gib = getattr(args, "kv_cache_disk_gib", None)
        if disk_gib is not None and not (isinstance(disk_gib, float | int) and 0 < disk_gib < math.inf):
            raise ValueError(f"--kv-cache-disk-gib must be a positive number of GiB, got {disk_gib!r}")
        report = memory_report(
            shape,
            kv_disk_bytes=None if disk_gib is None else int(disk_gib * 2**30),
            quantization=quantization,
            quantization_group_size=group_size,
            exact_weight_bytes=exact,
            kv_dtype=kv_dtype,
            weight_dtype=weight_dtype,
            memory_bytes=memory_bytes,
            reserve_bytes=reserve_bytes,
            name=name,
            **ints,
            **lora,
        )
        if gguf_file is not None:
            panels = getattr(args, "int4_compute", "w4a8") == "w4a8"
            notes = gguf_notes(gguf_file, weight_dtype, keep=quantization == "gguf", kquant_panels=panels)
            report = dataclasses.replace(report, notes=report.notes + notes)
        pd = None
        if getattr(args, "disaggregation", None):
            import re

            from lmserve.memory.disaggregation import disaggregated_memory

            m = re.fullmatch(r"(\d+)P(\d+)D", args.disaggregation.strip(), re.IGNORECASE)
            if m is None:
                raise ValueError(f"--disaggregation must look like 1P1D (NPmD), got {args.disaggregation!r}")
            pd = disaggregated_memory(report, int(m.group(1)), int(m.group(2)))
    except (ValueError, OSError) as e:
        return _error(str(e))

    if getattr(args, "json", False):
        print(json.dumps({**report.to_dict(), **({"disaggregation": pd.to_dict()} if pd else {})}, indent=2))
    else:
        print(report.format_table())
        if pd is not None:
            print(pd.format_table())
    return 0


def _gguf_file(args: argparse.Namespace) -> Path | None:
    from lmserve.checkpoint.gguf import find_gguf_file

    model = getattr(args, "model", None)
    return find_gguf_file(model) if model else None


def _keeps_gguf_blocks(gguf_file: Path, weight_dtype: str) -> bool:
    """Whether the engine keeps this GGUF's block-32 / K-quant tensors as they are (float32 weights, no
    --quantization)."""
    from lmserve.checkpoint.gguf import KEPT_TYPES, GGUFCheckpoint

    return dtype_bytes(weight_dtype) == 4 and bool(set(GGUFCheckpoint(gguf_file).bytes_by_type()) & set(KEPT_TYPES))


def gguf_notes(gguf_file: Path, weight_dtype: str, keep: bool = False, kquant_panels: bool = False) -> tuple[str, ...]:
    """What the GGUF file holds per tensor type, and what its weights take once lmserve has loaded them
    (`keep`: its Q8_0 / Q4_0 / Q4_1 projections and LM head, and its K-quant ones and K-quant token embedding,
    stay as they are, the rest is dequantized; kquant_panels: the Q4_K / Q5_K projections are held as W4A8
    panels)."""
    from lmserve.checkpoint.gguf import (
        BLOCK32_TYPES,
        KQUANT_TYPES,
        UNQUANTIZED_TYPES,
        GGUFCheckpoint,
        resident_weight_bytes,
    )

    ckpt = GGUFCheckpoint(gguf_file)
    by_type = ckpt.bytes_by_type()
    file_bytes = sum(b for _, b, _ in by_type.values())
    resident, kept = resident_weight_bytes(ckpt, dtype_bytes(weight_dtype), keep, kquant_panels)
    as_file = resident_weight_bytes(ckpt, dtype_bytes(weight_dtype), keep)[1] if kquant_panels else kept
    parts = ", ".join(f"{n} {t} tensors {format_bytes(b)}" for t, (n, b, _) in sorted(by_type.items()))
    quantized = sorted(t for t in by_type if t not in UNQUANTIZED_TYPES)
    notes = [f"GGUF file: {format_bytes(file_bytes)} of tensors ({parts})"]
    if keep:
        kinds = [
            k for k, types in (("block-32", BLOCK32_TYPES), ("K-quant", KQUANT_TYPES)) if set(by_type) & set(types)
        ]
        what = "projections, LM head, token embedding" if "K-quant" in kinds else "projections, LM head"
        notes.append(
            f"lmserve keeps {format_bytes(as_file)} of {' and '.join(kinds)} tensors as they are ({what}) and "
            f"dequantizes the rest to {weight_dtype}: the weights take {format_bytes(resident)} in memory "
            f"({resident / file_bytes:.1f}x the file; --quantization none dequantizes everything)"
        )
        if kept != as_file:
            notes.append(
                f"its Q4_K / Q5_K projections are held as W4A8 panels (a float16 scale and min per 32 weights): "
                f"{format_bytes(kept - as_file)} more than in the file (--int4-compute weight-only keeps the blocks)"
            )
    elif quantized:
        notes.append(
            f"lmserve dequantizes {', '.join(quantized)} at load: the weights take {format_bytes(resident)} in memory "
            f"at {weight_dtype} ({resident / file_bytes:.1f}x the file)"
        )
    else:
        notes.append(f"the weights take {format_bytes(resident)} in memory at {weight_dtype}")
    return tuple(notes)


def _bytes_arg(flag: str, value: str | int) -> int:
    try:
        return parse_bytes(value)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def _quantization(args: argparse.Namespace) -> tuple[str | None, int]:
    """--quantization, else the one a `lmserve quantize` checkpoint given as --model was written with."""
    method = getattr(args, "quantization", None)
    group = getattr(args, "quantization_group_size", 32)
    if method == "none":
        return None, group
    if method is None and getattr(args, "model", None):
        from lmserve.config.engine import checkpoint_quantization

        saved = checkpoint_quantization(args.model)
        if saved is not None:
            return saved.method, saved.group_size or 32
    return method, group
