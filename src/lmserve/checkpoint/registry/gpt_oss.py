"""gpt-oss: Llama's layout with biases on q/k/v and o_proj (attention_bias), a learned sink logit per head in
every softmax, sliding and full layers alternating by layer_types (sliding first), YaRN rotary, and the MoE block
on every layer (top-k of the router's logits with its bias, softmax over the k; expert biases; the clamped
SwiGLU); the experts as HF saves them (fused 3-D) or as OpenAI ships them (MXFP4 `_blocks` / `_scales`)."""

from lmserve.checkpoint.registry.family import ModelFamily
from lmserve.checkpoint.registry.moe import moe_layers

FAMILY = ModelFamily("gpt_oss", ("GptOssForCausalLM",), sliding_layers="pattern", sliding_pattern=2, layers=moe_layers)
