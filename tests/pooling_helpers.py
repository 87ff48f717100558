"""Tiny random embedding checkpoints (a Qwen3 causal LM with sentence-transformers' pooling files, or a headless
Qwen3Model) and HF's pooling of them: the reference the pooling runner is compared with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tests.helpers import build_model

ST_POOLING = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def add_sentence_transformers_files(model_dir: Path, pooling: str, normalize: bool) -> Path:
    """modules.json with a Pooling module (and a Normalize one), as sentence-transformers saves them."""
    st = "sentence_transformers.models."
    modules = [{"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"}]  # fmt: skip
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": st + "Normalize"})
        (model_dir / "2_Normalize").mkdir(exist_ok=True)
    (model_dir / "modules.json").write_text(json.dumps(modules))
    (model_dir / "1_Pooling").mkdir(exist_ok=True)
    cfg = {"word_embedding_dimension": 64, **{key: kind == pooling for kind, key in ST_POOLING.items()}}
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    return model_dir


def build_embedding_model(out_dir: Path, tokenizer_dir: Path, pooling: str, normalize: bool, seed: int = 0) -> Path:
    build_model(out_dir, "qwen3", tokenizer_dir, seed=seed, head_dim=32)
    return add_sentence_transformers_files(out_dir, pooling, normalize)


def build_headless_model(out_dir: Path, tokenizer_dir: Path, seed: int = 1) -> Path:
    """A Qwen3Model checkpoint: architectures ["Qwen3Model"], tensors without the `model.` prefix, no LM head."""
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, max_position_embeddings=512, eos_token_id=0,
                      tie_word_embeddings=False, initializer_range=0.2)  # fmt: skip
    Qwen3Model(cfg).eval().save_pretrained(out_dir, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out_dir / f.name)
    return out_dir


def hf_embeddings(model_dir: Path, token_ids: list[list[int]], pooling: str, normalize: bool,
                  dimensions: int | None = None) -> list[torch.Tensor]:  # fmt: skip
    """HF's base model's last hidden states of each prompt, pooled as sentence-transformers does."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in token_ids:
            h = model(torch.tensor([ids])).last_hidden_state[0]
            vec = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling]
            if dimensions is not None:
                vec = vec[:dimensions]
            out.append(torch.nn.functional.normalize(vec, dim=-1) if normalize else vec)
    return out
