"""Llama: the reference layout (pre-norm, SiLU gated MLP, full rotary); every default of ModelFamily."""

from lmserve.model.registry.family import ModelFamily

FAMILY = ModelFamily("llama", ("LlamaForCausalLM",))
