"""KV-cache memory ledger: how many bytes the weights and the KV cache take, and how many
requests fit in a memory budget.

Pure arithmetic (no torch), so the engine can size its block pool before it allocates
anything and `lmserve memory` can answer "will it fit?" without a GPU. The only I/O is
`load_model_shape`, which reads an HF ``config.json`` (or a GGUF file's metadata).

Conventions
-----------
* KV bytes per token = 2 (K and V) * layers * kv_heads * head_dim * dtype bytes; the 8-bit KV dtypes
  (int8, fp8) add a float32 scale per (token, KV head) for K and for V: 2 * layers * kv_heads * 4 bytes.
* Paged KV: a request holds whole blocks, ceil(seq_len / block_size) of them.
* Byte strings: ``KiB/MiB/GiB/TiB`` are powers of 1024, ``KB/MB/GB/TB`` powers of 1000, and a
  bare ``K/M/G/T`` (as in ``80G``) is binary, i.e. GiB, like Docker's ``--memory 80g``.
* Tensor parallel (``tp``): attention heads, KV heads, MLP columns and the vocabulary are split
  across ranks; norms are replicated. If ``num_kv_heads < tp`` each KV head is replicated on
  ``tp / num_kv_heads`` ranks, so every rank holds exactly one KV head (as vLLM does); this
  requires ``tp % num_kv_heads == 0``. The memory budget is per device (per rank).
* Sliding windows: when every layer slides (Mistral v0.1, Qwen2 with use_sliding_window over all layers) the
  engine frees the blocks that fall out of the window while a request runs, so a request holds at most
  ``kv_blocks_held`` blocks: the window plus one block of slack (per layer: min(len, window) + a block). When
  only some layers slide (Gemma 2/3 interleave global layers) every block stays (a block holds all layers'
  K/V) and the KV is counted in full; the report says which applies.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from lmserve.config import HEAD_LAYOUTS

__all__ = [
    "DTYPE_BYTES",
    "MemoryReport",
    "ModelShape",
    "dtype_bytes",
    "format_bytes",
    "kv_bytes_per_token",
    "kv_blocks_held",
    "kv_bytes_per_token_per_layer",
    "kv_cache_bytes_per_token",
    "kv_scale_bytes_per_token",
    "kv_heads_per_rank",
    "load_model_shape",
    "max_concurrent_requests",
    "max_num_kv_blocks",
    "memory_report",
    "model_shape_from_hf_config",
    "num_parameters",
    "num_parameters_per_rank",
    "parse_bytes",
    "projection_shapes_per_rank",
    "quantized_projection_bytes",
    "weight_bytes_per_rank",
]

DTYPE_BYTES: dict[str, float] = {
    "fp32": 4,
    "float32": 4,
    "float": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "float8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}


def dtype_bytes(name: str) -> float:
    """Bytes per element of a dtype name (case-insensitive; a ``torch.`` prefix is accepted,
    so an HF config's ``torch_dtype`` works)."""
    if not isinstance(name, str):
        raise ValueError(f"dtype must be a string, got {name!r}")
    key = name.strip().lower().removeprefix("torch.")
    try:
        return DTYPE_BYTES[key]
    except KeyError:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise ValueError(f"unknown dtype {name!r}; known dtypes: {known}") from None


# ---------------------------------------------------------------------------------------------
# Byte quantities
# ---------------------------------------------------------------------------------------------

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "kb": 10**3,
    "m": 2**20,
    "mib": 2**20,
    "mb": 10**6,
    "g": 2**30,
    "gib": 2**30,
    "gb": 10**9,
    "t": 2**40,
    "tib": 2**40,
    "tb": 10**12,
}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """Parse a byte quantity such as ``"80GiB"``, ``"80GB"``, ``"1.5GiB"``, ``"512KiB"`` or
    ``"100"`` (plain bytes) into an int.

    ``KiB/MiB/GiB/TiB`` are binary, ``KB/MB/GB/TB`` decimal, and a bare ``K/M/G/T`` is binary
    (``"80G"`` == ``"80GiB"``). Units are case-insensitive. Fractions of a byte are rounded down.
    """
    if isinstance(text, bool):
        raise ValueError(f"invalid byte quantity {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"invalid byte quantity {text!r}: must be >= 0")
        return text
    if not isinstance(text, str):
        raise ValueError(f"invalid byte quantity {text!r}: expected a string like '80GiB'")
    m = _BYTES_RE.match(text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"invalid byte quantity {text!r}: expected a number with an optional unit "
            "(B, KiB, MiB, GiB, TiB, KB, MB, GB, TB, or K/M/G/T meaning KiB/MiB/GiB/TiB)"
        )
    number, unit = m.groups()
    return math.floor(Fraction(number) * _UNITS[unit.lower()])


def format_bytes(n: int | float, *, binary: bool = True) -> str:
    """Human-readable size: ``format_bytes(2**31) == "2.00 GiB"``; ``binary=False`` gives
    decimal units (``"2.15 GB"``). Values under one unit print as whole bytes."""
    base = 1024 if binary else 1000
    units = ("KiB", "MiB", "GiB", "TiB", "PiB") if binary else ("KB", "MB", "GB", "TB", "PB")
    sign = "-" if n < 0 else ""
    value = abs(n)
    if value < base:
        return f"{sign}{value:g} B" if isinstance(value, float) else f"{sign}{value} B"
    scaled = value / base
    exponent = 0
    while scaled >= base and exponent < len(units) - 1:
        scaled /= base
        exponent += 1
    unit = units[exponent]
    return f"{sign}{scaled:.2f} {unit}"


# ---------------------------------------------------------------------------------------------
# Model shape
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a dense Llama-family decoder that decide its memory footprint."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2, Llama attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama attention_bias)
    mlp_bias: bool = False  # bias on gate/up/down (Llama mlp_bias)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    model_type: str = "llama"
    rope_theta: float | None = None
    max_position_embeddings: int | None = None
    sliding_window: int | None = None  # the largest window of the sliding layers
    num_sliding_layers: int = 0  # layers attending within sliding_window (0: all attend to everything)

    @property
    def kv_free_window(self) -> int | None:
        """The window outside which the engine frees KV blocks: only when every layer slides."""
        return self.sliding_window if self.num_sliding_layers == self.num_layers else None

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "intermediate_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def gqa_ratio(self) -> float:
        """Query heads per KV head: how many times smaller the KV cache is than with MHA."""
        return self.num_attention_heads / self.num_kv_heads


_REQUIRED_HF_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


def model_shape_from_hf_config(cfg: dict[str, Any]) -> ModelShape:
    """Build a ModelShape from an HF ``config.json`` dict (Llama, Mistral, Qwen2, Qwen3...).

    ``head_dim`` defaults to hidden_size / num_attention_heads and ``num_key_value_heads`` to
    num_attention_heads. A multimodal config's ``text_config`` is used when the top level has
    no layers. Mixture-of-experts configs are rejected (the parameter count would be wrong).
    """
    if not isinstance(cfg, dict):
        raise ValueError(f"config must be a JSON object, got {type(cfg).__name__}")
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    missing = [f for f in _REQUIRED_HF_FIELDS if cfg.get(f) is None]
    if missing:
        raise ValueError(f"config is missing required field(s): {', '.join(missing)}")
    for moe_field in ("num_local_experts", "num_experts", "n_routed_experts"):
        if cfg.get(moe_field):
            raise ValueError(
                f"config field {moe_field}={cfg[moe_field]!r}: mixture-of-experts models are not "
                "supported by the memory ledger"
            )

    def _int(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"config field {name} must be an integer, got {value!r}")
        return value

    hidden = _int("hidden_size", cfg["hidden_size"])
    heads = _int("num_attention_heads", cfg["num_attention_heads"])
    kv_heads = _int("num_key_value_heads", cfg.get("num_key_value_heads") or heads)
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if heads <= 0 or hidden % heads != 0:
            raise ValueError(
                f"config has no head_dim and hidden_size ({hidden}) is not divisible by "
                f"num_attention_heads ({heads})"
            )
        head_dim = hidden // heads
    model_type = str(cfg.get("model_type") or "llama")
    num_layers = _int("num_hidden_layers", cfg["num_hidden_layers"])
    sliding_window, num_sliding = _sliding_layers(cfg, num_layers)
    attention_bias = bool(cfg.get("attention_bias", False))
    max_pos = cfg.get("max_position_embeddings")
    rope_theta = cfg.get("rope_theta")
    return ModelShape(
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=_int("head_dim", head_dim),
        vocab_size=_int("vocab_size", cfg["vocab_size"]),
        intermediate_size=_int("intermediate_size", cfg["intermediate_size"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v bias (and no o bias); Llama's attention_bias covers all four.
        qkv_bias=attention_bias or model_type == "qwen2",
        o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=model_type.startswith("qwen3"),
        model_type=model_type,
        rope_theta=float(rope_theta) if rope_theta is not None else None,
        max_position_embeddings=int(max_pos) if max_pos is not None else None,
        sliding_window=sliding_window,
        num_sliding_layers=num_sliding,
    )


def _sliding_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int | None, int]:
    """(window, number of sliding layers) as the engine reads them (config.layer_sliding_windows); (None, 0)
    for architectures the engine does not know (the ledger still counts their KV, in full)."""
    from lmserve.config import layer_sliding_windows
    from lmserve.model.registry import resolve_architecture

    try:
        family = resolve_architecture(cfg.get("architectures"))
    except ValueError:
        return None, 0
    windows = [w for w in layer_sliding_windows(family, cfg, num_layers) if w]
    return (max(windows) if windows else None), len(windows)


def load_model_shape(path: str | Path) -> ModelShape:
    """Read an HF ``config.json`` (a file, or a model directory containing one), or a GGUF file's metadata."""
    from lmserve.model.gguf import GGUFCheckpoint, find_gguf_file  # numpy + gguf, no torch

    p = Path(path)
    gguf_file = find_gguf_file(p)
    if gguf_file is not None:
        try:
            return model_shape_from_hf_config(GGUFCheckpoint(gguf_file).hf_config())
        except ValueError as e:
            raise ValueError(f"{gguf_file}: {e}") from None
    if p.is_dir():
        config_file = p / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model directory {p} has no config.json")
    elif p.is_file():
        config_file = p
    else:
        raise ValueError(f"config not found: {p} (expected a model directory or a config.json file)")
    try:
        cfg = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file} is not valid JSON: {e}") from None
    try:
        return model_shape_from_hf_config(cfg)
    except ValueError as e:
        raise ValueError(f"{config_file}: {e}") from None


# ---------------------------------------------------------------------------------------------
# Counting
# ---------------------------------------------------------------------------------------------


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _positive_bytes(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"dtype_bytes must be a positive number, got {value!r}")
    return value


def kv_bytes_per_token_per_layer(num_kv_heads: int, head_dim: int, dtype_bytes: float) -> int:
    """K and V for one token in one layer: 2 * kv_heads * head_dim * bytes."""
    _positive("num_kv_heads", num_kv_heads)
    _positive("head_dim", head_dim)
    return math.ceil(2 * num_kv_heads * head_dim * _positive_bytes(dtype_bytes))


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float) -> int:
    """K and V for one token across all layers: 2 * layers * kv_heads * head_dim * bytes."""
    _positive("num_layers", num_layers)
    return num_layers * kv_bytes_per_token_per_layer(num_kv_heads, head_dim, dtype_bytes)


