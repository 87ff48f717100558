"""GGUF hybrid files as data for checkpoint/gguf_arch.py: `qwen35` (Qwen3.5), `qwen35moe` (Qwen3.5-MoE) and
`qwen3next` (Qwen3-Next; their experts are gguf_moe.py's). The Gated DeltaNet tensor names and metadata, and the
inverse of what llama.cpp's converter does to them (Qwen3.5's V heads reordered from grouped-by-K-head to tiled, A_log
stored as -exp(A_log), dt_bias as ssm_dt.bias, the conv kernel squeezed, 1 added to the (1 + w) norms; Qwen3-Next's
in_proj_ba split back into b and a), so the HF-named weights the hybrid layers read come back. MTP blocks skipped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from lmserve.checkpoint.gguf_moe import MOE_ARCHITECTURES

Transform = Callable[[np.ndarray], np.ndarray]
# (GGUF name, HF name, row-major shape, raw rows) of a part of a tensor the converter fused
Part = tuple[str, str, tuple[int, ...], np.ndarray]
# (axis, index): HF's tensor is the file's with its rows (axis 0) or columns (axis 1) taken in `index` order
Reorder = tuple[int, np.ndarray]

# GGUF `general.architecture` → (HF architecture, model_type)
HYBRID_ARCHITECTURES = {
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    **{arch: MOE_ARCHITECTURES[arch] for arch in ("qwen35moe", "qwen3next")},
}
# the model types whose converter tiles the V heads (_LinearAttentionVReorderBase); Qwen3NextModel keeps HF's order
TILED_V_HEADS = ("qwen3_5_text", "qwen3_5_moe_text")

QWEN35_LAYER_TENSORS = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt": "linear_attn.dt_bias",  # (the file's ssm_dt.bias)
    "ssm_a": "linear_attn.A_log",  # (the file's ssm_a, no suffix)
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
QWEN35_UNSUFFIXED = ("dt_bias", "A_log")
# what a layer needs (suffixed as in the file): a linear-attention one (and Qwen3.5's b / a or Qwen3-Next's fused ba),
# a full-attention one, a sparse one's routed experts beyond its router and down stack
LINEAR_TENSORS = ("attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a",
                  "ssm_norm.weight", "ssm_out.weight")  # fmt: skip
BETA_ALPHA = ("ssm_beta.weight", "ssm_alpha.weight")
FULL_ATTENTION_TENSORS = tuple(f"attn_{p}.weight" for p in ("q", "k", "v", "output", "q_norm", "k_norm"))
EXPERT_GATE_UP = ("ffn_gate_exps.weight", "ffn_up_exps.weight")
# the Gated DeltaNet Linears whose V-head reorder the reader applies to the file's data (blocks kept, gguf.py)
REORDERED_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


def hybrid_config(meta: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """The trunk's layers (block_count less nextn_predict_layers), linear / full layers from recurrent_layers (else
    every full_attention_interval-th full), the Gated DeltaNet shape from the ssm keys, partial rotary; a
    ValueError naming the first tensor a layer of the trunk lacks."""

    def get(key: str, default: Any = None) -> Any:
        return meta.field(f"{meta.architecture}.{key}", default)

    n = int(cfg["num_hidden_layers"]) - int(get("nextn_predict_layers", 0) or 0)
    num_k, num_v = int(get("ssm.group_count")), int(get("ssm.time_step_rank"))
    inner = int(get("ssm.inner_size"))
    if inner % num_v or num_v % num_k:
        raise ValueError(f"GGUF {meta.architecture}: ssm.inner_size {inner} / time_step_rank {num_v} / group_count "
                         f"{num_k} do not divide")  # fmt: skip
    recurrent = get("attention.recurrent_layers")
    if isinstance(recurrent, list):
        linear = [bool(r) for r in recurrent[:n]]
    else:
        interval = int(get("full_attention_interval", 4))
        linear = [(i + 1) % interval != 0 for i in range(n)]
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    rotary = int(get("rope.dimension_count", head_dim))
    out = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling")}
    hf_arch, model_type = HYBRID_ARCHITECTURES[meta.architecture]
    if "mlp_only_layers" in cfg:  # (gguf_moe's, over every block: the trunk's only)
        out["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < n]
    out.update(
        architectures=[hf_arch], model_type=model_type, num_hidden_layers=n, head_dim=head_dim,
        linear_num_key_heads=num_k, linear_num_value_heads=num_v, linear_key_head_dim=int(get("ssm.state_size")),
        linear_value_head_dim=inner // num_v, linear_conv_kernel_dim=int(get("ssm.conv_kernel")),
        layer_types=["linear_attention" if lin else "full_attention" for lin in linear],
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.get("rope_theta", 10000.0)),
                         "partial_rotary_factor": rotary / head_dim},
    )  # fmt: skip
    _check_layers(meta, out)
    return out


def _check_layers(meta: Any, cfg: dict[str, Any]) -> None:
    """ValueError naming the first tensor llama.cpp's loader requires that a trunk layer lacks."""
    linear = [*LINEAR_TENSORS, *(["ssm_ba.weight"] if cfg["model_type"] == "qwen3_next" else BETA_ALPHA)]
    dense = set(cfg.get("mlp_only_layers", ())) if "num_experts" in cfg else set(range(len(cfg["layer_types"])))
    shared = ["ffn_gate_inp_shexp.weight", *(f"ffn_{p}_shexp.weight" for p in ("gate", "up", "down"))]
    for i, layer_type in enumerate(cfg["layer_types"]):
        needed = ["attn_norm.weight", "post_attention_norm.weight"]
        needed += linear if layer_type == "linear_attention" else FULL_ATTENTION_TENSORS
        if i in dense:
            needed += [f"ffn_{p}.weight" for p in ("gate", "up", "down")]
        else:
            fused = meta.raw_tensor(f"blk.{i}.ffn_gate_up_exps.weight") is not None
            needed += ["ffn_gate_inp.weight", "ffn_down_exps.weight", *(() if fused else EXPERT_GATE_UP)]
            needed += shared if cfg.get("shared_expert_intermediate_size") else []
        missing = next((f"blk.{i}.{t}" for t in needed if meta.raw_tensor(f"blk.{i}.{t}") is None), None)
        if missing is not None:
            raise ValueError(f"GGUF file: tensor {missing!r} is missing ({meta.architecture} layer {i}, a "
                             f"{layer_type.replace('_', ' ')} layer, needs it)")  # fmt: skip


