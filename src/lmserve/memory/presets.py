"""Public config numbers of well-known models, so `lmserve memory --preset NAME` works offline.

Each entry is the relevant subset of the model's HF ``config.json`` and goes through the same
``model_shape_from_hf_config`` path as a real config file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from lmserve.memory.ledger import ModelShape, model_shape_from_hf_config


@dataclass(frozen=True)
class Preset:
    """One named model: where its numbers come from and its config.json subset."""

    name: str
    hf_id: str
    config: Mapping[str, Any]

    def shape(self) -> ModelShape:
        return model_shape_from_hf_config(dict(self.config))


def _p(name: str, hf_id: str, **config: Any) -> Preset:
    return Preset(name=name, hf_id=hf_id, config=MappingProxyType(config))


_PRESET_LIST = (
    _p(
        "llama-2-7b",
        "meta-llama/Llama-2-7b-hf",
        model_type="llama",
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=11008,
        vocab_size=32000,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    ),
    _p(
        "llama-3-8b",
        "meta-llama/Meta-Llama-3-8B",
        model_type="llama",
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
    ),
    _p(
        "llama-3.1-8b",
        "meta-llama/Llama-3.1-8B",
        model_type="llama",
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
    ),
    _p(
        "llama-3.1-70b",
        "meta-llama/Llama-3.1-70B",
        model_type="llama",
        num_hidden_layers=80,
        hidden_size=8192,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
    ),
    _p(
        "mistral-7b-v0.1",
        "mistralai/Mistral-7B-v0.1",
        model_type="mistral",
        architectures=["MistralForCausalLM"],
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=32000,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        max_position_embeddings=32768,
        sliding_window=4096,
        rms_norm_eps=1e-5,
    ),
    _p(
        "mistral-7b",
        "mistralai/Mistral-7B-Instruct-v0.2",
        model_type="mistral",
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=32000,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
    ),
    _p(
        "qwen2.5-0.5b",
        "Qwen/Qwen2.5-0.5B",
        model_type="qwen2",
        num_hidden_layers=24,
        hidden_size=896,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
    ),
    _p(
        "qwen2.5-7b",
        "Qwen/Qwen2.5-7B",
        model_type="qwen2",
        num_hidden_layers=28,
        hidden_size=3584,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
    ),
    _p(
        "qwen3-0.6b",
        "Qwen/Qwen3-0.6B",
        model_type="qwen3",
        num_hidden_layers=28,
        hidden_size=1024,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
    ),
)

PRESETS: Mapping[str, Preset] = MappingProxyType({p.name: p for p in _PRESET_LIST})


def preset_names() -> list[str]:
    return sorted(PRESETS)


def get_preset(name: str) -> Preset:
    """Look a preset up by name (case-insensitive); unknown names list the known ones."""
    key = name.strip().lower()
    try:
        return PRESETS[key]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())}") from None
