"""StepInputs: what every block of one forward may read besides its own input (built once per forward)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmserve.model.attention import AttentionMetadata


@dataclass
class StepInputs:
    meta: AttentionMetadata  # the step's attention metadata (slots, block tables, prefill segments)
    rotary: dict[str, tuple[torch.Tensor, torch.Tensor]]  # rotary table name → (cos, sin), (T, 1, rotary dim)
    # layer index → its (k, v) of this step, kept for Gemma 4's KV-sharing layers (None: no layer shares)
    shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    per_layer_inputs: torch.Tensor | None = None  # Gemma 4: (T, layers, per-layer size)
