"""GGUF `qwen35` (Qwen3.5, dense) as data for checkpoint/gguf_arch.py: the Gated DeltaNet tensor names and metadata,
and the inverse of what llama.cpp's converter does to them (V heads reordered from grouped-by-K-head to tiled,
A_log stored as -exp(A_log), dt_bias as ssm_dt.bias, the conv kernel squeezed, 1 added to the (1 + w) norms), so the
HF-named weights the hybrid layers read come back. The multi-token-prediction blocks after the trunk are skipped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

Transform = Callable[[np.ndarray], np.ndarray]

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


def qwen35_config(meta: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """The trunk's layers (block_count less nextn_predict_layers), linear / full layers from recurrent_layers (else
    every full_attention_interval-th full), the Gated DeltaNet shape from the ssm keys, partial rotary."""

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
    out.update(
        architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", num_hidden_layers=n, head_dim=head_dim,
        linear_num_key_heads=num_k, linear_num_value_heads=num_v, linear_key_head_dim=int(get("ssm.state_size")),
        linear_value_head_dim=inner // num_v, linear_conv_kernel_dim=int(get("ssm.conv_kernel")),
        layer_types=["linear_attention" if lin else "full_attention" for lin in linear],
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.get("rope_theta", 10000.0)),
                         "partial_rotary_factor": rotary / head_dim},
    )  # fmt: skip
    return out


def _tiled_to_grouped(x: np.ndarray, axis: int, num_k: int, per_k: int, width: int) -> np.ndarray:
    """Undo the converter's _reorder_v_heads along `axis`: V heads (per K head, tiled: r-major) back to HF's order
    (grouped by K head: k-major), each head `width` wide."""
    shape = x.shape
    tiled = x.reshape(*shape[:axis], per_k, num_k, width, *shape[axis + 1 :])
    return np.swapaxes(tiled, axis, axis + 1).reshape(shape)


def qwen35_transform(cfg: dict[str, Any], hf_name: str) -> Transform | None:
    """The float transform that gives tensor `hf_name` back as HF saved it (None: as it is in the file)."""
    stem = hf_name.removesuffix(".weight")
    if stem.endswith("norm") and not stem.endswith("linear_attn.norm"):
        return lambda w: w - np.float32(1.0)  # (exact: the converter's w + 1 lies in [0.5, 2])
    if ".linear_attn." not in hf_name:
        return None
    num_k, num_v = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    k_dim, v_dim = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
    per_k, qk = num_v // num_k, 2 * num_k * k_dim
    part = stem.rpartition(".")[2]

    def heads(x: np.ndarray, axis: int = 0, width: int = 1) -> np.ndarray:
        return x if per_k == 1 else _tiled_to_grouped(x, axis, num_k, per_k, width)

    def v_rows(x: np.ndarray) -> np.ndarray:  # q and k channels first, then v
        return np.concatenate([x[:qk], heads(x[qk:], 0, v_dim)])

    transforms: dict[str, Transform] = {
        "in_proj_qkv": v_rows,
        "in_proj_z": lambda w: heads(w, 0, v_dim),
        "in_proj_b": heads,
        "in_proj_a": heads,
        "dt_bias": heads,
        "A_log": lambda a: np.log(-heads(a).astype(np.float64)).astype(np.float32),
        "conv1d": lambda w: v_rows(w)[:, None, :],  # (channels, kernel) → HF's (channels, 1, kernel)
        "out_proj": lambda w: heads(w, 1, v_dim),
    }
    return transforms.get(part)
