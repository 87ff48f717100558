"""Rotary position embeddings: inverse frequencies (default, linear, llama3, longrope, proportional, yarn), the cos/sin
tables, and the rotate-half application (full or partial rotary)."""

from __future__ import annotations

import math

import torch
from torch import nn

from lmserve.config.engine import RopeConfig
from lmserve.model.yarn import yarn_inv_freq


def rope_inv_freq(rope: RopeConfig, head_dim: int, max_positions: int = 0) -> torch.Tensor:
    """Inverse frequencies per rotary pair, including `linear`, `llama3`, `longrope` and `proportional` (HF's
    formulas). longrope: HF switches from short to long factors once a sequence passes the original
    context; here the choice is made once per engine, by max_positions (the engine's max_model_len)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if rope.rope_type == "longrope":
        long = max_positions > rope.original_max_position_embeddings
        ext = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
        return 1.0 / (ext * rope.theta**exponents)
    if rope.rope_type == "proportional":  # Gemma 4: the first `proportion` of the pairs turn, the rest stay put
        angles = int(rope.proportion * head_dim // 2)
        turning = 1.0 / (rope.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
        return torch.cat((turning, torch.zeros(head_dim // 2 - angles))) / rope.factor
    if rope.rope_type == "yarn":  # (its attention factor: RopeConfig.attention_factor, from the config)
        return yarn_inv_freq(
            rope.theta, head_dim, rope.factor, rope.original_max_position_embeddings, rope.beta_fast, rope.beta_slow,
            rope.truncate, attention_factor=rope.attention_factor,
        )[0]  # fmt: skip
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, looked up per token."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        """head_dim: the rotated dimensions per head (all of it, or the rotary part with partial rotary)."""
        super().__init__()
        inv_freq = rope_inv_freq(rope, head_dim, max_positions)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_positions, head_dim)
        scale = rope.attention_factor  # longrope and yarn scale cos and sin (1.0 otherwise)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # (num_tokens, 1, head_dim): broadcasts over heads
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (num_tokens, num_heads, head_dim), rotate-half convention as HF Llama. With partial rotary
    (cos narrower than head_dim) only the first cos.shape[-1] dimensions turn; the rest pass through."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
