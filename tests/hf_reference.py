"""Reference outputs from HF transformers for the same checkpoints."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=8)
def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_last_logits(model_dir: Path, prompt_ids: list[int]) -> torch.Tensor:
    return hf_model(model_dir)(torch.tensor([prompt_ids])).logits[0, -1].float()


@torch.inference_mode()
def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain argmax decoding, full recompute each step, no EOS handling (compare with ignore_eos=True)."""
    model = hf_model(model_dir)
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]
