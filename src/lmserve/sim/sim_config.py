"""What a simulation is asked to run: the engine config, replicas (DP or xPyD disaggregation), the client's cap,
the KV transfer's cost and the step noise."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from lmserve.config.engine import EngineConfig
from lmserve.sim.step_features import Overheads

# the KV transfer's cost when the config gives none: a ZeroMQ round trip on one host, and a 16-token block of a
# small model copied at memory speed (calibrate measures both into the step model; --kv-transfer-*-us set them)
DEFAULT_KV_TRANSFER_LATENCY_S = 200e-6
DEFAULT_KV_TRANSFER_BLOCK_S = 20e-6



@dataclass(frozen=True)
class SimConfig:
    engine: EngineConfig
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    max_concurrency: int | None = None  # the client's cap on requests in flight (bench serve --max-concurrency)
    disaggregation: str | None = None  # "xPyD": x prefill replicas, y decode replicas (instead of data parallel)
    # a KV pull's cost: per pull (a request's missing blocks) and per block; None: the step model's measured figures
    # (calibrate), else DEFAULT_KV_TRANSFER_*
    kv_transfer_latency_s: float | None = None
    kv_transfer_block_s: float | None = None
    record_steps: bool = False  # keep a StepTrace per step (tests, debugging; costs memory)
    step_noise: bool = False  # multiply each step by a draw from the profile's measured/fitted ratios
    seed: int = 0  # of the step noise

    def __post_init__(self) -> None:
        if not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {self.data_parallel_size!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.disaggregation is not None:
            check_disaggregation(self.disaggregation)
            if self.data_parallel_size != 1:
                raise ValueError("--disaggregation sets the replicas (xPyD); --data-parallel-size must stay 1")
        for name, flag in (("kv_transfer_latency_s", "latency"), ("kv_transfer_block_s", "block")):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"the KV transfer's cost: {name} (--kv-transfer-{flag}-us) must be a number of "
                                 f"seconds >= 0, got {value!r}")  # fmt: skip
        if self.engine.speculative is not None:
            raise ValueError("--speculative-config: speculative decoding is not simulated (acceptance is not modelled)")


def check_disaggregation(spec: str) -> tuple[int, int]:
    """Parse "xPyD" (x prefill replicas, y decode replicas), as `lmserve serve --disaggregation`."""
    m = re.fullmatch(r"(\d+)P(\d+)D", spec.strip(), re.IGNORECASE)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"--disaggregation must look like 2P1D (prefill and decode replicas), got {spec!r}")
    return int(m.group(1)), int(m.group(2))


def kv_transfer_cost(config: SimConfig, overheads: Overheads) -> tuple[float, float]:
    """(seconds per pull, seconds per block) of a KV transfer: the config's, else the step model's measured ones
    (calibrate), else the defaults."""

    def first(*values: float | None) -> float:
        return next(v for v in values if v is not None)

    return (
        first(config.kv_transfer_latency_s, overheads.kv_transfer_latency_s, DEFAULT_KV_TRANSFER_LATENCY_S),
        first(config.kv_transfer_block_s, overheads.kv_transfer_block_s, DEFAULT_KV_TRANSFER_BLOCK_S),
    )
