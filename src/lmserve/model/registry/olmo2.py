"""OLMo 2: norms on the sublayer outputs only (h + norm(attn(h)), then h + norm(mlp(h))), and q/k norms over
the whole projection rather than per head."""

from lmserve.model.registry.family import ModelFamily

FAMILY = ModelFamily("olmo2", ("Olmo2ForCausalLM",), qk_norm_whole=True, norm_layout="post")
