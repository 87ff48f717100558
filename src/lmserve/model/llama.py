"""One decoder for Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3 and OLMo 2: family differences are
ModelConfig flags (set from model/registry.py), read here once at construction.

Parameter names mirror HF's, except that q/k/v and gate/up are fused (see loader.STACKED_PARAMS).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lmserve import kernels
from lmserve.config.engine import ModelConfig
from lmserve.model.attention import AttentionMetadata, KVCache, paged_attention
from lmserve.model.decode_stack import DecodeStack
from lmserve.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary

LOGITS_SLICE = 2048  # vocabulary rows per LM-head product
LOGITS_SLICE_MIN_ROWS = 8  # below this the product is bandwidth-bound and one call is fastest


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        elif cfg.qk_norm_whole:  # OLMo 2: over all heads at once
            self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)
        self.qk_norm, self.qk_norm_whole = cfg.qk_norm, cfg.qk_norm_whole
        self.sliding_window = cfg.layer_sliding_windows[layer_idx] if cfg.layer_sliding_windows else None
        self.scale, self.logit_softcap = cfg.attn_scale, cfg.attn_logit_softcap
        self.partial_rotary = cfg.rotary_dim is not None and cfg.rotary_dim < cfg.head_dim

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_whole:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        attn = dict(scale=self.scale, sliding_window=self.sliding_window, logit_softcap=self.logit_softcap)
        if not self.partial_rotary and kernels.usable(q) and kv_cache.k.dtype in kernels.KV_CACHE_DTYPES:
            # one pass: rotate q and k in place and write the new K/V rows (quantized) into the paged cache
            kernels.rope_write_kv(
                q, k, v, cos.squeeze(1), sin.squeeze(1), kv_cache.k, kv_cache.v, meta.slot_mapping,
                kv_cache.k_scale, kv_cache.v_scale,
            )  # fmt: skip
            o = paged_attention(q, k, v, kv_cache, meta, kv_written=True, **attn)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            o = paged_attention(q, k, v, kv_cache, meta, **attn)
        return self.o_proj(o.reshape(num_tokens, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        if not cfg.post_norms_only:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.sandwich_norms or cfg.post_norms_only:
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.sandwich_norms, self.post_norms_only = cfg.sandwich_norms, cfg.post_norms_only

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the previous sublayer's output (the embeddings for layer 0); residual: the running sum of
        the skip connections (None for layer 0). Returns (this layer's MLP output, residual); adding the
        two happens inside the next norm, fused."""
        if self.post_norms_only:  # OLMo 2: h + norm(attn(h)), then h + norm(mlp(h))
            residual = h if residual is None else h + residual
            residual = residual + self.post_attention_layernorm(self.self_attn(residual, cos, sin, kv_cache, meta))
            return self.post_feedforward_layernorm(self.mlp(residual)), residual
        if residual is None:
            residual = h
            x = self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm.add_forward(h, residual)
        a = self.self_attn(x, cos, sin, kv_cache, meta)
        if self.sandwich_norms:  # Gemma: norm the attention output, add, then the MLP's own input norm
            x, residual = self.pre_feedforward_layernorm.add_forward(self.post_attention_layernorm(a), residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        x, residual = self.post_attention_layernorm.add_forward(a, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.embed_scale = cfg.embed_scale
        self.build_rotary(cfg, max_positions)

    def build_rotary(self, cfg: ModelConfig, max_positions: int) -> None:
        """The cos/sin tables (computed, not loaded): one set, plus the sliding layers' own (Gemma 3)."""
        rotary_dim = cfg.rotary_dim or cfg.head_dim
        self.rotary = RotaryEmbedding(cfg.rope, rotary_dim, max_positions)
        self.rotary_local = (
            None if cfg.rope_local is None else RotaryEmbedding(cfg.rope_local, rotary_dim, max_positions)
        )

    _decode_stack: DecodeStack | None = None
    lora_active = False  # LoRA hooks on the projections (lora/layers.py); the C stack adds their deltas itself
    lora_hooks: Any = None  # the installed lora.layers.LoRAHooks (its linears and the step's groups), else None
    tensor_parallel_size = 1  # > 1 (model/parallel.py): the decode stack only with a shared-memory all-reduce
    tp_all_reduce: Any = None  # that all-reduce (worker/shm_allreduce.ShmAllReduce, its C description set)
    _decode_stack_checked: tuple | None = None  # the KV caches supports() was last asked about
    _decode_stack_caches: list[KVCache] | None = None  # the list they came in (its caches are not replaced)
    # (the LM head,) the stack may run after the final norm (CausalLM sets it; a tuple, so not a submodule here)
    stack_head: tuple[Linear] | None = None

    def decode_stack(self, kv_caches: list[KVCache]) -> DecodeStack | None:
        """The C description of this decoder over kv_caches, when DecodeStack.supports it (built once per
        set of caches; reset_decode_stack() after changing weights or their kernel paths). A tensor-parallel
        rank has one when its group's all-reduce is the shared memory's, which the C stack calls itself."""
        if not self._stack_possible():
            return None
        if kv_caches is self._decode_stack_caches:  # (the runner passes the same list every step)
            return self._decode_stack
        self._decode_stack_caches = kv_caches
        key = DecodeStack.cache_key(kv_caches)
        if key != self._decode_stack_checked:
            self._decode_stack_checked = key
            ok = DecodeStack.supports(self, kv_caches)
            head = self.stack_head[0] if self.stack_head is not None and self.tensor_parallel_size == 1 else None
            self._decode_stack = DecodeStack(self, kv_caches, self.tp_all_reduce, head) if ok else None
        return self._decode_stack

    def _stack_possible(self) -> bool:
        """One rank, or a tensor-parallel rank whose all-reduce C can call."""
        if self.tensor_parallel_size == 1:
            return True
        return self.tp_all_reduce is not None and self.tp_all_reduce.desc is not None

    def stack_linears(self) -> list[Linear]:
        """The projections a decode stack would run when they take their C kernels ([] if the layout has none)."""
        if not self._stack_possible() or not DecodeStack.supports_layout(self):
            return []
        return [m for layer in self.layers for m in DecodeStack.layer_linears(layer)]

    def _run_stack(self, stack: DecodeStack, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   meta: AttentionMetadata, lora: Any) -> torch.Tensor:
        """The stack's hidden states; when it takes the LM head for these rows, it computes their logits in the
        same call (kept for take_logits: no second crossing into C for the head, no Python around it)."""
        return stack.run(h, cos, sin, meta, lora, with_logits=h.shape[0] <= stack.head_rows)[0]

    def take_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The LM head's logits of hidden when the decode stack computed them with it (hidden is that step's
        output tensor itself, every row), else None."""
        stack = self._decode_stack
        step = None if stack is None else stack.step_logits
        if step is None or step[0] is not hidden:
            return None
        stack.step_logits = None
        return step[1]

    def reset_decode_stack(self) -> None:
        self._decode_stack = self._decode_stack_checked = self._decode_stack_caches = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        stack = self.decode_stack(kv_caches)
        # the whole stack in one C call, same arithmetic (with LoRA rows, the hooks' deltas added in C, when the
        # slots are float32 CPU tensors; else the module path runs the hooks)
        lora = self.lora_hooks if self.lora_active else None
        takes = stack is not None and stack.takes(input_ids.shape[0], meta) and (lora is None or stack.takes_lora(lora))
        rows = stack.table_rows(input_ids, positions) if takes else None
        if rows is not None:
            return self._run_stack(stack, *rows, meta, lora)
        h = self.embed_tokens(input_ids)  # (T, hidden)
        if self.embed_scale is not None:
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)  # rounded to the dtype first, as HF
        cos, sin = self.rotary(positions, h.dtype)
        if takes and stack.applies(h, meta):
            return self._run_stack(stack, h, cos.squeeze(1), sin.squeeze(1), meta, lora)
        local = None if self.rotary_local is None else self.rotary_local(positions, h.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            c, s = local if local is not None and layer.self_attn.sliding_window else (cos, sin)
            h, residual = layer(h, residual, c, s, kv_cache, meta)
        return self.norm.add_forward(h, residual)[0]


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, max_positions)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if cfg.final_logit_softcap is None:  # the decode stack may run the head too (compute_logits takes its logits)
            self.model.stack_head = (self.lm_head,)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states (T, hidden) of every token of the step; logits come from compute_logits."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(rows, hidden) → (rows, vocab) float32. For several rows the vocabulary is covered in slices:
        on CPU BLAS, one (32 × 576) @ (576 × 49152) product runs at half the speed of 2048-wide slices."""
        fused = self.model.take_logits(hidden)
        if fused is not None:
            return fused
        cap = self.config.final_logit_softcap
        if cap is not None:  # Gemma 2
            return torch.tanh(self._logits(hidden) / cap) * cap
        return self._logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head.fast_path(hidden) is not None:
            return self.lm_head(hidden)  # C kernel, packed oneDNN or int8 weight: one call, already float32
        weight = self.lm_head.weight
        if hidden.shape[0] < LOGITS_SLICE_MIN_ROWS or weight.shape[0] <= LOGITS_SLICE:
            return self.lm_head(hidden).float()
        out = torch.empty(hidden.shape[0], weight.shape[0], dtype=hidden.dtype, device=hidden.device)
        for start in range(0, weight.shape[0], LOGITS_SLICE):
            w = weight[start : start + LOGITS_SLICE]
            torch.mm(hidden, w.t(), out=out[:, start : start + w.shape[0]])
        return out.float()
