"""Tiny random hybrid checkpoints (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) built with HF transformers, and HF's greedy
tokens for them (computed once per checkpoint and prompt): the hybrid tests' ground truth."""

from __future__ import annotations

import shutil
from functools import lru_cache
from pathlib import Path

import torch

from tests.hf_reference import hf_model

PROMPTS = [
    "The capital of France is",
    "import json\nimport os\n\nclass Decoder(object):\n    def __init__(self, strict=True):",
    "def fib(n):",
    "a",
]
COMMON = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=512, eos_token_id=0,
    tie_word_embeddings=False, initializer_range=0.2,
)  # fmt: skip
MAX_TOKENS = 20  # HF's reference is computed once per prompt, this long (tests compare a prefix of it)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def hf_model_of(kind: str, **overrides: object) -> torch.nn.Module:
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    from transformers.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM

    common = {**COMMON, **overrides}
    if kind == "qwen3_5":
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**common))
    if kind == "qwen3_next":  # a dense layer (mlp_only_layers) beside the sparse ones
        return Qwen3NextForCausalLM(Qwen3NextConfig(**common, **MOE, mlp_only_layers=[1], norm_topk_prob=True))
    return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**common, **MOE))


def build(out: Path, tokenizer_dir: Path, kind: str, seed: int = 0, **overrides: object) -> Path:
    """A tiny random `kind` checkpoint (config keys `overrides` over COMMON) with the tokenizer's files."""
    torch.manual_seed(seed)
    model = hf_model_of(kind, **overrides)
    with torch.no_grad():
        for name, p in model.named_parameters():  # HF's init leaves the norms at 0 / 1 and A_log uniform: perturb all
            p.copy_(torch.randn_like(p) * (0.05 if "norm" in name else 0.2))
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(-2, 1)
    model.eval().save_pretrained(out, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


class HybridDirs(dict):
    """Checkpoints built on first use (a test of one family builds only that one)."""

    def __init__(self, root: Path, tokenizer_dir: Path) -> None:
        super().__init__()
        self.root, self.tokenizer_dir = root, tokenizer_dir

    def __missing__(self, kind: str) -> Path:
        self[kind] = build(self.root / kind, self.tokenizer_dir, kind)
        return self[kind]


@lru_cache(maxsize=32)
@torch.inference_mode()
def _hf_greedy(model_dir: Path, prompt_ids: tuple[int, ...]) -> list[int]:
    """HF's greedy decoding with its own cache (the chunked delta rule for the prompt, the recurrent form after)."""
    ids = torch.tensor([prompt_ids])
    out = hf_model(model_dir).generate(
        ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt_ids) :].tolist()


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """HF's first max_tokens (at most MAX_TOKENS) greedy tokens after prompt_ids, EOS not stopping them."""
    assert max_tokens <= MAX_TOKENS
    return _hf_greedy(model_dir, tuple(prompt_ids))[:max_tokens]
