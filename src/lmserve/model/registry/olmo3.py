"""OLMo 3: OLMo 2 (norms on the sublayer outputs, whole-projection q/k norms) with sliding-window layers by
`layer_types` (default: three sliding layers, then a global one), each layer type with its own rotary parameters."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lmserve.model.registry.family import LayerSpec, ModelFamily


def layers(cfg: dict[str, Any], specs: tuple[LayerSpec, ...]) -> tuple[LayerSpec, ...]:
    params = cfg.get("rope_parameters") or {}
    per_type = isinstance(params.get("sliding_attention"), dict) and isinstance(params.get("full_attention"), dict)
    if not per_type or params["sliding_attention"] == params["full_attention"]:
        return specs
    return tuple(replace(s, rope="local") if s.sliding_window else s for s in specs)  # the sliding type's table


FAMILY = ModelFamily(
    "olmo3", ("Olmo3ForCausalLM",), qk_norm_whole=True, norm_layout="post", sliding_layers="pattern",
    sliding_pattern=4, layers=layers,
)  # fmt: skip