def _tiled_to_grouped(x: np.ndarray, axis: int, num_k: int, per_k: int, width: int) -> np.ndarray:
    """Undo the converter's _reorder_v_heads along `axis`: V heads (per K head, tiled: r-major) back to HF's order
    (grouped by K head: k-major), each head `width` wide."""
    shape = x.shape
    tiled = x.reshape(*shape[:axis], per_k, num_k, width, *shape[axis + 1 :])
    return np.swapaxes(tiled, axis, axis + 1).reshape(shape)


def _v_head_order(cfg: dict[str, Any], part: str) -> Reorder | None:
    """(axis, index) undoing the converter's V-head reorder of Gated DeltaNet tensor `part`: HF's tensor is the
    file's taken in `index` order along `axis` (rows, or out_proj's columns); None where nothing moved."""
    num_k, num_v = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    if cfg["model_type"] not in TILED_V_HEADS or num_v == num_k:
        return None
    per_k, v_dim, qk = num_v // num_k, int(cfg["linear_value_head_dim"]), 2 * num_k * int(cfg["linear_key_head_dim"])

    def heads(width: int) -> np.ndarray:
        return _tiled_to_grouped(np.arange(num_v * width), 0, num_k, per_k, width)

    channels = (0, np.concatenate([np.arange(qk), qk + heads(v_dim)]))  # q and k channels first, then v
    orders = {
        "in_proj_qkv": channels,
        "conv1d": channels,
        "in_proj_z": (0, heads(v_dim)),
        **{p: (0, heads(1)) for p in ("in_proj_b", "in_proj_a", "dt_bias", "A_log")},
        "out_proj": (1, heads(v_dim)),
    }
    return orders.get(part)


