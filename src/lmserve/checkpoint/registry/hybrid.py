"""A hybrid model's layout as its HF ``config.json`` states it (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): the Gated DeltaNet
layers' shape (`LinearAttentionShape`), which layers use it (`linear_attention_layers`), and the families' per-layer
specs (`hybrid_layers`: linear attention or gated full attention). Torch-free: the ledger and the model read the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from lmserve.checkpoint.registry.family import LayerSpec

LayersFn = Callable[[dict[str, Any], tuple[LayerSpec, ...]], tuple[LayerSpec, ...]]


@dataclass(frozen=True)
class LinearAttentionShape:
    """A hybrid model's Gated DeltaNet layers (Qwen3.5, Qwen3-Next): their heads and the conv window."""

    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv (q, k and v before the split)."""
        return 2 * self.num_k_heads * self.k_dim + self.num_v_heads * self.v_dim

    @property
    def state_elements(self) -> int:
        """One layer's state per sequence: the conv window (conv_dim x (kernel - 1)) and v_heads x k_dim x v_dim."""
        return self.conv_dim * (self.conv_kernel - 1) + self.num_v_heads * self.k_dim * self.v_dim


def linear_attention_layers(cfg: dict[str, Any], num_layers: int) -> tuple[LinearAttentionShape | None, list[bool]]:
    """A hybrid config's Gated DeltaNet shape and which layers use it (layer_types' "linear_attention", else every
    layer but each full_attention_interval-th, as Qwen3-Next's configs say); (None, all False) for other models."""
    if "linear_num_value_heads" not in cfg:
        return None, [False] * num_layers
    types = cfg.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        unknown = sorted(set(types) - {"linear_attention", "full_attention"})
        if unknown:
            raise ValueError(f"layer_types: unknown layer type(s) {unknown} in a linear-attention model")
        is_linear = [t == "linear_attention" for t in types]
    else:
        interval = cfg.get("full_attention_interval", 4)
        is_linear = [bool((i + 1) % interval) for i in range(num_layers)]
    fields = {
        "num_k_heads": "linear_num_key_heads", "num_v_heads": "linear_num_value_heads",
        "k_dim": "linear_key_head_dim", "v_dim": "linear_value_head_dim", "conv_kernel": "linear_conv_kernel_dim",
    }  # fmt: skip
    values = {}
    for name, key in fields.items():
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config field {key} must be a positive integer, got {value!r}")
        values[name] = value
    if values["num_v_heads"] % values["num_k_heads"]:
        raise ValueError(
            f"linear_num_value_heads ({values['num_v_heads']}) must be a multiple of linear_num_key_heads "
            f"({values['num_k_heads']})"
        )
    if values["conv_kernel"] < 2:
        raise ValueError(f"linear_conv_kernel_dim must be at least 2, got {values['conv_kernel']}")
    return LinearAttentionShape(**values), is_linear


def hybrid_layers(feed_forwards: LayersFn | None = None) -> LayersFn:
    """The families' per-layer specs: each layer's token mixer from layer_types (or full_attention_interval), then
    the feed-forwards (feed_forwards: moe_layers for the MoE families; None: the dense MLP everywhere)."""

    def layers(cfg: dict[str, Any], specs: tuple[LayerSpec, ...]) -> tuple[LayerSpec, ...]:
        linear, is_linear = linear_attention_layers(cfg, len(specs))
        if linear is None:
            raise ValueError("config field linear_num_value_heads: missing (a hybrid model's linear attention)")
        specs = tuple(
            replace(s, mixer="linear_attention", rope=None) if lin else replace(s, mixer="gated_attention")
            for s, lin in zip(specs, is_linear, strict=True)
        )
        return specs if feed_forwards is None else feed_forwards(cfg, specs)

    return layers


# the family fields the hybrids share: q/k norm per head, every RMSNorm but the gated one scaling by (1 + weight), a
# multimodal checkpoint's text model (its vision tower and the multi-token-prediction head skipped)
HYBRID: dict[str, Any] = dict(
    qk_norm=True,
    norm_weight_offset=1.0,
    checkpoint_renames=(("model.language_model.", "model."),),
    checkpoint_skips=("model.visual.", "mtp."),
)
