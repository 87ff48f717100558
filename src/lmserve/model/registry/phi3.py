"""Phi-3 / Phi-4-mini: Llama's layout; checkpoints hold qkv and gate_up fused, rotary may be partial or longrope
(both read from the config)."""

from lmserve.model.registry.family import ModelFamily

FAMILY = ModelFamily("phi3", ("Phi3ForCausalLM",))
