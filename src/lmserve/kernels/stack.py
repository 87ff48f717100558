"""Bindings of the one-call decode stack (kernels/decode_stack.c) and its MoE block and router (kernels/moe.c), the
shared-memory all-reduce (kernels/allreduce.c) and the LoRA delta (kernels/lora.c)."""

from __future__ import annotations

import ctypes

import torch

from lmserve.kernels import library as L


def decode_stack(
    model: ctypes._Pointer | ctypes._CArgObject,
    h: torch.Tensor,
    out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    logits: torch.Tensor | None = None,
) -> int:
    """Every layer of a decoder and its final norm for B decode tokens (cpu_kernels.c: decode_stack): model
    points at the C description lmserve.model.decode_stack builds; h (B, hidden) embeddings in, out (B, hidden)
    written; cos, sin (B, head_dim); slot_mapping (B,), block_tables (B, max_blocks), context_lens (B,) int64.
    logits (B, vocab) float32: also the LM head model.head describes, on out (the model's head must be set).
    Returns 0, -1 if the kernel's scratch memory could not be allocated, or (a tensor-parallel rank's stack,
    model.allreduce set) SHM_ABORTED / SHM_TIMEOUT from its all-reduce."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    b, hidden = h.shape
    for t, n in ((h, "h"), (out, "out"), (cos, "cos"), (sin, "sin")):
        L._check(t, n)
    for t, n in ((slot_mapping, "slot_mapping"), (block_tables, "block_tables"), (context_lens, "context_lens")):
        L._check(t, n, torch.int64)
    assert out.shape == h.shape and cos.shape == sin.shape and cos.shape[0] == b, "one row per token"
    assert slot_mapping.shape == (b,) and context_lens.shape == (b,) and block_tables.shape[0] == b, "per token"
    if logits is not None:
        L._check(logits, "logits")
        assert logits.dim() == 2 and logits.shape[0] == b, "one logits row per token"
    return L._lib.decode_stack(
        model, h.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(),
        block_tables.data_ptr(), context_lens.data_ptr(), b, block_tables.shape[1], L._ptr(logits),
        torch.get_num_threads(),
    )  # fmt: skip


SHM_ABORTED, SHM_TIMEOUT = -2, -3  # cpu_kernels.c's LS_AR_ABORTED / LS_AR_TIMEOUT


def shm_all_reduce(desc: ctypes._Pointer | ctypes._CArgObject, x: torch.Tensor) -> int:
    """x (contiguous float32, CPU) summed in place over a shared-memory group (cpu_kernels.c: shm_all_reduce_f32,
    worker/shm_allreduce.py's protocol); desc points at the group's ls_allreduce. Returns 0, SHM_ABORTED or
    SHM_TIMEOUT."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    L._check(x, "x")
    return L._lib.shm_all_reduce_f32(desc, x.data_ptr(), x.numel())


def shm_wait(desc: ctypes._Pointer | ctypes._CArgObject, seq: int) -> int:
    """Wait (spin, then sleep) until every peer of the group desc points at posted call seq (cpu_kernels.c:
    shm_wait). Returns 0, SHM_ABORTED or SHM_TIMEOUT."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    return L._lib.shm_wait(desc, seq)


def shm_post(desc: ctypes._Pointer | ctypes._CArgObject, seq: int) -> None:
    """Post this rank's call seq and wake peers sleeping on it (cpu_kernels.c: shm_post)."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    L._lib.shm_post(desc, seq)


# runs of at most this many rows take lora_delta, on the hooks' path and in the decode stack alike (its most rows:
# model/decode_stack.W4A8_STACK_MAX_ROWS); longer runs (prefills) the hooks' BLAS products
LORA_MAX_ROWS = 64


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, y: torch.Tensor, cols: int) -> None:
    """y (M, O) += (x (M, K) · a[:cols]ᵀ) · b[:, :cols]ᵀ (cpu_kernels.c: lora_delta_f32, what the decode stack adds
    for a LoRA run): a (≥ cols, K), b (O, ≥ cols) one slot's stacked LoRA weights, rows contiguous."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    for t, n in ((x, "x"), (a, "A"), (b, "B"), (y, "y")):
        L._check(t, n)
    m, k = x.shape
    o, stride = b.shape
    assert y.shape == (m, o) and a.shape[1] == k and 0 < cols <= min(a.shape[0], stride), "LoRA delta shapes"
    rc = L._lib.lora_delta_f32(x.data_ptr(), a.data_ptr(), b.data_ptr(), y.data_ptr(), m, k, o, cols, stride,
                             torch.get_num_threads())  # fmt: skip
    assert rc == 0, "lora_delta: out of memory for its scratch"


MOE_SCORINGS = {"softmax_topk": 0, "topk_softmax": 1}  # moe.c's MOE_SOFTMAX_TOPK / MOE_TOPK_SOFTMAX
MOE_MAX_TOP_K = 17  # moe_route_f32 sorts the first k - 1 as torch does for at most 16 (an insertion sort)


def moe_route(logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, E) float32 router logits → (weights (B, k) float32, expert ids (B, k) int64), each row's experts in
    ascending id (cpu_kernels.c: moe_route_f32): model/layers/moe.route's arithmetic in C, the experts torch.topk
    picks (ties included), the weights within float32 rounding of route's."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    logits = logits.contiguous()
    L._check(logits, "logits")
    b, e = logits.shape
    assert 0 < top_k <= min(e, MOE_MAX_TOP_K), f"top_k {top_k} of {e} experts (at most {MOE_MAX_TOP_K})"
    w = torch.empty(b, top_k, dtype=torch.float32)
    ids = torch.empty(b, top_k, dtype=torch.int64)
    rc = L._lib.moe_route_f32(logits.data_ptr(), b, e, top_k, MOE_SCORINGS[scoring], int(renormalize),
                              w.data_ptr(), ids.data_ptr())  # fmt: skip
    assert rc == 0, "moe_route: out of memory for its scratch"
    return w, ids


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) of a float32 CPU tensor (cpu_kernels.c: sigmoid_f32, the MoE shared expert's gate)."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    x = x.contiguous()
    L._check(x, "x")
    y = torch.empty_like(x)
    L._lib.sigmoid_f32(x.data_ptr(), y.data_ptr(), x.numel())
    return y


def moe_block(desc: ctypes._Pointer | ctypes._CArgObject, x: torch.Tensor) -> torch.Tensor:
    """The MoE block desc points at (an ls_moe: model/decode_stack's MoEDesc) on x (B, hidden) float32
    (cpu_kernels.c: moe_block_f32, what the decode stack runs for the layer). Returns (B, hidden)."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    x = x.contiguous()
    L._check(x, "x")
    out = torch.empty_like(x)
    rc = L._lib.moe_block_f32(desc, x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
    assert rc == 0, "moe_block: out of memory for its scratch"
    return out
