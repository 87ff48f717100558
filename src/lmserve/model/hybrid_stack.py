"""The hybrid models' layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) in the one-call decode stack (kernels/hybrid_stack.c):
a Gated DeltaNet layer's C description over its state tensors (GDNDesc), which hybrid layers the C computes as the
modules do, and which steps it takes (every row a decode on its own state slot, no state snapshot saved). See
docs/hybrid_models.md."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from lmserve.model.attention import AttentionMetadata
from lmserve.model.layers import Linear
from lmserve.model.layers.gated_attention import GatedAttention
from lmserve.model.layers.gated_deltanet import LinearAttention
from lmserve.model.linear_attention import qwen3_next_row_order
from lmserve.model.stack_linear import LinearDesc, linear_desc, on_kernel, ptr

ATTENTION, GATED, LINEAR = 0, 1, 2  # ls_layer.mixer (cpu_kernels.c: LS_MIX_*)


class _GDN(ctypes.Structure):  # struct ls_gdn
    _fields_ = [(n, ctypes.c_int64) for n in ("num_k_heads", "num_v_heads", "k_dim", "v_dim", "conv_kernel", "fused")]
    _fields_ += [("inputs", LinearDesc * 4), ("out", LinearDesc)]
    _fields_ += [(n, ctypes.c_void_p) for n in ("qkvz_order", "ba_order", "conv_w", "A_log", "dt_bias", "norm_w")]
    _fields_ += [(n, ctypes.c_void_p) for n in ("conv_state", "ssm")] + [("eps", ctypes.c_double)]


def mixer_kind(layer: torch.nn.Module) -> int:
    """ATTENTION (Llama's), GATED (a hybrid's gated full attention) or LINEAR (Gated DeltaNet)."""
    mixer = layer.mixer
    return LINEAR if isinstance(mixer, LinearAttention) else GATED if isinstance(mixer, GatedAttention) else ATTENTION


def mixer_linears(mixer: torch.nn.Module) -> tuple[Linear, ...]:
    """The projections of a token mixer: a Gated DeltaNet's input projections and out_proj, else qkv and o."""
    if not isinstance(mixer, LinearAttention):
        return mixer.qkv_proj, mixer.o_proj
    m = mixer
    inputs = (m.in_proj_qkvz, m.in_proj_ba) if m.fused else (m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a)
    return (*inputs, m.out_proj)


def is_state(cache: Any) -> bool:
    """Whether a layer's cache is a linear-attention layer's state tensors (worker/state_cache.LayerState)."""
    return hasattr(cache, "conv") and hasattr(cache, "ssm")


def supports_linear_attention(mixer: LinearAttention, state: Any) -> bool:
    """Whether the C layer computes mixer over state as GatedDeltaNet.forward's decode rows do: float32 contiguous CPU
    parameters and state tensors (a bfloat16 state cache keeps the torch path), every projection on its C kernel."""
    if not is_state(state):
        return False
    tensors = (mixer.A_log, mixer.dt_bias, mixer.conv1d.weight, mixer.norm.weight, state.conv, state.ssm)
    if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return False
    return all(isinstance(m, Linear) and on_kernel(m) for m in mixer_linears(mixer))


class GDNDesc:
    """The C description of one Gated DeltaNet layer over its state tensors (a LayerState; neither may move while it
    lives: built with the stack). `rows`: the most rows its projections' kernels take in one call."""

    def __init__(self, mixer: LinearAttention, state: Any) -> None:
        d = mixer.dims
        linears = mixer_linears(mixer)
        descs = [linear_desc(m) for m in linears]
        self.rows = min(rows for _, rows in descs)
        inputs = [desc for desc, _ in descs[:-1]] + [LinearDesc()] * (5 - len(linears))
        self._orders = None
        if mixer.fused:  # (Qwen3-Next: the rows of its fused projections in Qwen3.5's order, gathered in C)
            self._orders = tuple(torch.tensor(o, dtype=torch.int64) for o in qwen3_next_row_order(d))
        orders = self._orders or (None, None)
        self.struct = _GDN(
            d.num_k_heads, d.num_v_heads, d.k_dim, d.v_dim, d.conv_kernel, int(mixer.fused),
            (LinearDesc * 4)(*inputs), descs[-1][0], *(ptr(o) for o in orders), ptr(mixer.conv1d.weight),
            ptr(mixer.A_log), ptr(mixer.dt_bias), ptr(mixer.norm.weight), ptr(state.conv), ptr(state.ssm),
            mixer.norm.eps,
        )  # fmt: skip
        self.state = state  # (kept alive with the pointers to it)


def takes_step(meta: AttentionMetadata, rows: int) -> bool:
    """Whether a step's state metadata lets the stack run its linear-attention layers: every one of its rows a
    decode on its own slot, no prefill chunk (nor a chunk's state snapshot: those steps take the torch path)."""
    lin = meta.linear
    return (
        lin is not None and lin.num_decode_tokens == rows and not lin.prefills and not lin.saves
        and lin.decode_slots is not None and lin.decode_slots.shape == (rows,)
    )  # fmt: skip


def begin_step(meta: AttentionMetadata, gdns: list[GDNDesc]) -> torch.Tensor:
    """The step's state slots (B,) int64; the slots of sequences at their first token zeroed in every linear layer
    first, as GatedDeltaNet.forward zeroes them (a new sequence starts from a zero state, not the slot's old one)."""
    lin = meta.linear
    fresh = lin.fresh_decode_slots
    if fresh is not None:
        for gdn in gdns:
            gdn.state.conv[fresh] = 0.0
            gdn.state.ssm[fresh] = 0.0
    slots = lin.decode_slots
    assert slots.dtype == torch.int64 and slots.is_contiguous() and slots.device.type == "cpu", "state slots"
    return slots


def end_step(meta: AttentionMetadata, gdns: list[GDNDesc]) -> None:
    """The prefix cache's snapshots of decode rows that completed a block (meta.linear.decode_saves), taken from
    their slots after the stack's call: what GatedDeltaNet.forward copies after each layer's decode, as no later
    layer of the step touches that layer's state."""
    lin = meta.linear
    for row, snapshot in lin.decode_saves:
        slot = int(lin.decode_slots[row])
        for gdn in gdns:
            gdn.state.save(slot, snapshot)
