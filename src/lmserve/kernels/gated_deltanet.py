"""The C decode step of a Gated DeltaNet layer (gdn_conv_decode_f32, gdn_recurrent_decode_f32 in cpu_kernels.c):
one token per sequence, the conv window and the delta-rule state updated in place at each sequence's slot. The
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
        lib.gdn_conv_decode_f32.argtypes = [_P, _P, _P, _P, _P, _I, _I, _I, ctypes.c_int]
        lib.gdn_conv_decode_f32.restype = None
        lib.gdn_recurrent_decode_f32.argtypes = [_P] * 8 + [_I] * 7 + [ctypes.c_int]
        lib.gdn_recurrent_decode_f32.restype = None
        _declared_on = lib
    return lib


def conv_decode(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (B, C), conv_state (S, C, W - 1) updated in place at slots (B,), weight (C, W) → silu(conv) (B, C)."""
    x, weight = x.contiguous(), weight.contiguous()
    assert conv_state.is_contiguous() and slots.dtype == torch.long, "conv_state contiguous, slots int64"
    batch, channels = x.shape
    out = torch.empty_like(x)
    _lib().gdn_conv_decode_f32(
        x.data_ptr(), conv_state.data_ptr(), slots.contiguous().data_ptr(), weight.data_ptr(), out.data_ptr(),
        batch, channels, weight.shape[1], torch.get_num_threads(),
    )  # fmt: skip
    return out


def recurrent_decode(
    mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, ssm: torch.Tensor, slots: torch.Tensor,
    num_k_heads: int, k_dim: int, v_dim: int,
) -> torch.Tensor:  # fmt: skip
    """mixed (B, conv_dim): the conv output [q | k | v]; g, beta (B, Hv); ssm (S, Hv, K, V) updated in place at
    slots (B,). Returns the output (B, Hv, V)."""
    mixed, g, beta = mixed.contiguous(), g.float().contiguous(), beta.float().contiguous()
    assert ssm.is_contiguous() and ssm.dtype == torch.float32, "ssm: a contiguous float32 state"
    batch = mixed.shape[0]
    num_v_heads = g.shape[1]
    key_size = num_k_heads * k_dim
    out = torch.empty(batch, num_v_heads, v_dim, dtype=torch.float32)
    base = mixed.data_ptr()
    row = mixed.stride(0)
    _lib().gdn_recurrent_decode_f32(
        base, base + 4 * key_size, base + 8 * key_size, g.data_ptr(), beta.data_ptr(), ssm.data_ptr(),
        slots.contiguous().data_ptr(), out.data_ptr(), batch, num_k_heads, num_v_heads, k_dim, v_dim, row, row,
        torch.get_num_threads(),
    )  # fmt: skip
    return out
