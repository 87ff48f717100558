"""Quantized linear weights: their layouts, the quantization math (the PyTorch reference every kernel is tested
against), and the checkpoint format `lmserve quantize` writes (write_quantized_checkpoint).

Methods int8 (W8A8) and int4 (W4A8 or weight-only); layouts int8, int4, int8w, int5 and the W4A8 panels (GGUF's
tensors as in the file: gguf_blocks.py). Formulas and byte layouts: docs/quantization.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from lmserve.config.engine import QUANTIZATION_FORMAT, QuantizationConfig

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


INT8_FLOAT_K = 1024  # K a float32 GEMM of int8 codes sums exactly: |partial sums| <= 128 * 128 * 1024 = 2**24
INT8_FLOAT_TILE = 2 * 2**20  # bytes of float32 weight rows converted per GEMM call (they stay in cache)


def int8_mm(xq: torch.Tensor, qweight: torch.Tensor, use_int_mm: bool) -> torch.Tensor:
    """xq (M, K) int8 times qweight (O, K) int8 transposed, summed exactly in int32 and returned as float32 (M, O).
    use_int_mm: torch._int_mm (oneDNN int8, fast with VNNI / AMX); else float32 GEMMs over K chunks of INT8_FLOAT_K,
    whose every partial sum is an integer below 2**24 and so exact (without VNNI, _int_mm runs ~10x slower)."""
    if use_int_mm:
        return torch._int_mm(xq, qweight.t()).float()
    m, k = xq.shape
    o = qweight.shape[0]
    rows = max(1, INT8_FLOAT_TILE // (4 * min(k, INT8_FLOAT_K)))
    out = torch.empty(m, o, dtype=torch.float32)
    acc = torch.zeros(m, o, dtype=torch.int32) if k > INT8_FLOAT_K else None  # chunks add up in int32
    for c in range(0, k, INT8_FLOAT_K):
        xf = xq[:, c : c + INT8_FLOAT_K].float()
        for r in range(0, o, rows):
            torch.mm(xf, qweight[r : r + rows, c : c + INT8_FLOAT_K].float().t(), out=out[:, r : r + rows])
        if acc is not None:
            acc += out.to(torch.int32)
    return out if acc is None else acc.float()


def int8_linear(
    xq: torch.Tensor,
    xs: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    use_int_mm: bool = True,
) -> torch.Tensor:
    """Quantized rows (xq, xs) times int8 weights (int8_mm, exact in int32), then one scale per element."""
    y = int8_mm(xq, qweight, use_int_mm) * (xs[:, None] * scales[None, :])
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


INT5_BLOCK_BYTES = 20  # the int5 layout's bytes per block of 32 (qh word + 16 bytes of nibbles)


def unpack_int5(qweight: torch.Tensor) -> torch.Tensor:
    """The int5 layout's (O, K / 32 * 20) bytes → (O, K) uint8 codes 0..31."""
    o = qweight.shape[0]
    b = qweight.reshape(o, -1, INT5_BLOCK_BYTES)
    low = unpack_int4(b[..., 4:].reshape(o, -1).contiguous())  # (O, K)
    qh = b[..., :4].to(torch.int64)
    word = qh[..., 0] | qh[..., 1] << 8 | qh[..., 2] << 16 | qh[..., 3] << 24  # (O, NB)
    high = (word[..., None] >> torch.arange(INT4_BLOCK)) & 1  # (O, NB, 32)
    return low | (high.reshape(o, -1) << 4).to(torch.uint8)


