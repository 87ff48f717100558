"""Gemma 3: Gemma 2 with per-head q/k norms, five sliding layers to one global, and the sliding layers' own
rotary base (rope_local_base_freq, or rope_parameters["sliding_attention"])."""

from lmserve.model.registry.family import ModelFamily
from lmserve.model.registry.gemma2 import GEMMA

FAMILY = ModelFamily("gemma3", ("Gemma3ForCausalLM",), **GEMMA, qk_norm=True, local_rope=True, sliding_pattern=6)
