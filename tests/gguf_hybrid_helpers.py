"""Hybrid GGUF files (`qwen35`, `qwen35moe`, `qwen3next`) from the tiny random checkpoints of tests/hybrid_helpers.py,
written with gguf's writer as llama.cpp's converter does it (convert_hf_to_gguf.py: Qwen3_5TextModel /
Qwen3_5MoeTextModel over _LinearAttentionVReorderBase over Qwen3NextModel over Qwen2MoeModel, `--no-mtp`),
independently of lmserve's reader tables: its names, metadata and tensor transforms."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from safetensors.torch import load_file

from tests.gguf_helpers import HF_TO_GGUF
from tests.gguf_moe_helpers import add_tensor, expert_stacks

HYBRID_ARCH = {
    "Qwen3_5ForCausalLM": "qwen35", "Qwen3_5MoeForCausalLM": "qwen35moe", "Qwen3NextForCausalLM": "qwen3next"
}  # fmt: skip
# HF name fragment → GGUF (gguf-py's tensor_mapping.py for QWEN35 / QWEN35MOE / QWEN3NEXT); a dense layer among
# Qwen3-Next's sparse ones (mlp_only_layers, which llama.cpp's QWEN3NEXT tensors lack) takes llama's ffn_* names
HYBRID_NAMES = {
    **HF_TO_GGUF,
    "post_attention_layernorm": "post_attention_norm",  # (llama's ffn_norm)
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.in_proj_ba": "ssm_ba",  # (Qwen3-Next; its in_proj_qkvz is split into attn_qkv and attn_gate)
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.dt_proj": "ssm_dt",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
# 2-D weights the converter keeps in float32 (conversion/base.py: FFN_GATE_INP[_SHEXP], SSM_CONV1D)
_ALWAYS_F32 = (".mlp.gate.", ".shared_expert_gate.", ".conv1d.")


def _gguf_name(hf_name: str) -> str:
    """The converter's names: dt_bias is renamed dt_proj.bias first; A_log keeps no suffix (blk.N.ssm_a)."""
    if hf_name.endswith(".dt_bias"):
        hf_name = hf_name.removesuffix(".dt_bias") + ".dt_proj.bias"
    stem, suffix = hf_name.rsplit(".", 1)
    if suffix not in ("weight", "bias"):
        stem, suffix = hf_name, ""
    if stem in HYBRID_NAMES:
        out = HYBRID_NAMES[stem]
    else:
        _, _, layer, rest = stem.split(".", 3)  # model.layers.{i}.<rest>
        out = f"blk.{layer}.{HYBRID_NAMES[rest]}"
    return f"{out}.{suffix}" if suffix else out


def _dims(cfg: dict) -> tuple[int, int, int, int, int]:
    """(K heads, V heads per K head, k width, v width, q + k channels)."""
    num_k, num_v, k_dim = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"]
    return num_k, num_v // num_k, k_dim, cfg["linear_value_head_dim"], 2 * num_k * k_dim


def _reorder_v_heads(x: np.ndarray, axis: int, num_k: int, per_k: int, width: int, back: bool = False) -> np.ndarray:
    """The converter's _LinearAttentionVReorderBase._reorder_v_heads: V heads grouped by K head → tiled (back: the
    inverse)."""
    shape = x.shape
    split = (per_k, num_k) if back else (num_k, per_k)
    return np.swapaxes(x.reshape(*shape[:axis], *split, width, *shape[axis + 1 :]), axis, axis + 1).reshape(shape)


