"""Mixture-of-experts GGUF files for the tests, written from the tiny random HF MoE models as llama.cpp's
convert_hf_to_gguf.py lays them out (conversion/qwen.py Qwen2MoeModel / Qwen3MoeModel, olmo.py OlmoeModel, llama.py
LlamaModel for Mixtral, gpt_oss.py GptOssModel): experts stacked into 3-D (E, rows, cols) tensors, Mixtral's q/k rows
permuted, gpt-oss's gate_up split and its MXFP4 blocks repacked; names from gguf's own tensor name map and written
with gguf's writer (independent of lmserve's reader tables)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.gguf_helpers import llama_cpp_permute

GGUF_MOE_ARCH = {
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "MixtralForCausalLM": "llama",
    "OlmoeForCausalLM": "olmoe",
    "GptOssForCausalLM": "gpt-oss",
}
_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_W = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Mixtral's expert names
# the 2-D weights the converter keeps in float32 whatever the file type (conversion/base.py: FFN_GATE_INP[_SHEXP])
_ALWAYS_F32 = (".mlp.gate.", ".mlp.router.", ".block_sparse_moe.gate.", ".shared_expert_gate.")


def _is_expert(hf_name: str) -> bool:
    return ".experts." in hf_name or ".shared_expert." in hf_name


def expert_stacks(tensors: dict[str, torch.Tensor], arch: str) -> tuple[dict, dict]:
    """HF tensors → (the non-expert ones, {(layer, proj): (E, rows, cols) float32 / MXFP4 pairs, biases}) in the
    converter's layout: gate / up (E, I, H), down (E, H, I), gpt-oss biases split from gate_up's interleaving."""
    rest, stacks, per_expert = {}, {}, {}
    for name, t in tensors.items():
        m = _PER_EXPERT.fullmatch(name)
        if m:
            per_expert.setdefault((int(m.group(1)), _W.get(m.group(3), m.group(3))), {})[int(m.group(2))] = t.float()
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?", name)
        if not m:
            rest[name] = t
            continue
        layer, proj, kind = int(m.group(1)), m.group(2), m.group(3) or ""
        if arch == "gpt-oss" and kind in ("_blocks", "_scales"):  # GptOssModel.generate_extra_tensors
            if proj == "gate_up_proj":
                stacks[(layer, "gate_proj", kind)], stacks[(layer, "up_proj", kind)] = t[:, ::2], t[:, 1::2]
            else:
                stacks[(layer, "down_proj", kind)] = t
        elif arch == "gpt-oss" and kind == "_bias":
            if proj == "gate_up_proj":
                stacks[(layer, "gate_proj", ".bias")], stacks[(layer, "up_proj", ".bias")] = t[..., ::2], t[..., 1::2]
            else:
                stacks[(layer, "down_proj", ".bias")] = t
        elif arch == "gpt-oss":  # float: (E, H, 2I) interleaved / (E, I, H), transposed to (out, in)
            w = t.float().transpose(-1, -2)
            if proj == "gate_up_proj":
                stacks[(layer, "gate_proj", "")], stacks[(layer, "up_proj", "")] = w[:, ::2], w[:, 1::2]
            else:
                stacks[(layer, "down_proj", "")] = w
        elif proj == "gate_up_proj":  # transformers' own fused layout (E, 2I, H), gate rows first
            half = t.shape[1] // 2
            stacks[(layer, "gate_proj", "")], stacks[(layer, "up_proj", "")] = t[:, :half].float(), t[:, half:].float()
        else:
            stacks[(layer, "down_proj", "")] = t.float()
    for (layer, proj), experts in per_expert.items():
        stacks[(layer, proj, "")] = torch.stack([experts[e] for e in sorted(experts)])
    return rest, stacks


def _nibbles_to_ggml(blocks: torch.Tensor) -> torch.Tensor:
    """GptOssModel.transform_nibble_layout, as the converter writes it: HF's (2j low, 2j + 1 high) nibble pairs →
    ggml's (j low, j + 16 high)."""
    t_lo, t_hi = blocks & 0x0F, blocks & 0xF0
    tensor = (t_lo << 4) | (t_hi >> 4)
    blk_a, blk_b = tensor.chunk(2, dim=-1)
    blk_a = torch.stack(((blk_a & 0xF0).view(-1, 1), (blk_a << 4).view(-1, 1)), dim=2).view(tensor.shape)
    blk_b = torch.stack(((blk_b >> 4).view(-1, 1), (blk_b & 0x0F).view(-1, 1)), dim=2).view(tensor.shape)
    out = blk_a | blk_b
    return ((out & 0xF0) >> 4) | ((out & 0x0F) << 4)


def _quantized(array: np.ndarray, type_name: str):  # noqa: ANN202
    import gguf
    from tests.gguf_helpers import KQUANT_TYPES, quantize_kquant

    if type_name in KQUANT_TYPES:
        return quantize_kquant(array.reshape(-1, array.shape[-1]), type_name).reshape(*array.shape[:-1], -1)
    return gguf.quants.quantize(array, gguf.GGMLQuantizationType[type_name])


