"""A model the simulator has no weights for: its HF config written as a directory holding only config.json (the
scheduler and the engine's config read shapes, never weights), with an architecture named from its model_type."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
}


def hf_config_with_architecture(cfg: dict[str, Any]) -> dict[str, Any]:
    cfg = dict(cfg)
    if not cfg.get("architectures"):
        arch = ARCHITECTURES.get(cfg.get("model_type", "llama"))
        if arch is None:
            raise ValueError(f"model_type {cfg.get('model_type')!r}: no architecture known for it")
        cfg["architectures"] = [arch]
    return cfg


def materialize_model_dir(hf_config: dict[str, Any]) -> str:
    """A directory holding only config.json (the scheduler needs shapes, never weights)."""
    d = Path(tempfile.mkdtemp(prefix="lmserve-sim-model-"))
    (d / "config.json").write_text(json.dumps(hf_config_with_architecture(hf_config)))
    return str(d)
