"""Shared layers, and the block kinds a decoder layer is built from (LayerSpec.mixer / .feed_forward → class).
A new kind is a class here taking (cfg, spec, layer_idx): a token mixer has `checkpoint_name` (its HF module
name) and forward(x, cache, step) → (T, hidden), where cache is kv_caches[layer] (per-request state rides in it,
looked up by step.meta); a feed-forward has forward(x). Register it below and name it in the family's LayerSpecs;
the C decode stack then stands aside for the whole model (DecoderLayer.stack_plain / stack_hybrid), the torch
path runs it."""

from lmserve.model.layers.attention import Attention
from lmserve.model.layers.embedding import Embedding
from lmserve.model.layers.gated_attention import GatedAttention
from lmserve.model.layers.gated_deltanet import LinearAttention
from lmserve.model.layers.linear import (
    DEQUANT_TILE_BYTES,
    SMALL_M_ENV,
    Linear,
    choose_small_m_paths,
    kernel_max_rows,
    onednn_packing_available,
    pack_linear_weights,
    pack_w4a8_weights,
    quantizable_linears,
    quantize_linear_weights,
    round_linear_weights_to_bf16,
    small_m_mode,
)
from lmserve.model.layers.mlp import DenseMLP, SwiGLU
from lmserve.model.layers.moe import MoEFeedForward, SparseMoE
from lmserve.model.layers.norm import RMSNorm
from lmserve.model.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq

TOKEN_MIXERS: dict[str, type] = {
    "attention": Attention, "gated_attention": GatedAttention, "linear_attention": LinearAttention,
}  # fmt: skip
FEED_FORWARDS: dict[str, type] = {"dense": DenseMLP, "moe": MoEFeedForward}

__all__ = [
    "GatedAttention", "LinearAttention", "MoEFeedForward", "SparseMoE",
    "DEQUANT_TILE_BYTES", "FEED_FORWARDS", "SMALL_M_ENV", "TOKEN_MIXERS", "Attention",
    "DenseMLP", "Embedding", "Linear", "RMSNorm", "RotaryEmbedding", "SwiGLU", "apply_rotary",
    "choose_small_m_paths", "kernel_max_rows", "onednn_packing_available", "pack_linear_weights",
    "pack_w4a8_weights", "quantizable_linears", "quantize_linear_weights", "rope_inv_freq",
    "round_linear_weights_to_bf16", "small_m_mode",
]  # fmt: skip
