"""Checks of engine arguments that EngineArgs shares: a positive integer, and tensor_parallel_size against the
model's shapes and the features that do not split yet (a ValueError naming the field and the numbers)."""

from __future__ import annotations

from typing import Any

from lmserve.config.model import ModelConfig


def check_tensor_parallel(tp: int, model: ModelConfig, quantization: Any, device: str) -> None:
    """tensor_parallel_size against the model's shapes and the features that do not split (yet): a ValueError
    naming the field and the numbers. The split itself is model/parallel.py's."""
    from lmserve.memory import ledger as memory

    check_positive("tensor_parallel_size", tp)
    if tp == 1:
        return
    if not model.uniform_layers:
        raise ValueError(f"tensor_parallel_size={tp}: {model.architecture}'s per-layer head shapes, shared K/V or "
                         "per-layer inputs are not split; use tensor_parallel_size=1")  # fmt: skip
    why = {
        "num_attention_heads": model.num_heads % tp and f"{model.num_heads} attention heads",
        "intermediate_size": model.intermediate_size % tp and f"intermediate_size {model.intermediate_size}",
    }
    moe = model.moe
    if moe is not None:  # (each rank holds every expert's slice of the expert width: model/parallel.py)
        width, shared = moe.expert_intermediate_size, moe.shared_expert_intermediate_size
        why["moe_intermediate_size"] = width % tp and f"the experts' width {width}"
        why["shared_expert_intermediate_size"] = shared % tp and f"the shared expert's width {shared}"
        if moe.mxfp4:
            raise ValueError(f"tensor_parallel_size={tp} with {model.architecture}'s MXFP4 experts: not supported "
                             "(not sliced); use tensor_parallel_size=1")  # fmt: skip
    bad = [f"{v}" for v in why.values() if v]
    if bad:
        raise ValueError(f"tensor_parallel_size={tp} must divide {' and '.join(bad)}")
    try:
        memory.kv_heads_per_rank(model.num_kv_heads, tp)
    except ValueError:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide num_key_value_heads ({model.num_kv_heads}) or be a multiple of it"
        ) from None
    if model.qk_norm_whole:
        raise ValueError(
            f"tensor_parallel_size={tp} with {model.architecture}: its q/k norm spans all heads (OLMo 2), which "
            "would need a cross-rank reduction; not supported"
        )
    if quantization is not None:
        if quantization.method == "gguf" or quantization.prequantized:
            what = "a GGUF file's kept blocks" if quantization.method == "gguf" else "a pre-quantized checkpoint"
            raise ValueError(
                f"tensor_parallel_size={tp} with {what} ({quantization.method}): not supported yet; load the float "
                "checkpoint with quantization='int8' / 'int4' (quantized per rank at load), or quantization='none'"
            )
        if quantization.group_size is not None:
            group = quantization.group_size
            shards = {"num_heads * head_dim / tp": model.num_heads * model.head_dim // tp,
                      "intermediate_size / tp": model.intermediate_size // tp}  # fmt: skip
            if moe is not None:
                shards["experts' width / tp"] = moe.expert_intermediate_size // tp
                if moe.shared_expert_intermediate_size:
                    shards["shared expert's width / tp"] = moe.shared_expert_intermediate_size // tp
            unaligned = {k: v for k, v in shards.items() if v % group}
            if unaligned:
                raise ValueError(
                    f"tensor_parallel_size={tp} with quantization={quantization.method!r}: the row-parallel shards' "
                    f"inputs {unaligned} must be multiples of quantization_group_size={group}"
                )
    if not device.startswith(("cpu", "cuda")):
        raise ValueError(f"tensor_parallel_size={tp} needs device 'cpu' (gloo) or 'cuda' (NCCL), got {device!r}")


def check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
