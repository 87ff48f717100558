"""The gated full-attention token mixer of Qwen3.5 / Qwen3-Next: q_proj yields each head's query and an output gate
(interleaved per head), an RMSNorm per head on q and k, partial rotary, attention over the paged KV cache, then the
output times sigmoid(gate) before o_proj. On float32 CPU rows it runs the C decode stack's kernels (per-head norm,
rope + KV write, sigmoid), so a stack step equals it bit for bit (kernels/hybrid_stack.c)."""

from __future__ import annotations

import torch

from lmserve import kernels
from lmserve.checkpoint.registry.family import LayerSpec
from lmserve.config.engine import ModelConfig
from lmserve.model.attention import paged_attention
from lmserve.model.kv_cache import KVCache
from lmserve.model.layers.attention import Attention
from lmserve.model.layers.linear import Linear
from lmserve.model.layers.rotary import apply_rotary
from lmserve.model.layers.step import StepInputs


class GatedAttention(Attention):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, layer_idx: int) -> None:
        super().__init__(cfg, spec, layer_idx)
        assert self.qk_norm and spec.kv_source is None, "gated attention: q/k norm per head, its own K/V"
        # q_proj's rows are twice the heads' (query, then gate, per head): the loader's part 0 is that wide
        self.qkv_proj = Linear(cfg.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.qkv_proj.shard_sizes = (2 * self.q_size, self.kv_size, self.kv_size)
        self.plain = False

    def forward(self, x: torch.Tensor, kv_cache: KVCache, step: StepInputs) -> torch.Tensor:
        n = x.shape[0]
        q_gate, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = q_gate.reshape(n, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        # (per_row, the C rope + KV write and the C sigmoid on float32 CPU rows: the decode stack's arithmetic)
        q = self.q_norm.per_row(q.contiguous())
        k = self.k_norm.per_row(k.reshape(n, self.num_kv_heads, self.head_dim))
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        cos, sin = step.rotary[self.rope]
        if kernels.usable(q) and kernels.usable(k) and kv_cache.k.dtype in kernels.KV_CACHE_DTYPES:
            kernels.rope_write_kv(
                q, k, v, cos.squeeze(1), sin.squeeze(1), kv_cache.k, kv_cache.v, step.meta.slot_mapping,
                kv_cache.k_scale, kv_cache.v_scale,
            )  # fmt: skip
            o = paged_attention(q, k, v, kv_cache, step.meta, kv_written=True, scale=self.scale)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            o = paged_attention(q, k, v, kv_cache, step.meta, scale=self.scale)
        gate = gate.reshape(n, self.q_size)
        gate = kernels.sigmoid(gate) if kernels.usable(gate) else torch.sigmoid(gate)
        return self.o_proj(o.reshape(n, self.q_size) * gate)
