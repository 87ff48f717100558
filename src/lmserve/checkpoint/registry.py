"""HF `architectures` names → the one decoder implementation, with its family flags."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFamily:
    name: str
    architectures: tuple[str, ...]
    qkv_bias: bool = False  # Qwen2: biases on q/k/v projections
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm per head on q and k before RoPE
    qk_norm_whole: bool = False  # OLMo 2: RMSNorm over the whole q / k projection
    hidden_act: str = "silu"  # silu | gelu_tanh (Gemma)
    norm_weight_offset: float = 0.0  # Gemma: RMSNorm scales by (1 + weight)
    sandwich_norms: bool = False  # Gemma 2/3: pre- and post-norms around attention and MLP
    post_norms_only: bool = False  # OLMo 2: norms on sublayer outputs only
    scaled_embeddings: bool = False  # Gemma: embeddings × sqrt(hidden_size)
    uses_query_pre_attn_scalar: bool = False  # Gemma 2/3: attention scale and soft-capping from the config
    local_rope: bool = False  # Gemma 3: sliding layers use their own rotary base
    # which layers use the config's sliding_window: none | all | pattern | from_max_window_layers
    sliding_layers: str = "none"
    sliding_pattern: int = 2  # "pattern": every sliding_pattern-th layer is global

    def architecture_of(self, names: list[str]) -> str:
        return next(n for n in names if n in self.architectures)


_GEMMA = dict(
    hidden_act="gelu_tanh",
    norm_weight_offset=1.0,
    sandwich_norms=True,
    scaled_embeddings=True,
    uses_query_pre_attn_scalar=True,
    sliding_layers="pattern",
)

FAMILIES = (
    ModelFamily("llama", ("LlamaForCausalLM",)),
    ModelFamily("mistral", ("MistralForCausalLM",), sliding_layers="all"),
    ModelFamily("qwen", ("Qwen2ForCausalLM",), qkv_bias=True, sliding_layers="from_max_window_layers"),
    ModelFamily("qwen", ("Qwen3ForCausalLM",), qk_norm=True, sliding_layers="from_max_window_layers"),
    ModelFamily("gemma2", ("Gemma2ForCausalLM",), **_GEMMA, sliding_pattern=2),
    ModelFamily("gemma3", ("Gemma3ForCausalLM",), **_GEMMA, qk_norm=True, local_rope=True, sliding_pattern=6),
    ModelFamily("phi3", ("Phi3ForCausalLM",)),
    ModelFamily("olmo2", ("Olmo2ForCausalLM",), qk_norm_whole=True, post_norms_only=True),
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
