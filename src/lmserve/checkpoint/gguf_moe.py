"""GGUF mixture-of-experts files as llama.cpp's converter writes them (qwen3moe, qwen2moe, llama with experts =
Mixtral, olmoe, gpt-oss, and the hybrids qwen35moe / qwen3next, whose other layers are gguf_hybrid.py's): their
metadata → the HF config's MoE fields, the 3-D `blk.N.ffn_*_exps` stacks split into per-expert views of the file's
bytes (nothing copied, so each expert keeps its type), the routers and shared experts' names, and ggml's block_mxfp4
→ HF's MXFP4 `_blocks` / `_scales`. Numpy only; gguf.py calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

# GGUF `general.architecture` → (HF architecture, HF model_type); a "llama" file with `llama.expert_count` is Mixtral
MOE_ARCHITECTURES = {
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "olmoe": ("OlmoeForCausalLM", "olmoe"),
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
    "qwen3next": ("Qwen3NextForCausalLM", "qwen3_next"),
}
MIXTRAL = ("MixtralForCausalLM", "mixtral")
# llama.cpp's graphs (src/models/*.cpp, build_moe_ffn's norm_w): whether the top-k weights are renormalised, unless
# the file says (`{arch}.expert_weights_norm`); Mixtral always renormalises, gpt-oss softmaxes over the k chosen
RENORMALIZE = {"qwen3moe": True, "qwen2moe": False, "olmoe": False, "qwen3next": True}  # (qwen35moe: HF's always does)
# the families whose HF config places dense layers among the sparse ones (mlp_only_layers): a layer without a
# router there is dense; in the others every layer has one
DENSE_LAYERS_ALLOWED = ("qwen3moe", "qwen2moe", "qwen3next")
# the HF families with Qwen's MoE fields (moe_intermediate_size, mlp_only_layers), and those with a shared expert
QWEN_MOE_TYPES = ("qwen3_moe", "qwen2_moe", "qwen3_next", "qwen3_5_moe_text")
SHARED_EXPERT_TYPES = ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text")
GATING_SOFTMAX = 1  # gguf.ExpertGatingFuncType.SOFTMAX

# per-layer GGUF tensor stem → HF name under `model.layers.N.` (the MoE layouts' names beyond gguf.LAYER_TENSOR_NAMES)
MOE_LAYER_TENSOR_NAMES = {
    "ffn_gate_inp": "mlp.router",  # (SparseMoE.load_tensor takes every family's router under this name)
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "post_attention_norm": "post_attention_layernorm",  # gpt-oss
    "attn_sinks": "self_attn.sinks",  # gpt-oss (HF's parameter has no ".weight")
}
# expert stack stem → the HF projections it holds, in row order (the converter may fuse gate and up)
EXPERT_STACKS = {
    "ffn_gate_exps": ("gate_proj",),
    "ffn_up_exps": ("up_proj",),
    "ffn_down_exps": ("down_proj",),
    "ffn_gate_up_exps": ("gate_proj", "up_proj"),
}
MXFP4_BLOCK_BYTES = 17  # ggml block_mxfp4: the e8m0 scale byte, then 16 bytes of nibbles for 32 weights


def moe_architecture(arch: str, field: Callable[[str], Any]) -> tuple[str, str] | None:
    """(HF architecture, model_type) of a GGUF file with experts, None for a dense one."""
    if arch in MOE_ARCHITECTURES:
        return MOE_ARCHITECTURES[arch]
    if arch == "llama" and int(field("llama.expert_count") or 0) > 0:
        return MIXTRAL
    return None


def moe_tensor_name(stem: str) -> str | None:
    """The HF name of a MoE layer tensor's GGUF stem (`blk.N.<part>`, no suffix), or None when it is not one."""
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in MOE_LAYER_TENSOR_NAMES:
        return None
    return f"model.layers.{parts[1]}.{MOE_LAYER_TENSOR_NAMES[parts[2]]}"