def write_moe_gguf(
    model_dir: Path, out: Path, expert_type: str = "F32", dense_type: str = "F32", fuse_gate_up: bool = False
) -> Path:
    """`model_dir` (a tiny HF MoE model) as the converter's GGUF file: expert stacks (and a shared expert) stored as
    `expert_type`, the other 2-D weights as `dense_type` (the router and shared-expert gate stay F32, as the
    converter keeps them), norms, biases and sinks F32; MXFP4 experts (`_blocks` / `_scales` in the HF checkpoint)
    repacked into ggml's blocks. fuse_gate_up: one `ffn_gate_up_exps` stack (the converter's --fuse-gate-up-exps)."""
    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    arch = GGUF_MOE_ARCH[cfg["architectures"][0]]
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper().replace("-", "_")], layers)
    dense_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    w = gguf.GGUFWriter(str(out), arch)
    _write_metadata(w, cfg, arch)
    rest, stacks = expert_stacks(load_file(model_dir / "model.safetensors"), arch)
    for name, tensor in sorted(rest.items()):
        array = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            array = llama_cpp_permute(array, heads)
        elif arch == "llama" and ".k_proj." in name:
            array = llama_cpp_permute(array, kv_heads)
        stem, suffix = name.rsplit(".", 1)
        if suffix == "sinks":  # GptOssModel.filter_tensors
            stem, suffix = name, "weight"
        qtype = (expert_type if _is_expert(name) else dense_type) if array.ndim == 2 else "F32"
        if any(part in name for part in _ALWAYS_F32) or stem.endswith("norm"):
            qtype = "F32"
        # (a dense layer among sparse ones, which llama.cpp's qwen*moe graphs lack: llama's dense ffn_* names)
        gguf_stem = name_map.get_name(stem) or dense_map.get_name(stem)
        assert gguf_stem is not None, f"{name}: not in gguf's {arch} tensor name map"
        add_tensor(w, f"{gguf_stem}.{suffix}", array, qtype)
    hf_stem = "layers.{}.feed_forward.experts.{}" if arch == "llama" else "model.layers.{}.mlp.experts.{}"
    llama_names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    for (layer, proj, kind), t in sorted(stacks.items()):
        if kind == "_scales" or (fuse_gate_up and proj == "up_proj" and kind == ""):
            continue
        stem = name_map.get_name(hf_stem.format(layer, llama_names[proj] if arch == "llama" else proj))
        if kind == "_blocks":  # GptOssModel.repack_mxfp4: the scale byte, then the nibbles in ggml's order
            scales = stacks[(layer, proj, "_scales")]
            data = torch.cat((scales.unsqueeze(-1), _nibbles_to_ggml(t)), dim=-1)
            w.add_tensor(f"{stem}.weight", data.reshape(*data.shape[:2], -1).numpy(),
                         raw_dtype=gguf.GGMLQuantizationType.MXFP4)  # fmt: skip
        elif kind == ".bias":
            add_tensor(w, f"{stem}.bias", t.float().numpy(), "F32")
        elif fuse_gate_up and proj == "gate_proj":  # conversion/base.py: cat((gate, up), dim=1)
            fused = torch.cat((t, stacks[(layer, "up_proj", "")]), dim=1).numpy()
            add_tensor(w, f"blk.{layer}.ffn_gate_up_exps.weight", fused, expert_type)
        else:
            add_tensor(w, f"{stem}.weight", t.numpy(), expert_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def add_tensor(w, name: str, array: np.ndarray, type_name: str) -> None:  # noqa: ANN001
    import gguf

    array = np.ascontiguousarray(array, dtype=np.float32)
    if type_name == "F32":
        w.add_tensor(name, array)
    else:
        w.add_tensor(name, _quantized(array, type_name), raw_dtype=gguf.GGMLQuantizationType[type_name])


def _write_metadata(w, cfg: dict, arch: str) -> None:  # noqa: ANN001
    """TextModel.set_gguf_parameters and the MoE models' additions."""
    import gguf

    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    w.add_rope_freq_base(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    w.add_layer_norm_rms_eps(1e-5 if arch == "olmoe" else cfg["rms_norm_eps"])  # (OlmoeModel writes 1e-5)
    w.add_expert_count(cfg.get("num_local_experts") or cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if arch == "llama":  # LlamaModel
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    if cfg.get("moe_intermediate_size"):  # Qwen2MoeModel (Qwen3MoeModel inherits it)
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch == "gpt-oss":  # GptOssModel, and the YaRN keys of TextModel
        w.add_sliding_window(cfg["sliding_window"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_eos_token_id(cfg["eos_token_id"])


def quantized_reference(model_dir: Path, out_dir: Path, expert_type: str, dense_type: str = "F32") -> Path:
    """A copy of `model_dir` whose weights are what write_moe_gguf(expert_type, dense_type) stores, dequantized by
    gguf: each quantized HF weight quantized and dequantized along its input dimension, as the file's rows are
    (stacking experts and permuting rows do not move a block)."""
    import gguf

    tensors = load_file(model_dir / "model.safetensors")
    for name, t in tensors.items():
        qtype = expert_type if _is_expert(name) else dense_type
        if t.dim() < 2 or qtype == "F32" or any(part in name for part in _ALWAYS_F32) or name.endswith("_bias"):
            continue
        assert not name.endswith(("experts.gate_up_proj", "experts.down_proj")) or "GptOss" not in str(model_dir), (
            "gpt-oss's float experts are input-major: quantize them as MXFP4 instead"
        )
        array = t.float().numpy()
        values = gguf.dequantize(_quantized(array, qtype), gguf.GGMLQuantizationType[qtype]).reshape(array.shape)
        tensors[name] = torch.from_numpy(np.array(values, dtype=np.float32))
    shutil.copytree(model_dir, out_dir)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir
