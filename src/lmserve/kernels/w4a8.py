"""Bindings of the W4A8 int4 kernels (kernels/w4a8.c): int8 activations per block of 32 and integer dot products
on the packed layout of lmserve.model.quantization.pack_w4a8; the instruction set chosen at run time."""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

from lmserve.kernels import library as L

W4A8_ISA_ENV = "LMSERVE_W4A8_ISA"  # auto (the fastest this CPU runs) | vnni512 | vnni256 | avx2 | scalar
W4A8_ISAS = {"scalar": 0, "avx2": 1, "vnni256": 2, "vnni512": 3}  # W4A8_* in the C source


def w4a8_isa_supported(isa: str) -> bool:
    """Whether this CPU (and OS) runs the W4A8 path isa, by cpuid at run time."""
    assert isa in W4A8_ISAS, f"W4A8 path {isa!r}: one of {list(W4A8_ISAS)}"
    return L.available() and bool(L._lib.w4a8_isa_supported(W4A8_ISAS[isa]))


def w4a8_isa(isa: str | None = None) -> str:
    """The W4A8 path the kernels run: isa, else $LMSERVE_W4A8_ISA, else ("auto") the fastest this CPU supports.
    A forced path the CPU lacks is a ValueError."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    want = (isa or os.environ.get(W4A8_ISA_ENV, "auto")).strip().lower() or "auto"
    if want == "auto":
        best = L._lib.w4a8_isa_best()
        return next(n for n, v in W4A8_ISAS.items() if v == best)
    if want not in W4A8_ISAS:
        raise ValueError(f"{W4A8_ISA_ENV} must be auto or one of {list(W4A8_ISAS)}, got {want!r}")
    if not w4a8_isa_supported(want):
        raise ValueError(
            f"W4A8 path {want!r} needs instructions this CPU lacks (flags: {sorted(L.cpu_flags())[:8]}...)"
        )
    return want


def w4a8_isa_name(isa: str) -> str:
    """What path isa runs, in words (the runner logs it, bench JSONs record it)."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    vex = bool(L._lib.w4a8_vnni256_vex())
    return {
        "vnni512": "W4A8 AVX512-VNNI (vpdpbusd zmm, 16-row panels)",
        "vnni256": f"W4A8 {'AVX-VNNI (vpdpbusd ymm, VEX)' if vex else 'AVX512-VNNI/VL (vpdpbusd ymm, EVEX)'}, 8 rows",
        "avx2": "W4A8 AVX2 (vpmaddubsw + vpmaddwd), 8 rows",
        "scalar": "W4A8 portable C",
    }[isa]


