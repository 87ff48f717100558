"""Gemma 2: GeGLU, (1 + weight) norms before and after each sublayer, embeddings × sqrt(hidden), attention scale
and tanh soft-capping from the config, every other layer sliding."""

from lmserve.model.registry.family import ModelFamily

GEMMA = dict(
    hidden_act="gelu_tanh",
    norm_weight_offset=1.0,
    norm_layout="sandwich",
    scaled_embeddings=True,
    uses_query_pre_attn_scalar=True,
    sliding_layers="pattern",
)

FAMILY = ModelFamily("gemma2", ("Gemma2ForCausalLM",), **GEMMA, sliding_pattern=2)
