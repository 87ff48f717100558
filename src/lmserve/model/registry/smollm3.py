"""SmolLM3: Llama with no rotary embedding (NoPE) on some layers: `no_rope_layers[i] == 0` (default: every
`no_rope_layer_interval`-th layer); with use_sliding_window, the sliding layers of `layer_types`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lmserve.model.registry.family import LayerSpec, ModelFamily


def rope_layers(cfg: dict[str, Any], num_layers: int) -> list[bool]:
    """Whether each layer applies the rotary embedding (HF's no_rope_layers: 1 = rotary, 0 = none)."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        return [(i + 1) % interval != 0 for i in range(num_layers)]
    if len(flags) != num_layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {num_layers} layers")
    return [bool(f) for f in flags]


def layers(cfg: dict[str, Any], specs: tuple[LayerSpec, ...]) -> tuple[LayerSpec, ...]:
    rope = rope_layers(cfg, len(specs))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    if window and not cfg.get("layer_types"):  # HF's default layer_types: the NoPE layers slide
        specs = tuple(replace(s, sliding_window=None if r else int(window)) for s, r in zip(specs, rope, strict=True))
    return tuple(s if r else replace(s, rope=None) for s, r in zip(specs, rope, strict=True))


FAMILY = ModelFamily(
    "smollm3", ("SmolLM3ForCausalLM",), sliding_layers="all", use_sliding_window_key=True, layers=layers
)
