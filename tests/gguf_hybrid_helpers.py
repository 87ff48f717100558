"""A `qwen35` GGUF file from a tiny random Qwen3.5 checkpoint (tests/hybrid_helpers.py), written with gguf's writer as
llama.cpp's converter does it (convert_hf_to_gguf.py: Qwen3_5TextModel over Qwen3NextModel, `--no-mtp`), independently
of lmserve's reader tables: its names, metadata and tensor transforms."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.torch import load_file

from tests.gguf_helpers import HF_TO_GGUF

# HF name fragment → GGUF (gguf-py's tensor_mapping.py for QWEN35)
QWEN35_NAMES = {
    **HF_TO_GGUF,
    "post_attention_layernorm": "post_attention_norm",  # (llama's ffn_norm)
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.dt_proj": "ssm_dt",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
}


def _gguf_name(hf_name: str) -> str:
    """The converter's names: dt_bias is renamed dt_proj.bias first; A_log keeps no suffix (blk.N.ssm_a)."""
    if hf_name.endswith(".dt_bias"):
        hf_name = hf_name.removesuffix(".dt_bias") + ".dt_proj.bias"
    stem, suffix = hf_name.rsplit(".", 1)
    if suffix not in ("weight", "bias"):
        stem, suffix = hf_name, ""
    if stem in QWEN35_NAMES:
        out = QWEN35_NAMES[stem]
    else:
        _, _, layer, rest = stem.split(".", 3)  # model.layers.{i}.<rest>
        out = f"blk.{layer}.{QWEN35_NAMES[rest]}"
    return f"{out}.{suffix}" if suffix else out


def _reorder_v_heads(x: np.ndarray, axis: int, num_k: int, per_k: int, width: int) -> np.ndarray:
    """The converter's _LinearAttentionVReorderBase._reorder_v_heads: V heads grouped by K head → tiled."""
    shape = x.shape
    grouped = x.reshape(*shape[:axis], num_k, per_k, width, *shape[axis + 1 :])
    return np.swapaxes(grouped, axis, axis + 1).reshape(shape)


def _converted(name: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    """The converter's modify_tensors for one HF tensor: V-head reorder (K heads fewer than V heads), then
    Qwen3NextModel's A_log → -exp(A_log), conv1d squeezed, 1 added to the norms but the gated one."""
    num_k, num_v = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    k_dim, v_dim, per_k = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], num_v // num_k
    qk = 2 * num_k * k_dim
    if per_k > 1 and "linear_attn." in name:
        if ".in_proj_qkv." in name:
            w = np.concatenate([w[:qk], _reorder_v_heads(w[qk:], 0, num_k, per_k, v_dim)])
        elif ".in_proj_z." in name:
            w = _reorder_v_heads(w, 0, num_k, per_k, v_dim)
        elif ".in_proj_b." in name or ".in_proj_a." in name or ".A_log" in name or ".dt_bias" in name:
            w = _reorder_v_heads(w, 0, num_k, per_k, 1)
        elif ".conv1d" in name:
            w = w.squeeze()
            w = np.concatenate([w[:qk], _reorder_v_heads(w[qk:], 0, num_k, per_k, v_dim)])
        elif ".out_proj." in name:
            w = _reorder_v_heads(w, 1, num_k, per_k, v_dim)
    if name.endswith(".A_log"):
        w = -np.exp(w)
    elif "conv1d" in name:
        w = w.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        w = w + 1
    return w


def write_qwen35_gguf(model_dir: Path, out: Path, weight_type: str = "F32") -> Path:
    """`model_dir` (a tiny Qwen3_5ForCausalLM) as llama.cpp's converter writes it with `--no-mtp`: 2-D weights as
    `weight_type` (F16 where a row is not whole blocks of it), the rest F32."""
    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    n, head_dim = cfg["num_hidden_layers"], cfg["head_dim"]
    rope = cfg["rope_parameters"]
    w = gguf.GGUFWriter(str(out), "qwen35")
    w.add_block_count(n)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_uint32("qwen35.ssm.conv_kernel", cfg["linear_conv_kernel_dim"])
    w.add_uint32("qwen35.ssm.state_size", cfg["linear_key_head_dim"])
    w.add_uint32("qwen35.ssm.group_count", cfg["linear_num_key_heads"])
    w.add_uint32("qwen35.ssm.time_step_rank", cfg["linear_num_value_heads"])
    w.add_uint32("qwen35.ssm.inner_size", cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_array("qwen35.attention.recurrent_layers", [t == "linear_attention" for t in cfg["layer_types"]])
    w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    w.add_rope_dimension_sections([11, 11, 10, 0])  # (the converter's default: text positions make it plain RoPE)
    for name, tensor in sorted(load_file(model_dir / "model.safetensors").items()):
        array = _converted(name, tensor.float().numpy(), cfg).astype(np.float32)
        qtype_name = weight_type if array.ndim == 2 and "conv1d" not in name else "F32"
        if qtype_name != "F32" and array.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype_name]][0]:
            qtype_name = "F16"
        if qtype_name == "F32":
            w.add_tensor(_gguf_name(name), array)
        else:
            qtype = gguf.GGMLQuantizationType[qtype_name]
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def dequantized_qwen35_model(model_dir: Path, gguf_file: Path, out_dir: Path) -> Path:
    """A copy of `model_dir` whose quantized 2-D weights are what `gguf_file` stores, dequantized by gguf with the
    converter's V-head reorder undone (rows and columns only move, so that is exact); the float tensors as HF's."""
    import shutil

    import torch
    from safetensors.torch import save_file

    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    num_k, num_v = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    k_dim, v_dim, per_k = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], num_v // num_k
    qk = 2 * num_k * k_dim

    def back(x: np.ndarray, axis: int, width: int) -> np.ndarray:  # tiled → grouped
        shape = x.shape
        tiled = x.reshape(*shape[:axis], per_k, num_k, width, *shape[axis + 1 :])
        return np.swapaxes(tiled, axis, axis + 1).reshape(shape)

    stored = {t.name: t for t in gguf.GGUFReader(str(gguf_file)).tensors}
    weights = load_file(model_dir / "model.safetensors")
    for name in list(weights):
        t = stored[_gguf_name(name)]
        if t.tensor_type.name == "F32":
            continue
        w = np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(weights[name].shape)
        if per_k > 1 and ".in_proj_qkv." in name:
            w = np.concatenate([w[:qk], back(w[qk:], 0, v_dim)])
        elif per_k > 1 and ".in_proj_z." in name:
            w = back(w, 0, v_dim)
        elif per_k > 1 and (".in_proj_b." in name or ".in_proj_a." in name):
            w = back(w, 0, 1)
        elif per_k > 1 and ".linear_attn.out_proj." in name:
            w = back(w, 1, v_dim)
        weights[name] = torch.from_numpy(w)
    shutil.copytree(model_dir, out_dir)
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir
