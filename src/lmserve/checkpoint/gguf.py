"""GGUF checkpoints (llama.cpp's format): metadata → an HF-style config dict, tensors → HF-named arrays.

GGUFCheckpoint maps the file (the `gguf` package) onto what lmserve reads from an HF directory, q/k RoPE permutation
undone; iter_hf_tensors keeps the types the quantized kernels run (kept_quantized) and dequantizes the rest. No torch.
Which types run as they are: docs/quantization.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmserve.checkpoint import gguf_moe
from lmserve.checkpoint.gguf_arch import GGUF_ARCHS, GGUFArch
from lmserve.checkpoint.gguf_hybrid import REORDERED_PROJECTIONS, Reorder, block_order, moved

logger = logging.getLogger(__name__)

# GGUF `general.architecture` → the HF architecture our decoder implements.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
GGUF_ARCHITECTURES.update((arch, spec.hf_architecture) for arch, spec in GGUF_ARCHS.items())  # (gguf_arch.py)
# llama.cpp's converter interleaves the q/k rows of these (for its RoPE kernel); transformers undoes it.
PERMUTED_QK_ARCHITECTURES = ("llama",)

# `{arch}.<key>` → HF config.json key (the keys transformers' GGUF config conversion maps).
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta",
}

# GGUF tensor name → HF parameter name (without ".weight" / ".bias"); per layer `blk.{i}.` → `model.layers.{i}.`
GLOBAL_TENSOR_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

UNQUANTIZED_TYPES = ("F32", "F16", "BF16")
BLOCK32_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # block-32 scales: the int8w / int4 / int5 layouts
# fused parts of these types are held together as the first (Q5_0's w = (c - 16) d is a Q8_0 weight, exactly)
MIXED_BLOCK32 = {frozenset({"Q5_0", "Q8_0"}): "Q8_0"}
KQUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K")  # 256-weight super-blocks, run by the K-quant kernels as they are
KEPT_TYPES = BLOCK32_TYPES + KQUANT_TYPES  # what the CPU float32 path keeps as it is in the file
# HF weights of the decoder's Linear layers (the ones a quantized layout can hold), and the parts the model
# fuses into one matrix (loader.STACKED_PARAMS): those are kept as blocks only when every part has one type.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", *REORDERED_PROJECTIONS)
FUSED_PARTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def find_gguf_file(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one *.gguf in a directory without config.json.
    None when `path` is not a GGUF checkpoint (an HF directory, a hub id)."""
    p = Path(path)
    if p.is_file():
        return p if p.suffix == ".gguf" else None
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    files = sorted(p.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(
            f"model: {str(p)!r} holds {len(files)} .gguf files ({', '.join(f.name for f in files)}); "
            f"pass the path of the one to load"
        )
    return files[0] if files else None


@dataclass(frozen=True)
class GGUFTensor:
    """One checkpoint tensor: its GGUF and HF names, GGML type, row-major shape and the raw data view."""

    gguf_name: str
    hf_name: str
    type_name: str
    shape: tuple[int, ...]  # (rows, cols) as in PyTorch, i.e. GGUF's dims reversed
    raw: np.ndarray  # memory-mapped: the element array (F32/F16) or the row-major block bytes
    unpermute_heads: int | None  # q/k of a permuted architecture: the head count to undo it with
    transform: Callable[[np.ndarray], np.ndarray] | None = None  # undoes a converter's float transform (gguf_arch)
    reorder: Reorder | None = None  # (axis, index) undoing rows / columns the converter moved: whole blocks move

    @property
    def num_bytes(self) -> int:
        return int(self.raw.nbytes)

    def blocks(self) -> np.ndarray:
        """The raw data, rows in HF order (block bytes for quantized types: one row of blocks per row)."""
        assert self.transform is None, f"{self.gguf_name}: a transformed tensor is dequantized, never kept as blocks"
        data = self.raw.reshape(self.shape[0], -1) if self.raw.ndim > 1 else self.raw
        data = _unpermute(data, self.unpermute_heads) if self.unpermute_heads else data
        if self.reorder is None:
            return data
        axis, index = self.reorder
        if axis == 0:
            return data[index]
        blocks = block_order(index, _block_size(self.type_name))
        assert blocks is not None, f"{self.gguf_name}: its column order splits {self.type_name} blocks"
        return data.reshape(data.shape[0], len(blocks), -1)[:, blocks].reshape(data.shape[0], -1)

    def to_numpy(self) -> np.ndarray:
        """The weights in HF layout: F32/F16 as stored, anything else dequantized to float32 by gguf."""
        import gguf

        if self.type_name in ("F32", "F16"):
            values = np.asarray(self.raw).reshape(self.shape)
        else:
            qtype = gguf.GGMLQuantizationType[self.type_name]
            try:
                values = gguf.dequantize(self.raw, qtype).reshape(self.shape)
            except NotImplementedError:
                raise ValueError(
                    f"GGUF tensor {self.gguf_name!r} has type {self.type_name}, which the gguf package "
                    f"cannot dequantize; supported: F32, F16, BF16 and gguf's quantized types"
                ) from None
        values = _unpermute(values, self.unpermute_heads) if self.unpermute_heads else values
        values = moved(values, self.reorder)
        return self.transform(values) if self.transform else values


def _block_size(type_name: str) -> int:
    """Weights per GGML block of the type (1 for F32 / F16 / BF16)."""
    import gguf

    return int(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0])