def pack_int5(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of unpack_int5: (O, K) uint8 codes 0..31 → (O, K / 32 * 20)."""
    o, k = codes.shape
    nib = pack_int4((codes & 0x0F).contiguous()).reshape(o, k // INT4_BLOCK, 16)
    high = (codes >> 4).to(torch.int64).reshape(o, k // INT4_BLOCK, INT4_BLOCK)
    word = (high << torch.arange(INT4_BLOCK)).sum(-1)  # (O, NB)
    qh = torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8)
    return torch.cat((qh, nib), dim=-1).reshape(o, -1)


def dequantize_int5(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None) -> torch.Tensor:
    """(O, K) float32 weights of the int5 layout: (code - 16) * scale (GGUF Q5_0), or code * scale + min (Q5_1),
    each with gguf's dequantizer's one rounding (the products are exact in float32)."""
    codes = unpack_int5(qweight)
    d = scales.float().repeat_interleave(INT4_BLOCK, dim=1)
    if mins is None:
        return (codes.to(torch.int32) - 16).float() * d
    return codes.float() * d + mins.float().repeat_interleave(INT4_BLOCK, dim=1)


def int5_as_int8w(qweight: torch.Tensor) -> torch.Tensor:
    """Symmetric int5 codes (GGUF Q5_0) as the int8w layout's weights, code - 16 (exact: same scales)."""
    return (unpack_int5(qweight).to(torch.int16) - 16).to(torch.int8)


# ---- W4A8: int4 weights with int8 activations (EngineArgs.int4_compute="w4a8") ------------------------------
# The same codes, scales and mins as the int4 layout, repacked at load into 16-row panels the W4A8 kernels stream
# (cpu_kernels.c, "W4A8 int4 kernels", describes the byte order); activations are quantized per row per block of
# 32 inside the step (llama.cpp's Q8_0 activation blocks, float32 scale): d = max|x| / 127, q = round(x * (1 / d)).

W4A8_PANEL = 16  # output rows per panel of the packed layout


@dataclass(frozen=True)
class W4A8Weights:
    """A weight in the W4A8 kernels' layout: codes (P, K/32, bits, 64) uint8, scales (P, K/G, 16) float16, mins the
    same or None; P = ceil(O / 16) panels, rows past O zero. bits 4: int4 codes (pack_w4a8); bits 5: int5 codes
    (pack_w5a8, GGUF Q5_0 / Q5_1); bits 8: the int8w layout's weights + 128 (pack_w8a8: the int4 method's 8-bit
    LM head, GGUF Q8_0, with int8 activations too)."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    out_features: int
    in_features: int
    group_size: int
    bits: int = 4

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scales, self.mins) if t is not None)


def pack_w4a8(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None) -> W4A8Weights:
    """The int4 layout (qweight (O, K/2), scales / mins (O, K/G) float16) → the W4A8 panels: per panel p, block b
    and vector t, byte 4j + i = code(16p + j, 32b + 4t + i) | code(16p + j, 32b + 16 + 4t + i) << 4."""
    o, k = qweight.shape[0], qweight.shape[1] * 2
    assert scales.shape[0] == o and k % scales.shape[1] == 0, f"scales {tuple(scales.shape)} for ({o}, {k})"
    group = k // scales.shape[1]
    assert group % INT4_BLOCK == 0, f"group size {group} must be a multiple of {INT4_BLOCK}"
    assert mins is None or mins.shape == scales.shape, f"mins {tuple(mins.shape)} vs scales {tuple(scales.shape)}"
    p = -(-o // W4A8_PANEL)
    codes = torch.zeros(p * W4A8_PANEL, k, dtype=torch.uint8)
    codes[:o] = unpack_int4(qweight)
    # (panel, row j, block, half, t, i) -> (panel, block, t, j, i, half)
    c = codes.reshape(p, W4A8_PANEL, k // INT4_BLOCK, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
    packed = (c[..., 0] | (c[..., 1] << 4)).reshape(p, k // INT4_BLOCK, 4, 64).contiguous()

    return W4A8Weights(packed, _panels(scales, p), None if mins is None else _panels(mins, p), o, k, group)


def pack_w5a8(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None) -> W4A8Weights:
    """The int5 layout (qweight (O, K / 32 * 20), scales / mins (O, K / 32) float16) → 5-bit panels: vectors 0..3
    the low nibbles as pack_w4a8 lays them, vector 4 byte 4j + i = sum over t of bit4(code(16p + j, 32b + 4t + i))
    << t | bit4(code(16p + j, 32b + 16 + 4t + i)) << (4 + t)."""
    o = qweight.shape[0]
    codes = unpack_int5(qweight)
    k = codes.shape[1]
    assert scales.shape == (o, k // INT4_BLOCK), f"scales {tuple(scales.shape)} for ({o}, {k}): one per block of 32"
    assert mins is None or mins.shape == scales.shape, f"mins {tuple(mins.shape)} vs scales {tuple(scales.shape)}"
    low = pack_w4a8(pack_int4((codes & 0x0F).contiguous()), scales, mins)
    p = low.codes.shape[0]
    high = torch.zeros(p * W4A8_PANEL, k, dtype=torch.uint8)
    high[:o] = codes >> 4
    h = high.reshape(p, W4A8_PANEL, k // INT4_BLOCK, 2, 4, 4).permute(0, 2, 1, 5, 3, 4)  # (panel, block, j, i, half, t)
    shifts = (torch.arange(2)[:, None] * 4 + torch.arange(4)[None, :]).to(torch.uint8)  # half * 4 + t
    plane = (h << shifts).sum(dim=(-2, -1), dtype=torch.int32).to(torch.uint8).reshape(p, k // INT4_BLOCK, 1, 64)
    codes5 = torch.cat((low.codes, plane), dim=2).contiguous()
    return W4A8Weights(codes5, low.scales, low.mins, o, k, INT4_BLOCK, 5)


def _panels(t: torch.Tensor, p: int) -> torch.Tensor:
    """(O, NG) per-row group values → (P, NG, 16), rows past O zero."""
    padded = torch.zeros(p * W4A8_PANEL, t.shape[1], dtype=t.dtype)
    padded[: t.shape[0]] = t
    return padded.reshape(p, W4A8_PANEL, t.shape[1]).transpose(1, 2).contiguous()


def _rows(t: torch.Tensor, o: int) -> torch.Tensor:
    """Inverse of _panels."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:o].contiguous()


def pack_w8a8(qweight: torch.Tensor, scales: torch.Tensor) -> W4A8Weights:
    """The int8w layout (qweight (O, K) int8, scales (O, K/G) float16) → 8-bit panels: per panel p, block b and
    vector t = 0..7, byte 4j + i = q(16p + j, 32b + 4t + i) + 128."""
    o, k = qweight.shape
    assert scales.shape[0] == o and k % scales.shape[1] == 0, f"scales {tuple(scales.shape)} for ({o}, {k})"
    group = k // scales.shape[1]
    assert group % INT4_BLOCK == 0 and qweight.dtype == torch.int8, f"int8 weights, group {group} (multiple of 32)"
    p = -(-o // W4A8_PANEL)
    codes = torch.zeros(p * W4A8_PANEL, k, dtype=torch.uint8)
    codes[:o] = (qweight.to(torch.int16) + 128).to(torch.uint8)
    c = codes.reshape(p, W4A8_PANEL, k // INT4_BLOCK, 8, 4).permute(0, 2, 3, 1, 4)  # (panel, block, t, j, i)
    return W4A8Weights(c.reshape(p, k // INT4_BLOCK, 8, 64).contiguous(), _panels(scales, p), None, o, k, group, 8)


def unpack_w4a8(w: W4A8Weights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Inverse of pack_w4a8 (qweight, scales, mins in the int4 layout), of pack_w5a8 (the int5 layout) and of
    pack_w8a8 (qweight, scales in the int8w layout, mins None)."""
    p, nb = w.codes.shape[:2]
    if w.bits == 5:
        low = W4A8Weights(w.codes[:, :, :4].contiguous(), w.scales, w.mins, w.out_features, w.in_features, w.group_size)
        q4, scales, mins = unpack_w4a8(low)
        plane = w.codes[:, :, 4].reshape(p, nb, W4A8_PANEL, 4)  # (panel, block, j, i)
        bits = (plane[..., None, None] >> torch.arange(8).reshape(2, 4).to(torch.uint8)) & 1  # (.., i, half, t)
        high = bits.permute(0, 2, 1, 4, 5, 3).reshape(p * W4A8_PANEL, nb * INT4_BLOCK)[: w.out_features]
        return pack_int5(unpack_int4(q4) | (high << 4)), scales, mins
    if w.bits == 8:
        q = w.codes.reshape(p, nb, 8, W4A8_PANEL, 4).permute(0, 3, 1, 2, 4).reshape(p * W4A8_PANEL, nb * INT4_BLOCK)
        return (q[: w.out_features].to(torch.int16) - 128).to(torch.int8), _rows(w.scales, w.out_features), None
    b = w.codes.reshape(p, nb, 4, W4A8_PANEL, 4)
    c = torch.stack((b & 0x0F, b >> 4), dim=-1)  # (panel, block, t, j, i, half)
    codes = c.permute(0, 3, 1, 5, 2, 4).reshape(p * W4A8_PANEL, nb * INT4_BLOCK)[: w.out_features]
    o = w.out_features
    return pack_int4(codes.contiguous()), _rows(w.scales, o), None if w.mins is None else _rows(w.mins, o)


def dequantize_w4a8(w: W4A8Weights) -> torch.Tensor:
    """The float32 weight packed panels stand for (exactly the source layout's)."""
    if w.bits == 5:
        return dequantize_int5(*unpack_w4a8(w))
    return dequantize_int8w(*unpack_w4a8(w)[:2]) if w.bits == 8 else dequantize_int4(*unpack_w4a8(w))


def w4a8_rows(w: W4A8Weights, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` (int64) of the float32 weight the panels stand for, exactly (a tied embedding's lookup)."""
    p = rows // W4A8_PANEL
    sub = W4A8Weights(
        w.codes[p], w.scales[p], None if w.mins is None else w.mins[p], len(rows) * W4A8_PANEL, w.in_features,
        w.group_size, w.bits,
    )  # fmt: skip
    values = dequantize_w4a8(sub).reshape(len(rows), W4A8_PANEL, w.in_features)
    return values[torch.arange(len(rows)), rows % W4A8_PANEL]


def quantize_activation_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float32 → (q (M, K) int8, d (M, K/32) float32) per block of 32: d = max|x| / 127,
    q = round-half-even(x * (1 / d)), 0 where the block is all zero. The C kernels compute the same bits."""
    m, k = x.shape
    assert k % INT4_BLOCK == 0, f"{k} inputs: not a multiple of {INT4_BLOCK}"
    xb = x.float().reshape(m, k // INT4_BLOCK, INT4_BLOCK)
    d = xb.abs().amax(dim=-1) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.round(xb * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(m, k), d


def fake_quantize_activation_blocks(x: torch.Tensor) -> torch.Tensor:
    """x rounded to its per-block-of-32 int8 grid (q * d), in float32: what a W4A8 projection multiplies."""
    flat = x.reshape(-1, x.shape[-1]).float()
    q, d = quantize_activation_blocks(flat)
    m, k = q.shape
    deq = q.float().reshape(m, k // INT4_BLOCK, INT4_BLOCK) * d[..., None]
    return deq.reshape(x.shape).to(x.dtype)


def w8a8_blocks_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The 8-bit panels' product (int8w weights, int8 activations per block of 32) in PyTorch: per block the exact
    integer sum of q_w * q_x (|.| <= 32 * 127 * 128 < 2^24, exact in float32), times d_w * d_x, summed in float64."""
    q, d = quantize_activation_blocks(x)
    m, k = q.shape
    o, nb, group = qweight.shape[0], k // INT4_BLOCK, k // scales.shape[1]
    isum = torch.einsum("mbi,obi->mob", q.float().reshape(m, nb, 32), qweight.float().reshape(o, nb, 32)).double()
    wd = scales.double().repeat_interleave(group // INT4_BLOCK, dim=1)
    y = (isum * wd[None] * d.double()[:, None, :]).sum(-1).float()
    return y + bias if bias is not None else y


def w4a8_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The W4A8 product in PyTorch (what the kernels compute, to float32 rounding): per activation block b of
    row m and weight row o, the exact integer sum of code * q (each block's sum of 32 integer products is
    exact in float32: |.| <= 60960 < 2^24), then d_w(o, b) * d_x(m, b) * (sum - 8 * sum q) for symmetric codes, or
    d_w * d_x * sum + min * d_x * sum q with mins; summed over blocks in float64. Returns (M, O) float32."""
    return _a8_block_product(x, unpack_int4(qweight), 8, scales, mins, bias)


def w5a8_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The 5-bit panels' product (int5 layout, int8 activations per block of 32) in PyTorch, as w4a8_reference:
    per block the exact integer sum of code * q, then d_w * d_x * (sum - 16 * sum q) (GGUF Q5_0), or
    d_w * d_x * sum + min * d_x * sum q (Q5_1); summed over blocks in float64. Returns (M, O) float32."""
    return _a8_block_product(x, unpack_int5(qweight), 16, scales, mins, bias)


def _a8_block_product(
    x: torch.Tensor,
    codes: torch.Tensor,
    offset: int,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """w4a8_reference / w5a8_reference: unsigned codes (O, K) against x's int8 blocks of 32; `offset` is the
    symmetric codes' zero (8 or 16); scales (and mins) per group of K // scales.shape[1] weights."""
    q, d = quantize_activation_blocks(x)
    m, k = q.shape
    nb = k // INT4_BLOCK
    reps = nb // scales.shape[1]  # activation blocks per weight group
    cb = codes.float().reshape(-1, nb, INT4_BLOCK)
    qb = q.float().reshape(m, nb, INT4_BLOCK)
    isum = torch.einsum("mbi,obi->mob", qb, cb).double()  # exact integers
    sx = qb.sum(dim=-1).double()  # (m, nb)
    wd = scales.double().repeat_interleave(reps, dim=1)  # (o, nb)
    dx = d.double()
    if mins is None:
        y = ((isum - offset * sx[:, None, :]) * wd[None] * dx[:, None, :]).sum(-1)
    else:
        wm = mins.double().repeat_interleave(reps, dim=1)
        y = (isum * wd[None] * dx[:, None, :] + wm[None] * (dx * sx)[:, None, :]).sum(-1)
    y = y.float()
    return y + bias if bias is not None else y


def dequantize_layout(
    method: str, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None
) -> torch.Tensor:
    """The float32 weight any layout stands for (the PyTorch reference of what its kernels compute)."""
    if method == "int8":
        return dequantize_int8(qweight, scales)
    if method == "int8w":
        return dequantize_int8w(qweight, scales)
    if method == "int5":
        return dequantize_int5(qweight, scales, mins)
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
    if method == "int5":
        assert group_size == INT4_BLOCK, f"int5: one scale per block of {INT4_BLOCK}, not {group_size}"
        specs = {
            "qweight": ((out_features, in_features // INT4_BLOCK * INT5_BLOCK_BYTES), torch.uint8),
            "scales": groups,
        }
        return {**specs, "mins": groups} if mins else specs
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