def moved(x: np.ndarray, order: Reorder | None) -> np.ndarray:
    """`x` with its rows or columns taken in `order` (as floats)."""
    return x if order is None else np.take(x, order[1], axis=order[0])


def block_order(index: np.ndarray, block: int) -> np.ndarray | None:
    """The order of `block`-wide runs of an element order that moves only whole runs (None when it splits one)."""
    if len(index) % block:
        return None
    runs = index.reshape(-1, block)
    if np.any(runs[:, 0] % block) or np.any(runs != runs[:, :1] + np.arange(block)):
        return None
    return runs[:, 0] // block


def hybrid_reorder(cfg: dict[str, Any], hf_name: str) -> Reorder | None:
    """The V-head reorder of a Gated DeltaNet projection (in_proj_qkv / z / b / a, out_proj) as (axis, index): whole
    rows or columns move, so the reader applies it to the file's blocks too (GGUFTensor.reorder). None otherwise."""
    stem = hf_name.removesuffix(".weight")
    if ".linear_attn." not in hf_name or stem.rpartition(".")[2] not in REORDERED_PROJECTIONS:
        return None
    return _v_head_order(cfg, stem.rpartition(".")[2])


def hybrid_transform(cfg: dict[str, Any], hf_name: str) -> Transform | None:
    """The float transform that gives tensor `hf_name` back as HF saved it (None: as it is in the file, or moved by
    hybrid_reorder): the norms' w - 1, and the small float32 tensors dt_bias, A_log and conv1d."""
    stem = hf_name.removesuffix(".weight")
    if stem.endswith("norm") and not stem.endswith("linear_attn.norm"):
        return lambda w: w - np.float32(1.0)  # (exact: the converter's w + 1 lies in [0.5, 2])
    if ".linear_attn." not in hf_name:
        return None
    part = stem.rpartition(".")[2]
    order = _v_head_order(cfg, part)
    transforms: dict[str, Transform] = {
        "dt_bias": lambda b: moved(b, order),
        "A_log": lambda a: np.log(-moved(a, order).astype(np.float64)).astype(np.float32),
        "conv1d": lambda w: moved(w, order)[:, None, :],  # (channels, kernel) → HF's (channels, 1, kernel)
    }
    return transforms.get(part)


def hybrid_split(cfg: dict[str, Any], gguf_name: str, shape: tuple[int, ...], raw: np.ndarray) -> list[Part] | None:
    """Qwen3-Next's `blk.N.ssm_ba` (HF's in_proj_ba, stored as it is: per K head its V heads' b rows, then their a
    rows) as in_proj_b and in_proj_a, V heads grouped by K head as Qwen3.5's: the file's rows (blocks for a
    quantized type) regrouped, each part keeping the type. None for any other tensor."""
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] != "ssm_ba" or parts[3] != "weight":
        return None
    num_k, num_v = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    if len(shape) != 2 or shape[0] != 2 * num_v:
        raise ValueError(f"GGUF tensor {gguf_name!r}: shape {shape}, expected ({2 * num_v}, hidden): b and a rows "
                         f"of {num_v} value heads (ssm.time_step_rank)")  # fmt: skip
    rows = raw.reshape(num_k, 2, num_v // num_k, -1)
    layer = f"model.layers.{parts[1]}.linear_attn"
    return [(f"{gguf_name}[{p}]", f"{layer}.in_proj_{p}.weight", (num_v, shape[1]), rows[:, i].reshape(num_v, -1))
            for i, p in enumerate("ba")]  # fmt: skip
