"""MXFP4 weights (OCP microscaling, gpt-oss checkpoints' experts) kept as the checkpoint's 4-bit bytes:
`blocks` (O, K/32, 16) uint8, two e2m1 values a byte (the even input in the low nibble), and `scales` (O, K/32)
uint8 e8m0 exponents: w = E2M1[nibble] * 2^(scale - 127). transformers' convert_moe_packed_tensors is the
reference dequantize_mxfp4 matches bit for bit. Mxfp4Linear runs few rows on the MXFP4 x int8 C kernel (e2m1 × 2
is an exact int8, activations int8 per block of 32), more by dequantizing float32 tiles; or becomes an int8w Linear.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from lmserve import kernels
from lmserve.model.quantization import quantize_activation_blocks

MXFP4_BLOCK = 32  # weights per e8m0 scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_LUT = torch.tensor(E2M1_VALUES, dtype=torch.float32)
_LUT_X2 = (_LUT * 2).to(torch.int8)  # e2m1 × 2: 0, ±1, ±2, ±3, ±4, ±6, ±8, ±12 (−0 → 0)
_F16_EXPONENTS = (-24, 15)  # the powers of two float16 holds exactly (subnormal to largest)
MXFP4_COMPUTE_ENV = "LMSERVE_MXFP4_COMPUTE"  # few rows: "w4a8" (int8 activations, the C kernel) | "weight-only"
MXFP4_COMPUTE_MODES = ("w4a8", "weight-only")


def mxfp4_compute() -> str:
    """$LMSERVE_MXFP4_COMPUTE, checked: "w4a8" (the default) or "weight-only" (float32 tiles for every row count)."""
    mode = os.environ.get(MXFP4_COMPUTE_ENV, "w4a8").strip().lower() or "w4a8"
    if mode not in MXFP4_COMPUTE_MODES:
        raise ValueError(f"{MXFP4_COMPUTE_ENV} must be one of {list(MXFP4_COMPUTE_MODES)}, got {mode!r}")
    return mode


def mxfp4_to_int8w(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """blocks (O, G, 16), scales (O, G) → the same weights as (codes (O, G * 32) int8, group-32 scales (O, G)
    float16), exactly: codes e2m1 × 2, scales 2^(e − 128); None when some scale is outside float16's range."""
    exp = scales.to(torch.int32) - 128
    if bool(((exp < _F16_EXPONENTS[0]) | (exp > _F16_EXPONENTS[1])).any()):
        return None
    codes = torch.stack((_LUT_X2[(blocks & 0x0F).long()], _LUT_X2[(blocks >> 4).long()]), dim=-1)
    return codes.flatten(-3), torch.ldexp(torch.ones(exp.shape), exp).to(torch.float16)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks (..., G, 16) uint8, scales (..., G) uint8 → (..., G * 32) float32 (exact: every value is a power of two
    times a 3-bit mantissa)."""
    assert blocks.dtype == torch.uint8 and scales.dtype == torch.uint8, f"MXFP4: uint8, got {blocks.dtype}"
    assert blocks.shape[:-1] == scales.shape and blocks.shape[-1] == MXFP4_BLOCK // 2, (
        f"MXFP4 blocks {tuple(blocks.shape)} vs scales {tuple(scales.shape)}"
    )
    values = torch.stack((_LUT[(blocks & 0x0F).long()], _LUT[(blocks >> 4).long()]), dim=-1)  # (..., G, 16, 2)
    values = torch.ldexp(values.flatten(-2), (scales.to(torch.int32) - 127).unsqueeze(-1))  # (int: as transformers)
    return values.flatten(-2)


def mxfp4_a8_reference(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What the MXFP4 x int8 kernel computes, in PyTorch (to float32 rounding): x (M, K) in int8 blocks of 32
    (quantize_activation_blocks: d, q), per block the exact integer sum of (e2m1 × 2) · q, times d · 2^(e − 128),
    summed over blocks in float64. Returns (M, O) float32."""
    q, d = quantize_activation_blocks(x)
    m, g = d.shape
    codes = torch.stack((_LUT_X2[(blocks & 0x0F).long()], _LUT_X2[(blocks >> 4).long()]), dim=-1).flatten(-2)
    isum = torch.einsum("mbi,obi->mob", q.double().reshape(m, g, MXFP4_BLOCK), codes.double())  # exact integers
    ws = torch.ldexp(torch.ones(scales.shape, dtype=torch.float64), scales.long() - 128)
    y = (isum * ws[None] * d.double()[:, None, :]).sum(-1).float()
    return y + bias if bias is not None else y


