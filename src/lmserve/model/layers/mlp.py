"""The dense feed-forward block: down(act(gate(x)) * up(x)), gate and up fused in one projection."""

from __future__ import annotations

import torch
from torch import nn

from lmserve import kernels
from lmserve.config import ModelConfig
from lmserve.model.layers.linear import Linear
from lmserve.model.registry.family import LayerSpec


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused in one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu") -> None:
        super().__init__()
        assert act in ("silu", "gelu_tanh"), f"MLP activation {act!r}"
        self.act = act  # gelu_tanh: Gemma's GeGLU, same layout
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.gate_up_proj.shard_sizes = (intermediate_size, intermediate_size)  # gate, up: the loader's parts
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act == "gelu_tanh":
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            return self.down_proj(nn.functional.gelu(gate, approximate="tanh") * up)
        if gate_up.dim() == 2 and kernels.usable(gate_up):
            return self.down_proj(kernels.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DenseMLP(SwiGLU):
    """The "dense" feed-forward block of a decoder layer (LayerSpec.feed_forward): the config's gated MLP."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, layer_idx: int) -> None:
        super().__init__(cfg.hidden_size, spec.intermediate_size or cfg.intermediate_size, cfg.hidden_act)
        self.plain = self.act == "silu" and self.intermediate_size == cfg.intermediate_size  # what the C stack runs
