"""Gemma 4 (text): Gemma 3's sandwich layout and sliding / global layers, with weight-only norms (no 1 + w), a
weightless norm on v, attention scale 1; global layers with their own head width (per_layer_config or
global_head_dim), proportional rotary, keys as values (attention_k_eq_v); the last num_kv_shared_layers attend
over the K/V of the last earlier layer of their type; per-layer inputs (hidden_size_per_layer_input). The text model
of a Gemma4ForConditionalGeneration checkpoint is served, its vision and audio towers skipped."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lmserve.model.registry.family import LayerSpec, ModelFamily


def layer_types(cfg: dict[str, Any], num_layers: int) -> list[str]:
    default = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)]
    types = cfg.get("layer_types") or default
    return [*types[:-1], "full_attention"]  # HF forces the last layer global


def kv_sources(types: list[str], num_shared: int) -> list[int | None]:
    """Each layer's K/V source: None for a layer with its own, else the last unshared layer of its type."""
    first = len(types) - num_shared
    if num_shared and (first <= 0 or not set(types[first:]) <= set(types[:first])):
        raise ValueError(f"num_kv_shared_layers={num_shared}: some shared layer type has no earlier layer to share")
    return [None if i < first else max(j for j in range(first) if types[j] == t) for i, t in enumerate(types)]


def layers(cfg: dict[str, Any], specs: tuple[LayerSpec, ...]) -> tuple[LayerSpec, ...]:
    if cfg.get("enable_moe_block"):
        raise ValueError("enable_moe_block: Gemma 4's mixture-of-experts block is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: only causal attention is supported")
    types = layer_types(cfg, len(specs))
    sources = kv_sources(types, int(cfg.get("num_kv_shared_layers") or 0))
    per_layer = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items() if str(k).isdigit()}
    k_eq_v = bool(cfg.get("attention_k_eq_v"))
    window = int(cfg["sliding_window"])
    out = []
    for i, (spec, t, src) in enumerate(zip(specs, types, sources, strict=True)):
        sliding = t == "sliding_attention"
        over = per_layer.get(i)
        if over is None and not sliding and not per_layer:  # a config before HF folded it into per_layer_config
            heads = cfg.get("num_global_key_value_heads") if k_eq_v else None
            over = {"head_dim": cfg.get("global_head_dim", 512), **({"num_key_value_heads": heads} if heads else {})}
        over = over or {}
        wide = cfg.get("use_double_wide_mlp") and src is not None
        out.append(replace(
            spec, sliding_window=window if sliding else None, rope="local" if sliding else "global", kv_source=src,
            head_dim=over.get("head_dim"), num_kv_heads=over.get("num_key_value_heads"), k_eq_v=k_eq_v and not sliding,
            intermediate_size=2 * int(cfg["intermediate_size"]) if wide else None,
        ))  # fmt: skip
    return tuple(out)


FAMILY = ModelFamily(
    "gemma4", ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"), hidden_act="gelu_tanh",
    norm_layout="sandwich", scaled_embeddings=True, qk_norm=True, v_norm=True, attn_scale=1.0, local_rope=True,
    sliding_layers="pattern", sliding_pattern=6, layers=layers,
    checkpoint_renames=(("model.language_model.", "model."),),
    checkpoint_skips=("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio."),
)  # fmt: skip
