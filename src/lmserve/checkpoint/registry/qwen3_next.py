"""Qwen3-Next: the hybrid layers of Qwen3.5 (a full-attention layer every full_attention_interval-th, Gated DeltaNet
linear attention on the rest, its input projections fused per key head: in_proj_qkvz, in_proj_ba) with the MoE block
on the sparse layers (decoder_sparse_step, mlp_only_layers; a shared expert behind a sigmoid gate) and the dense MLP
on the others."""

from lmserve.checkpoint.registry.family import ModelFamily
from lmserve.checkpoint.registry.hybrid import HYBRID, hybrid_layers
from lmserve.checkpoint.registry.moe import moe_layers

FAMILY = ModelFamily("qwen3_next", ("Qwen3NextForCausalLM",), **HYBRID, layers=hybrid_layers(moe_layers))
