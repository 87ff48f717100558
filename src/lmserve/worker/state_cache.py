"""The recurrent-state tensors of a hybrid model's linear-attention layers: per layer a conv window
(slots, conv_dim, kernel - 1) and a delta-rule state (slots, v_heads, k_dim, v_dim), indexed by the slots the
scheduler hands out (core/state_pool.py). Their bytes are the ledger's (memory.linear_state_bytes_per_sequence), and
a slot's pages are committed when first written (slots go out lowest first: max_num_seqs slots cost what is used)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmserve.checkpoint.shape import LinearAttentionShape
from lmserve.model.kv_pool import lazy_zeros


@dataclass
class LayerState:
    conv: torch.Tensor  # (num_slots, conv_dim, conv_kernel - 1)
    ssm: torch.Tensor  # (num_slots, num_v_heads, k_dim, v_dim)


class StateCache:
    def __init__(
        self, shape: LinearAttentionShape, num_linear_layers: int, num_slots: int,
        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    ) -> None:  # fmt: skip
        assert num_slots > 0 and num_linear_layers > 0, "a state cache needs slots and linear layers"
        self.num_slots = num_slots
        self.layers = [
            LayerState(
                lazy_zeros((num_slots, shape.conv_dim, shape.conv_kernel - 1), dtype, device),
                lazy_zeros((num_slots, shape.num_v_heads, shape.k_dim, shape.v_dim), dtype, device),
            )
            for _ in range(num_linear_layers)
        ]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.conv, layer.ssm))
