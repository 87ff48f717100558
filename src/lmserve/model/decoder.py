"""The decoder every family runs: per-layer blocks (a token mixer and a feed-forward, model/layers TOKEN_MIXERS /
FEED_FORWARDS) chosen by ModelConfig.layers, between the embedding and the LM head. A family's details are data
(checkpoint/registry/<family>.py); the C decode stack's dispatch is decode_stack.DecodeStackDispatch.

Parameter names mirror HF's, except that q/k/v and gate/up are fused (see loader.STACKED_PARAMS).
"""

from __future__ import annotations

import torch
from torch import nn

from lmserve.checkpoint.registry.family import LayerSpec
from lmserve.config.engine import ModelConfig
from lmserve.model.attention import AttentionMetadata
from lmserve.model.decode_stack import DecodeStackDispatch
from lmserve.model.kv_cache import KVCache
from lmserve.model.layers import FEED_FORWARDS, TOKEN_MIXERS, Embedding, Linear, RMSNorm, RotaryEmbedding
from lmserve.model.layers.step import StepInputs

LOGITS_SLICE = 2048  # vocabulary rows per LM-head product
LOGITS_SLICE_MIN_ROWS = 8  # below this the product is bandwidth-bound and one call is fastest


class DecoderLayer(nn.Module):
    """norm → token mixer → norm → feed-forward, with the skip connections; norm_layout "pre" (Llama), "sandwich"
    (Gemma: the sublayer outputs normed too) or "post" (OLMo 2: only the sublayer outputs)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, layer_idx: int = 0) -> None:
        super().__init__()
        mixer = TOKEN_MIXERS[spec.mixer](cfg, spec, layer_idx)
        setattr(self, mixer.checkpoint_name, mixer)
        self._mixer = (mixer,)  # (a tuple: registered once, under its checkpoint name)
        self.mlp = FEED_FORWARDS[spec.feed_forward](cfg, spec, layer_idx)
        self.norm_layout = cfg.norm_layout
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        if cfg.norm_layout != "post":
            self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        if cfg.norm_layout == "sandwich":
            self.pre_feedforward_layernorm = RMSNorm(h, eps)
        if cfg.norm_layout != "pre":
            self.post_feedforward_layernorm = RMSNorm(h, eps)
        self.per_layer_input = bool(cfg.hidden_size_per_layer_input)
        if self.per_layer_input:  # Gemma 4: a gated per-layer input added after the MLP, then the stream scaled
            p = cfg.hidden_size_per_layer_input
            self.per_layer_input_gate = nn.Linear(h, p, bias=False)
            self.per_layer_projection = nn.Linear(p, h, bias=False)
            self.post_per_layer_input_norm = RMSNorm(h, eps)
            self.layer_scalar = nn.Parameter(torch.ones(1))
        self.layer_idx = layer_idx
        plain_mixer = getattr(mixer, "plain", False) and spec.mixer == "attention"
        # what the C decode stack computes: Llama's layer (anything else: the torch path for the whole model)
        self.stack_plain = cfg.norm_layout == "pre" and plain_mixer and spec.feed_forward in ("dense", "moe")
        self.stack_plain = self.stack_plain and self.mlp.plain and not self.per_layer_input
        # a hybrid's gated or linear attention layer, pre-norm with a plain feed-forward: the stack's hybrid kinds
        ffn = cfg.norm_layout == "pre" and spec.feed_forward in ("dense", "moe") and self.mlp.plain
        hybrid = spec.mixer in ("gated_attention", "linear_attention")
        self.stack_hybrid = hybrid and ffn and not self.per_layer_input

    @property
    def mixer(self) -> nn.Module:
        return self._mixer[0]

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cache: KVCache, step: StepInputs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h: the previous layer's output (the embeddings for layer 0); residual: the running sum of the skip
        connections (None: h is the whole stream). Returns (this layer's feed-forward output, residual); adding
        the two happens inside the next norm, fused."""
        if self.norm_layout == "post":  # OLMo 2: h + norm(attn(h)), then h + norm(mlp(h))
            residual = h if residual is None else h + residual
            residual = residual + self.post_attention_layernorm(self.mixer(residual, cache, step))
            return self.post_feedforward_layernorm(self.mlp(residual)), residual
        if residual is None:
            residual = h
            x = self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm.add_forward(h, residual)
        a = self.mixer(x, cache, step)
        if self.norm_layout == "sandwich":  # Gemma: norm the mixer output, add, then the MLP's own input norm
            x, residual = self.pre_feedforward_layernorm.add_forward(self.post_attention_layernorm(a), residual)
            out = self.post_feedforward_layernorm(self.mlp(x))
            return (out, residual) if not self.per_layer_input else (self._per_layer_input(out + residual, step), None)
        x, residual = self.post_attention_layernorm.add_forward(a, residual)
        return self.mlp(x), residual

    def _per_layer_input(self, stream: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """Gemma 4: stream + norm(proj(gelu(gate(stream)) * this layer's input)), times the layer's scalar."""
        gate = nn.functional.gelu(self.per_layer_input_gate(stream), approximate="tanh")
        gated = gate * step.per_layer_inputs[:, self.layer_idx]
        added = self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return (stream + added) * self.layer_scalar


class DecoderModel(DecodeStackDispatch, nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec, i) for i, spec in enumerate(cfg.layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.embed_scale = cfg.embed_scale
        self.shares_kv = any(spec.kv_source is not None for spec in cfg.layers)
        self.per_layer_size = cfg.hidden_size_per_layer_input
        if self.per_layer_size:  # Gemma 4's per-layer inputs: a token table and a projection of the embeddings
            n = cfg.num_layers * self.per_layer_size
            self.embed_tokens_per_layer = Embedding(cfg.vocab_size_per_layer_input, n)
            self.per_layer_model_projection = nn.Linear(cfg.hidden_size, n, bias=False)
            self.per_layer_projection_norm = RMSNorm(self.per_layer_size, cfg.rms_norm_eps)
        self.build_rotary(cfg, max_positions)

    def build_rotary(self, cfg: ModelConfig, max_positions: int) -> None:
        """The cos/sin tables (computed, not loaded): one set, plus the sliding layers' own (Gemma 3/4); each as
        wide as the heads of the layers that read it (Gemma 4's global heads are wider)."""

        def dims(rope: str) -> int:
            widths = {spec.head_dim or cfg.head_dim for spec in cfg.layers if spec.rope == rope} or {cfg.head_dim}
            assert len(widths) == 1, f"rotary table {rope!r} read by heads of widths {widths}"
            return cfg.rotary_dim or widths.pop()

        self.rotary = RotaryEmbedding(cfg.rope, dims("global"), max_positions)
        local = cfg.rope_local
        self.rotary_local = None if local is None else RotaryEmbedding(local, dims("local"), max_positions)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # (T, hidden)
        if self.embed_scale is not None:
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)  # rounded to the dtype first, as HF
        return h

    def per_layer_inputs(self, input_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Gemma 4: (T, layers, per-layer size): (norm(project(h)) + table(ids)) / sqrt(2)."""
        p, n = self.per_layer_size, len(self.layers)
        table = self.embed_tokens_per_layer(input_ids) * torch.tensor(p**0.5, dtype=h.dtype)
        projected = self.per_layer_model_projection(h) * h.shape[-1] ** -0.5
        projected = self.per_layer_projection_norm(projected.reshape(-1, n, p))
        return (projected + table.reshape(-1, n, p)) * 2.0**-0.5

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        stack, lora = self.stack_for_step(input_ids, kv_caches, meta)
        # the whole stack in one C call, same arithmetic (with LoRA rows, the hooks' deltas added in C, when the
        # slots are float32 CPU tensors; else the module path runs the hooks)
        rows = stack.table_rows(input_ids, positions) if stack is not None else None
        if rows is not None:
            return self._run_stack(stack, *rows, meta, lora)
        h = self.embed(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        if stack is not None and stack.applies(h, meta):
            return self._run_stack(stack, h, cos.squeeze(1), sin.squeeze(1), meta, lora)
        rotary = {"global": (cos, sin)}
        if self.rotary_local is not None:
            rotary["local"] = self.rotary_local(positions, h.dtype)
        step = StepInputs(meta, rotary, {} if self.shares_kv else None)
        if self.per_layer_size:
            step.per_layer_inputs = self.per_layer_inputs(input_ids, h)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, kv_cache, step)
        return self.norm(h) if residual is None else self.norm.add_forward(h, residual)[0]


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