def expert_stack(gguf_name: str) -> tuple[int, tuple[str, ...], str] | None:
    """(layer, HF projections, "weight" | "bias") of an expert stack tensor's name, None for any other tensor."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in EXPERT_STACKS:
        if parts[3] in ("weight", "bias"):
            return int(parts[1]), EXPERT_STACKS[parts[2]], parts[3]
    return None


def split_expert_stack(
    gguf_name: str, shape: tuple[int, ...], raw: np.ndarray
) -> list[tuple[str, str, tuple[int, ...], np.ndarray]]:
    """A 3-D (E, rows, cols) weight stack or 2-D (E, rows) bias stack → (GGUF name, HF name, shape, raw) of each
    expert's projection: views of the file's bytes (rows of blocks for a quantized type), a fused gate_up stack's
    first half gate rows, second half up rows."""
    layer, projections, suffix = expert_stack(gguf_name)
    want = 3 if suffix == "weight" else 2
    if len(shape) != want:
        raise ValueError(f"GGUF tensor {gguf_name!r}: shape {shape}, expected {want} dimensions (experts first)")
    rows = shape[1] // len(projections)
    if rows * len(projections) != shape[1]:
        raise ValueError(f"GGUF tensor {gguf_name!r}: {shape[1]} rows do not split into gate and up halves")
    out = []
    for e in range(shape[0]):
        for i, proj in enumerate(projections):
            part = raw[e][i * rows : (i + 1) * rows]
            name = f"{gguf_name}[{e}]" + (f".{proj}" if len(projections) > 1 else "")
            hf = f"model.layers.{layer}.mlp.experts.{e}.{proj}.{suffix}"
            out.append((name, hf, (rows, *shape[2:]), part))
    return out


def moe_hf_config(
    arch: str, field: Callable[[str], Any], cfg: dict[str, Any], tensors: dict[str, tuple[str, tuple[int, ...]]]
) -> dict[str, Any]:
    """`cfg` (the dense fields gguf.hf_config read) completed as the HF config of the file's MoE family; tensors:
    GGUF name → (type name, row-major shape). ValueError naming the key or tensor the experts contradict."""
    hf_arch, model_type = moe_architecture(arch, field)
    cfg = {**cfg, "architectures": [hf_arch], "model_type": model_type}
    counts = []
    for key in ("expert_count", "expert_used_count"):
        value = field(f"{arch}.{key}")
        if value is None or isinstance(value, (str, list)) or int(value) < 1:
            raise ValueError(f"GGUF {arch}.{key}: {value!r}, a {arch} file needs a positive count")
        counts.append(int(value))
    num_experts, top_k = counts
    gating = field(f"{arch}.expert_gating_func")
    if gating is not None and gating != GATING_SOFTMAX and arch != "gpt-oss":
        raise ValueError(f"GGUF {arch}.expert_gating_func={gating}: only softmax routers (1) are supported")
    scale = field(f"{arch}.expert_weights_scale")
    if scale not in (None, 0.0, 1.0):
        raise ValueError(f"GGUF {arch}.expert_weights_scale={scale}: scaled expert weights are not supported")
    layers = int(cfg["num_hidden_layers"])
    hidden = int(cfg["hidden_size"])
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    if len(dense) == layers:
        raise ValueError(f"GGUF file: a {arch} file without routers (blk.N.ffn_gate_inp.weight tensors)")
    if dense and arch not in DENSE_LAYERS_ALLOWED:
        raise ValueError(f"GGUF file: layer {dense[0]} has no router (blk.{dense[0]}.ffn_gate_inp.weight); every "
                         f"{arch} layer is a mixture-of-experts layer")  # fmt: skip
    width = _expert_width(arch, field, tensors)
    _check_stacks(tensors, num_experts, width, hidden)
    cfg["num_experts_per_tok"] = top_k
    if model_type in ("mixtral", "gpt_oss"):
        cfg["num_local_experts"] = num_experts
    else:
        cfg["num_experts"] = num_experts
    if model_type in QWEN_MOE_TYPES:
        cfg["moe_intermediate_size"] = width
        cfg["mlp_only_layers"], cfg["decoder_sparse_step"] = dense, 1
        cfg.setdefault("intermediate_size", width)  # (the dense layers' width: `{arch}.feed_forward_length`)
    else:
        cfg["intermediate_size"] = width
    if arch in RENORMALIZE:
        norm = field(f"{arch}.expert_weights_norm")
        cfg["norm_topk_prob"] = RENORMALIZE[arch] if norm is None else bool(norm)
    if model_type in SHARED_EXPERT_TYPES:
        shared = field(f"{arch}.expert_shared_feed_forward_length")
        gate = tensors.get(f"blk.{next(i for i in range(layers) if i not in dense)}.ffn_gate_shexp.weight")
        if shared is None and gate is None:
            raise ValueError(f"GGUF file: a {arch} file needs shared experts (ffn_gate_shexp tensors)")
        cfg["shared_expert_intermediate_size"] = int(shared if shared is not None else gate[1][0])
    if model_type == "gpt_oss":
        cfg.update(_gpt_oss_fields(arch, field, layers))
    if model_type == "mixtral":
        cfg["sliding_window"] = field(f"{arch}.attention.sliding_window")
    if model_type == "olmoe" and field(f"{arch}.attention.clamp_kqv") is not None:  # (OLMoE's clip_qkv: refused)
        cfg["clip_qkv"] = field(f"{arch}.attention.clamp_kqv")
    stacks = [t for name, (t, _) in tensors.items() if (s := expert_stack(name)) is not None and s[2] == "weight"]
    if stacks and all(t == "MXFP4" for t in stacks):  # kept in 4 bits (SparseMoE's MXFP4 experts)
        cfg["quantization_config"] = {"quant_method": "mxfp4"}
    return cfg


def _expert_width(arch: str, field: Callable[[str], Any], tensors: dict[str, tuple[str, tuple[int, ...]]]) -> int:
    """The experts' intermediate size: `{arch}.expert_feed_forward_length` (one value, or one per layer: all equal),
    else the first down_exps stack's columns."""
    width = field(f"{arch}.expert_feed_forward_length")
    if isinstance(width, list):
        if len({int(w) for w in width if w}) != 1:
            raise ValueError(f"GGUF {arch}.expert_feed_forward_length={width}: experts of different widths per layer")
        width = next(int(w) for w in width if w)
    if width is None:
        down = next((shape for name, (_, shape) in tensors.items() if name.endswith(".ffn_down_exps.weight")), None)
        if down is None:
            raise ValueError("GGUF file: a mixture-of-experts architecture without ffn_down_exps tensors")
        width = down[-1]
    return int(width)


