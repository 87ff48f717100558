"""The C decode step of a Gated DeltaNet layer (cpu_kernels.c: gdn_decode_f32, the decode stack's own): one token
per sequence, its gates, conv window and delta-rule state updated in place at its slot, and the gated norm. The
torch path (model/linear_attention.py) is the reference; tests/model/test_linear_attention.py compares both."""

from __future__ import annotations

import ctypes

import torch

from lmserve import kernels

_P, _I = ctypes.c_void_p, ctypes.c_int64
_declared_on: ctypes.CDLL | None = None  # argtypes live on the CDLL object: set_enabled loads a new one


def usable(*tensors: torch.Tensor) -> bool:
    """float32 CPU operands with the kernels loaded."""
    return all(kernels.usable(t) for t in tensors)


def _lib() -> ctypes.CDLL:
    global _declared_on
    lib = kernels.library._lib
    assert lib is not None, "kernels not loaded: check usable() first"
    if _declared_on is not lib:
        lib.gdn_decode_f32.argtypes = [_P, _I] * 4 + [_P] * 4 + [ctypes.c_float] + [_P] * 4 + [_I] * 6 + [ctypes.c_int]
        lib.gdn_decode_f32.restype = ctypes.c_int
        _declared_on = lib
    return lib


def _rows(t: torch.Tensor, name: str) -> int:
    """The row stride of a (B, n) float32 CPU view whose elements are contiguous within a row."""
    assert t.dim() == 2 and t.dtype == torch.float32 and t.device.type == "cpu", f"{name}: (B, n) cpu float32"
    assert t.stride(1) == 1 or t.shape[1] == 1, f"{name}: elements contiguous within a row"
    return t.stride(0)


def decode(
    mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor,
    dt_bias: torch.Tensor, conv_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    conv_state: torch.Tensor, ssm: torch.Tensor, slots: torch.Tensor, num_k_heads: int, k_dim: int,
) -> torch.Tensor:  # fmt: skip
    """The decode rows of a Gated DeltaNet layer after its projections, in one call (gdn_decode_f32): mixed
    (B, conv_dim), z (B, Hv * V), b, a (B, Hv) (row-strided views allowed); a_log, dt_bias (Hv,), conv_weight
    (conv_dim, W), norm_weight (V,); conv_state (S, conv_dim, W - 1) and ssm (S, Hv, K, V) updated in place at slots
    (B,). Returns the gated norm of the delta rule's output, (B, Hv * V): what out_proj takes."""
    strides = [_rows(t, n) for t, n in ((mixed, "mixed"), (z, "z"), (b, "b"), (a, "a"))]
    params = [t.contiguous() for t in (a_log, dt_bias, conv_weight, norm_weight)]
    for t in (*params, conv_state, ssm):
        kernels.library._check(t, "operand")
    kernels.library._check(slots, "slots", torch.int64)
    batch, num_v_heads = b.shape
    v_dim = norm_weight.shape[0]
    assert num_v_heads * v_dim == z.shape[1] and ssm.shape[1:] == (num_v_heads, k_dim, v_dim), "head shapes"
    assert mixed.shape[1] == conv_state.shape[1] == 2 * num_k_heads * k_dim + num_v_heads * v_dim, "conv_dim"
    assert all(t.shape[0] == batch for t in (mixed, z, a, slots)), "one row per sequence"
    out = torch.empty(batch, num_v_heads * v_dim, dtype=torch.float32)
    rc = _lib().gdn_decode_f32(
        mixed.data_ptr(), strides[0], z.data_ptr(), strides[1], b.data_ptr(), strides[2], a.data_ptr(), strides[3],
        *(t.data_ptr() for t in params), eps, conv_state.data_ptr(), ssm.data_ptr(), slots.data_ptr(),
        out.data_ptr(), batch, num_k_heads, num_v_heads, k_dim, v_dim, conv_weight.shape[1],
        torch.get_num_threads(),
    )  # fmt: skip
    assert rc == 0, "gdn_decode: out of memory for its scratch"
    return out
