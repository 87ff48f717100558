"""YaRN rotary scaling (gpt-oss, Qwen's long-context configs): the inverse frequencies, blended between
interpolation and extrapolation by a linear ramp over the rotary pairs, and the attention factor that scales cos
and sin; the same float32 arithmetic as transformers' _compute_yarn_parameters."""

from __future__ import annotations

import math

import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(
    theta: float,
    dim: int,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
    attention_factor: float | None = None,
    mscale: float | None = None,
    mscale_all_dim: float | None = None,
) -> tuple[torch.Tensor, float]:
    """(inverse frequency per rotary pair (dim / 2,) float32, the attention factor) for `dim` rotated dimensions."""
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers': no division by zero)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor
