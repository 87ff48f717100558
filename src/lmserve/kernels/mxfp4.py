"""Bindings of the MXFP4 x int8 kernels (kernels/mxfp4.c): gpt-oss's 4-bit expert weights as the checkpoint holds
them (lmserve.model.mxfp4's layout) against activations quantized to int8 per block of 32; the path chosen at run
time from the CPU's features."""

from __future__ import annotations

import os

import torch

from lmserve.kernels import library as L

MXFP4_ISA_ENV = "LMSERVE_MXFP4_ISA"  # auto (the fastest this CPU runs) | vnni256 | avx2 | scalar
MXFP4_ISAS = {"scalar": 0, "avx2": 1, "vnni256": 2}  # MX_* in the C source
MXFP4_MAX_ROWS = 8  # rows one pass over the weights serves (MX_MR in the C source); more run in passes of it


def mxfp4_isa_supported(isa: str) -> bool:
    """Whether this CPU (and OS) runs the MXFP4 path isa, by cpuid at run time."""
    assert isa in MXFP4_ISAS, f"MXFP4 path {isa!r}: one of {list(MXFP4_ISAS)}"
    return L.available() and bool(L._lib.mxfp4_isa_supported(MXFP4_ISAS[isa]))


def mxfp4_isa(isa: str | None = None) -> str:
    """The MXFP4 path the kernels run: isa, else $LMSERVE_MXFP4_ISA, else ("auto") the fastest this CPU supports.
    A forced path the CPU lacks, or an unknown name, is a ValueError."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    want = (isa or os.environ.get(MXFP4_ISA_ENV, "auto")).strip().lower() or "auto"
    if want == "auto":
        best = L._lib.mxfp4_isa_best()
        return next(n for n, v in MXFP4_ISAS.items() if v == best)
    if want not in MXFP4_ISAS:
        raise ValueError(f"{MXFP4_ISA_ENV} must be auto or one of {list(MXFP4_ISAS)}, got {want!r}")
    if not mxfp4_isa_supported(want):
        raise ValueError(f"MXFP4 path {want!r} needs instructions this CPU lacks")
    return want


def mxfp4_isa_name(isa: str) -> str:
    """What path isa runs, in words (the runner logs it)."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    vex = bool(L._lib.w4a8_vnni256_vex())
    return {
        "vnni256": f"MXFP4 x int8 {'AVX-VNNI (vpdpbusd ymm, VEX)' if vex else 'AVX512-VNNI/VL (vpdpbusd ymm, EVEX)'}",
        "avx2": "MXFP4 x int8 AVX2 (vpshufb lookup, vpmaddubsw + vpmaddwd)",
        "scalar": "MXFP4 x int8 portable C",
    }[isa]


def linear_mxfp4(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, isa: str | None = None
) -> torch.Tensor:
    """y = x W^T + b with W as MXFP4: x (M, K) float32, quantized inside to int8 per row per block of 32; blocks
    (O, K/32, 16) uint8, scales (O, K/32) uint8 e8m0; bias (O,) float32 or None; isa as mxfp4_isa. Any M (up to
    MXFP4_MAX_ROWS a pass over the weights). Returns (M, O) float32."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    x = x.contiguous()
    L._check(x, "x")
    m, k = x.shape
    L._check(blocks, "blocks", torch.uint8)
    L._check(scales, "scales", torch.uint8)
    o = blocks.shape[0]
    assert k % 32 == 0 and blocks.shape == (o, k // 32, 16), f"MXFP4 blocks {tuple(blocks.shape)} for {k} inputs"
    assert scales.shape == (o, k // 32), f"MXFP4 scales {tuple(scales.shape)} for blocks {tuple(blocks.shape)}"
    if bias is not None:
        L._check(bias, "bias")
        assert bias.shape == (o,), f"bias {tuple(bias.shape)} for {o} outputs"
    y = torch.empty(m, o, dtype=torch.float32)
    if m == 0:
        return y
    rc = L._lib.linear_mxfp4_f32(
        x.data_ptr(), blocks.data_ptr(), scales.data_ptr(), L._ptr(bias), y.data_ptr(), m, o, k,
        MXFP4_ISAS[mxfp4_isa(isa)], torch.get_num_threads(),
    )  # fmt: skip
    assert rc == 0, "linear_mxfp4_f32: out of memory for the activation scratch"
    return y
