"""A mixture-of-experts decoder's expert layout as its HF ``config.json`` states it: `MoEShape` (experts, top-k,
expert width, shared expert, which layers are sparse) with its router variant (`RouterSpec`, one table entry per
family), and `moe_layers`, the MoE families' per-layer specs. Torch-free: the ledger and the model read the same.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from lmserve.checkpoint.registry.family import LayerSpec

# scoring: "softmax_topk": softmax over every expert (float32), top-k of the probabilities, optionally renormalised
#          (Qwen2/3-MoE, Mixtral, OLMoE); "topk_softmax": top-k of the logits, softmax over the k chosen (gpt-oss).
ROUTER_SCORINGS = ("softmax_topk", "topk_softmax")
# activation of a routed expert: "silu" (SwiGLU, gate rows first) | "swiglu_clamped" (gpt-oss: clamps, alpha, +1)
EXPERT_ACTIVATIONS = ("silu", "swiglu_clamped")


@dataclass(frozen=True)
class RouterSpec:
    """One router variant as data: route() in model/layers/moe.py computes every family's from these fields."""

    num_experts: int
    top_k: int
    scoring: str = "softmax_topk"
    renormalize: bool = False  # divide the k weights by their sum (HF's norm_topk_prob; Mixtral always)
    bias: bool = False  # the router projection has a bias (gpt-oss)

    def __post_init__(self) -> None:
        if self.scoring not in ROUTER_SCORINGS:
            raise ValueError(f"router scoring must be one of {list(ROUTER_SCORINGS)}, got {self.scoring!r}")
        _positive_field("num_experts", self.num_experts)
        _positive_field("num_experts_per_tok", self.top_k)
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) exceeds the {self.num_experts} experts")


@dataclass(frozen=True)
class MoEShape:
    """The expert layout of a MoE decoder: per sparse layer `router.num_experts` experts of width
    `expert_intermediate_size`, `router.top_k` run per token, plus an always-run shared expert of width
    `shared_expert_intermediate_size` (0: none) behind a sigmoid gate; dense layers keep the config's MLP."""

    router: RouterSpec
    expert_intermediate_size: int
    sparse_layers: tuple[bool, ...]  # per layer: the MoE block (True) or the dense MLP (False)
    dense_intermediate_size: int = 0  # the dense layers' MLP width (0 when every layer is sparse)
    shared_expert_intermediate_size: int = 0
    activation: str = "silu"
    expert_bias: bool = False  # biases on the experts' projections (gpt-oss)
    mxfp4: bool = False  # the checkpoint holds the experts as MXFP4 (gpt-oss's quantization_config)
    swiglu_alpha: float = 1.702  # swiglu_clamped only
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        _positive_field("moe_intermediate_size", self.expert_intermediate_size)
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"expert activation must be one of {list(EXPERT_ACTIVATIONS)}, got {self.activation!r}")

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)


def _positive_field(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config field {name} must be a positive integer, got {value!r}")
    return value


# model_type → (field holding the expert count, field holding the expert width, scoring, renormalize: a bool, or
# the config field that says, with its HF default)
_FAMILIES: dict[str, tuple[str, str, str, bool | tuple[str, bool]]] = {
    "qwen3_moe": ("num_experts", "moe_intermediate_size", "softmax_topk", ("norm_topk_prob", False)),
    "qwen2_moe": ("num_experts", "moe_intermediate_size", "softmax_topk", ("norm_topk_prob", False)),
    "mixtral": ("num_local_experts", "intermediate_size", "softmax_topk", True),
    "olmoe": ("num_experts", "intermediate_size", "softmax_topk", ("norm_topk_prob", False)),
    "gpt_oss": ("num_local_experts", "intermediate_size", "topk_softmax", False),
    # the hybrid (linear-attention) MoE families: a gated shared expert beside the routed ones, as Qwen2-MoE
    "qwen3_next": ("num_experts", "moe_intermediate_size", "softmax_topk", ("norm_topk_prob", True)),
    "qwen3_5_moe_text": ("num_experts", "moe_intermediate_size", "softmax_topk", True),
}
_SHARED_EXPERT_TYPES = ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text")
MOE_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")  # a config with experts sets one
MOE_MODEL_TYPES = tuple(_FAMILIES)


def is_moe_config(cfg: dict[str, Any]) -> bool:
    return any(cfg.get(f) for f in MOE_EXPERT_FIELDS)


def moe_shape_from_hf_config(cfg: dict[str, Any], num_layers: int) -> MoEShape:
    """The MoEShape of an HF config with experts; ValueError naming the field for a family without a router
    variant here, or fields that contradict each other."""
    model_type = cfg.get("model_type")
    if model_type not in _FAMILIES:
        field = next(f for f in MOE_EXPERT_FIELDS if cfg.get(f))
        raise ValueError(
            f"config field model_type={model_type!r} (with {field}={cfg[field]!r}): no router variant for it; "
            f"mixture-of-experts families: {', '.join(MOE_MODEL_TYPES)}"
        )
    experts_field, width_field, scoring, renorm = _FAMILIES[model_type]
    if isinstance(renorm, tuple):
        renorm = cfg.get(renorm[0], renorm[1])
        if not isinstance(renorm, bool):
            raise ValueError(f"config field norm_topk_prob must be true or false, got {renorm!r}")
    if cfg.get(experts_field) is None:  # (transformers v5 saves num_experts as num_local_experts)
        experts_field = next((f for f in MOE_EXPERT_FIELDS if cfg.get(f) is not None), experts_field)
    router = RouterSpec(
        num_experts=_positive_field(experts_field, cfg.get(experts_field)),
        top_k=_positive_field("num_experts_per_tok", cfg.get("num_experts_per_tok")),
        scoring=scoring,
        renormalize=renorm,
        bias=model_type == "gpt_oss",
    )
    sparse = [True] * num_layers
    dense_width = 0
    # HF: sparse unless in mlp_only_layers, every decoder_sparse_step-th
    if model_type in ("qwen3_moe", "qwen2_moe", "qwen3_next"):
        step = _positive_field("decoder_sparse_step", cfg.get("decoder_sparse_step", 1))
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
            raise ValueError(f"config field mlp_only_layers must be a list of layer indices, got {only!r}")
        sparse = [i not in only and (i + 1) % step == 0 for i in range(num_layers)]
        if not all(sparse):
            dense_width = _positive_field("intermediate_size", cfg.get("intermediate_size"))
    shared = 0
    if model_type in _SHARED_EXPERT_TYPES:
        shared = _positive_field("shared_expert_intermediate_size", cfg.get("shared_expert_intermediate_size"))
    gpt_oss = model_type == "gpt_oss"
    return MoEShape(
        router=router,
        expert_intermediate_size=_positive_field(width_field, cfg.get(width_field)),
        sparse_layers=tuple(sparse),
        dense_intermediate_size=dense_width,
        shared_expert_intermediate_size=shared,
        activation="swiglu_clamped" if gpt_oss else "silu",
        expert_bias=gpt_oss,
        mxfp4=(cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4",
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
    )


def moe_layers(cfg: dict[str, Any], specs: tuple[LayerSpec, ...]) -> tuple[LayerSpec, ...]:
    """The config's sparse layers get the "moe" feed-forward (model/layers/moe.py), the others keep the dense MLP."""
    if not is_moe_config(cfg):  # (HF: num_experts 0 leaves every layer dense)
        return specs
    sparse = moe_shape_from_hf_config(cfg, len(specs)).sparse_layers
    return tuple(replace(s, feed_forward="moe") if moe else s for s, moe in zip(specs, sparse, strict=True))
