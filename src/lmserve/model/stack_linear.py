"""The C description of one projection (cpu_kernels.c: ls_linear) as the one-call decode stack runs it, and whether a
Linear's few-row input takes its C kernel on the module path (so the stack computes the same bits)."""

from __future__ import annotations

import ctypes

import torch

from lmserve import kernels
from lmserve.model import quantization as quant
from lmserve.model.layers import Linear, kernel_max_rows
from lmserve.model.mxfp4 import Mxfp4Linear

# ls_linear.kind in cpu_kernels.c
_KINDS = {"float32": 0, "bf16w": 1, "int8": 2, "int4": 3, "int8w": 4, "kquant": 5, "w4a8": 6, "w5a8": 7, "w8a8": 8,
          "mxfp4": 9}  # fmt: skip
_PANEL_KINDS = {4: "w4a8", 5: "w5a8", 8: "w8a8"}  # W4A8 panels by their codes' bits (int4; GGUF Q5_0 / Q5_1; Q8_0)
W4A8_STACK_MAX_ROWS = 64  # decode rows one call takes when every projection is on W4A8 panels (scratch ~B x 36 KiB)


class LinearDesc(ctypes.Structure):
    """ls_linear: one projection as the stack's kernels take it."""

    _fields_ = (
        [(n, ctypes.c_int64) for n in ("kind", "O", "K", "G")]
        + [(n, ctypes.c_void_p) for n in ("w", "scales", "mins", "row_sums", "bias")]
        + [("isa", ctypes.c_int64)]
    )


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def linear_desc(m: Linear | Mxfp4Linear) -> tuple[LinearDesc, int]:
    """m's C description and the most rows its kernel takes in one call."""
    isa = 0
    if isinstance(m, Mxfp4Linear):  # (w: the 4-bit blocks, scales: the e8m0 bytes; the path resolved now)
        isa = kernels.MXFP4_ISAS[kernels.mxfp4_isa()]
        desc = LinearDesc(_KINDS["mxfp4"], m.out_features, m.in_features, 0, ptr(m.blocks), ptr(m.scales), None, None,
                          ptr(m.bias), isa)  # fmt: skip
        return desc, kernels.MXFP4_MAX_ROWS
    if m._w4a8 is not None:  # packed for W4A8: the panels, the path resolved now (kernels.w4a8_isa)
        p = m._w4a8
        w, scales, mins, kind, group, sums = p.codes, p.scales, p.mins, _PANEL_KINDS[p.bits], p.group_size, None
        isa = kernels.W4A8_ISAS[kernels.w4a8_isa()]
    elif m.quant_method is None:
        bf16 = m._weight_bf16 is not None
        w, kind = (m._weight_bf16 if bf16 else m.weight), ("bf16w" if bf16 else "float32")
        scales = mins = sums = None
        group = 0
    elif m.quant_method == "kquant":  # (GGUF K-quants: `scales` points at the segment table, G counts its rows)
        w, scales, mins, sums, kind = m.qweight, m._kq_table, None, None, "kquant"
        group = m._kq_table.shape[0]
    else:
        w, scales, mins, kind = m.qweight, m.scales, m.mins, m.quant_method
        group, sums = (0 if kind == "int8" else m.in_features // m.scales.shape[1]), None
        if kind == "int8":
            if m._row_sums is None:
                m._row_sums = quant.int8_row_sums(m.qweight)
            sums = m._row_sums
    desc = LinearDesc(_KINDS[kind], m.out_features, m.in_features, group, ptr(w), ptr(scales), ptr(mins), ptr(sums),
                      ptr(m.bias), isa)  # fmt: skip
    return desc, W4A8_STACK_MAX_ROWS if m._w4a8 is not None else kernel_max_rows(m)


def on_kernel(m: Linear | Mxfp4Linear) -> bool:
    """Whether m's few-row input runs through its C kernel on the module path (so the stack computes the same)."""
    if isinstance(m, Mxfp4Linear):
        return m.compute == "w4a8" and m.blocks.device.type == "cpu"
    if m._small_m_path is not None:
        return False
    if m.quant_method is None:  # the module path: float32 weights (read from their bf16 copy if rounded)
        w = m._weight_bf16 if m._weight_bf16 is not None else m.weight
        return m.weight.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous()
    if m._w4a8 is not None:
        return True  # the panels are CPU tensors
    return m.quant_method in _KINDS and m.qweight.device.type == "cpu"
