"""Quantized linear weights: their layouts, the quantization math (the PyTorch reference every kernel is
tested against), and the checkpoint format `lmserve quantize` writes.

Two methods (EngineArgs.quantization):

- "int8" (W8A8): symmetric int8 weights with one float32 scale per output channel, s_w = max|w_row| / 127;
  activations quantized per token inside the step, s_x = max|x_row| / 127 (dynamic, symmetric); the
  product accumulates in int32 and is scaled once: y = (x_q . w_q) * s_x * s_w (+ bias).
- "int4" (weight-only): 4-bit codes with one float16 scale per group of `group_size` inputs along a row,
  symmetric with no zero point (llama.cpp's Q4_0 rule): d = m / -8 where m is the group's value of
  largest magnitude, code = clamp(round(w / d), -8, 7) + 8, w ≈ (code - 8) * d. Activations stay float32.

The decoder's projections are quantized (qkv, o, gate_up, down), and the LM head too (as llama.cpp's Q8_0 and
Q4_0 do; a float32 head is half the bytes of an int8 decode step, two thirds of an int4 one): with int8 as a
projection (W8A8), with int4 at 8 bits weight-only ("int8w" below, group 32, llama.cpp's Q8_0 block rule). A
tied model keeps its float32 embedding table for the token lookup and gives the head its own 8-bit copy (extra).
Embeddings and the norms stay float32. Checkpoints record the head's layout (`lm_head` in quantization_config);
an int4 checkpoint written before the head was quantized has none and keeps a float32 head.

A GGUF checkpoint's block-32 tensors load as they are in the file (QuantizationConfig method "gguf"; the
same bytes, no re-quantization), into two more per-Linear layouts of the same family:
  Q4_0 → "int4", group 32, no mins: llama.cpp's Q4_0 block *is* the int4 layout below (same nibble order,
         same (code - 8) * d).
  Q4_1 → "int4", group 32, with mins: w = code * d + m (codes 0..15 not offset, one float16 min per group).
  Q8_0 → "int8w", weight-only int8 with one float16 scale per group of 32: w = q * d; activations float32
         (not the W8A8 path: that would re-quantize the weights per channel).
and its K-quant tensors (Q4_K, Q5_K, Q6_K: 256-weight super-blocks with 6-bit sub-block scales) into a
"kquant" layout that is the file's bytes themselves (see the K-quant section below; weight-only, x float32).

Layouts (what the C kernels read):
  int8  qweight (O, K) int8, scales (O,) float32, row_sums (O,) int32 (sum of each qweight row; not saved)
  int4  qweight (O, K / 2) uint8: each run of 32 inputs is 16 bytes, byte i holding input i in its low
        nibble and input i + 16 in its high nibble; scales (O, K / group_size) float16; optional mins
        (O, K / group_size) float16 (then w = code * scale + min)
  int8w qweight (O, K) int8, scales (O, K / group_size) float16 (GGUF Q8_0 blocks; the int4 method's LM head)
  kquant qweight (bytes,) uint8: row segments of ggml Q4_K / Q5_K / Q6_K super-blocks, no scales tensor
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lmserve.config import QUANTIZATION_FORMAT, QuantizationConfig
from lmserve.kernels import KQ_BLOCK, KQ_BLOCK_BYTES, KQ_TYPES

INT4_BLOCK = 32  # inputs per packed run (16 bytes); group sizes are multiples of it
INT8W_GROUP = 32  # the int8w layout's group (GGUF Q8_0's block)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, K) float → (qweight (O, K) int8, scales (O,) float32), symmetric per output channel."""
    w = w.detach().float()
    s = w.abs().amax(dim=1) / 127
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
    return q, s


def int8_row_sums(qweight: torch.Tensor) -> torch.Tensor:
    """Sum of each int8 weight row: the correction the VNNI kernel subtracts (it shifts x to unsigned)."""
    return qweight.sum(dim=1, dtype=torch.int32)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of x (M, K) float32: (q (M, K) int8, scales (M,) float32). The C kernel
    (kernels.quantize_rows_i8) does the same operations and gives identical bits."""
    s = x.abs().amax(dim=1) / 127
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round(x / s[:, None]).clamp(-127, 127).to(torch.int8)
    return q, s


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded to its per-token int8 grid, in float32 (what the int8 path computes with)."""
    flat = x.reshape(-1, x.shape[-1]).float()
    q, s = quantize_activations(flat)
    return (q.float() * s[:, None]).reshape(x.shape).to(x.dtype)