def _unpermute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation, exactly as transformers' LlamaTensorProcessor does: within each
    head, rows were reordered from (2, half) to (half, 2) so rotary pairs sit side by side."""
    dim = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def unpack_block32(tensor: GGUFTensor) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Split a block-32 tensor into (scales, mins or None, values), each (rows, cols // 32[, 32]): weight = scale *
    value (Q8_0: int8 value; Q4_0: value in 0..15 minus 8; Q5_0: 0..31 minus 16) or scale * value + min (Q4_1, Q5_1).
    For a quantized weight path that keeps the blocks; the math is gguf's (tests check against its dequantizer)."""
    assert tensor.type_name in BLOCK32_TYPES, f"{tensor.gguf_name}: {tensor.type_name} is not a block-32 type"
    rows, cols = tensor.shape
    blocks = tensor.blocks().reshape(rows, cols // 32, -1)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0]
    if tensor.type_name == "Q8_0":
        return scales, None, blocks[..., 2:].copy().view(np.int8)
    packed = blocks[..., 4:] if tensor.type_name in ("Q4_1", "Q5_1") else blocks[..., 2:]
    high = None
    if tensor.type_name.startswith("Q5"):  # a little-endian word of fifth bits, bit i for value i
        qh, packed = packed[..., :4].copy().view(np.uint32), packed[..., 4:]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int8) << 4
    # 16 bytes hold 32 values: the low nibbles are values 0..15 of the block, the high nibbles 16..31.
    values = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int8)
    if high is not None:
        values = values | high
    if tensor.type_name in ("Q4_0", "Q5_0"):
        return scales, None, values - (8 if tensor.type_name == "Q4_0" else 16)
    mins = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    return scales, mins, values


