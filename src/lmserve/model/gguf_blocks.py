"""GGUF's quantized tensors as they are in the file: block-32 types (Q8_0, Q4_0/1, Q5_0/1) split into a layout's
codes, scales and mins, and the K-quants (Q4_K, Q5_K, Q6_K) as row segments, scales or float32 references."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lmserve.checkpoint.gguf import KQUANT_PANEL_BITS
from lmserve.kernels import KQ_BLOCK, KQ_BLOCK_BYTES, KQ_TYPES
from lmserve.model.quantization import int5_as_int8w, pack_int4, pack_int5

# GGML type → (Linear layout, whether it carries mins)
GGUF_LAYOUTS = {
    "Q8_0": ("int8w", False),
    "Q4_0": ("int4", False),
    "Q4_1": ("int4", True),
    "Q5_0": ("int5", False),
    "Q5_1": ("int5", True),
}
GGUF_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24}
GGUF_GROUP_SIZE = 32


def gguf_block32_tensors(type_name: str, blocks: np.ndarray, layout: str | None = None) -> dict[str, torch.Tensor]:
    """A Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 tensor's raw blocks (rows, row bytes) uint8 (rows in HF order,
    `GGUFTensor.blocks()`) → the layout's buffers {"qweight", "scales"[, "mins"]}: the file's bytes, regrouped
    (a block is [d f16][m f16, Q4_1 / Q5_1 only][qh 4 bytes, Q5_* only][32 int8 | 16 bytes of nibbles]). layout
    "int8w" for a Q5_0 tensor: its codes - 16 as int8 weights (a fused projection with Q8_0 parts)."""
    rows = blocks.shape[0]
    b = np.ascontiguousarray(blocks).reshape(rows, -1, GGUF_BLOCK_BYTES[type_name])
    with_mins = GGUF_LAYOUTS[type_name][1]
    head = 4 if with_mins else 2
    out = {"scales": torch.from_numpy(b[..., :2].copy().view(np.float16)[..., 0])}
    if with_mins:
        out["mins"] = torch.from_numpy(b[..., 2:4].copy().view(np.float16)[..., 0])
    body = b[..., head:].reshape(rows, -1).copy()
    out["qweight"] = torch.from_numpy(body.view(np.int8) if type_name == "Q8_0" else body)
    if layout == "int8w" and type_name == "Q5_0":
        out["qweight"] = int5_as_int8w(out["qweight"])
    else:
        assert layout in (None, GGUF_LAYOUTS[type_name][0]), f"{type_name} blocks as {layout}"
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




def kquant_as_block32(type_name: str, blocks: torch.Tensor, in_features: int) -> dict[str, torch.Tensor]:
    """Q4_K / Q5_K super-blocks (rows, row bytes) uint8 → the int4 / int5 layout with mins, group 32, for the W4A8
    panels: each sub-block of 32 keeps its codes (4 / 5 bits), its scale d·sc and its min −dmin·m rounded once to
    float16 (gguf computes them in float32; the relative difference is at most 2⁻¹¹, below the int8 activations'
    own rounding). ggml's layout (block_q4_K / block_q5_K): d, dmin float16, 12 bytes of 6-bit (sc, m) pairs
    (get_scale_min_k4), [Q5_K: qh, 32 bytes, bit 2c / 2c + 1 of qh[l] the fifth bit of chunk c's low / high
    sub-block], qs 128 bytes: chunk c = 0..3 of 32 bytes, low nibbles sub-block 2c, high nibbles 2c + 1."""
    assert type_name in KQUANT_PANEL_BITS, f"{type_name}: no W4A8 panels for it"
    rows = blocks.shape[0]
    assert blocks.numel() == rows * kquant_row_bytes(type_name, in_features), f"{type_name} {tuple(blocks.shape)}"
    b = blocks.reshape(rows * (in_features // KQ_BLOCK), KQ_BLOCK_BYTES[type_name]).numpy()
    n = b.shape[0]
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # (n, 1)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    q = b[:, 4:16].astype(np.int32)  # get_scale_min_k4, for j = 0..7
    sc = np.concatenate([q[:, 0:4] & 63, (q[:, 8:12] & 15) | ((q[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([q[:, 4:8] & 63, (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)], axis=1)
    qs = b[:, -128:].reshape(n, 4, 32)
    codes = np.stack([qs & 15, qs >> 4], axis=2).reshape(n, 8, 32)  # sub-block 2c low, 2c + 1 high
    if type_name == "Q5_K":
        qh = b[:, 16:48]  # (n, 32): bit j of qh[l] is the fifth bit of sub-block j, element l
        codes = codes | (((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4)
    scales = (d * sc).astype(np.float16).reshape(rows, -1)
    mins = (-(dmin * mn)).astype(np.float16).reshape(rows, -1)
    codes_t = torch.from_numpy(codes.reshape(rows, in_features).astype(np.uint8))
    qweight = pack_int4(codes_t) if type_name == "Q4_K" else pack_int5(codes_t)
    return {"qweight": qweight, "scales": torch.from_numpy(scales), "mins": torch.from_numpy(mins)}


def kquant_scales(type_name: str, blocks: torch.Tensor) -> torch.Tensor:
    """The float16 super-block scales of (rows, row bytes) blocks: d and dmin (Q4_K / Q5_K), d (Q6_K); for the
    check that a file holds finite ones."""
    size = KQ_BLOCK_BYTES[type_name]
    b = blocks.reshape(-1, size)
    fields = b[:, 208:210] if type_name == "Q6_K" else b[:, 0:4]
    return fields.contiguous().view(torch.float16)


