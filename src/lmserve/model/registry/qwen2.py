"""Qwen2: Llama with q/k/v biases; with use_sliding_window, layers from max_window_layers on slide."""

from lmserve.model.registry.family import ModelFamily

FAMILY = ModelFamily(
    "qwen", ("Qwen2ForCausalLM",), qkv_bias=True, sliding_layers="from_max_window_layers", use_sliding_window_key=True
)
