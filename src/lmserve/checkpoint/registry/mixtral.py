"""Mixtral: Mistral's attention with the MoE block (softmax top-k, always renormalised) on every layer; its
checkpoints name the block `block_sparse_moe` and the experts' projections w1 (gate), w3 (up), w2 (down)."""

from lmserve.checkpoint.registry.family import ModelFamily
from lmserve.checkpoint.registry.moe import moe_layers

FAMILY = ModelFamily("mixtral", ("MixtralForCausalLM",), sliding_layers="all", layers=moe_layers)
