"""What a model family is, before any torch: `ModelFamily` (the family's details, read once into ModelConfig) and
`LayerSpec` (what one decoder layer is made of: a token mixer and a feed-forward, with their per-layer details),
chosen per layer from the HF config. Torch-free: the memory ledger reads the same layer list as the engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: block kinds (keys of model/layers TOKEN_MIXERS / FEED_FORWARDS) and their details."""

    # token mixer: "attention" (full or sliding, over the paged KV cache), "gated_attention" (Qwen3.5 / Qwen3-Next:
    # an output gate, over the paged KV cache), "linear_attention" (Gated DeltaNet: a per-sequence state, no KV)
    mixer: str = "attention"
    feed_forward: str = "dense"  # feed-forward: "dense" (gated MLP)
    sliding_window: int | None = None  # attention within this many positions (None: full attention)
    rope: str | None = "global"  # rotary table: "global", "local" (Gemma 3's sliding layers), None (no rotary)
    kv_source: int | None = None  # Gemma 4: attend over this earlier layer's K/V, writing none itself
    head_dim: int | None = None  # None: the model's (Gemma 4's global layers have their own)
    num_kv_heads: int | None = None  # None: the model's
    intermediate_size: int | None = None  # None: the model's (Gemma 4's double-wide MLP)
    k_eq_v: bool = False  # Gemma 4 (attention_k_eq_v): no v projection, values are the keys before their norm

    @property
    def holds_kv(self) -> bool:
        """Whether this layer writes K/V into its own paged cache."""
        return self.mixer in ("attention", "gated_attention") and self.kv_source is None


@dataclass(frozen=True)
class ModelFamily:
    """A family's details beyond Llama's (the defaults). One instance per module in checkpoint/registry/."""

    name: str
    architectures: tuple[str, ...]
    qkv_bias: bool = False  # Qwen2: biases on q/k/v projections
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm per head on q and k before RoPE
    qk_norm_whole: bool = False  # OLMo 2: RMSNorm over the whole q / k projection
    v_norm: bool = False  # Gemma 4: RMSNorm without weight per head on v
    hidden_act: str = "silu"  # silu | gelu_tanh (Gemma)
    norm_weight_offset: float = 0.0  # Gemma 2/3: RMSNorm scales by (1 + weight)
    norm_layout: str = "pre"  # pre | sandwich (Gemma: pre and post norms) | post (OLMo 2: sublayer outputs only)
    scaled_embeddings: bool = False  # Gemma: embeddings × sqrt(hidden_size)
    uses_query_pre_attn_scalar: bool = False  # Gemma 2/3: attention scale and soft-capping from the config
    attn_scale: float | None = None  # a fixed attention scale (Gemma 4: 1.0); None: head_dim ** -0.5
    local_rope: bool = False  # Gemma 3/4: sliding layers use their own rotary parameters
    # which layers use the config's sliding_window: none | all | pattern | from_max_window_layers
    sliding_layers: str = "none"
    sliding_pattern: int = 2  # "pattern": every sliding_pattern-th layer is global
    use_sliding_window_key: bool = False  # Qwen2/3: the window applies only when config["use_sliding_window"]
    # per-layer details beyond the sliding window: (config, default specs) -> specs
    layers: Callable[[dict[str, Any], tuple[LayerSpec, ...]], tuple[LayerSpec, ...]] | None = None
    # checkpoint names: (prefix, replacement) renames, and prefixes of tensors not served (a vision tower)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    checkpoint_skips: tuple[str, ...] = ()

    def architecture_of(self, names: list[str]) -> str:
        return next(n for n in names if n in self.architectures)


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: a multimodal config's text_config (with the top level's architectures)."""
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        return {**cfg["text_config"], "architectures": cfg.get("architectures")}
    return cfg


def layer_sliding_windows(family: ModelFamily, cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """The attention window of each layer (None: full attention); () when no layer slides."""
    window = cfg.get("sliding_window")
    if family.use_sliding_window_key and not cfg.get("use_sliding_window", False):
        window = None
    if not window or family.sliding_layers == "none":
        return ()
    types = cfg.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        sliding = [t == "sliding_attention" for t in types]
    elif family.sliding_layers == "all":
        sliding = [True] * num_layers
    elif family.sliding_layers == "from_max_window_layers":  # Qwen2: layers from max_window_layers on
        sliding = [i >= cfg.get("max_window_layers", 28) for i in range(num_layers)]
    else:  # "pattern": every `pattern`-th layer is global (Gemma 2: 2, Gemma 3: sliding_window_pattern or 6)
        pattern = int(cfg.get("sliding_window_pattern") or family.sliding_pattern)
        sliding = [bool((i + 1) % pattern) for i in range(num_layers)]
    if not any(sliding):
        return ()
    return tuple(int(window) if s else None for s in sliding)


def layer_specs(family: ModelFamily, cfg: dict[str, Any], num_layers: int) -> tuple[LayerSpec, ...]:
    """Every layer's LayerSpec: the sliding windows, the rotary table, then the family's own per-layer details."""
    windows = layer_sliding_windows(family, cfg, num_layers) or (None,) * num_layers
    specs = tuple(
        LayerSpec(sliding_window=w, rope="local" if family.local_rope and w else "global") for w in windows
    )
    if family.layers is not None:
        specs = family.layers(cfg, specs)
    assert len(specs) == num_layers, f"{family.name}: {len(specs)} layer specs for {num_layers} layers"
    return specs


def kv_layer_count(specs: tuple[LayerSpec, ...], num_kv_heads: int, head_dim: int) -> int:
    """The K/V the layers write, in layers of (num_kv_heads, head_dim), rounded up (Gemma 4: the sharing layers hold
    none, the global ones their own width); len(specs) for a model of plain attention layers."""
    units = sum((s.num_kv_heads or num_kv_heads) * (s.head_dim or head_dim) for s in specs if s.holds_kv)
    return -(-units // (num_kv_heads * head_dim))


__all__ = ["LayerSpec", "ModelFamily", "kv_layer_count", "layer_sliding_windows", "layer_specs", "text_config"]