QUANTIZED_KV_DTYPES = frozenset({"int8", "fp8", "float8", "fp8_e4m3", "fp8_e5m2"})
KV_SCALE_BYTES = 4  # one float32 scale per (token, KV head) for K and one for V


def kv_scale_bytes_per_token(num_layers: int, num_kv_heads: int, kv_dtype: str) -> int:
    """Bytes of quantization scales per token across all layers: 2 * layers * kv_heads * 4 for the 8-bit
    KV dtypes (int8, fp8), 0 for the float ones (their values need no scale)."""
    _positive("num_layers", num_layers)
    _positive("num_kv_heads", num_kv_heads)
    dtype_bytes(kv_dtype)  # unknown names are an error here too
    if kv_dtype.strip().lower().removeprefix("torch.") not in QUANTIZED_KV_DTYPES:
        return 0
    return 2 * num_layers * num_kv_heads * KV_SCALE_BYTES


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """What one token costs in the paged KV pool stored as ``kv_dtype``: K and V values plus, for the
    8-bit dtypes, their scales. The engine sizes its pool with this."""
    values = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes(kv_dtype))
    return values + kv_scale_bytes_per_token(num_layers, num_kv_heads, kv_dtype)


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads one tensor-parallel rank stores: kv_heads / tp, or 1 (replicated) when there are
    fewer KV heads than ranks. Needs kv_heads % tp == 0 or tp % kv_heads == 0."""
    _positive("num_kv_heads", num_kv_heads)
    _positive("tp", tp)
    if num_kv_heads % tp == 0:
        return num_kv_heads // tp
    if tp % num_kv_heads == 0:
        return 1
    raise ValueError(f"tp ({tp}) must divide num_kv_heads ({num_kv_heads}) or be a multiple of it")


def _check_tp(shape: ModelShape, tp: int) -> None:
    _positive("tp", tp)
    if shape.num_attention_heads % tp != 0:
        raise ValueError(f"tp ({tp}) must divide num_attention_heads ({shape.num_attention_heads})")
    kv_heads_per_rank(shape.num_kv_heads, tp)


def num_parameters_per_rank(shape: ModelShape, tp: int = 1) -> int:
    """Parameters one tensor-parallel rank holds. Heads, MLP columns and the vocabulary are
    split (vocab rows rounded up, no padding beyond that), KV heads replicated when fewer than
    ranks, norms and row-parallel biases replicated. With tp=1 this is the full count."""
    _check_tp(shape, tp)
    h, d = shape.hidden_size, shape.head_dim
    q_out = shape.num_attention_heads // tp * d
    kv_out = kv_heads_per_rank(shape.num_kv_heads, tp) * d
    inter = math.ceil(shape.intermediate_size / tp)
    vocab = math.ceil(shape.vocab_size / tp)

    attn = h * q_out + 2 * h * kv_out + q_out * h
    if shape.qkv_bias:
        attn += q_out + 2 * kv_out
    if shape.o_bias:
        attn += h  # row-parallel bias: applied once after the all-reduce, kept on every rank
    if shape.qk_norm:
        attn += 2 * d
    mlp = 3 * h * inter
    if shape.mlp_bias:
        mlp += 2 * inter + h
    norms = 2 * h
    per_layer = attn + mlp + norms

    embeddings = vocab * h
    lm_head = 0 if shape.tie_word_embeddings else vocab * h
    final_norm = h
    return shape.num_layers * per_layer + embeddings + lm_head + final_norm


def num_parameters(shape: ModelShape) -> int:
    """Llama-family parameter count: embeddings, untied lm_head, per layer q/k/v/o (+biases),
    gate/up/down, two RMSNorm weights (+ q/k norms for Qwen3), and the final norm.
    Llama-2-7B -> 6,738,415,616; Llama-3-8B -> 8,030,261,248."""
    return num_parameters_per_rank(shape, 1)


QUANTIZATION_METHODS = ("int8", "int4")


def projection_shapes_per_rank(shape: ModelShape, tp: int = 1) -> list[tuple[int, int]]:
    """(out_features, in_features) of one layer's projections on one rank: q, k, v, o, gate, up, down
    (what `--quantization` quantizes; fused or separate, per-row scales and groups come out the same)."""
    _check_tp(shape, tp)
    h, d = shape.hidden_size, shape.head_dim
    q_out = shape.num_attention_heads // tp * d
    kv_out = kv_heads_per_rank(shape.num_kv_heads, tp) * d
    inter = math.ceil(shape.intermediate_size / tp)
    return [(q_out, h), (kv_out, h), (kv_out, h), (h, q_out), (inter, h), (inter, h), (h, inter)]


def quantized_projection_bytes(out_features: int, in_features: int, method: str, group_size: int = 32) -> int:
    """Bytes one quantized projection holds in memory (lmserve.model.quantization's layouts):
    int8: 1 B per weight + a float32 scale and an int32 row sum (the VNNI kernel's correction) per output row;
    int4: 1/2 B per weight + a float16 scale per group of `group_size` inputs; int8w (the int4 method's LM head):
    1 B per weight + a float16 scale per 32 inputs."""
    if method == "int8":
        return out_features * in_features + 8 * out_features
    if method == "int8w":
        return out_features * in_features + 2 * out_features * (in_features // 32)
    if method != "int4":
        raise ValueError(f"quantization must be one of {list(QUANTIZATION_METHODS)}, got {method!r}")
    if group_size < 32 or group_size % 32 or in_features % group_size:
        raise ValueError(
            f"quantization_group_size {group_size} must be a multiple of 32 dividing the projection's "
            f"{in_features} inputs"
        )
    return out_features * in_features // 2 + 2 * out_features * (in_features // group_size)


def weight_bytes_per_rank(
    shape: ModelShape, weight_dtype_bytes: float, tp: int = 1, quantization: str | None = None, group_size: int = 32
) -> int:
    """Weight bytes on one rank: everything at `weight_dtype_bytes`, except that with `quantization` the
    projections are int8 / int4 (embeddings, norms and biases stay at `weight_dtype_bytes`). The LM head is
    quantized too (config.HEAD_LAYOUTS: int8 as a projection, int4 at 8 bits weight-only): an untied head is
    replaced by it; a tied model keeps its embedding table for the token lookup and holds the quantized head as
    an extra copy."""
    params = num_parameters_per_rank(shape, tp)
    if quantization is None:
        return math.ceil(params * weight_dtype_bytes)
    projections = projection_shapes_per_rank(shape, tp)
    num_float_params = params - shape.num_layers * sum(o * k for o, k in projections)
    per_layer = sum(quantized_projection_bytes(o, k, quantization, group_size) for o, k in projections)
    quantized = shape.num_layers * per_layer
    if quantization in HEAD_LAYOUTS:
        vocab = math.ceil(shape.vocab_size / tp)
        quantized += quantized_projection_bytes(vocab, shape.hidden_size, HEAD_LAYOUTS[quantization], group_size)
        if not shape.tie_word_embeddings:
            num_float_params -= vocab * shape.hidden_size
    return math.ceil(num_float_params * weight_dtype_bytes) + quantized


def max_num_kv_blocks(budget_bytes: int, block_size: int, kv_bytes_per_token: int) -> int:
    """Whole KV blocks of ``block_size`` tokens that fit in ``budget_bytes``."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"budget_bytes must be a non-negative integer, got {budget_bytes!r}")
    _positive("block_size", block_size)
    _positive("kv_bytes_per_token", kv_bytes_per_token)
    return budget_bytes // (block_size * kv_bytes_per_token)


def blocks_per_request(seq_len: int, block_size: int) -> int:
    """Blocks one request of ``seq_len`` tokens occupies: ceil(seq_len / block_size)."""
    _positive("seq_len", seq_len)
    _positive("block_size", block_size)
    return -(-seq_len // block_size)


def kv_blocks_held(seq_len: int, block_size: int, sliding_window: int | None = None, num_new_tokens: int = 1) -> int:
    """Blocks a request of ``seq_len`` tokens holds at most while a step computes ``num_new_tokens`` of them
    (1: decoding). Without a freeing window: all of its blocks. When the engine frees KV blocks outside a
    sliding window W (every layer slides; core/kv_cache_manager.py), a step after c computed tokens holds the
    blocks from the one with position c - W + 1 to the one with position c + n - 1: at most
    ceil((W + block_size - 2 + n) / block_size), i.e. the window plus one block of slack when decoding."""
    full = blocks_per_request(seq_len, block_size)
    if sliding_window is None:
        return full
    _positive("sliding_window", sliding_window)
    _positive("num_new_tokens", num_new_tokens)
    return min(full, -(-(sliding_window + block_size - 2 + num_new_tokens) // block_size))


def max_concurrent_requests(
    kv_budget_bytes: int, seq_len: int, kv_bytes_per_token: int, block_size: int = 16, sliding_window: int | None = None
) -> int:
    """Requests of ``seq_len`` tokens whose KV fits in the budget at once. Each request holds
    whole blocks, so it costs ceil(seq_len / block_size) * block_size tokens of KV (with a freeing
    sliding window, only the blocks of kv_blocks_held)."""
    blocks = max_num_kv_blocks(kv_budget_bytes, block_size, kv_bytes_per_token)
    return blocks // kv_blocks_held(seq_len, block_size, sliding_window)


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryReport:
    """Everything `lmserve memory` prints. "per rank" is one tensor-parallel device; "total" is
    summed over all ranks (it counts replicated KV heads once per rank that holds them)."""

    name: str | None
    shape: ModelShape
    seq_len: int
    batch: int
    block_size: int
    tp: int
    kv_dtype: str
    weight_dtype: str
    # weights
    num_parameters: int
    num_parameters_per_rank: int
    weight_bytes: int
    weight_bytes_per_rank: int
    # KV cache, whole model (unsharded); per-token figures include the 8-bit dtypes' scales
    kv_bytes_per_token: int
    kv_scale_bytes_per_token: int
    kv_bytes_per_token_per_layer: int
    mha_kv_bytes_per_token: int
    gqa_factor: float
    kv_bytes_per_request: int
    kv_bytes_batch: int
    # KV cache, sharded
    kv_heads_per_rank: int
    kv_bytes_per_token_per_rank: int
    kv_bytes_per_request_per_rank: int
    kv_bytes_batch_per_rank: int
    kv_bytes_batch_total: int
    blocks_per_request: int
    # budget (per device); None when no memory budget was given
    memory_bytes: int | None = None
    reserve_bytes: int = 0
    weights_fit: bool | None = None
    kv_budget_bytes_per_rank: int | None = None
    num_kv_blocks: int | None = None
    max_kv_tokens: int | None = None
    max_concurrent_requests: int | None = None
    batch_fits: bool | None = None
    notes: tuple[str, ...] = field(default=())
    quantization: str | None = None  # "int8" | "int4": projections quantized, the rest at weight_dtype
    quantization_group_size: int | None = None
    # sliding windows: the tokens of KV a request holds (seq_len, or the window + a block when freed)
    kv_tokens_per_request: int | None = None
    kv_freed_outside_window: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict (for ``--json``)."""
        d = asdict(self)
        d["notes"] = list(self.notes)
        return d

    def format_table(self) -> str:
        """Readable two-column report."""
        s = self.shape
        tp = self.tp

        def both(total: int, per_rank: int) -> str:
            text = _fmt(total)
            if tp > 1:
                text += f"   [per rank: {_fmt(per_rank)}]"
            return text

        rows: list[tuple[str, str]] = []
        title = f"lmserve memory: {self.name}" if self.name else "lmserve memory"
        rows.append(
            (
                "model",
                f"{s.num_layers} layers, hidden {s.hidden_size}, {s.num_attention_heads} heads / "
                f"{s.num_kv_heads} KV heads, head_dim {s.head_dim}, vocab {s.vocab_size}",
            )
        )
        params = f"{self.num_parameters:,} ({self.num_parameters / 1e9:.2f} B)"
        if tp > 1:
            params += f"   [per rank: {self.num_parameters_per_rank:,}]"
        rows.append(("parameters", params))
        label = f"weights ({self.weight_dtype})"
        if self.quantization == "int8":
            head = "int8 copy of the tied" if s.tie_word_embeddings else "int8"
            label = f"weights (int8 projections + {head} LM head + {self.weight_dtype} embeddings/norms)"
        elif self.quantization == "gguf":
            label = f"weights (GGUF blocks as in the file + {self.weight_dtype} dequantized rest)"
        elif self.quantization == "int4":
            head = "8-bit g32 copy of the tied" if s.tie_word_embeddings else "8-bit g32"
            label = (
                f"weights (int4 g{self.quantization_group_size} projections + {head} LM head + {self.weight_dtype} "
                "embeddings/norms)"
            )
        rows.append((label, both(self.weight_bytes, self.weight_bytes_per_rank)))
        if tp > 1:
            rows.append(
                (
                    "tensor parallel",
                    f"tp={tp}, {self.kv_heads_per_rank} KV head(s) per rank"
                    + (" (replicated)" if s.num_kv_heads < tp else ""),
                )
            )
        rows.append((f"KV cache ({self.kv_dtype})", ""))
        rows.append(
            (
                "  per token",
                f"{format_bytes(self.kv_bytes_per_token)} ({self.kv_bytes_per_token:,} B)"
                + (f", of which scales {self.kv_scale_bytes_per_token:,} B" if self.kv_scale_bytes_per_token else "")
                + (f"   [per rank: {_fmt(self.kv_bytes_per_token_per_rank)}]" if tp > 1 else ""),
            )
        )
        rows.append(("  per token per layer", format_bytes(self.kv_bytes_per_token_per_layer)))
        rows.append(
            (
                "  MHA equivalent per token",
                f"{format_bytes(self.mha_kv_bytes_per_token)} "
                + (
                    f"(GQA: {self.gqa_factor:g}× smaller with {s.num_kv_heads} KV heads "
                    f"for {s.num_attention_heads} query heads)"
                    if s.num_kv_heads < s.num_attention_heads
                    else "(1× smaller: model is MHA, KV heads = query heads)"
                ),
            )
        )
        held = ""
        if self.kv_freed_outside_window:
            held = f"   [{self.kv_tokens_per_request:,} tokens held: sliding window {s.sliding_window:,} + a block]"
        rows.append(
            (
                f"  per request ({self.seq_len:,} tokens)",
                both(self.kv_bytes_per_request, self.kv_bytes_per_request_per_rank) + held,
            )
        )
        batch_text = _fmt(self.kv_bytes_batch)
        if tp > 1:
            batch_text += (
                f"   [per rank: {_fmt(self.kv_bytes_batch_per_rank)}, "
                f"all ranks: {_fmt(self.kv_bytes_batch_total)}]"
            )
        rows.append((f"  batch ({self.batch} × {self.seq_len:,} tokens)", batch_text))
        if self.memory_bytes is not None:
            budget = f"{_fmt(self.memory_bytes)} per device"
            if self.reserve_bytes:
                budget += f", reserve {_fmt(self.reserve_bytes)}"
            rows.append(("memory budget", budget))
            rows.append(("  left for KV (per device)", _fmt(self.kv_budget_bytes_per_rank or 0)))
            rows.append((f"  KV blocks ({self.block_size} tokens)", f"{self.num_kv_blocks:,}"))
            rows.append(("  tokens that fit", f"{self.max_kv_tokens:,}"))
            rows.append(
                (
                    "  max concurrent requests",
                    f"{self.max_concurrent_requests:,} × {self.seq_len:,} tokens "
                    f"(batch of {self.batch} {'fits' if self.batch_fits else 'does NOT fit'})",
                )
            )
        width = max(len(label) for label, _ in rows) + 2
        lines = [title]
        lines += [f"  {label.ljust(width)}{value}".rstrip() for label, value in rows]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _fmt(n: int) -> str:
    """Binary size, plus the decimal one when it reads differently (GiB vs GB)."""
    b, d = format_bytes(n), format_bytes(n, binary=False)
    return b if n < 1000 else f"{b} ({d})"


def memory_report(
    shape: ModelShape,
    *,
    seq_len: int = 4096,
    batch: int = 1,
    kv_dtype: str = "bf16",
    weight_dtype: str = "bf16",
    memory_bytes: int | None = None,
    reserve_bytes: int = 0,
    block_size: int = 16,
    tp: int = 1,
    name: str | None = None,
    quantization: str | None = None,
    quantization_group_size: int = 32,
    exact_weight_bytes: int | None = None,
) -> MemoryReport:
    """Weights, KV per token/request/batch, and (given a per-device ``memory_bytes``) how many
    ``seq_len``-token requests fit after weights and ``reserve_bytes``. ``exact_weight_bytes``: the weights'
    bytes when the checkpoint fixes them (a GGUF file's blocks kept as they are; tp=1)."""
    _positive("seq_len", seq_len)
    _positive("batch", batch)
    _positive("block_size", block_size)
    _check_tp(shape, tp)
    dtype_bytes(kv_dtype)  # an unknown KV dtype name is an error before anything else
    w_b = dtype_bytes(weight_dtype)
    if isinstance(reserve_bytes, bool) or not isinstance(reserve_bytes, int) or reserve_bytes < 0:
        raise ValueError(f"reserve_bytes must be a non-negative integer, got {reserve_bytes!r}")
    if memory_bytes is not None:
        _positive("memory_bytes", memory_bytes)
        if reserve_bytes > memory_bytes:
            raise ValueError(
                f"reserve_bytes ({format_bytes(reserve_bytes)}) exceeds memory_bytes "
                f"({format_bytes(memory_bytes)})"
            )

    params = num_parameters(shape)
    params_rank = num_parameters_per_rank(shape, tp)
    if exact_weight_bytes is not None:
        if tp != 1:
            raise ValueError("exact weight bytes (a GGUF file's kept blocks) are known for tp=1 only")
        weight_bytes = weight_bytes_rank = exact_weight_bytes
    elif quantization is None:
        weight_bytes = math.ceil(params * w_b)
        weight_bytes_rank = math.ceil(params_rank * w_b)
    else:
        weight_bytes = weight_bytes_per_rank(shape, w_b, 1, quantization, quantization_group_size)
        weight_bytes_rank = weight_bytes_per_rank(shape, w_b, tp, quantization, quantization_group_size)

    # per-token sizes: values plus, for the 8-bit KV dtypes, their scales
    layers, heads_rank = shape.num_layers, kv_heads_per_rank(shape.num_kv_heads, tp)
    per_token = kv_cache_bytes_per_token(layers, shape.num_kv_heads, shape.head_dim, kv_dtype)
    scales = kv_scale_bytes_per_token(layers, shape.num_kv_heads, kv_dtype)
    per_layer = kv_cache_bytes_per_token(1, shape.num_kv_heads, shape.head_dim, kv_dtype)
    mha = kv_cache_bytes_per_token(layers, shape.num_attention_heads, shape.head_dim, kv_dtype)
    per_token_rank = kv_cache_bytes_per_token(layers, heads_rank, shape.head_dim, kv_dtype)
    free_window = shape.kv_free_window
    n_blocks_req = kv_blocks_held(seq_len, block_size, free_window)
    tokens = seq_len if free_window is None else min(seq_len, n_blocks_req * block_size)

    notes: list[str] = []
    if free_window is not None:
        notes.append(
            f"every layer slides (window {free_window:,}): the engine frees KV blocks outside the window while a "
            f"request runs, so a request holds at most {n_blocks_req:,} blocks ({tokens:,} tokens) of KV, "
            "counted so here"
        )
    elif shape.num_sliding_layers:
        notes.append(
            f"{shape.num_sliding_layers} of {layers} layers slide (window {shape.sliding_window:,}), the others "
            "attend to everything: a block holds every layer's K/V, so the engine keeps all blocks (the sliding "
            "layers only stop reading outside their window); KV counted in full"
        )
    if shape.num_kv_heads < tp:
        notes.append(
            f"{shape.num_kv_heads} KV heads < tp={tp}: each KV head is replicated on "
            f"{tp // shape.num_kv_heads} ranks"
        )
    if shape.max_position_embeddings is not None and seq_len > shape.max_position_embeddings:
        notes.append(
            f"seq_len {seq_len:,} exceeds the model's max_position_embeddings "
            f"({shape.max_position_embeddings:,})"
        )

    budget: dict[str, Any] = {}
    if memory_bytes is not None:
        free = memory_bytes - reserve_bytes - weight_bytes_rank
        kv_budget = max(0, free)
        if free < 0:
            notes.append(
                f"weights ({format_bytes(weight_bytes_rank)} per device) do not fit in "
                f"memory minus reserve ({format_bytes(memory_bytes - reserve_bytes)})"
            )
        blocks = max_num_kv_blocks(kv_budget, block_size, per_token_rank)
        max_req = blocks // n_blocks_req
        budget = dict(
            memory_bytes=memory_bytes,
            reserve_bytes=reserve_bytes,
            weights_fit=free >= 0,
            kv_budget_bytes_per_rank=kv_budget,
            num_kv_blocks=blocks,
            max_kv_tokens=blocks * block_size,
            max_concurrent_requests=max_req,
            batch_fits=max_req >= batch,
        )
    else:
        budget = dict(reserve_bytes=reserve_bytes)

    return MemoryReport(
        name=name,
        shape=shape,
        seq_len=seq_len,
        batch=batch,
        block_size=block_size,
        tp=tp,
        kv_dtype=kv_dtype,
        weight_dtype=weight_dtype,
        num_parameters=params,
        num_parameters_per_rank=params_rank,
        weight_bytes=weight_bytes,
        weight_bytes_per_rank=weight_bytes_rank,
        kv_bytes_per_token=per_token,
        kv_scale_bytes_per_token=scales,
        kv_bytes_per_token_per_layer=per_layer,
        mha_kv_bytes_per_token=mha,
        gqa_factor=shape.gqa_ratio,
        kv_bytes_per_request=per_token * tokens,
        kv_bytes_batch=per_token * tokens * batch,
        kv_heads_per_rank=heads_rank,
        kv_bytes_per_token_per_rank=per_token_rank,
        kv_bytes_per_request_per_rank=per_token_rank * tokens,
        kv_bytes_batch_per_rank=per_token_rank * tokens * batch,
        kv_bytes_batch_total=per_token_rank * tokens * batch * tp,
        blocks_per_request=n_blocks_req,
        kv_tokens_per_request=tokens,
        kv_freed_outside_window=free_window is not None,
        notes=tuple(notes),
        quantization=quantization,
        quantization_group_size=quantization_group_size if quantization == "int4" else None,
        **budget,
    )
