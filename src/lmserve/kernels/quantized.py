"""Bindings of the quantized linear kernels: int8 W8A8, int4 weight-only, int8 weight-only and the GGUF K-quants
(kernels/linear_quant.c, kernels/kquant.c); tensor layouts are lmserve.model.quantization's."""

from __future__ import annotations

import functools

import torch

from lmserve.kernels import library as L
from lmserve.kernels.w4a8 import w4a8_isa, w4a8_isa_name

I4_MAX_ROWS = 8  # rows linear_i4 takes in one pass over the weights (I4_MAX_ROWS in the C source)
I8_MAX_ROWS = 8  # rows linear_i8 serves in one pass over the weights (I8_MAX_ROWS in the C source)
I8_KERNEL_NAMES = {2: "AVX512-VNNI (vpdpbusd, 512-bit)", 1: "AVX-VNNI (vpdpbusd, 256-bit)",
                   -1: "AVX2 (vpmaddubsw, no VNNI)", 0: "portable C (no VNNI)"}


def quantized_kernel_names() -> dict[str, str]:
    """Which instructions the loaded int8 / int4 kernels use (what the runner logs)."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    return {
        "int8": I8_KERNEL_NAMES[L._lib.i8_kernel_isa()],
        "int4": "AVX-512" if L._lib.i4_kernel_isa() else "portable C",
        "int8w": "AVX-512" if L._lib.i4_kernel_isa() else "portable C",  # compiled with the int4 kernel's paths
        "w4a8": w4a8_isa_name(w4a8_isa()),
    }


@functools.cache
def _i8_isa(lib: object) -> int:
    return lib.i8_kernel_isa()  # (fixed when the library was compiled: asked once, not on every forward)


def i8_kernel_rows() -> int:
    """The most rows Linear gives linear_i8 (and the decode stack takes) before the batched path (int8_mm) is
    faster: I8_MAX_ROWS with VNNI (oneDNN's _int_mm then), 64 with AVX2's vpmaddubsw, 16 for the portable loop."""
    isa = _i8_isa(L._lib) if L._lib is not None else 1
    return I8_MAX_ROWS if isa > 0 else 64 if isa < 0 else 16


def int8_dot_instructions() -> bool:
    """Whether the CPU has int8 dot-product instructions (VNNI): what makes torch._int_mm fast (oneDNN)."""
    return L._lib is not None and _i8_isa(L._lib) > 0


def quantize_rows_i8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of x (M, K) float32: (q (M, K) int8, scales (M,) float32), bit-identical to
    lmserve.model.quantization.quantize_activations."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    x = x.contiguous()
    L._check(x, "x")
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    s = torch.empty(m, dtype=torch.float32)
    L._lib.quantize_rows_i8(x.data_ptr(), q.data_ptr(), s.data_ptr(), m, k, torch.get_num_threads())
    return q, s


def linear_i8(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, row_sums: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """W8A8 for few rows: x (M, K) float32 quantized per row inside, qweight (O, K) int8, scales (O,) float32,
    row_sums (O,) int32 (sum of each qweight row). Returns (M, O) float32."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    x = x.contiguous()
    L._check(x, "x")
    L._check(qweight, "qweight", torch.int8)
    L._check(scales, "scales")
    L._check(row_sums, "row_sums", torch.int32)
    if bias is not None:
        L._check(bias, "bias")
    m, k = x.shape
    o = qweight.shape[0]
    assert qweight.shape[1] == k, f"x has {k} features, weight expects {qweight.shape[1]}"
    y = torch.empty(m, o, dtype=torch.float32)
    L._lib.linear_i8_f32(
        x.data_ptr(),
        qweight.data_ptr(),
        scales.data_ptr(),
        row_sums.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        y.data_ptr(),
        m,
        o,
        k,
        torch.get_num_threads(),
    )
    return y


def _check_groups(scales: torch.Tensor, o: int, k: int, name: str = "scales") -> int:
    L._check(scales, name, torch.float16)
    assert scales.shape[0] == o and k % scales.shape[1] == 0, f"{name} {tuple(scales.shape)} for ({o}, {k})"
    group = k // scales.shape[1]
    assert group % 32 == 0, f"group size {group} must be a multiple of 32"
    return group


def _check_i4(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, k: int) -> int:
    L._check(qweight, "qweight", torch.uint8)
    o = qweight.shape[0]
    assert qweight.shape == (o, k // 2) and k % 32 == 0, f"int4 codes {tuple(qweight.shape)} for {k} inputs"
    group = _check_groups(scales, o, k)
    if mins is not None:
        L._check(mins, "mins", torch.float16)
        assert mins.shape == scales.shape, f"mins {tuple(mins.shape)} vs scales {tuple(scales.shape)}"
    return group


def linear_i4(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weight-only int4 for up to I4_MAX_ROWS rows: x (M, K) float32, qweight (O, K/2) uint8 codes, scales
    (O, K/G) float16, mins (O, K/G) float16 or None (asymmetric: w = code * scale + min). Returns (M, O) float32."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    x = x.contiguous()
    L._check(x, "x")
    m, k = x.shape
    assert m <= I4_MAX_ROWS, f"linear_i4 takes at most {I4_MAX_ROWS} rows, got {m}"
    group = _check_i4(qweight, scales, mins, k)
    if bias is not None:
        L._check(bias, "bias")
    o = qweight.shape[0]
    y = torch.empty(m, o, dtype=torch.float32)
    L._lib.linear_i4_f32(
        x.data_ptr(), qweight.data_ptr(), scales.data_ptr(), L._ptr(mins), L._ptr(bias), y.data_ptr(), m, o, k, group,
        torch.get_num_threads(),
    )  # fmt: skip
    return y


def dequant_i4(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 (O, K) matrix of int4 codes, group scales and mins (exactly lmserve.model.quantization's)."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    o, k = qweight.shape[0], qweight.shape[1] * 2
    group = _check_i4(qweight, scales, mins, k)
    out = torch.empty(o, k, dtype=torch.float32)
    L._lib.dequant_i4_f32(
        qweight.data_ptr(), scales.data_ptr(), L._ptr(mins), out.data_ptr(), o, k, group, torch.get_num_threads()
    )
    return out


def _check_i8w(qweight: torch.Tensor, scales: torch.Tensor) -> int:
    L._check(qweight, "qweight", torch.int8)
    o, k = qweight.shape
    return _check_groups(scales, o, k)


def linear_i8w(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Weight-only int8 with group scales (GGUF Q8_0) for up to I4_MAX_ROWS rows: x (M, K) float32, qweight
    (O, K) int8, scales (O, K/G) float16. Returns (M, O) float32."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    x = x.contiguous()
    L._check(x, "x")
    m, k = x.shape
    assert m <= I4_MAX_ROWS, f"linear_i8w takes at most {I4_MAX_ROWS} rows, got {m}"
    assert qweight.dim() == 2 and qweight.shape[1] == k, f"x has {k} features, weight {tuple(qweight.shape)}"
    group = _check_i8w(qweight, scales)
    if bias is not None:
        L._check(bias, "bias")
    o = qweight.shape[0]
    y = torch.empty(m, o, dtype=torch.float32)
    L._lib.linear_i8w_f32(
        x.data_ptr(), qweight.data_ptr(), scales.data_ptr(), L._ptr(bias), y.data_ptr(), m, o, k, group,
        torch.get_num_threads(),
    )  # fmt: skip
    return y


def dequant_i8w(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 (O, K) matrix of group-scaled int8 weights (exactly lmserve.model.quantization's)."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    group = _check_i8w(qweight, scales)
    o, k = qweight.shape
    out = torch.empty(o, k, dtype=torch.float32)
    L._lib.dequant_i8w_f32(qweight.data_ptr(), scales.data_ptr(), out.data_ptr(), o, k, group, torch.get_num_threads())
    return out


KQ_MAX_ROWS = 8  # rows linear_kq takes in one pass over the weights (KQ_MAX_ROWS in the C source)
KQ_BLOCK = 256  # weights a super-block (ggml's QK_K)
KQ_TYPES = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}  # GGML type -> the C kernels' type code (KQ_Q4_K ...)
KQ_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def kquant_kernel_name() -> str:
    """Which path the K-quant kernels take on this CPU now (chosen at run time by its features)."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    return "AVX-512 (chosen at run time)" if L._lib.kq_kernel_isa() else "portable C"


def force_kquant_portable(on: bool) -> None:
    """Make the K-quant kernels take their portable C path whatever the CPU has (on=False: back to the CPU's)."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    L._lib.kq_force_portable(int(on))


def linear_kq(
    x: torch.Tensor, qweight: torch.Tensor, segments: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """K-quant weight-only L.linear: x (M, K) float32; qweight uint8, the row segments' super-block bytes one after
    the other; segments (S, 3) int64 rows (type code, rows, byte offset in qweight) covering the out_features
    output rows in order (lmserve.model.quantization.kquant_segment_table). Returns (M, out_features) float32.
    Up to KQ_MAX_ROWS rows cost about one pass over the weights; more are served in runs of it (Linear
    dequantizes tiles for the float32 GEMM then)."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    x = x.contiguous()
    L._check(x, "x")
    m, k = x.shape
    assert k % KQ_BLOCK == 0, f"K-quant rows hold whole super-blocks of {KQ_BLOCK}, got {k} inputs"
    L._check(qweight, "qweight", torch.uint8)
    L._check(segments, "segments", torch.int64)
    assert segments.dim() == 2 and segments.shape[1] == 3, f"segments {tuple(segments.shape)}: (S, 3) rows"
    if bias is not None:
        L._check(bias, "bias")
        assert bias.shape == (out_features,), f"bias {tuple(bias.shape)} for {out_features} outputs"
    y = torch.empty(m, out_features, dtype=torch.float32)
    L._lib.linear_kq_f32(
        x.data_ptr(), qweight.data_ptr(), segments.data_ptr(), segments.shape[0], L._ptr(bias), y.data_ptr(), m,
        out_features, k, torch.get_num_threads(),
    )  # fmt: skip
    return y


def dequant_kq(type_name: str, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows of one K-quant type, blocks (rows, in_features / 256 * block bytes) uint8, as float32 (rows,
    in_features): exactly gguf's dequantized values."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    assert type_name in KQ_TYPES, f"{type_name} is not a K-quant type ({', '.join(KQ_TYPES)})"
    L._check(blocks, "blocks", torch.uint8)
    assert in_features % KQ_BLOCK == 0, f"K-quant rows hold whole super-blocks of {KQ_BLOCK}, got {in_features}"
    rows = blocks.shape[0]
    row_bytes = in_features // KQ_BLOCK * KQ_BLOCK_BYTES[type_name]
    assert blocks.numel() == rows * row_bytes, f"{type_name} blocks {tuple(blocks.shape)} for {in_features} inputs"
    out = torch.empty(rows, in_features, dtype=torch.float32)
    L._lib.dequant_kq_f32(
        KQ_TYPES[type_name], blocks.data_ptr(), out.data_ptr(), rows, in_features, torch.get_num_threads()
    )
    return out