class GGUFCheckpoint:
    """A GGUF file opened for reading: metadata fields, an HF-style config dict and the mapped tensors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._reader = _open_reader(self.path)
        self.architecture = str(self.field("general.architecture"))
        if self.architecture not in GGUF_ARCHITECTURES and self.architecture not in gguf_moe.MOE_ARCHITECTURES:
            raise ValueError(
                f"GGUF architecture {self.architecture!r} in {self.path.name} is not supported; "
                f"supported: {', '.join(dict.fromkeys([*GGUF_ARCHITECTURES, *gguf_moe.MOE_ARCHITECTURES]))}"
            )
        self._by_name = {t.name: t for t in self._reader.tensors}
        self.moe = gguf_moe.moe_architecture(self.architecture, self.field)  # (HF architecture, model_type) or None
        self.spec = GGUF_ARCHS.get(self.architecture, GGUFArch(GGUF_ARCHITECTURES.get(self.architecture, "")))

    def raw_tensor(self, name: str) -> Any:
        """gguf's tensor of that GGUF name (data, shape in GGUF's order), or None."""
        return self._by_name.get(name)

    def field(self, key: str, default: Any = None) -> Any:
        f = self._reader.get_field(key)
        return default if f is None else f.contents()

    def hf_config(self) -> dict[str, Any]:
        """An HF config.json dict for `ModelConfig.from_hf`: the shape, RoPE, tying and EOS ids."""
        arch = self.architecture
        cfg: dict[str, Any] = {"architectures": [GGUF_ARCHITECTURES.get(arch)], "model_type": arch}
        for key, hf_key in CONFIG_KEYS.items():
            value = self.field(f"{arch}.{key}")
            if value is not None:
                cfg[hf_key] = value
        embed = self._by_name.get("token_embd.weight")
        if embed is None:
            raise ValueError(f"GGUF file {self.path.name} has no token_embd.weight tensor")
        cfg["vocab_size"] = int(embed.shape[-1])  # GGUF dims are (hidden, vocab)
        cfg["tie_word_embeddings"] = "output.weight" not in self._by_name
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        rope_dims = self.field(f"{arch}.rope.dimension_count")
        if rope_dims is not None and rope_dims != head_dim and not self.spec.partial_rotary:
            raise ValueError(f"GGUF {arch}.rope.dimension_count={rope_dims} (partial rotary) is not supported")
        if "rope_freqs.weight" in self._by_name and "rope_freqs" not in self.spec.config_tensors:
            raise ValueError(
                f"GGUF file {self.path.name} scales RoPE by a rope_freqs tensor (Llama 3.1-style), which the "
                f"GGUF reader does not support yet"
            )
        scaling = self.field(f"{arch}.rope.scaling.type")
        if scaling == "yarn" and self.moe is not None:
            cfg["rope_scaling"] = gguf_moe.yarn_rope_scaling(arch, self.field, self.moe[1])
        elif scaling not in (None, "none"):
            if scaling != "linear":
                raise ValueError(f"GGUF {arch}.rope.scaling.type={scaling!r} is not supported (only 'linear')")
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(self.field(f"{arch}.rope.scaling.factor"))}
        eos = [self.field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        cfg["eos_token_id"] = sorted({int(t) for t in eos if t is not None})
        cfg["bos_token_id"] = self.field("tokenizer.ggml.bos_token_id")
        if self.moe is not None:
            shapes = {t.name: (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())))
                      for t in self._reader.tensors}  # fmt: skip
            cfg = gguf_moe.moe_hf_config(arch, self.field, cfg, shapes)
        return self.spec.config(self, cfg) if self.spec.config else cfg

    def tensors(self) -> list[GGUFTensor]:
        """Every tensor under its HF name; an unknown name is an error (never silently dropped)."""
        permuted = self.architecture in PERMUTED_QK_ARCHITECTURES or self.spec.permuted_qk
        num_heads = int(self.field(f"{self.architecture}.attention.head_count")) if permuted else 0
        num_kv_heads = int(self.field(f"{self.architecture}.attention.head_count_kv", num_heads)) if permuted else 0
        cfg = self.hf_config() if self.spec.transform or self.spec.trunk_key else {}
        trunk = int(cfg.get("num_hidden_layers", 0))
        out = []
        for t in self._reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            if t.name.rpartition(".")[0] in self.spec.config_tensors:
                continue  # (read into the config)
            block = t.name.split(".")[1] if t.name.startswith("blk.") else ""
            if self.spec.trunk_key and block.isdigit() and int(block) >= trunk:
                continue  # (a block after the trunk: the MTP head, not served, as an HF checkpoint's mtp.*)
            parts = self.spec.parts(cfg, t.name, shape, t.data)  # (an expert stack's views, a fused tensor's parts)
            if parts is not None:
                out += [GGUFTensor(name, hf, t.tensor_type.name, s, raw, None) for name, hf, s, raw in parts]
                continue
            hf_name = hf_tensor_name(t.name, self.spec)
            unpermute = None
            if permuted:
                if ".attn_q." in t.name:
                    unpermute = num_heads
                elif ".attn_k." in t.name:
                    unpermute = num_kv_heads
            moves = self.spec.moves(cfg, hf_name, _block_size(t.tensor_type.name))  # (float transform, reorder)
            out.append(GGUFTensor(t.name, hf_name, t.tensor_type.name, shape, t.data, unpermute, *moves))
        return out

    def bytes_by_type(self) -> dict[str, tuple[int, int, int]]:
        """GGML type name → (tensor count, bytes in the file, elements)."""
        totals: dict[str, tuple[int, int, int]] = {}
        for t in self._reader.tensors:
            n, b, e = totals.get(t.tensor_type.name, (0, 0, 0))
            totals[t.tensor_type.name] = (n + 1, b + int(t.n_bytes), e + int(t.n_elements))
        return totals


def hf_tensor_name(gguf_name: str, spec: GGUFArch | None = None) -> str:
    """The HF name of a GGUF tensor: the shared tables, with an architecture's own names (gguf_arch) over them."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias") and spec is not None and suffix in spec.layer_tensors:
        stem, suffix = gguf_name, ""  # (a tensor llama.cpp names without a suffix: qwen35's blk.N.ssm_a)
    elif suffix not in ("weight", "bias"):
        raise ValueError(f"GGUF tensor {gguf_name!r}: expected a .weight or .bias tensor")
    global_names = {**GLOBAL_TENSOR_NAMES, **spec.global_tensors} if spec else GLOBAL_TENSOR_NAMES
    layer_names = {**LAYER_TENSOR_NAMES, **spec.layer_tensors} if spec else LAYER_TENSOR_NAMES
    hf_stem = global_names.get(stem)
    parts = stem.split(".")
    if hf_stem is None and len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        hf_stem = f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
    if hf_stem is not None:
        unsuffixed = spec is not None and hf_stem.rpartition(".")[2] in spec.unsuffixed
        return hf_stem if unsuffixed or not suffix else f"{hf_stem}.{suffix}"
    moe = gguf_moe.moe_tensor_name(stem)
    if moe is not None:
        return moe if moe.endswith(".sinks") else f"{moe}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in the supported architectures")


