"""Qwen2-MoE: Qwen2's attention (q/k/v biases) with the MoE block (softmax top-k, and a shared expert behind a
sigmoid gate) on the sparse layers and the dense MLP on the others."""

from lmserve.checkpoint.registry.family import ModelFamily
from lmserve.checkpoint.registry.moe import moe_layers

FAMILY = ModelFamily(
    "qwen2_moe", ("Qwen2MoeForCausalLM",), qkv_bias=True, sliding_layers="from_max_window_layers",
    use_sliding_window_key=True, layers=moe_layers,
)  # fmt: skip