def _check_stacks(tensors: dict[str, tuple[str, tuple[int, ...]]], num_experts: int, width: int, hidden: int) -> None:
    """ValueError naming the first expert stack whose shape does not match the metadata."""
    for name, (_, shape) in tensors.items():
        stack = expert_stack(name)
        if stack is None:
            continue
        rows = width * len(stack[1]) if stack[1][0] != "down_proj" else hidden
        want = (num_experts, rows) + (
            ((hidden if stack[1][0] != "down_proj" else width),) if stack[2] == "weight" else ()
        )
        if tuple(shape) != want:
            raise ValueError(f"GGUF tensor {name!r}: shape {tuple(shape)}, the metadata gives {want} "
                             f"(expert_count, expert_feed_forward_length, embedding_length)")  # fmt: skip


def _gpt_oss_fields(arch: str, field: Callable[[str], Any], layers: int) -> dict[str, Any]:
    """gpt-oss's attention: biases, sinks (the tensors), sliding / full layers as llama.cpp's load_swa_pattern reads
    them (a per-layer array, else every n-th layer full, n = the pattern or 2), YaRN as HF's config has it."""
    pattern = field(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(
                f"GGUF {arch}.attention.sliding_window_pattern: {len(pattern)} entries for {layers} layers"
            )
        sliding = [bool(p) for p in pattern]
    else:
        n = int(pattern or 2)
        sliding = [i % n < n - 1 for i in range(layers)]
    swa_base, base = field(f"{arch}.rope.freq_base_swa"), field(f"{arch}.rope.freq_base")
    if swa_base is not None and swa_base != base:
        raise ValueError(f"GGUF {arch}.rope.freq_base_swa={swa_base}: sliding layers with their own RoPE base")
    return {
        "sliding_window": field(f"{arch}.attention.sliding_window"),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "attention_bias": True,
    }


def yarn_rope_scaling(arch: str, field: Callable[[str], Any], model_type: str) -> dict[str, Any]:
    """`{arch}.rope.scaling.*` of a YaRN file → HF's rope_scaling (gpt-oss's HF config does not truncate the ramp)."""
    original = field(f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise ValueError(f"GGUF {arch}.rope.scaling.type='yarn' needs {arch}.rope.scaling.original_context_length")
    out: dict[str, Any] = {"rope_type": "yarn", "factor": float(field(f"{arch}.rope.scaling.factor") or 1.0),
                           "original_max_position_embeddings": int(original)}  # fmt: skip
    for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                        ("yarn_attn_factor", "attention_factor"), ("attn_factor", "attention_factor")):  # fmt: skip
        value = field(f"{arch}.rope.scaling.{key}")
        if value is not None:
            out[hf_key] = float(value)
    if model_type == "gpt_oss":
        out["truncate"] = False
    return out


def mxfp4_to_hf(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml block_mxfp4 bytes of a (rows, cols) weight → HF's (blocks (rows, cols/32, 16), scales (rows, cols/32))
    uint8, the same values: ggml's byte j holds weight j (low nibble) and j + 16 (high) of its block, HF's weights
    2j (low) and 2j + 1 (high); both code e2m1 alike, and ggml's doubled values with a halved scale are HF's."""
    assert cols % 32 == 0 and raw.nbytes == rows * cols // 32 * MXFP4_BLOCK_BYTES, (
        f"MXFP4 {raw.shape} for {rows}x{cols}"
    )
    b = np.ascontiguousarray(raw).reshape(rows, cols // 32, MXFP4_BLOCK_BYTES)
    qs = b[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # (rows, groups, 32): the block's weights in order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), b[..., 0].copy()
