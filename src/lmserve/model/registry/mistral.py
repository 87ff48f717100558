"""Mistral: Llama with every layer attending within `sliding_window`."""

from lmserve.model.registry.family import ModelFamily

FAMILY = ModelFamily("mistral", ("MistralForCausalLM",), sliding_layers="all")
