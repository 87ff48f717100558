"""The GGUF architectures beyond llama / qwen2 / qwen3, as data: the HF architecture each is, the tensor names it
adds to the reader's shared tables, and how its metadata becomes the family's HF config keys (llama.cpp's
convert_hf_to_gguf.py, inverted). Read by checkpoint/gguf.py; no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import numpy as np

from lmserve.checkpoint import gguf_moe
from lmserve.checkpoint.gguf_hybrid import (
    HYBRID_ARCHITECTURES,
    QWEN35_LAYER_TENSORS,
    QWEN35_UNSUFFIXED,
    Part,
    Reorder,
    Transform,
    block_order,
    hybrid_config,
    hybrid_reorder,
    hybrid_split,
    hybrid_transform,
    moved,
)


class GGUFMetadata(Protocol):
    """What a config hook reads of the file (GGUFCheckpoint): metadata fields and raw tensors by GGUF name."""

    architecture: str

    def field(self, key: str, default: Any = None) -> Any: ...

    def raw_tensor(self, name: str) -> Any: ...


@dataclass(frozen=True)
class GGUFArch:
    """One `general.architecture`: its HF architecture and what the reader needs beyond llama's tables."""

    hf_architecture: str
    permuted_qk: bool = False  # the converter interleaved q/k rows for its RoPE kernel (LlamaModel.permute)
    layer_tensors: Mapping[str, str] = field(default_factory=dict)  # `blk.{i}.<stem>` → HF stem, over the shared
    global_tensors: Mapping[str, str] = field(default_factory=dict)  # GGUF stem → HF name stem, over the shared
    unsuffixed: tuple[str, ...] = ()  # HF stems saved without ".weight" (a buffer the converter suffixed)
    config_tensors: tuple[str, ...] = ()  # GGUF stems read into the config (by `config`), not loaded as weights
    # (file, the generic HF config) -> the family's HF config
    config: Callable[[GGUFMetadata, dict[str, Any]], dict[str, Any]] | None = None
    partial_rotary: bool = False  # rope.dimension_count below the head width is the config's (its hook reads it)
    # (the family's HF config, HF name) -> the float transform undoing the converter's, or None
    transform: Callable[[dict[str, Any], str], Transform | None] | None = None
    # (the family's HF config, HF name) -> (axis, index) of the rows / columns the converter moved, or None: applied
    # to the file's blocks where whole blocks move (the tensor keeps its type), else as a float transform
    reorder: Callable[[dict[str, Any], str], Reorder | None] | None = None
    trunk_key: str | None = None  # metadata key counting blocks after the trunk not served (an MTP head)
    # (the family's HF config, GGUF name, shape, raw) -> the parts of a tensor the converter fused, or None
    split: Callable[[dict[str, Any], str, tuple[int, ...], np.ndarray], list[Part] | None] | None = None

    def moves(self, cfg: dict[str, Any], hf_name: str, block_size: int) -> tuple[Transform | None, Reorder | None]:
        """(float transform, reorder) undoing the converter's moves of tensor `hf_name`: a reorder of columns in runs
        narrower than the type's blocks (`block_size` weights) comes back as a float transform (dequantized)."""
        transform = self.transform(cfg, hf_name) if self.transform else None
        reorder = self.reorder(cfg, hf_name) if self.reorder else None
        if reorder is None or reorder[0] == 0 or block_order(reorder[1], block_size) is not None:
            return transform, reorder  # (rows: a GGUF row is whole blocks)
        assert transform is None, f"{hf_name}: a float transform and a reorder"
        return partial(moved, order=reorder), None

    def parts(self, cfg: dict[str, Any], name: str, shape: tuple[int, ...], raw: np.ndarray) -> list[Part] | None:
        """(GGUF name, HF name, shape, raw) of each part a tensor is read as (an expert stack's per-expert views, a
        fused tensor's parts: each keeps the file's type), or None for a tensor read whole."""
        if gguf_moe.expert_stack(name) is not None:
            return gguf_moe.split_expert_stack(name, shape, raw)
        return self.split(cfg, name, shape, raw) if self.split else None


# OLMo 2 / Gemma: norms on the sublayer outputs (gguf's ATTN_POST_NORM / FFN_POST_NORM)
POST_NORMS = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


