"""PEFT adapters for tiny random bases, and PEFT's reference outputs (the LoRA tests' ground truth)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

# name → (r, lora_alpha, target_modules, use_rslora): ranks 8 and 64 on different module sets
ADAPTER_SPECS: dict[str, tuple[int, int, tuple[str, ...], bool]] = {
    "all8": (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    "qv64": (64, 32, ("q_proj", "v_proj"), False),
    "mlp8rs": (8, 8, ("o_proj", "gate_proj", "down_proj"), True),
    "kup64": (64, 64, ("q_proj", "k_proj", "up_proj", "down_proj"), False),
    "o8": (8, 16, ("o_proj",), False),
}


def build_adapter(
    base_dir: Path, out_dir: Path, r: int, alpha: int, targets: tuple[str, ...], rslora: bool = False, seed: int = 0,
    **config: object,
) -> Path:  # fmt: skip
    """A PEFT LoRA adapter of base_dir with random A and B (PEFT initialises B to zero, a no-op adapter), saved as
    adapter_config.json + adapter_model.safetensors."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, use_rslora=rslora,
                     **config)  # fmt: skip
    model = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
    model.save_pretrained(out_dir)
    return out_dir


@lru_cache(maxsize=16)
def peft_model(base_dir: Path, adapter_dir: Path | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    return base if adapter_dir is None else PeftModel.from_pretrained(base, adapter_dir).eval()


@torch.inference_mode()
def peft_last_logits(base_dir: Path, adapter_dir: Path | None, ids: list[int]) -> torch.Tensor:
    return peft_model(base_dir, adapter_dir)(input_ids=torch.tensor([ids])).logits[0, -1].float()


@torch.inference_mode()
def peft_greedy(base_dir: Path, adapter_dir: Path | None, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = peft_model(base_dir, adapter_dir)
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]
