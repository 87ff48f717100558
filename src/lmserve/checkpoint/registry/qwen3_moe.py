"""Qwen3-MoE: Qwen3's attention (an RMSNorm per head on q and k) with the MoE block on the sparse layers
(decoder_sparse_step, mlp_only_layers; softmax top-k, norm_topk_prob) and the dense MLP on the others."""

from lmserve.checkpoint.registry.family import ModelFamily
from lmserve.checkpoint.registry.moe import moe_layers

FAMILY = ModelFamily(
    "qwen3_moe", ("Qwen3MoeForCausalLM",), qk_norm=True, sliding_layers="from_max_window_layers",
    use_sliding_window_key=True, layers=moe_layers,
)  # fmt: skip