def _split_qkvz(w: np.ndarray, cfg: dict) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3NextModel.modify_tensors: in_proj_qkvz's rows (per K head: q, k, its V heads' v, then z) → (q, k, v of
    every head, z of every head)."""
    num_k, per_k, k_dim, v_dim, _ = _dims(cfg)
    heads = w.reshape(num_k, 2 * k_dim + 2 * per_k * v_dim, -1)
    q, k, v, z = np.split(heads, np.cumsum([k_dim, k_dim, per_k * v_dim]), axis=1)
    return np.concatenate([p.reshape(-1, w.shape[-1]) for p in (q, k, v)]), z.reshape(-1, w.shape[-1])


def _converted(name: str, w: np.ndarray, cfg: dict, arch: str) -> list[tuple[str, np.ndarray]]:
    """The converter's modify_tensors for one HF tensor: the Qwen3.5 converters' V-head reorder (K heads fewer than V
    heads), then Qwen3NextModel's A_log → -exp(A_log), conv1d squeezed, 1 added to the norms but the gated one, and
    in_proj_qkvz split."""
    num_k, per_k, _, v_dim, qk = _dims(cfg)
    if arch != "qwen3next" and per_k > 1 and "linear_attn." in name:
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
    if ".in_proj_qkvz." in name:
        qkv, z = _split_qkvz(w, cfg)
        stem = name.removesuffix("in_proj_qkvz.weight")
        return [(_gguf_name(f"{stem}in_proj_qkv.weight"), qkv), (_gguf_name(f"{stem}in_proj_z.weight"), z)]
    return [(_gguf_name(name), w)]


def _type_for(array: np.ndarray, weight_type: str) -> str:
    """`weight_type`, or F16 where a row is not whole blocks of it."""
    import gguf

    if weight_type != "F32" and array.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[weight_type]][0]:
        return "F16"
    return weight_type


def write_hybrid_gguf(model_dir: Path, out: Path, weight_type: str = "F32", expert_type: str | None = None) -> Path:
    """`model_dir` (a tiny Qwen3.5 / Qwen3.5-MoE / Qwen3-Next) as llama.cpp's converter writes it with `--no-mtp`:
    2-D weights as `weight_type` and the expert stacks as `expert_type` (default: the same; MXFP4 as
    llama-quantize's MXFP4_MOE), F16 where a row is not whole blocks of it; the routers, the shared-expert gate, the
    conv kernels, norms and 1-D tensors F32."""
    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    arch = HYBRID_ARCH[cfg["architectures"][0]]
    n, head_dim = cfg["num_hidden_layers"], cfg["head_dim"]
    rope = cfg["rope_parameters"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(n)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if "num_experts" in cfg:  # TextModel's expert counts, Qwen2MoeModel's widths
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_uint32(f"{arch}.ssm.conv_kernel", cfg["linear_conv_kernel_dim"])
    w.add_uint32(f"{arch}.ssm.state_size", cfg["linear_key_head_dim"])
    w.add_uint32(f"{arch}.ssm.group_count", cfg["linear_num_key_heads"])
    w.add_uint32(f"{arch}.ssm.time_step_rank", cfg["linear_num_value_heads"])
    w.add_uint32(f"{arch}.ssm.inner_size", cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in cfg["layer_types"]])
    w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    if arch != "qwen3next":  # (_Qwen35MRopeMixin's default: text positions make it plain RoPE)
        w.add_rope_dimension_sections([11, 11, 10, 0])
    rest, stacks = expert_stacks(load_file(model_dir / "model.safetensors"), arch)
    for name, tensor in sorted(rest.items()):
        for gguf_name, array in _converted(name, tensor.float().numpy(), cfg, arch):
            f32 = array.ndim != 2 or any(part in name for part in _ALWAYS_F32)
            add_tensor(w, gguf_name, array.astype(np.float32), "F32" if f32 else _type_for(array, weight_type))
    for (layer, proj, _), t in sorted(stacks.items()):  # Qwen2MoeModel: the experts stacked, (E, rows, cols)
        array = t.numpy()
        stem = f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight"
        add_tensor(w, stem, array, _type_for(array, expert_type or weight_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def dequantized_hybrid_model(model_dir: Path, gguf_file: Path, out_dir: Path) -> Path:
    """A copy of `model_dir` whose quantized weights are what `gguf_file` stores, dequantized by gguf with the
    converter's moves undone (the V-head reorder, Qwen3-Next's qkvz split, the expert stacking: rows and columns only
    move, so that is exact); the float32 tensors as HF's."""
    import shutil

    import torch
    from safetensors.torch import save_file

    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    arch = HYBRID_ARCH[cfg["architectures"][0]]
    num_k, per_k, k_dim, v_dim, qk = _dims(cfg)
    tiled = arch != "qwen3next" and per_k > 1
    stored = {t.name: t for t in gguf.GGUFReader(str(gguf_file)).tensors}

    def read(name: str) -> np.ndarray | None:  # the file's values in HF's row-major shape, None for F32 (as HF's)
        t = stored[name]
        if t.tensor_type.name == "F32":
            return None
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        return np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)

    weights = load_file(model_dir / "model.safetensors")
    for name in list(weights):
        expert = _EXPERT.fullmatch(name)
        if expert:
            stack = read(f"blk.{expert.group(1)}.ffn_{expert.group(3)}_exps.weight")
            w = None if stack is None else stack[int(expert.group(2))]
        elif ".in_proj_qkvz." in name:  # per K head: its q, k, v and z rows again
            qkv, z = read(_gguf_name(name.replace("qkvz", "qkv"))), read(_gguf_name(name.replace("qkvz", "z")))
            parts = [] if qkv is None else [qkv[: qk // 2], qkv[qk // 2 : qk], qkv[qk:], z]
            w = np.concatenate([p.reshape(num_k, -1, p.shape[-1]) for p in parts], 1) if parts else None
        else:
            w = read(_gguf_name(name))
        if w is None:
            continue
        if tiled and ".in_proj_qkv." in name:
            w = np.concatenate([w[:qk], _reorder_v_heads(w[qk:], 0, num_k, per_k, v_dim, back=True)])
        elif tiled and ".in_proj_z." in name:
            w = _reorder_v_heads(w, 0, num_k, per_k, v_dim, back=True)
        elif tiled and (".in_proj_b." in name or ".in_proj_a." in name):
            w = _reorder_v_heads(w, 0, num_k, per_k, 1, back=True)
        elif tiled and ".linear_attn.out_proj." in name:
            w = _reorder_v_heads(w, 1, num_k, per_k, v_dim, back=True)
        weights[name] = torch.from_numpy(np.ascontiguousarray(w).reshape(weights[name].shape))
    shutil.copytree(model_dir, out_dir)
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir
