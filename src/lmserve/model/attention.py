"""Paged attention: new tokens' K/V written into the block cache by slot mapping (write_kv), history read back
through block tables (paged_attention).

Slot = block_id * block_size + offset. A step's tokens are flat: decode tokens first (one query per request), then
each prefill chunk as a contiguous segment (AttentionMetadata). Layout and dtypes: kv_cache.py, docs/kv_cache.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from lmserve import kernels
from lmserve.model.kv_cache import KVCache

# A run of up to this many new tokens of one sequence (a speculative verification, a draft's catch-up) runs as that
# many decode rows, each a query over its own prefix, so the decode kernels and the one-call stack take it (the
# most rows the few-row linear kernels serve: kernels.I4_MAX_ROWS, F32_MAX_ROWS in the C source)
MAX_DECODE_RUN = 8


def long_tensor(values: list[int] | list[list[int]], device: torch.device) -> torch.Tensor:
    """torch.tensor(values, dtype=torch.long, device=device), built through numpy on the CPU: the same tensor for
    ~5 µs where torch.tensor takes ~35 µs with the caches cold, as every step finds them after its weights streamed
    through (a single-stream decode step makes five of these)."""
    if device.type != "cpu":
        return torch.tensor(values, dtype=torch.long, device=device)
    return torch.from_numpy(np.array(values, dtype=np.int64))


@dataclass
class PrefillSegment:
    start: int  # first token index of the chunk in the flat batch
    end: int
    num_context_tokens: int  # tokens of this request already in the cache before the chunk
    block_table: torch.Tensor  # (num_blocks,) long: blocks covering context + chunk
    mask: torch.Tensor | None  # (chunk_len, context + chunk_len) bool; None: plain causal, no context

    @classmethod
    def for_chunk(
        cls, start: int, num_tokens: int, num_context_tokens: int, block_ids: list[int], block_size: int, device
    ) -> PrefillSegment:
        """A request's chunk of `num_tokens` rows from flat row `start`, after `num_context_tokens` cached ones."""
        num_blocks = -(-(num_context_tokens + num_tokens) // block_size)
        return cls(
            start=start,
            end=start + num_tokens,
            num_context_tokens=num_context_tokens,
            block_table=long_tensor(block_ids[:num_blocks], torch.device(device)),
            mask=causal_mask_with_context(num_context_tokens, num_tokens, device) if num_context_tokens else None,
        )


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) long
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # (num_decodes, max_num_blocks) long
    decode_context_lens: torch.Tensor | None = None  # (num_decodes,) long: tokens each decode query sees
    prefills: list[PrefillSegment] = field(default_factory=list)
    linear: Any = None  # hybrid models: the step's state slots (model/linear_attention.LinearAttentionMetadata)

    def set_decodes(self, context_lens: list[int], block_tables: list[list[int]], block_size: int) -> None:
        """One query token per decode: each sees `context_lens[i]` tokens through its block table (padded with
        block 0 to the longest)."""
        max_blocks = -(-max(context_lens) // block_size)
        tables = [t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks])) for t in block_tables]
        device = self.slot_mapping.device
        self.num_decode_tokens = len(context_lens)
        self.decode_block_tables = long_tensor(tables, device)
        self.decode_context_lens = long_tensor(context_lens, device)
        self._decode_lists = (list(context_lens), [list(t) for t in block_tables])

    _decode_mask: torch.Tensor | None = None
    _decode_lists: tuple[list[int], list[list[int]]] | None = None
    _window_cache: dict[tuple[str, int, int], tuple] = field(default_factory=dict)

    def decode_mask(self, block_size: int) -> torch.Tensor:
        """(num_decodes, 1, 1, max_num_blocks * block_size) bool for SDPA over gathered blocks; built once
        per step, and only when the PyTorch path runs (the C kernel reads the lengths directly)."""
        if self._decode_mask is None:
            assert self.decode_block_tables is not None and self.decode_context_lens is not None
            key_pos = torch.arange(self.decode_block_tables.shape[1] * block_size, device=self.slot_mapping.device)
            self._decode_mask = (key_pos[None, :] < self.decode_context_lens[:, None])[:, None, None, :]
        return self._decode_mask

    def decode_window(self, block_size: int, sliding_window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decodes' block tables cut to the blocks inside a sliding window, and their SDPA mask: query i
        (position L_i - 1) reads blocks from the one holding position L_i - W on, and sees keys L_i - W ..
        L_i - 1. Blocks before the window are never gathered (they may be freed: -1 entries). Built once per
        step and window, from the host-side lists (no device sync)."""
        key = ("decode", sliding_window, 0)
        if key not in self._window_cache:
            assert self._decode_lists is not None, "decode metadata missing"
            lens, tables = self._decode_lists
            firsts = [max(0, n - sliding_window) // block_size for n in lens]
            cut = [t[f : -(-n // block_size)] for t, f, n in zip(tables, firsts, lens, strict=True)]
            width = max(len(t) for t in cut)
            device = self.slot_mapping.device
            table = torch.tensor([t + [0] * (width - len(t)) for t in cut], dtype=torch.long, device=device)
            key_pos = torch.arange(width * block_size, device=device)[None, :] + (
                torch.tensor(firsts, dtype=torch.long, device=device)[:, None] * block_size
            )
            ends = torch.tensor(lens, dtype=torch.long, device=device)[:, None]
            mask = (key_pos < ends) & (key_pos >= ends - sliding_window)
            self._window_cache[key] = (table, mask[:, None, None, :])
        return self._window_cache[key]

    def prefill_window(self, seg: PrefillSegment, block_size: int, sliding_window: int) -> tuple[int, torch.Tensor]:
        """For seg with cached context under a sliding window: the first block any of its queries reads (the
        one holding position num_context - W + 1) and the causal window mask over keys from that block's
        first position on. Built once per step, segment and window."""
        key = ("prefill", sliding_window, seg.start)
        if key not in self._window_cache:
            first_block = max(0, seg.num_context_tokens - sliding_window + 1) // block_size
            mask = causal_mask_with_context(
                seg.num_context_tokens, seg.end - seg.start, self.slot_mapping.device, sliding_window,
                key_start=first_block * block_size,
            )  # fmt: skip
            self._window_cache[key] = (first_block, mask)
        return self._window_cache[key]

    def prefill_window_mask(self, seg: PrefillSegment, sliding_window: int) -> torch.Tensor:
        """seg's causal mask restricted to the window (no cached context: keys are the chunk's own), built once
        per step and segment."""
        key = ("prefill-self", sliding_window, seg.start)
        if key not in self._window_cache:
            n = seg.end - seg.start
            self._window_cache[key] = (causal_mask_with_context(0, n, self.slot_mapping.device, sliding_window),)
        return self._window_cache[key][0]


def write_kv(kv_cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    kv_cache.write(k, v, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    meta: AttentionMetadata,
    kv_written: bool = False,
    scale: float | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: (T, H, D); k, v: (T, KVH, D) for the step's new tokens (already in the cache if kv_written).
    Returns (T, H, D). scale: None = D ** -0.5; sliding_window: keys more than that many positions back are
    not read; logit_softcap: scores become tanh(s / cap) * cap before the softmax (Gemma 2); sinks (H,): a
    logit per head that joins each softmax's denominator and reads no value (gpt-oss).

    Every new K/V row of the step is written before any query attends, so a request may read blocks that
    another request of the same step computes (the scheduler's in-step prefix sharing relies on it)."""
    if not kv_written:
        write_kv(kv_cache, k, v, meta.slot_mapping)
    spec = _Spec(q.shape[-1] ** -0.5 if scale is None else scale, sliding_window, logit_softcap, sinks)
    out = torch.empty_like(q)
    if meta.num_decode_tokens:
        nd = meta.num_decode_tokens
        out[:nd] = _decode_attention(q[:nd], kv_cache, meta, spec)
    for seg in meta.prefills:
        out[seg.start : seg.end] = _prefill_attention(q, k, v, kv_cache, seg, meta, spec)
    return out


@dataclass(frozen=True)
class _Spec:
    scale: float
    sliding_window: int | None = None
    logit_softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def kernel_ok(self) -> bool:
        """The C decode kernel has no soft-capping (sliding windows it reads in place, sinks it adds to each
        softmax: float32 CPU ones)."""
        s = self.sinks
        return self.logit_softcap is None and (s is None or (s.dtype == torch.float32 and s.device.type == "cpu"))


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, spec: _Spec
) -> torch.Tensor:
    """SDPA on (B, H, n, D) / (B, KVH, L, D) operands; mask None = causal. Soft-capping needs the scores,
    so it runs eagerly (as HF's eager attention for Gemma 2: fp32 softmax)."""
    if spec.sinks is not None:
        return _attend_with_sinks(q, k, v, mask, spec)
    if spec.logit_softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=spec.scale, enable_gqa=True
        )
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * spec.scale
    scores = torch.tanh(scores / spec.logit_softcap) * spec.logit_softcap
    if mask is None:
        n, total = q.shape[-2], k.shape[-2]
        mask = causal_mask_with_context(total - n, n, q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _attend_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, spec: _Spec
) -> torch.Tensor:
    """Attention whose softmax denominator also holds exp(sink) per head: softmax([s, sink]) without the sink's
    column equals softmax(s) · sigmoid(logsumexp(s) − sink), so the flash kernel's output and log-sum-exp give it
    (on the CPU; elsewhere the scores are materialised, as HF's eager attention)."""
    n, total = q.shape[-2], k.shape[-2]
    if mask is None:
        mask = causal_mask_with_context(total - n, n, q.device)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    acc = torch.promote_types(q.dtype, torch.float32)  # (16-bit operands: a float32 softmax, as HF's eager)
    sinks = spec.sinks.to(acc).view(1, -1, 1)  # (1, H, 1)
    if q.device.type == "cpu" and q.dtype == torch.float32:
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=spec.scale
        )[:2]  # (B, H, n, D), (B, H, n)
        return out * torch.sigmoid(lse - sinks).unsqueeze(-1).to(q.dtype)
    scores = (torch.matmul(q, k.transpose(-1, -2)) * spec.scale).to(acc).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1) * torch.sigmoid(lse - sinks).unsqueeze(-1)
    return torch.matmul(probs.to(q.dtype), v)


