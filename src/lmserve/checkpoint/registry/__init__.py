"""HF `architectures` names → the model family: one module per family here (checkpoint/registry/<family>.py), each a
torch-free `FAMILY` (family.py) saying only what differs from Llama. Torch-free: the config and the memory ledger
resolve a checkpoint's family and its layers without loading a model."""

from __future__ import annotations

from lmserve.checkpoint.registry import (
    gemma2,
    gemma3,
    gemma4,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    olmo2,
    olmo3,
    olmoe,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
    smollm3,
)  # fmt: skip
from lmserve.checkpoint.registry.family import ModelFamily

# in the order resolve_architecture searches them
FAMILIES = tuple(
    m.FAMILY
    for m in (
        llama,
        mistral,
        qwen2,
        qwen3,
        gemma2,
        gemma3,
        phi3,
        olmo2,
        smollm3,
        olmo3,
        gemma4,
        qwen3_moe,
        qwen2_moe,
        mixtral,
        olmoe,
        qwen3_5,
        qwen3_5_moe,
        qwen3_next,
        gpt_oss,
    )  # fmt: skip
)

SUPPORTED_ARCHITECTURES = tuple(a for f in FAMILIES for a in f.architectures)


def resolve_architecture(names: list[str] | None) -> ModelFamily:
    for name in names or []:
        for family in FAMILIES:
            if name in family.architectures:
                return family
    raise ValueError(f"unsupported model architecture {names!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
