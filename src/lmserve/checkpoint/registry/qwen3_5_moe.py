"""Qwen3.5-MoE: Qwen3.5's hybrid layers (Gated DeltaNet linear attention, gated full attention) with the MoE block on
every layer (softmax top-k renormalised, a shared expert behind a sigmoid gate). The text model of a
Qwen3_5MoeForConditionalGeneration checkpoint is served, its vision tower skipped."""

from lmserve.checkpoint.registry.family import ModelFamily
from lmserve.checkpoint.registry.hybrid import HYBRID, hybrid_layers
from lmserve.checkpoint.registry.moe import moe_layers

FAMILY = ModelFamily(
    "qwen3_5_moe", ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"), **HYBRID,
    layers=hybrid_layers(moe_layers),
)  # fmt: skip
