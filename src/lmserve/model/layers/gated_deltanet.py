"""The linear-attention token mixer (Gated DeltaNet, model/linear_attention.py) as a decoder block: its cache is the
layer's recurrent-state tensors (worker/state_cache.LayerState), the step's slots LinearAttentionMetadata."""

from __future__ import annotations

from typing import Any

import torch

from lmserve.checkpoint.registry.family import LayerSpec
from lmserve.config.engine import ModelConfig
from lmserve.model.layers.linear import Linear
from lmserve.model.layers.step import StepInputs
from lmserve.model.linear_attention import GatedDeltaNet, LinearAttentionDims


class LinearAttention(GatedDeltaNet):
    checkpoint_name = "linear_attn"  # the HF module name the decoder layer registers it under

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, layer_idx: int) -> None:
        lin = cfg.linear
        assert lin is not None, f"layer {layer_idx} is linear attention but the config has no linear_* fields"
        dims = LinearAttentionDims(cfg.hidden_size, lin.num_k_heads, lin.num_v_heads, lin.k_dim, lin.v_dim,
                                   lin.conv_kernel, cfg.rms_norm_eps)  # fmt: skip
        # Qwen3-Next's HF checkpoints fuse the input projections (in_proj_qkvz, in_proj_ba), Qwen3.5's do not, nor
        # does a GGUF file (llama.cpp's converter splits qkvz into qkv and z; checkpoint/gguf_hybrid.py splits ba)
        fused = cfg.family == "qwen3_next" and not cfg.path.endswith(".gguf")
        super().__init__(dims, Linear, fused=fused)
        self.layer_idx = layer_idx

    def forward(self, x: torch.Tensor, cache: Any, step: StepInputs) -> torch.Tensor:
        """cache: this layer's LayerState (conv window and delta-rule state per slot)."""
        meta = step.meta.linear
        assert meta is not None, "a linear-attention layer's step without state slots (LinearAttentionMetadata)"
        snapshots = None if cache.conv_snapshots is None else (cache.conv_snapshots, cache.ssm_snapshots)
        return super().forward(x, cache.conv, cache.ssm, meta, snapshots)
