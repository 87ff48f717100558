"""Bindings of the float32 kernels: few-row linears, paged decode attention, RMSNorm, SiLU·up, RoPE + KV write
(kernels/linear_f32.c, attention.c, elementwise.c, kv_quant.c)."""

from __future__ import annotations

import torch

from lmserve.kernels import library as L


def f32_max_rows() -> int:
    """The most rows `linear` serves at about the cost of one pass over the weights: 8 where it was compiled
    with AVX-512 (each row computed bit-identically whatever the row count), else 2; 0 without the kernels."""
    return int(L._lib.f32_kernel_max_rows()) if L.available() else 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, in) @ weight (out, in)^T + bias on the CPU, x float32; weight float32 or bfloat16 (converted
    exactly to float32 as it is read). For few rows (bandwidth-bound). Returns (M, out) float32."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    x = x.contiguous()
    L._check(x, "x")
    if bias is not None:
        L._check(bias, "bias")
    bf16 = weight.dtype == torch.bfloat16
    L._check(weight, "weight", torch.bfloat16 if bf16 else torch.float32)
    m, k = x.shape
    o = weight.shape[0]
    assert weight.shape[1] == k, f"x has {k} features, weight expects {weight.shape[1]}"
    y = torch.empty(m, o, dtype=torch.float32)
    fn = L._lib.linear_bf16w_f32 if bf16 else L._lib.linear_f32
    fn(
        x.data_ptr(),
        weight.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        y.data_ptr(),
        m,
        o,
        k,
        torch.get_num_threads(),
    )
    return y


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (B, H, D) against K/V caches (num_blocks, block_size, KVH, D) through block_tables (B, max_blocks)
    int64, each row attending to its first context_lens[b] tokens (with a sliding_window W, to the last
    min(W, context_lens[b]) of them: blocks before those are never read, so their table entries may be freed
    blocks or the -1 sentinel). sinks (H,) float32: a logit per head in each softmax's denominator (gpt-oss).
    Returns (B, H, D) float32.
    The caches are float32, bfloat16, or int8 / float8_e4m3fn with k_scale, v_scale (num_blocks, block_size,
    KVH) float32 (lmserve/model/kv_cache.py); values are converted in registers, never copied."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    q = q.contiguous()
    kind = _kv_kind(k_cache, v_cache, k_scale, v_scale)
    L._check(q, "q")
    L._check(block_tables, "block_tables", torch.int64)
    L._check(context_lens, "context_lens", torch.int64)
    b, h, d = q.shape
    _, block_size, kvh, dk = k_cache.shape
    assert dk == d and h % kvh == 0 and h <= L.MAX_HEADS, f"q {tuple(q.shape)} vs cache {tuple(k_cache.shape)}"
    assert block_tables.shape[0] == b and context_lens.shape == (b,), "one block table and length per query"
    assert sliding_window is None or sliding_window > 0, f"sliding_window {sliding_window} must be positive"
    if sinks is not None:
        L._check(sinks, "sinks")
        assert sinks.shape == (h,), f"sinks {tuple(sinks.shape)} for {h} query heads"
    out = torch.empty_like(q)
    args = (block_tables.data_ptr(), context_lens.data_ptr(), out.data_ptr(), b, h, kvh, d, block_size)
    window = sliding_window or 0
    if kind < 0:
        L._lib.paged_decode_attention(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), *args, block_tables.shape[1], scale, window,
            L._ptr(sinks), torch.get_num_threads(),
        )  # fmt: skip
    else:
        L._lib.paged_decode_attention_q(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), L._ptr(k_scale), L._ptr(v_scale), *args,
            block_tables.shape[1], scale, window, L._ptr(sinks), kind, torch.get_num_threads(),
        )  # fmt: skip
    return out