def w4a8_quantize_rows(x: torch.Tensor, offset: int = 8) -> tuple[torch.Tensor, ...]:
    """The activation blocks the W4A8 kernels compute with, for x (M, K) float32: q (M, K) int8, d (M, K/32)
    float32, corr (M, K/32) int32 = -offset * (sum of the block's q), ds (M, K/32) float32 = d * sum q."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    x = x.contiguous()
    L._check(x, "x")
    m, k = x.shape
    assert k % 32 == 0, f"{k} inputs: not a multiple of 32"
    q = torch.empty(m, k, dtype=torch.int8)
    d, ds = torch.empty(m, k // 32), torch.empty(m, k // 32)
    corr = torch.empty(m, k // 32, dtype=torch.int32)
    L._lib.w4a8_quantize_rows(
        x.data_ptr(), q.data_ptr(), d.data_ptr(), corr.data_ptr(), ds.data_ptr(), m, k, offset,
        torch.get_num_threads(),
    )  # fmt: skip
    return q, d, corr, ds


def _check_operands(x: torch.Tensor, w: Any, bias: torch.Tensor | None) -> None:
    """x (M, K) contiguous float32, w's packed panels for K inputs, bias (O,) or None: what the kernels read."""
    L._check(x, "x")
    k, o = x.shape[1], w.out_features
    assert k == w.in_features, f"x has {k} features, weight expects {w.in_features}"
    L._check(w.codes, "codes", torch.uint8)
    L._check(w.scales, "scales", torch.float16)
    assert w.codes.shape == (-(-o // 16), k // 32, w.bits, 64), f"codes {tuple(w.codes.shape)} for ({o}, {k})"
    assert w.bits in (4, 5, 8) and (w.bits != 8 or w.mins is None), f"{w.bits}-bit panels (4, 5, or 8 without mins)"
    assert w.scales.shape == (w.codes.shape[0], k // w.group_size, 16), f"scales {tuple(w.scales.shape)}"
    if w.mins is not None:
        L._check(w.mins, "mins", torch.float16)
        assert w.mins.shape == w.scales.shape, f"mins {tuple(w.mins.shape)} vs scales {tuple(w.scales.shape)}"
    if bias is not None:
        L._check(bias, "bias")


def linear_w4a8(x: torch.Tensor, w: Any, bias: torch.Tensor | None, isa: str | None = None) -> torch.Tensor:
    """W4A8 for any number of rows: x (M, K) float32 quantized inside per row per block of 32; w a
    lmserve.model.quantization.W4A8Weights (the packed int4 panels, 5-bit ones (GGUF Q5_0 / Q5_1), or 8-bit ones:
    W8A8 blocks); bias (O,) or None;
    isa as w4a8_isa. Returns (M, O) float32."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    x = x.contiguous()
    _check_operands(x, w, bias)
    m, k = x.shape
    o = w.out_features
    y = torch.empty(m, o, dtype=torch.float32)
    if m == 0:
        return y
    rc = L._lib.linear_w4a8_f32(
        x.data_ptr(), w.codes.data_ptr(), w.scales.data_ptr(), L._ptr(w.mins), L._ptr(bias), y.data_ptr(), m, o, k,
        w.group_size, w.bits, W4A8_ISAS[w4a8_isa(isa)], torch.get_num_threads(),
    )  # fmt: skip
    assert rc == 0, "linear_w4a8_f32: out of memory for the activation scratch"
    return y


class _Job(ctypes.Structure):
    """w4a8_job in kernels/w4a8.c: one product of linear_w4a8_multi_f32."""

    _fields_ = [(n, ctypes.c_void_p) for n in ("x", "pc", "ps", "pm", "b", "y")] + [
        (n, ctypes.c_int64) for n in ("M", "O", "G")
    ]


def linear_w4a8_many(
    xs: list[torch.Tensor], ws: list[Any], biases: list[torch.Tensor | None], isa: str | None = None
) -> list[torch.Tensor]:
    """linear_w4a8(xs[i], ws[i], biases[i]) for every i in one call of the kernel (one parallel region over all
    the products, as the decode stack runs a layer's input projections and a token's experts): the same bits.
    The weights share in_features, bits and mins-ness."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    assert xs and len(xs) == len(ws) == len(biases), "one x, weight and bias per product"
    w0 = ws[0]
    assert all(w.in_features == w0.in_features and w.bits == w0.bits for w in ws), "one K and bits for all"
    assert all((w.mins is None) == (w0.mins is None) for w in ws), "mins on all weights or on none"
    xs = [x.contiguous() for x in xs]
    ys = [torch.empty(x.shape[0], w.out_features) for x, w in zip(xs, ws, strict=True)]
    for x, w, b in zip(xs, ws, biases, strict=True):
        _check_operands(x, w, b)
    jobs = (_Job * len(xs))(*[
        _Job(x.data_ptr(), w.codes.data_ptr(), w.scales.data_ptr(), L._ptr(w.mins), L._ptr(b), y.data_ptr(),
             x.shape[0], w.out_features, w.group_size)
        for x, w, b, y in zip(xs, ws, biases, ys, strict=True)
    ])  # fmt: skip
    rc = L._lib.linear_w4a8_multi_f32(
        ctypes.addressof(jobs), len(xs), w0.in_features, w0.bits, W4A8_ISAS[w4a8_isa(isa)], torch.get_num_threads()
    )
    assert rc == 0, "linear_w4a8_multi_f32: out of memory, or operands it refuses"
    return ys