def check_mxfp4(name: str, blocks: torch.Tensor, scales: torch.Tensor, out_features: int, in_features: int) -> None:
    """ValueError naming the tensor when blocks / scales are not an (out_features, in_features) MXFP4 weight."""
    want_b = (out_features, in_features // MXFP4_BLOCK, MXFP4_BLOCK // 2)
    if in_features % MXFP4_BLOCK or tuple(blocks.shape) != want_b or blocks.dtype != torch.uint8:
        raise ValueError(f"{name}_blocks: {tuple(blocks.shape)} {blocks.dtype}, expected {want_b} uint8")
    if tuple(scales.shape) != want_b[:2] or scales.dtype != torch.uint8:
        raise ValueError(f"{name}_scales: {tuple(scales.shape)} {scales.dtype}, expected {want_b[:2]} uint8")


class Mxfp4Linear(nn.Module):
    """y = x W^T + b with W held as MXFP4 (4.25 bits a weight); only this Linear's bytes are read (an expert not
    chosen costs nothing). fast_path: up to kernels.MXFP4_MAX_ROWS rows the C kernel (int8 activations per block of
    32, integer dot products on the 4-bit codes), more (or `compute` "weight-only") dequantize the weight in float32
    tiles of DEQUANT_ROWS output rows."""

    DEQUANT_ROWS = 512

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        assert in_features % MXFP4_BLOCK == 0, f"MXFP4: {in_features} inputs, not a multiple of {MXFP4_BLOCK}"
        self.in_features, self.out_features = in_features, out_features
        g = in_features // MXFP4_BLOCK
        self.register_buffer("blocks", torch.zeros(out_features, g, MXFP4_BLOCK // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.zeros(out_features, g, dtype=torch.uint8))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.compute = mxfp4_compute()  # "w4a8" | "weight-only" (MXFP4_COMPUTE_ENV)

    def set_mxfp4(self, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        check_mxfp4("weight", blocks, scales, self.out_features, self.in_features)
        self.blocks, self.scales = blocks.contiguous(), scales.contiguous()

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_mxfp4(self.blocks, self.scales)

    def to_int8w(self) -> nn.Module | None:
        """The same weight as an lmserve Linear in the int8w layout (8-bit codes, float16 scales per 32 inputs: the
        C int8w kernels), or None when a scale does not fit float16."""
        from lmserve.model.layers.linear import Linear

        converted = mxfp4_to_int8w(self.blocks, self.scales)
        if converted is None:
            return None
        with torch.device("meta"):
            out = Linear(self.in_features, self.out_features, bias=self.bias is not None)
        out._set_quantized("int8w", MXFP4_BLOCK, *converted)
        out.bias = None if self.bias is None else nn.Parameter(self.bias.detach().clone(), requires_grad=False)
        return out

    def fast_path(self, x: torch.Tensor) -> str:
        """Which path forward(x) takes: "mxfp4_kernel" (few float32 CPU rows, compute "w4a8") or "dequant"."""
        rows = x.numel() // max(1, x.shape[-1])
        few = self.compute == "w4a8" and rows <= kernels.MXFP4_MAX_ROWS and kernels.usable(x)
        return "mxfp4_kernel" if few and self.blocks.device.type == "cpu" else "dequant"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o, step = self.out_features, self.DEQUANT_ROWS
        if self.fast_path(x) == "mxfp4_kernel":
            y = kernels.linear_mxfp4(x.reshape(-1, self.in_features), self.blocks, self.scales, self.bias)
            return y.view(*x.shape[:-1], o)
        if o <= step:
            return nn.functional.linear(x, self.dequantized_weight(), self.bias)
        out = torch.empty(*x.shape[:-1], o, dtype=torch.float32)
        for start in range(0, o, step):
            w = dequantize_mxfp4(self.blocks[start : start + step], self.scales[start : start + step])
            out[..., start : start + w.shape[0]] = x @ w.t()
        return out + self.bias if self.bias is not None else out
