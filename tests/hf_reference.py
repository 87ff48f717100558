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



@lru_cache(maxsize=64)
def hf_greedy_with_margins(model_dir: Path, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple:
    """hf_greedy, plus at every step the margin between HF's top-2 logits: how far the argmax is from a tie."""
    model = hf_model(model_dir)
    ids, margins = list(prompt_ids), []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            top2 = model(torch.tensor([ids])).logits[0, -1].float().topk(2)
            ids.append(int(top2.indices[0]))
            margins.append(float(top2.values[0] - top2.values[1]))
    return ids[len(prompt_ids) :], margins


def assert_greedy_matches_hf_up_to_margin(
    model_dir: Path, prompt_ids: list[int], got: list[int], margin: float, what: str = ""
) -> int:
    """The margin tool: lmserve's greedy tokens `got` must equal HF's fp32 greedy tokens, except that a
    configuration that perturbs the logits (a quantized KV cache, 16-bit weights) may legitimately flip a
    near-tie. The first differing position is accepted only where HF's top-2 logit margin is below `margin`
    (the logit perturbation the configuration is allowed); after a flip the sequences are compared no further.
    Returns the number of tokens that matched (len(got) when there was no flip)."""
    expected, margins = hf_greedy_with_margins(model_dir, tuple(prompt_ids), len(got))
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        if a != b:
            assert margins[i] < margin, (
                f"{what}: token {i} is {a}, HF's is {b} with a top-2 logit margin of {margins[i]:.4f} >= {margin} "
                f"(not a near-tie: a real error)"
            )
            return i
    return len(got)
