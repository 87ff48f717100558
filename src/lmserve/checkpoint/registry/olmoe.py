"""OLMoE: Llama's layout with an RMSNorm over the whole q and k projections and the MoE block (softmax top-k, not
renormalised unless norm_topk_prob) on every layer. clip_qkv (clamped q/k/v) is not served."""

from __future__ import annotations

from typing import Any

from lmserve.checkpoint.registry.family import LayerSpec, ModelFamily
from lmserve.checkpoint.registry.moe import moe_layers


def _layers(cfg: dict[str, Any], specs: tuple[LayerSpec, ...]) -> tuple[LayerSpec, ...]:
    if cfg.get("clip_qkv") is not None:
        raise ValueError(f"config field clip_qkv={cfg['clip_qkv']!r}: clamped q/k/v are not supported (null only)")
    return moe_layers(cfg, specs)


FAMILY = ModelFamily("olmoe", ("OlmoeForCausalLM",), qk_norm_whole=True, layers=_layers)
