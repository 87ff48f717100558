"""Expert load of a mixture-of-experts model: tokens routed to each expert, summed over groups of MoE layers
(`/metrics` shows them per group and expert, and each group's imbalance: observability/prometheus.py)."""

from __future__ import annotations

import re

import torch.nn as nn

from lmserve.model.layers.moe import SparseMoE

NUM_LAYER_GROUPS = 4


def moe_layers(model: nn.Module) -> list[tuple[int, SparseMoE]]:
    """(layer index, MoE block) of every MoE layer, in layer order."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, SparseMoE):
            m = re.search(r"layers\.(\d+)\.", name)
            assert m is not None, f"an MoE block outside a decoder layer: {name}"
            found.append((int(m.group(1)), module))
    return sorted(found, key=lambda x: x[0])


def expert_load(layers: list[tuple[int, SparseMoE]], num_groups: int = NUM_LAYER_GROUPS) -> dict[str, int]:
    """Tokens per expert summed over each group of consecutive MoE layers: {"first-last:expert": tokens}."""
    out: dict[str, int] = {}
    per_group = -(-len(layers) // num_groups) if layers else 1
    for g in range(0, len(layers), per_group):
        group = layers[g : g + per_group]
        label = f"{group[0][0]}-{group[-1][0]}"
        totals = [sum(col) for col in zip(*(moe.tokens_total for _, moe in group), strict=True)]
        for e, n in enumerate(totals):
            out[f"{label}:{e}"] = n
    return out
