"""model/yarn.py against transformers' own YaRN rotary parameters."""

from __future__ import annotations

import pytest
import torch

from lmserve.model.yarn import yarn_inv_freq


@pytest.mark.parametrize(
    "params",
    [
        # gpt-oss-20b's
        dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=4096, truncate=False),
        dict(factor=4.0, original_max_position_embeddings=32768),  # Qwen3's long-context recipe
        dict(factor=8.0, original_max_position_embeddings=2048, mscale=0.707, mscale_all_dim=0.707),
        dict(factor=2.0, original_max_position_embeddings=1024, attention_factor=1.5),
    ],
)
def test_yarn_matches_transformers(params: dict) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta, head_dim = 150000.0, 64
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=131072,
                      rope_parameters={"rope_type": "yarn", "rope_theta": theta, **params})  # fmt: skip
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    got, factor = yarn_inv_freq(theta, head_dim, **params)
    assert torch.equal(got, want.float())
    assert factor == pytest.approx(want_factor, rel=1e-12)
