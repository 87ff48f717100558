"""Qwen3.5 (dense): Gated DeltaNet linear attention on three layers of four (config layer_types), gated full
attention (q/k norm per head, partial rotary, an output gate) on the rest, the dense MLP everywhere. The text model of
a Qwen3_5ForConditionalGeneration checkpoint is served, its vision tower skipped."""

from lmserve.checkpoint.registry.family import ModelFamily
from lmserve.checkpoint.registry.hybrid import HYBRID, hybrid_layers

FAMILY = ModelFamily(
    "qwen3_5", ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"), **HYBRID, layers=hybrid_layers()
)