def _kv_kind(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> int:
    """The C `kind` of a cache (-1: float32), after checking values and scales agree in dtype and layout."""
    assert k_cache.dtype in L.KV_CACHE_DTYPES, f"no kernel reads a {k_cache.dtype} KV cache"
    for t, n in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        L._check(t, n, k_cache.dtype)
    assert v_cache.shape == k_cache.shape, f"k_cache {tuple(k_cache.shape)} vs v_cache {tuple(v_cache.shape)}"
    scaled = k_cache.dtype in (torch.int8, torch.float8_e4m3fn)
    for t, n in ((k_scale, "k_scale"), (v_scale, "v_scale")):
        assert (t is not None) == scaled, f"{n}: needed exactly for int8 / fp8 caches ({k_cache.dtype})"
        if t is not None:
            L._check(t, n)
            assert t.shape == k_cache.shape[:3], f"{n} {tuple(t.shape)}: one scale per (slot, KV head)"
    return L.KV_CACHE_DTYPES[k_cache.dtype]


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x (M, N). With residual (M, N), first residual += x in place (the
    decoder's skip connection) and normalise the sum. Returns a new (M, N) tensor."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    x = x.contiguous()
    L._check(x, "x")
    L._check(weight, "weight")
    if residual is not None:
        L._check(residual, "residual")
        assert residual.shape == x.shape, f"residual {tuple(residual.shape)} vs x {tuple(x.shape)}"
    m, n = x.shape
    assert weight.shape == (n,), f"weight {tuple(weight.shape)} for rows of {n}"
    out = torch.empty_like(x)
    L._lib.rmsnorm_f32(
        x.data_ptr(),
        residual.data_ptr() if residual is not None else None,
        weight.data_ptr(),
        out.data_ptr(),
        m,
        n,
        eps,
        torch.get_num_threads(),
    )
    return out


def _gated(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up contiguous and checked, the (M, I) output) for a [gate | up] activation kernel."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    gate_up = gate_up.contiguous()
    L._check(gate_up, "gate_up")
    m, two_i = gate_up.shape
    assert two_i % 2 == 0, "gate_up must hold gate and up halves"
    return gate_up, torch.empty(m, two_i // 2, dtype=torch.float32)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(M, 2I) [gate | up] → (M, I) silu(gate) * up."""
    gate_up, out = _gated(gate_up)
    L._lib.silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), *out.shape, torch.get_num_threads())
    return out


def swiglu_clamped(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """(M, 2I) [gate | up] → (M, I) (clamp(up, ±limit) + 1) · g · sigmoid(alpha · g), g = min(gate, limit): gpt-oss's
    experts' activation."""
    gate_up, out = _gated(gate_up)
    L._lib.swiglu_clamped_f32(gate_up.data_ptr(), out.data_ptr(), *out.shape, alpha, limit, torch.get_num_threads())
    return out


def _token_rows(t: torch.Tensor, name: str) -> int:
    """(T, heads, D) view whose heads and elements are contiguous within a token; returns the token stride."""
    assert t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 3, f"{name}: cpu float32 (T, heads, D)"
    assert t.stride(2) == 1 and t.stride(1) == t.shape[2], f"{name}: heads must be contiguous within a token"
    return t.stride(0)


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Rotate q (T, H, D) and k (T, KVH, D) in place (rotate-half RoPE with cos/sin (T, D), or partial rotary
    with cos/sin (T, R), R < D: the first R dimensions of each head turn, as rotary.apply_rotary), then write
    k and v rows into the caches (num_blocks, block_size, KVH, D) at slot_mapping (T,) int64: float32 as is,
    bfloat16 rounded to nearest even, int8 / float8_e4m3fn quantized per row with its scale written to
    k_scale / v_scale (the bytes model/kv_cache.quantize produces)."""
    assert L._lib is not None, "kernels not loaded: call available() first"
    qs, ks, vs = _token_rows(q, "q"), _token_rows(k, "k"), _token_rows(v, "v")
    t, h, d = q.shape
    kvh = k.shape[1]
    assert k.shape == v.shape == (t, kvh, d) and d % 2 == 0, f"q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}"
    kind = _kv_kind(k_cache, v_cache, k_scale, v_scale)
    for c, n in ((cos, "cos"), (sin, "sin")):
        L._check(c, n)
    rd = cos.shape[-1]
    assert cos.shape == sin.shape == (t, rd) and 0 < rd <= d and rd % 2 == 0, (
        f"cos/sin must be ({t}, R), R even and at most {d}, got {tuple(cos.shape)}"
    )
    assert k_cache.shape[2:] == (kvh, d), "cache layout (blocks, size, KVH, D)"
    L._check(slot_mapping, "slot_mapping", torch.int64)
    assert slot_mapping.shape == (t,), "one slot per token"
    rows = (q.data_ptr(), qs, k.data_ptr(), ks, v.data_ptr(), vs, cos.data_ptr(), sin.data_ptr())
    if rd < d:  # (partial rotary: Qwen3.5 / Qwen3-Next's gated attention)
        L._lib.rope_partial_write_kv(
            *rows, rd, k_cache.data_ptr(), v_cache.data_ptr(), L._ptr(k_scale), L._ptr(v_scale),
            slot_mapping.data_ptr(), t, h, kvh, d, kind, torch.get_num_threads(),
        )  # fmt: skip
        return
    if kind < 0:
        L._lib.rope_write_kv_f32(
            *rows, k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), t, h, kvh, d,
            torch.get_num_threads(),
        )  # fmt: skip
    else:
        L._lib.rope_write_kv_q(
            *rows, k_cache.data_ptr(), v_cache.data_ptr(), L._ptr(k_scale), L._ptr(v_scale), slot_mapping.data_ptr(),
            t, h, kvh, d, kind, torch.get_num_threads(),
        )  # fmt: skip
