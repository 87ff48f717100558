"""The analytic step-time estimate for machines we do not have: overhead + max(FLOPs / (peak · mfu),
bytes / (bandwidth · mbu)) + the all-reduces of tensor parallelism. Labelled an estimate wherever it is printed."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lmserve.sim.step_features import StepFeatures, StepTimeFn

# ---- the analytic estimate -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """One accelerator's published figures (dense, no sparsity) and the interconnect between ranks."""

    name: str
    peak_flops: float  # FLOP/s at the compute dtype (16-bit)
    peak_flops_8bit: float  # FP8 / INT8 tensor FLOP/s (W8A8 / fp8 paths)
    mem_bw_bytes_s: float
    mem_bytes: float
    link_bw_bytes_s: float  # per direction, per GPU (NVLink)
    link_latency_s: float = 5e-6  # per all-reduce (assumed)
    step_overhead_s: float = 1e-3  # per step: scheduling, launches, sampling (assumed, CUDA graphs not modelled)
    source: str = ""


HARDWARE: dict[str, Hardware] = {
    "h200": Hardware(
        "NVIDIA H200 SXM", 989e12, 1979e12, 4.8e12, 141e9, 450e9,
        source="NVIDIA H200 datasheet: 989 TFLOP/s BF16 dense, 1979 FP8 dense, HBM3e 4.8 TB/s, 141 GB, "
        "NVLink 900 GB/s (bidirectional)",
    ),
    "h100": Hardware(
        "NVIDIA H100 SXM", 989e12, 1979e12, 3.35e12, 80e9, 450e9,
        source="NVIDIA H100 datasheet: 989 TFLOP/s BF16 dense, 1979 FP8 dense, HBM3 3.35 TB/s, 80 GB, "
        "NVLink 900 GB/s (bidirectional)",
    ),
    "a100": Hardware(
        "NVIDIA A100 SXM 80GB", 312e12, 624e12, 2.039e12, 80e9, 300e9,
        source="NVIDIA A100 datasheet: 312 TFLOP/s BF16 dense, 624 TOPS INT8, HBM2e 2.039 TB/s, 80 GB, "
        "NVLink 600 GB/s (bidirectional)",
    ),
}  # fmt: skip


@dataclass(frozen=True)
class RooflineStepModel:
    """Analytic step time on `hardware` for a dense decoder (an estimate: no measured kernel efficiencies)."""

    hardware: Hardware
    hf_config: dict[str, Any]
    weight_dtype_bytes: float
    kv_bytes_per_token: int  # all layers, one replica (all ranks together)
    quantization: str | None = None
    mfu: float = 0.5  # achievable fraction of peak FLOP/s (assumed)
    mbu: float = 0.8  # achievable fraction of memory bandwidth (assumed)

    def __post_init__(self) -> None:
        for name in ("mfu", "mbu"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"roofline {name} must be in (0, 1], got {v!r}")

    def fast(self, tp: int = 1, tp_efficiency: float = 1.0) -> StepTimeFn:
        from lmserve.memory import ledger as memory

        shape = memory.model_shape_from_hf_config(dict(self.hf_config))
        hw = self.hardware
        params_rank = memory.num_parameters_per_rank(shape, tp)
        weights_rank = memory.weight_bytes_per_rank(shape, self.weight_dtype_bytes, tp, self.quantization)
        embed_rank = math.ceil(shape.vocab_size / tp) * shape.hidden_size
        flops_per_token = 2.0 * (params_rank - embed_rank * (1 if shape.tie_word_embeddings else 0))
        heads_rank = shape.num_attention_heads // tp
        attn_flops_per_pair = 4.0 * shape.num_layers * heads_rank * shape.head_dim  # QKᵀ and PV
        kv_rank = self.kv_bytes_per_token * memory.kv_heads_per_rank(shape.num_kv_heads, tp) / shape.num_kv_heads
        peak = (hw.peak_flops_8bit if self.quantization == "int8" else hw.peak_flops) * self.mfu
        bw = hw.mem_bw_bytes_s * self.mbu
        act_bytes = shape.hidden_size * 2.0  # bf16 activations all-reduced per token per all-reduce
        num_allreduce = 2 * shape.num_layers if tp > 1 else 0
        ring = 2.0 * (tp - 1) / tp if tp > 1 else 0.0

        def step_time(prefill: int, segments: int, rows: int, context: int, pairs: float) -> float:
            tokens = prefill + rows
            flops = flops_per_token * tokens + attn_flops_per_pair * (pairs + context)
            # KV read: decode rows read their context; prefill chunks read cached context (≈ pairs / n, bounded
            # by the chunk's own keys when there is none), written once per new token
            kv_bytes = kv_rank * (context + tokens)
            compute_s = flops / peak
            memory_s = (weights_rank + kv_bytes) / bw
            comm_s = num_allreduce * (hw.link_latency_s + ring * tokens * act_bytes / hw.link_bw_bytes_s)
            return hw.step_overhead_s + max(compute_s, memory_s) + comm_s

        return step_time

    def step_time_s(self, f: StepFeatures, tp: int = 1) -> float:
        return self.fast(tp)(*f.as_tuple())