def _array(value: Any, n: int, key: str) -> list[Any]:
    """A per-layer metadata value: an array of n entries, or one value for every layer."""
    values = list(value) if isinstance(value, list | tuple) else [value] * n
    if len(values) != n:
        raise ValueError(f"GGUF {key} has {len(values)} entries for {n} layers")
    return values


def _one_per_type(values: list[Any], types: list[str], key: str) -> dict[str, Any]:
    """{layer type: its value} of a per-layer array that holds one value per layer type."""
    out: dict[str, Any] = {}
    for v, t in zip(values, types, strict=True):
        if out.setdefault(t, v) != v:
            raise ValueError(f"GGUF {key}: {t} layers with different values ({out[t]}, {v}) are not supported")
    return out


def smollm3_config(meta: GGUFMetadata, cfg: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp reads no key for it: every 4th layer has no RoPE (llama_model_smollm3: n_no_rope_layer_step = 4)
    return {**cfg, "no_rope_layer_interval": 4}


def olmo2_config(meta: GGUFMetadata, cfg: dict[str, Any]) -> dict[str, Any]:
    """OLMo 2, or OLMo 3 where the file has a sliding window: its layers by the window pattern (a per-layer array, or
    every n-th layer global; default 4), the full layers with the file's RoPE scaling, the sliding ones without."""
    window = meta.field("olmo2.attention.sliding_window")
    if not window:
        return cfg
    n = int(cfg["num_hidden_layers"])
    pattern = meta.field("olmo2.attention.sliding_window_pattern", 4)
    if isinstance(pattern, list):
        sliding = [bool(s) for s in _array(pattern, n, "olmo2.attention.sliding_window_pattern")]
    else:  # llama.cpp's set_swa_pattern: the last of every `pattern` layers is global
        sliding = [i % int(pattern) < int(pattern) - 1 for i in range(n)]
    out = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling")}
    theta = float(cfg.get("rope_theta", 10000.0))
    full = {"rope_type": "default", "rope_theta": theta, **(cfg.get("rope_scaling") or {})}
    local = {"rope_type": "default", "rope_theta": float(meta.field("olmo2.rope.freq_base_swa", theta))}
    out.update(
        architectures=["Olmo3ForCausalLM"], model_type="olmo3", sliding_window=int(window),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        rope_parameters={"full_attention": full, "sliding_attention": local},
    )  # fmt: skip
    return out


def gemma4_config(meta: GGUFMetadata, cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4 (text): layer types, per-type head widths and KV heads, the double-wide MLPs of the KV-sharing layers,
    keys as values where the global layers have no attn_v, and the global layers' proportional RoPE from rope_freqs
    (1 for a turning pair, 1e30 for a still one)."""

    def get(key: str, default: Any = None) -> Any:
        return meta.field(f"gemma4.{key}", default)

    if get("expert_count"):
        raise ValueError("GGUF gemma4 with experts (Gemma 4's mixture-of-experts block) is not supported")
    n = int(cfg["num_hidden_layers"])
    pattern = get("attention.sliding_window_pattern")
    if not isinstance(pattern, list):
        raise ValueError("GGUF gemma4.attention.sliding_window_pattern: expected one flag per layer")
    types = ["sliding_attention" if s else "full_attention" for s in _array(pattern, n, "sliding_window_pattern")]
    head_full, head_swa = int(get("attention.key_length")), int(get("attention.key_length_swa"))
    if (get("attention.value_length", head_full), get("attention.value_length_swa", head_swa)) != (head_full, head_swa):
        raise ValueError("GGUF gemma4: value heads wider or narrower than the key heads are not supported")
    if isinstance(get("attention.head_count"), list):
        raise ValueError("GGUF gemma4.attention.head_count: a per-layer head count is not supported")
    if (get("rope.dimension_count", head_full), get("rope.dimension_count_swa", head_swa)) != (head_full, head_swa):
        raise ValueError("GGUF gemma4: partial rotary on the sliding layers is not supported")
    kv_heads = _array(get("attention.head_count_kv"), n, "gemma4.attention.head_count_kv")
    kv = _one_per_type(kv_heads, types, "gemma4.attention.head_count_kv")
    shared = int(get("attention.shared_kv_layers", 0))
    first_shared = n - shared
    ff = _array(get("feed_forward_length"), n, "gemma4.feed_forward_length")
    wide = [ff[0]] * first_shared + [2 * ff[0]] * shared
    if ff != [ff[0]] * n and ff != wide:
        raise ValueError(f"GGUF gemma4.feed_forward_length {ff}: only the KV-sharing layers may be double-wide")
    own_global = [i for i, t in enumerate(types) if t == "full_attention" and i < first_shared]
    no_v = {meta.raw_tensor(f"blk.{i}.attn_v.weight") is None for i in own_global}
    if len(no_v) > 1:
        raise ValueError("GGUF gemma4: some global layers have attn_v and some have none")
    freqs = meta.raw_tensor("rope_freqs.weight")
    if freqs is None:
        raise ValueError("GGUF gemma4 has no rope_freqs tensor (the global layers' proportional RoPE)")
    freqs = np.asarray(freqs.data, dtype=np.float32).reshape(-1)
    turning = int(np.sum(freqs == 1.0))
    if len(freqs) != head_full // 2 or not np.all(freqs[:turning] == 1.0) or not np.all(freqs[turning:] >= 1e20):
        raise ValueError("GGUF gemma4 rope_freqs: expected 1 for the turning pairs then 1e30 (proportional RoPE)")
    per_layer_table = meta.raw_tensor("per_layer_token_embd.weight")
    out = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling")}
    out.update(
        architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", layer_types=types,
        sliding_window=int(get("attention.sliding_window")), head_dim=head_swa,
        num_key_value_heads=int(kv.get("sliding_attention", kv_heads[0])), intermediate_size=int(ff[0]),
        use_double_wide_mlp=bool(shared) and ff == wide and ff != [ff[0]] * n, num_kv_shared_layers=shared,
        attention_k_eq_v=no_v == {True},
        per_layer_config={
            str(i): {"head_dim": head_full, "num_key_value_heads": int(kv_heads[i])}
            for i, t in enumerate(types) if t == "full_attention"
        },
        hidden_size_per_layer_input=int(get("embedding_length_per_layer_input", 0) or 0),
        vocab_size_per_layer_input=0 if per_layer_table is None else int(per_layer_table.shape[-1]),
        final_logit_softcapping=get("final_logit_softcapping"),
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", 10000.0))},
            "full_attention": {"rope_type": "proportional", "rope_theta": float(get("rope.freq_base", 1e6)),
                               "partial_rotary_factor": 2 * turning / head_full},
        },
    )  # fmt: skip
    return out


GGUF_ARCHS: dict[str, GGUFArch] = {
    "smollm3": GGUFArch("SmolLM3ForCausalLM", permuted_qk=True, config=smollm3_config),
    "olmo2": GGUFArch("Olmo2ForCausalLM", layer_tensors=POST_NORMS, config=olmo2_config),  # (and OLMo 3)
    "gemma4": GGUFArch(
        "Gemma4ForCausalLM",
        layer_tensors={
            **POST_NORMS,
            "ffn_norm": "pre_feedforward_layernorm",
            "inp_gate": "per_layer_input_gate",
            "proj": "per_layer_projection",
            "post_norm": "post_per_layer_input_norm",
            "layer_output_scale": "layer_scalar",
        },
        global_tensors={
            "per_layer_token_embd": "model.embed_tokens_per_layer",
            "per_layer_model_proj": "model.per_layer_model_projection",
            "per_layer_proj_norm": "model.per_layer_projection_norm",
        },
        unsuffixed=("layer_scalar",),
        config_tensors=("rope_freqs",),
        config=gemma4_config,
    ),
}
# the hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): one table, their differences in gguf_hybrid.py's hooks
GGUF_ARCHS.update(
    (arch, GGUFArch(hf_arch, layer_tensors=QWEN35_LAYER_TENSORS, unsuffixed=QWEN35_UNSUFFIXED, config=hybrid_config,
                    partial_rotary=True, transform=hybrid_transform, reorder=hybrid_reorder,
                    trunk_key="nextn_predict_layers", split=hybrid_split))
    for arch, (hf_arch, _) in HYBRID_ARCHITECTURES.items()
)  # fmt: skip