def _open_reader(path: Path):
    """gguf's reader, with its tensor table checked against the file size first: a truncated file is
    reported naming the first tensor whose bytes are missing, an unknown type id naming its tensor."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class CheckedReader(GGUFReader):
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
            """gguf's own `_get`, slicing a plain ndarray view of the file's memmap: a memmap slice runs numpy's
            Python-level `memmap.__array_finalize__`, and a tokenizer's fields take ~10^6 slices (a 49k-token
            vocabulary: 2.5 s a file against 0.7 s). The views share the same mapped bytes."""
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            dt = np.dtype(dtype)
            arr = plain[offset : offset + dt.itemsize * count].view(dt)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            file_bytes = len(self.data)
            for field in fields:
                _, name_data, _, dims, raw_dtype, offset = field.parts
                name = bytes(name_data).decode("utf-8")
                try:
                    qtype = GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise ValueError(
                        f"GGUF tensor {name!r} in {path.name} has GGML type id {int(raw_dtype[0])}, which gguf "
                        f"does not know"
                    ) from None
                block_size, type_size = GGML_QUANT_SIZES[qtype]
                end = int(start_offs + offset[0]) + int(np.prod(dims)) * type_size // block_size
                if end > file_bytes:
                    raise ValueError(
                        f"GGUF file {path.name} is truncated: tensor {name!r} ends at byte {end:,} but the file has "
                        f"{file_bytes:,} bytes"
                    )
            super()._build_tensors(start_offs, fields)

    try:
        return CheckedReader(path)
    except ValueError as e:
        if "GGUF" in str(e):
            raise
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None


def fused_siblings(tensors: dict[str, GGUFTensor], name: str) -> list[GGUFTensor | None]:
    """The tensors (of an HF name → tensor dict) of the parts fused with HF weight `name` into one projection
    (FUSED_PARTS: q/k/v, gate/up), itself included, in part order; None for a part not in `tensors`. A projection
    that fuses nothing: [itself]."""
    parts = name.split(".")
    group = next((g for g in FUSED_PARTS if parts[-2] in g), (parts[-2],))
    return [tensors.get(".".join([*parts[:-2], p, "weight"])) for p in group]


def kept_quantized(checkpoint: GGUFCheckpoint, tie_word_embeddings: bool) -> dict[str, GGUFTensor]:
    """HF weight name → quantized tensor the quantized weight path keeps as it is: every projection whose fused
    parts share one block-32 type or are all K-quants, the LM head (`output.weight`, or for a tied model the
    token embedding's tensor as "lm_head.weight"), and a K-quant token embedding ("model.embed_tokens.weight",
    looked up row by row; a K-quant tied head shares the embedding's bytes). A block-32 token embedding of a tied
    model is kept too ("model.embed_tokens.weight"): its rows are looked up from the head's copy of the blocks
    (one copy for both); an untied model's block-32 token embedding is dequantized for its lookup."""
    tensors = {t.hf_name: t for t in checkpoint.tensors()}
    kept = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if t.type_name not in KEPT_TYPES or parts[-1] != "weight" or parts[-2] not in PROJECTIONS or t.transform:
            continue  # (a tensor moved as floats is dequantized)
        siblings = fused_siblings(tensors, name)
        kinds = {None if s is None else "K" if s.type_name in KQUANT_TYPES else s.type_name for s in siblings}
        if kinds in ({t.type_name}, {"K"}) or frozenset(kinds) in MIXED_BLOCK32:  # one type, a mix held as one
            kept[name] = t
    embed = tensors.get("model.embed_tokens.weight")
    head = tensors.get("lm_head.weight") or (embed if tie_word_embeddings else None)
    if head is not None and head.type_name in KEPT_TYPES:
        kept["lm_head.weight"] = head
    if embed is not None and embed.type_name in KQUANT_TYPES:
        kept["model.embed_tokens.weight"] = embed
    elif embed is not None and head is embed and head.type_name in BLOCK32_TYPES:
        kept["model.embed_tokens.weight"] = embed  # (its lookup reads the tied head's blocks)
    return kept


def held_block32_types(kept: dict[str, GGUFTensor]) -> dict[str, str]:
    """HF name → the block-32 type a kept tensor is held as: its own, or for a part of a fused projection whose
    parts mix types (MIXED_BLOCK32: Q5_0 with Q8_0) the type they are all held as.

    All are held as Q8_0 then (Q5_0's codes convert exactly): llama-quantize's fallbacks for rows that are not
    whole super-blocks give a Q4_K_M file's qkv those two types.
    """
    held = {}
    for name, t in kept.items():
        if t.type_name not in BLOCK32_TYPES:
            continue
        mix = frozenset(s.type_name for s in fused_siblings(kept, name) if s is not None)
        held[name] = MIXED_BLOCK32.get(mix, t.type_name)
    return held


# the K-quants the W4A8 kernels also run (lmserve.model.quantization.KQUANT_PANEL_BITS): their bits per weight in
# the panels, a float16 scale and min per 32 beside the codes (the file's super-block: 4.5 / 5.5)
KQUANT_PANEL_BITS = {"Q4_K": 4, "Q5_K": 5}


def kquant_panel_types(kept: dict[str, GGUFTensor]) -> dict[str, str]:
    """HF name → K-quant type of the kept tensors int4_compute="w4a8" repacks into W4A8 panels (layers.
    pack_w4a8_weights): projections (and an untied LM head) whose fused parts are all one type of
    KQUANT_PANEL_BITS; the token embedding and a head sharing its bytes stay as they are."""
    out = {}
    for name, t in kept.items():
        if t.type_name not in KQUANT_PANEL_BITS or name == "model.embed_tokens.weight" or name != t.hf_name:
            continue
        if all(s is not None and s.type_name == t.type_name for s in fused_siblings(kept, name)):
            out[name] = t.type_name
    return out


def kquant_panel_bytes(type_name: str, num_weights: int) -> int:
    """Bytes the W4A8 panels of `num_weights` weights of a Q4_K / Q5_K tensor take (codes, float16 scales and
    mins per 32; rows padded to whole panels of 16 not counted, as for the block-32 panels)."""
    return num_weights * KQUANT_PANEL_BITS[type_name] // 8 + num_weights // 32 * 4


# A quantized weight path's claim on a block-32 or K-quant tensor: (HF name, tensor) → True when it keeps the
# blocks itself (`GGUFTensor.blocks()` / `unpack_block32`); the tensor is then not dequantized nor yielded.
Block32Hook = Callable[[str, GGUFTensor], bool]


def iter_hf_tensors(
    checkpoint: GGUFCheckpoint,
    compute_dtype: str,
    dtype_bytes: int,
    take_block32: Block32Hook | None = None,
    why_block32: str = "quantization='none', or an engine that is not CPU float32",
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) for every tensor not claimed by `take_block32` (offered every block-32, K-quant and MXFP4 one),
    dequantizing what needs it (logged; `why_block32`: why the kept types' tensors not claimed are dequantized)."""
    tensors = checkpoint.tensors()
    claimed = {
        t.gguf_name
        for t in tensors
        if t.type_name in (*KEPT_TYPES, "MXFP4") and take_block32 is not None and take_block32(t.hf_name, t)
    }
    dequantized = [t for t in tensors if t.type_name not in UNQUANTIZED_TYPES and t.gguf_name not in claimed]
    log_dequantized(dequantized, compute_dtype, dtype_bytes, why_block32)
    for t in tensors:
        if t.gguf_name not in claimed:
            yield t.hf_name, t.to_numpy()


def log_dequantized(
    tensors: list[GGUFTensor], compute_dtype: str, dtype_bytes: int, why_block32: str = "no kernel takes it here"
) -> None:
    """One log line per quantized type dequantized at load: how many tensors, file bytes → resident bytes."""
    by_type: dict[str, list[GGUFTensor]] = {}
    for t in tensors:
        by_type.setdefault(t.type_name, []).append(t)
    for type_name, group in sorted(by_type.items()):
        file_bytes = sum(t.num_bytes for t in group)
        resident = sum(int(np.prod(t.shape)) for t in group) * dtype_bytes
        why = why_block32 if type_name in KEPT_TYPES else "no kernel for this type"
        logger.info(
            "GGUF: %d %s tensors dequantized to %s at load (%s): "
            "%.1f MiB in the file -> %.1f MiB in memory (+%.1f MiB)",
            len(group), type_name, compute_dtype, why, file_bytes / 2**20, resident / 2**20,
            (resident - file_bytes) / 2**20,
        )  # fmt: skip


def log_kept(kept: dict[str, GGUFTensor]) -> None:
    """One log line per quantized type kept as it is in the file: how many tensors, the bytes they hold."""
    by_type: dict[str, dict[str, GGUFTensor]] = {}
    for t in kept.values():  # (a K-quant tied head and its embedding: one tensor)
        by_type.setdefault(t.type_name, {})[t.gguf_name] = t
    for type_name, group in sorted(by_type.items()):
        logger.info(
            "GGUF: %d %s tensors kept as they are in the file (their %s kernels run them): %.1f MiB",
            len(group), type_name, "K-quant" if type_name in KQUANT_TYPES else "block-32",
            sum(t.num_bytes for t in group.values()) / 2**20,
        )  # fmt: skip


def resident_weight_bytes(
    checkpoint: GGUFCheckpoint, dtype_bytes: float, keep_block32: bool, kquant_panels: bool = False
) -> tuple[int, int]:
    """(bytes the loaded weights take, of which kept quantized bytes): kept tensors hold exactly their bytes in
    the file (lmserve.model.quantization's int4 / int5 / int8w layouts are the blocks regrouped: Q4_0 18, Q4_1 20,
    Q5_0 22, Q5_1 24, Q8_0 34 bytes per 32 weights; kquant is the K-quant blocks themselves; a Q5_0 part held as
    Q8_0 takes Q8_0's 34), a tied head kept from a block-32 token embedding is one more copy of it (a K-quant one
    shares the embedding's), and everything else is dequantized to `dtype_bytes` per element. kquant_panels
    (int4_compute="w4a8" with the C kernels): the Q4_K / Q5_K tensors kquant_panel_types names take their W4A8
    panels' bytes (kquant_panel_bytes: 20 / 24 per 32 weights against the file's 18 / 22) instead. (W4A8 panels
    pad the rows to whole panels of 16: at most 15 rows more per Linear.)"""
    hf = checkpoint.hf_config()
    kept = kept_quantized(checkpoint, hf["tie_word_embeddings"]) if keep_block32 else {}
    held = held_block32_types(kept)
    panels = kquant_panel_types(kept) if kquant_panels else {}
    kept_names = {t.gguf_name for name, t in kept.items() if name == t.hf_name}

    def held_bytes(name: str, t: GGUFTensor) -> int:
        if held.get(name, t.type_name) != t.type_name:  # (Q5_0 held as Q8_0)
            return int(np.prod(t.shape)) // 32 * 34
        if name in panels:
            return kquant_panel_bytes(t.type_name, int(np.prod(t.shape)))
        return t.num_bytes

    kept_bytes = sum(
        held_bytes(name, t) for name, t in kept.items() if name == t.hf_name or t.gguf_name not in kept_names
    )
    if (hf.get("quantization_config") or {}).get("quant_method") == "mxfp4":  # MXFP4 experts: their bytes, held
        mxfp4 = [t for t in checkpoint.tensors() if t.type_name == "MXFP4"]
        kept_bytes += sum(t.num_bytes for t in mxfp4)
        kept_names |= {t.gguf_name for t in mxfp4}
    rest = sum(int(np.prod(t.shape)) for t in checkpoint.tensors() if t.gguf_name not in kept_names)
    return math.ceil(rest * dtype_bytes) + kept_bytes, kept_bytes
