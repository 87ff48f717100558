"""The recurrent-state tensors of a hybrid model's linear-attention layers: per layer a conv window
(slots, conv_dim, kernel - 1) and a delta-rule state (slots, v_heads, k_dim, v_dim), indexed by the slots the
scheduler hands out (core/state_pool.py). Their bytes are the ledger's (memory.linear_state_bytes_per_sequence), and
a slot's pages are committed when first written (slots go out lowest first: max_num_seqs slots cost what is used).
The prefix cache's snapshots (core/state_snapshots.py) are tensors of the same shapes with their own slots."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmserve.checkpoint.shape import LinearAttentionShape
from lmserve.model.kv_pool import lazy_zeros


@dataclass
class LayerState:
    conv: torch.Tensor  # (num_slots, conv_dim, conv_kernel - 1)
    ssm: torch.Tensor  # (num_slots, num_v_heads, k_dim, v_dim)
    conv_snapshots: torch.Tensor | None = None  # (num_snapshots, ...) as conv; None: no prefix cache
    ssm_snapshots: torch.Tensor | None = None

    def save(self, slot: int, snapshot: int) -> None:
        assert self.conv_snapshots is not None and self.ssm_snapshots is not None, "a save without snapshot tensors"
        self.conv_snapshots[snapshot] = self.conv[slot]
        self.ssm_snapshots[snapshot] = self.ssm[slot]

    def restore(self, snapshot: int, slot: int) -> None:
        assert self.conv_snapshots is not None and self.ssm_snapshots is not None, "a restore without snapshots"
        self.conv[slot] = self.conv_snapshots[snapshot]
        self.ssm[slot] = self.ssm_snapshots[snapshot]


class StateCache:
    def __init__(
        self, shape: LinearAttentionShape, num_linear_layers: int, num_slots: int,
        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", num_snapshots: int = 0,
    ) -> None:  # fmt: skip
        assert num_slots > 0 and num_linear_layers > 0, "a state cache needs slots and linear layers"
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots

        def tensors(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (lazy_zeros((n, shape.conv_dim, shape.conv_kernel - 1), dtype, device),
                    lazy_zeros((n, shape.num_v_heads, shape.k_dim, shape.v_dim), dtype, device))  # fmt: skip

        self.layers = [
            LayerState(*tensors(num_slots), *(tensors(num_snapshots) if num_snapshots else (None, None)))
            for _ in range(num_linear_layers)
        ]

    @property
    def nbytes(self) -> int:
        """The running sequences' slots (the snapshots apart: snapshot_nbytes)."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.conv, layer.ssm))

    @property
    def snapshot_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers
                   for t in (layer.conv_snapshots, layer.ssm_snapshots) if t is not None)  # fmt: skip

    def restore(self, pairs: list[tuple[int, int]]) -> None:
        """Start each (snapshot, state slot) pair's slot from the snapshot, in every linear-attention layer."""
        for layer in self.layers:
            for snapshot, slot in pairs:
                layer.restore(snapshot, slot)