def int8_linear(
    xq: torch.Tensor, xs: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Quantized rows (xq, xs) times int8 weights: torch._int_mm (oneDNN int8: AMX / VNNI where the CPU has
    them), exact in int32, then one scale per element."""
    acc = torch._int_mm(xq, qweight.t())
    y = acc.float() * (xs[:, None] * scales[None, :])
    return y + bias if bias is not None else y


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, K) float → (qweight (O, K/2) uint8 packed codes, scales (O, K/group_size) float16)."""
    o, k = w.shape
    assert group_size % INT4_BLOCK == 0 and k % group_size == 0, f"group size {group_size} for {k} inputs"
    g = w.detach().float().reshape(o, k // group_size, group_size)
    m = g.gather(-1, g.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    d = (m / -8).to(torch.float16)  # the stored scale; codes are rounded against it, not the fp32 one
    div = d.float()
    div = torch.where(div == 0, torch.ones_like(div), div)
    codes = (torch.round(g / div[..., None]).clamp(-8, 7) + 8).to(torch.uint8).reshape(o, k)
    return pack_int4(codes), d


def quantize_int8w(w: torch.Tensor, group_size: int = INT8W_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, K) float → (qweight (O, K) int8, scales (O, K/group_size) float16), llama.cpp's Q8_0 rule per group
    (the same bytes as gguf's quantizer): d = max|w| / 127 in float32, q = round-half-away(w * (1 / d)),
    d stored as float16."""
    o, k = w.shape
    assert group_size % INT4_BLOCK == 0 and k % group_size == 0, f"group size {group_size} for {k} inputs"
    g = w.detach().float().reshape(o, k // group_size, group_size)
    d = g.abs().amax(dim=-1) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = g * inv[..., None]
    q = (torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)).clamp(-127, 127).to(torch.int8).reshape(o, k)
    return q, d.to(torch.float16)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(O, K) uint8 codes 0..15 → (O, K/2): per run of 32, byte i = code[i] | code[i + 16] << 4."""
    o, k = codes.shape
    c = codes.reshape(o, k // INT4_BLOCK, 2, INT4_BLOCK // 2)
    return (c[:, :, 0, :] | (c[:, :, 1, :] << 4)).reshape(o, k // 2)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: (O, K/2) → (O, K) uint8 codes."""
    o, half = qweight.shape
    b = qweight.reshape(o, half // (INT4_BLOCK // 2), INT4_BLOCK // 2)
    return torch.stack((b & 0x0F, b >> 4), dim=2).reshape(o, half * 2)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None) -> torch.Tensor:
    """(O, K) float32 weights: (code - 8) * scale of the code's group, or with mins code * scale + min
    (GGUF Q4_1; code * scale is exact in float32, so one rounding, as gguf's dequantizer). kernels.dequant_i4
    is bit-identical."""
    codes = unpack_int4(qweight)
    group_size = codes.shape[1] // scales.shape[1]
    if mins is None:
        return (codes.to(torch.int32) - 8).float() * scales.float().repeat_interleave(group_size, dim=1)
    w = codes.float() * scales.float().repeat_interleave(group_size, dim=1)
    return w + mins.float().repeat_interleave(group_size, dim=1)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return qweight.float() * scales[:, None]


def dequantize_int8w(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(O, K) float32 weights of the group-scaled int8 layout (GGUF Q8_0): q * scale of its group (exact)."""
    group_size = qweight.shape[1] // scales.shape[1]
    return qweight.float() * scales.float().repeat_interleave(group_size, dim=1)


# ---- GGUF block-32 tensors, as they are in the file ---------------------------------------------------------

# GGML type → (Linear layout, whether it carries mins)
GGUF_LAYOUTS = {"Q8_0": ("int8w", False), "Q4_0": ("int4", False), "Q4_1": ("int4", True)}
GGUF_GROUP_SIZE = 32


def gguf_block32_tensors(type_name: str, blocks: np.ndarray) -> dict[str, torch.Tensor]:
    """A Q8_0 / Q4_0 / Q4_1 tensor's raw blocks (rows, row bytes) uint8 (rows in HF order,
    `GGUFTensor.blocks()`) → the layout's buffers {"qweight", "scales"[, "mins"]}: the file's bytes, regrouped
    (a block is [d f16][m f16, Q4_1 only][32 int8 | 16 bytes of nibbles])."""
    rows = blocks.shape[0]
    b = np.ascontiguousarray(blocks).reshape(rows, -1, {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[type_name])
    head = 4 if type_name == "Q4_1" else 2
    out = {"scales": torch.from_numpy(b[..., :2].copy().view(np.float16)[..., 0])}
    if type_name == "Q4_1":
        out["mins"] = torch.from_numpy(b[..., 2:4].copy().view(np.float16)[..., 0])
    body = b[..., head:].reshape(rows, -1).copy()
    out["qweight"] = torch.from_numpy(body.view(np.int8) if type_name == "Q8_0" else body)
    return out


# ---- GGUF K-quant tensors (Q4_K, Q5_K, Q6_K), as they are in the file ------------------------------------------
# The "kquant" layout: qweight (bytes,) uint8, the file's super-block bytes of one or more row segments one after
# the other (a fused projection whose parts have different K-quant types: llama-quantize's Q4_K_M gives some
# layers' attn_v / ffn_down Q6_K and the rest Q4_K), each segment of one type; the C kernels read the blocks as
# ggml lays them out (cpu_kernels.c, the K-quant section). No scales tensor: the scales are inside the blocks.

KQUANT_TYPES = tuple(KQ_TYPES)  # ("Q4_K", "Q5_K", "Q6_K")


@dataclass(frozen=True)
class KQuantSegment:
    """Output rows [start, start + rows) of a K-quant weight: their type and where their bytes begin in qweight."""

    type_name: str
    start: int
    rows: int
    offset: int
    row_bytes: int

    @property
    def end(self) -> int:
        return self.start + self.rows


def kquant_row_bytes(type_name: str, in_features: int, what: str = "weight") -> int:
    """Bytes one row of `in_features` weights takes as `type_name` super-blocks (ValueError naming `what`)."""
    if type_name not in KQ_TYPES:
        raise ValueError(f"{what}: {type_name} is not a K-quant type ({', '.join(KQ_TYPES)})")
    if in_features % KQ_BLOCK:
        raise ValueError(f"{what}: {type_name} rows hold whole super-blocks of {KQ_BLOCK}, got {in_features} inputs")
    return in_features // KQ_BLOCK * KQ_BLOCK_BYTES[type_name]


def kquant_segments(parts: list[tuple[str, int]], in_features: int) -> tuple[KQuantSegment, ...]:
    """(type, rows) of each part of a weight, in output-row order → its segments (neighbours of one type merged)."""
    segments: list[KQuantSegment] = []
    start = offset = 0
    for type_name, rows in parts:
        row_bytes = kquant_row_bytes(type_name, in_features)
        last = segments[-1] if segments else None
        if last is not None and last.type_name == type_name:
            segments[-1] = KQuantSegment(type_name, last.start, last.rows + rows, last.offset, row_bytes)
        else:
            segments.append(KQuantSegment(type_name, start, rows, offset, row_bytes))
        start, offset = start + rows, offset + rows * row_bytes
    return tuple(segments)


def kquant_segment_table(segments: tuple[KQuantSegment, ...]) -> torch.Tensor:
    """The (S, 3) int64 table the C kernel reads: (type code, rows, byte offset) per segment."""
    return torch.tensor([[KQ_TYPES[s.type_name], s.rows, s.offset] for s in segments], dtype=torch.int64)


def dequantize_kquant(type_name: str, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """(rows, row bytes) uint8 super-blocks → (rows, in_features) float32 by gguf's own dequantizer (the reference
    kernels.dequant_kq matches bit for bit)."""
    import gguf

    rows = blocks.shape[0]
    assert blocks.numel() == rows * kquant_row_bytes(type_name, in_features), f"{type_name} {tuple(blocks.shape)}"
    values = gguf.dequantize(blocks.reshape(rows, -1).numpy(), gguf.GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(rows, in_features))


def kquant_scales(type_name: str, blocks: torch.Tensor) -> torch.Tensor:
    """The float16 super-block scales of (rows, row bytes) blocks: d and dmin (Q4_K / Q5_K), d (Q6_K); for the
    check that a file holds finite ones."""
    size = KQ_BLOCK_BYTES[type_name]
    b = blocks.reshape(-1, size)
    fields = b[:, 208:210] if type_name == "Q6_K" else b[:, 0:4]
    return fields.contiguous().view(torch.float16)


def dequantize_layout(
    method: str, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None
) -> torch.Tensor:
    """The float32 weight any layout stands for (the PyTorch reference of what its kernels compute)."""
    if method == "int8":
        return dequantize_int8(qweight, scales)
    if method == "int8w":
        return dequantize_int8w(qweight, scales)
    return dequantize_int4(qweight, scales, mins)


# ---- checkpoint format ----------------------------------------------------------------------------------
# `lmserve quantize` writes config.json (the source's, plus `quantization_config`) and model.safetensors in
# which every quantized projection is saved under its fused name (qkv_proj, gate_up_proj) as
# `<name>.qweight` and `<name>.scales` (the head as `lm_head.qweight` / `lm_head.scales` as well, tied or not);
# everything else keeps the source's tensors (float32).


def quantized_tensor_specs(
    method: str, group_size: int, out_features: int, in_features: int, mins: bool = False
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Suffix → (shape, dtype) a checkpoint must hold for one quantized projection."""
    if method == "int8":
        return {"qweight": ((out_features, in_features), torch.int8), "scales": ((out_features,), torch.float32)}
    groups = ((out_features, in_features // group_size), torch.float16)
    if method == "int8w":
        return {"qweight": ((out_features, in_features), torch.int8), "scales": groups}
    specs = {"qweight": ((out_features, in_features // 2), torch.uint8), "scales": groups}
    return {**specs, "mins": groups} if mins else specs


def write_quantized_checkpoint(model: torch.nn.Module, src_dir: Path, out_dir: Path, quant: QuantizationConfig) -> int:
    """Save a model whose projections are quantized (and the rest float32) in our format; returns bytes written."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items() if t is not None}
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt", "lmserve": QUANTIZATION_FORMAT})
    cfg = json.loads((src_dir / "config.json").read_text())
    cfg["quantization_config"] = quant.to_hf()
    cfg["dtype"] = cfg["torch_dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in src_dir.iterdir():  # tokenizer and generation config travel with the weights
        if (
            f.is_file()
            and f.name != "config.json"
            and not f.name.endswith(".safetensors")
            and "safetensors" not in f.name
        ):
            (out_dir / f.name).write_bytes(f.read_bytes())
    return (out_dir / "model.safetensors").stat().st_size
