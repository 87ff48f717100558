"""The bundled default models: ``target`` (~6.6 M parameters) and its speculative ``draft`` (~0.6 M).

Both are HF-format ``LlamaForCausalLM`` folders (config.json, bfloat16 model.safetensors,
tokenizer.json, tokenizer_config.json) trained by ``scripts/train_tiny_model.py``; see README.md.
"""

from __future__ import annotations

import os

MODEL_NAMES = ("target", "draft")

_HERE = os.path.dirname(os.path.abspath(__file__))


def default_model_path(name: str = "target") -> str:
    """Absolute path of the bundled model folder ``name`` (``"target"`` or ``"draft"``)."""
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown default model {name!r}; expected one of {MODEL_NAMES}")
    return os.path.join(_HERE, name)


__all__ = ["MODEL_NAMES", "default_model_path"]