def _decode_attention(q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, spec: _Spec) -> torch.Tensor:
    assert meta.decode_block_tables is not None and meta.decode_context_lens is not None, "decode metadata missing"
    if spec.kernel_ok and kernels.usable(q) and kv_cache.k.dtype in kernels.KV_CACHE_DTYPES:
        # Reads each sequence's blocks in place (dequantizing in registers): no gather copy, no padding; with a
        # sliding window only the blocks inside it.
        return kernels.paged_decode_attention(
            q, kv_cache.k, kv_cache.v, meta.decode_block_tables, meta.decode_context_lens, spec.scale,
            kv_cache.k_scale, kv_cache.v_scale, spec.sliding_window, spec.sinks,
        )  # fmt: skip
    if spec.sliding_window is None:
        tables, mask = meta.decode_block_tables, meta.decode_mask(kv_cache.block_size)
    else:  # gather only the blocks inside each query's window
        tables, mask = meta.decode_window(kv_cache.block_size, spec.sliding_window)
    k, v = kv_cache.gather(tables, q.dtype)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, KVH, L, D)
    qb = q.unsqueeze(2)  # (B, H, 1, D)
    o = _attend(qb, k, v, mask, spec)
    return o.squeeze(2)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    seg: PrefillSegment,
    meta: AttentionMetadata,
    spec: _Spec,
) -> torch.Tensor:
    # 4-D (1, heads, tokens, D) operands: the CPU dispatcher sends those to the flash kernel, 3-D ones
    # to the math path (a 512-token prompt: 4.2 ms instead of 17.7 ms per layer, benchmark model shape).
    qs = q[seg.start : seg.end].transpose(0, 1).unsqueeze(0)  # (1, H, n, D)
    if seg.num_context_tokens == 0:
        mask = seg.mask if spec.sliding_window is None else meta.prefill_window_mask(seg, spec.sliding_window)
        ks = k[seg.start : seg.end].transpose(0, 1).unsqueeze(0)
        vs = v[seg.start : seg.end].transpose(0, 1).unsqueeze(0)
    else:
        # Reads the cache after this layer wrote the whole step's K/V (blocks shared within the step included);
        # under a sliding window from the first block inside the earliest query's window only.
        first_block, mask = 0, seg.mask
        if spec.sliding_window is not None:
            first_block, mask = meta.prefill_window(seg, kv_cache.block_size, spec.sliding_window)
        total = seg.num_context_tokens + (seg.end - seg.start) - first_block * kv_cache.block_size
        kc, vc = kv_cache.gather(seg.block_table[first_block:], q.dtype)  # context dequantized (chunk's rows too)
        ks = kc[:total].transpose(0, 1).unsqueeze(0)  # (1, KVH, total, D)
        vs = vc[:total].transpose(0, 1).unsqueeze(0)
    o = _attend(qs, ks, vs, mask, spec)
    return o[0].transpose(0, 1)


def causal_mask_with_context(
    num_context: int, num_new: int, device: torch.device, sliding_window: int | None = None, key_start: int = 0
) -> torch.Tensor:
    """(num_new, num_context + num_new - key_start) bool: query i (position num_context + i) sees keys (positions
    key_start ..) <= its position (and, with a sliding window W, keys > its position - W: HF's
    sliding_window_overlay)."""
    q_pos = torch.arange(num_new, device=device)[:, None] + num_context
    k_pos = torch.arange(key_start, num_context + num_new, device=device)[None, :]
    if sliding_window is None:
        return k_pos <= q_pos
    return (k_pos <= q_pos) & (k_pos > q_pos - sliding_window)
