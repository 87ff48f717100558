"""HF `architectures` names → the one decoder implementation, with its family flags."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFamily:
    name: str
    architectures: tuple[str, ...]
    qkv_bias: bool = False  # Qwen2: biases on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm per head on q and k before RoPE

    def architecture_of(self, names: list[str]) -> str:
        return next(n for n in names if n in self.architectures)


FAMILIES = (
    ModelFamily("llama", ("LlamaForCausalLM", "MistralForCausalLM")),
    ModelFamily("qwen", ("Qwen2ForCausalLM",), qkv_bias=True),
    ModelFamily("qwen", ("Qwen3ForCausalLM",), qk_norm=True),
)

SUPPORTED_ARCHITECTURES = tuple(a for f in FAMILIES for a in f.architectures)


def resolve_architecture(names: list[str] | None) -> ModelFamily:
    for name in names or []:
        for family in FAMILIES:
            if name in family.architectures:
                return family
    raise ValueError(
        f"unsupported model architecture {names!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
