"""Qwen3: Qwen2's sliding rule, no q/k/v biases, an RMSNorm per head on q and k before the rotary."""

from lmserve.model.registry.family import ModelFamily

FAMILY = ModelFamily(
    "qwen", ("Qwen3ForCausalLM",), qk_norm=True, sliding_layers="from_max_window_layers", use_sliding_window_key=True
)
