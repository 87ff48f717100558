"""The attention token mixer: q/k/v projection, optional q/k/v norms, rotary, attention over the layer's paged KV
cache (full or sliding window, soft-capped or not), output projection. Gemma 4's KV-sharing layers project only q
and attend over an earlier layer's K/V (StepInputs.shared_kv)."""

from __future__ import annotations

import torch
from torch import nn

from lmserve import kernels
from lmserve.checkpoint.registry.family import LayerSpec
from lmserve.config.engine import ModelConfig
from lmserve.model.attention import paged_attention
from lmserve.model.kv_cache import KVCache
from lmserve.model.layers.linear import Linear
from lmserve.model.layers.norm import RMSNorm
from lmserve.model.layers.rotary import apply_rotary
from lmserve.model.layers.step import StepInputs


class Attention(nn.Module):
    checkpoint_name = "self_attn"  # the HF module name the decoder layer registers it under

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.num_kv_heads = spec.num_kv_heads or cfg.num_kv_heads
        self.head_dim = spec.head_dim or cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.kv_source, self.k_eq_v = spec.kv_source, spec.k_eq_v
        # (a KV-sharing layer keeps zero-width k/v rows: one fused projection shape for every layer)
        kv_rows = 0 if spec.kv_source is not None else self.kv_size * (1 if spec.k_eq_v else 2)
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + kv_rows, bias=cfg.qkv_bias)
        self.qkv_proj.shard_sizes = (self.q_size, *[self.kv_size] * (kv_rows // max(1, self.kv_size)))  # q, k, v
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        # gpt-oss: a learned logit per head beside each softmax's scores (model/attention.paged_attention's sinks)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False) if cfg.attention_sinks else None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            if spec.kv_source is None:
                self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        elif cfg.qk_norm_whole:  # OLMo 2: over all heads at once
            self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)
        self.qk_norm, self.qk_norm_whole, self.v_norm = cfg.qk_norm, cfg.qk_norm_whole, cfg.v_norm
        self.sliding_window = spec.sliding_window
        self.rope = spec.rope
        self.scale, self.logit_softcap = cfg.attn_scale, cfg.attn_logit_softcap
        self.partial_rotary = spec.rope is not None and cfg.rotary_dim is not None and cfg.rotary_dim < self.head_dim
        self.eps = cfg.rms_norm_eps
        # the layout the C decode stack computes: Llama's (full rotary on every layer), q/k norms, o bias and
        # attention sinks (gpt-oss) allowed
        self.plain = not (
            self.v_norm or self.partial_rotary or spec.rope != "global"
            or self.logit_softcap is not None or spec.kv_source is not None or spec.k_eq_v
            or self.head_dim != cfg.head_dim or self.num_kv_heads != cfg.num_kv_heads
        )  # fmt: skip

    def forward(self, x: torch.Tensor, kv_cache: KVCache, step: StepInputs) -> torch.Tensor:
        num_tokens = x.shape[0]
        meta = step.meta
        rotary = step.rotary[self.rope] if self.rope is not None else None
        attn = dict(scale=self.scale, sliding_window=self.sliding_window, logit_softcap=self.logit_softcap,
                    sinks=self.sinks)  # fmt: skip
        if self.kv_source is not None:  # Gemma 4: the source layer's K/V of this step; it wrote the cache
            q = self.qkv_proj(x).view(num_tokens, self.num_heads, self.head_dim)
            q = self.q_norm(q) if self.qk_norm else q
            q = q if rotary is None else apply_rotary(q, *rotary)
            k, v = step.shared_kv[self.kv_source]
            o = paged_attention(q, k, v, kv_cache, meta, kv_written=True, **attn)
            return self.o_proj(o.reshape(num_tokens, self.q_size))
        qkv = self.qkv_proj(x)
        if self.k_eq_v:  # Gemma 4's global layers: the values are the keys' projection
            q, k = qkv.split([self.q_size, self.kv_size], dim=-1)
            v = k
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_whole:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm.per_row(q), self.k_norm.per_row(k)
        if self.v_norm:  # RMSNorm without a weight (Gemma 4)
            v = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.eps)).contiguous()
        if rotary is None:  # no positional encoding on this layer (SmolLM3's NoPE layers)
            o = paged_attention(q, k, v, kv_cache, meta, **attn)
        elif not self.partial_rotary and kernels.usable(q) and kv_cache.k.dtype in kernels.KV_CACHE_DTYPES:
            cos, sin = rotary
            # one pass: rotate q and k in place and write the new K/V rows (quantized) into the paged cache
            kernels.rope_write_kv(
                q, k, v, cos.squeeze(1), sin.squeeze(1), kv_cache.k, kv_cache.v, meta.slot_mapping,
                kv_cache.k_scale, kv_cache.v_scale,
            )  # fmt: skip
            o = paged_attention(q, k, v, kv_cache, meta, kv_written=True, **attn)
        else:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
            o = paged_attention(q, k, v, kv_cache, meta, **attn)
        if step.shared_kv is not None:
            step.shared_kv[self.layer_idx] = (k, v)
        return self.o_proj(o.reshape(num_tokens, self.q_size))
