"""The model as its checkpoint describes it, before any weight is read: `ModelShape` (the numbers that decide its
memory footprint), parsed from an HF ``config.json`` or a GGUF file's metadata (load_model_shape), with MoE layout,
per-layer attention windows and the LM head's layout per quantization method.

One reading of the shape fields for the memory ledger and for ModelConfig.from_hf. No torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmserve.checkpoint.registry.family import kv_layer_count, layer_sliding_windows, layer_specs, text_config
from lmserve.checkpoint.registry.hybrid import LinearAttentionShape, linear_attention_layers
from lmserve.checkpoint.registry.moe import MoEShape, is_moe_config, moe_shape_from_hf_config

# The LM head's layout per quantization method (lmserve/model/quantization.py): int8 quantizes it as a projection
# (W8A8); int4 gives it 8 bits, weight-only with group-32 scales ("int8w", GGUF Q8_0's block).
HEAD_LAYOUTS = {"int8": "int8", "int4": "int8w"}


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
    # hybrid models: layers with linear attention (a per-sequence state, no KV) and their shape
    num_linear_layers: int = 0
    linear: LinearAttentionShape | None = None
    attn_output_gate: bool = False  # Qwen3.5 / Qwen3-Next: q_proj also yields a sigmoid gate on the output
    moe: MoEShape | None = None  # mixture of experts: the sparse layers' expert layout (None: dense)
    attention_sinks: bool = False  # one learned sink logit per head and layer (gpt-oss)

    # the K/V the layers hold, in layers of (num_kv_heads, head_dim) (None: every attention layer; Gemma 4 shares
    # and widens)
    num_kv_layer_units: int | None = None
    # parameters beside the Llama layout's (Gemma 4: wider global layers, shared K/V, per-layer inputs), counted
    # at the weight dtype
    extra_parameters: int = 0

    @property
    def num_kv_layers(self) -> int:
        """Layers of K/V per token the KV pool holds (model_config.ModelConfig.num_kv_layers, the same count): every
        layer but the linear-attention ones, or the family's own count where it shares or widens K/V."""
        return self.num_layers - self.num_linear_layers if self.num_kv_layer_units is None else self.num_kv_layer_units

    @property
    def kv_layers(self) -> int:
        return self.num_kv_layers

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
    no layers. A mixture-of-experts config (Qwen2/3-MoE, Mixtral, OLMoE, gpt-oss) gets its MoEShape; one of
    another family is a ValueError naming model_type.
    """
    if not isinstance(cfg, dict):
        raise ValueError(f"config must be a JSON object, got {type(cfg).__name__}")
    cfg = text_config(cfg)
    missing = [f for f in _REQUIRED_HF_FIELDS if cfg.get(f) is None]
    if missing:
        raise ValueError(f"config is missing required field(s): {', '.join(missing)}")

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
    moe = moe_shape_from_hf_config(cfg, num_layers) if is_moe_config(cfg) else None
    linear, linear_types = linear_attention_layers(cfg, num_layers)
    head_dim = _int("head_dim", head_dim)
    sliding_window, num_sliding, kv_units, known = _sliding_layers(cfg, num_layers, kv_heads, head_dim)
    intermediate = _int("intermediate_size", cfg["intermediate_size"])
    attention_bias = bool(cfg.get("attention_bias", False))
    max_pos = cfg.get("max_position_embeddings")
    rope_theta = cfg.get("rope_theta")
    return ModelShape(
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=_int("vocab_size", cfg["vocab_size"]),
        intermediate_size=intermediate,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v bias (and no o bias); Llama's attention_bias covers all four.
        qkv_bias=attention_bias or model_type in ("qwen2", "qwen2_moe"),
        o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=model_type.startswith("qwen3"),
        model_type=model_type,
        rope_theta=float(rope_theta) if rope_theta is not None else None,
        max_position_embeddings=int(max_pos) if max_pos is not None else None,
        sliding_window=sliding_window,
        num_sliding_layers=num_sliding,
        num_kv_layer_units=kv_units if kv_units != num_layers else None,
        # (a hybrid's parameters: the ledger counts its linear and gated layers itself)
        extra_parameters=0
        if known is None or linear is not None
        else _extra_parameters(cfg, *known, hidden, heads, kv_heads, head_dim, intermediate),
        num_linear_layers=sum(linear_types),
        linear=linear,
        attn_output_gate=linear is not None,
        moe=moe,
        attention_sinks=model_type == "gpt_oss",
    )


def _sliding_layers(cfg: dict[str, Any], num_layers: int, kv_heads: int, head_dim: int) -> tuple:
    """(window, number of sliding layers, KV layers, LayerSpecs) as the engine reads them; (None, 0, num_layers, ())
    for architectures the engine does not know (the ledger still counts their KV, in full)."""
    from lmserve.checkpoint.registry import resolve_architecture

    try:
        family = resolve_architecture(cfg.get("architectures"))
    except ValueError:
        return None, 0, num_layers, None
    specs = layer_specs(family, cfg, num_layers)
    windows = [s.sliding_window for s in specs if s.sliding_window]
    return (max(windows) if windows else None), len(windows), kv_layer_count(specs, kv_heads, head_dim), (family, specs)


def _extra_parameters(
    cfg: dict[str, Any], family: Any, specs: tuple, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int
) -> int:
    """Parameters the layers hold beyond num_layers Llama layers of the config's shape (projections, the norms of
    the Gemma / OLMo layouts, per-head q/k norms outside Qwen3), plus per-layer inputs."""
    norms = {"pre": 0, "sandwich": 2 * hidden, "post": 0}[family.norm_layout]
    qk_norm = family.qk_norm and not str(cfg.get("model_type", "")).startswith("qwen3")  # (Qwen3's: counted)

    def layer(spec: Any) -> int:
        d = spec.head_dim or head_dim
        q, kv = heads * d, (spec.num_kv_heads or kv_heads) * d
        kv_rows = 0 if spec.kv_source is not None else kv * (1 if spec.k_eq_v else 2)
        qk = (d + (d if spec.kv_source is None else 0)) if qk_norm else (q + kv if family.qk_norm_whole else 0)
        return hidden * (2 * q + kv_rows) + 3 * hidden * (spec.intermediate_size or inter) + qk + norms

    base = hidden * (2 * heads * head_dim + 2 * kv_heads * head_dim) + 3 * hidden * inter
    extra = sum(layer(s) - base for s in specs)
    per_layer = int(cfg.get("hidden_size_per_layer_input") or 0)
    if per_layer:  # the token table, the projection of the embeddings, and each layer's gate and projection
        n = len(specs) * per_layer
        extra += int(cfg.get("vocab_size_per_layer_input") or 0) * n + hidden * n + per_layer  # (+ its norm)
        extra += len(specs) * (2 * hidden * per_layer + hidden + 1)  # gate, projection, norm, layer scalar
    return extra


def load_model_shape(path: str | Path) -> ModelShape:
    """Read an HF ``config.json`` (a file, or a model directory containing one), or a GGUF file's metadata."""
    from lmserve.checkpoint.gguf import GGUFCheckpoint, find_gguf_file  # numpy + gguf, no torch

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


__all__ = [
    "HEAD_LAYOUTS", "LinearAttentionShape", "ModelShape", "layer_sliding_windows", "linear_attention_layers",
    "load_model_shape", "model_shape_from_hf_config",
]  # fmt: skip
