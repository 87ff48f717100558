"""What a simulation returns: per-request records, per-replica counters and, when asked, every step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmserve.bench.metrics import RequestRecord


@dataclass
class StepTrace:
    """One simulated step of one replica (SimConfig.record_steps)."""

    replica: int
    index: int  # the replica's step number, from 0
    start_s: float
    end_s: float
    scheduled: list[tuple[str, int, int]]  # (request id, start, num_new_tokens) in scheduled order
    admitted: list[str]  # requests that were not running before this step's schedule()
    preempted: list[str]
    finished: list[str]


@dataclass
class ReplicaStats:
    num_steps: int = 0
    busy_s: float = 0.0
    step_s: float = 0.0  # of busy_s, the step model's time (without the core loop's overhead)
    num_requests: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    max_running: int = 0
    role: str = "colocated"  # or "prefill" / "decode" (disaggregation)
    num_blocks_pulled: int = 0  # decode role: KV blocks pulled from prefill replicas
    num_blocks_hit: int = 0  # decode role: prompt blocks found in the local prefix cache instead


@dataclass
class SimResult:
    records: list[RequestRecord]
    duration_s: float  # first arrival to the last response's end (bench serve's duration)
    replicas: list[ReplicaStats]
    wall_s: float  # what the simulation itself took
    steps: list[StepTrace] = field(default_factory=list)

    @property
    def num_steps(self) -> int:
        return sum(r.num_steps for r in self.replicas)

    def stats_dict(self) -> dict[str, Any]:
        reps = self.replicas
        queries = sum(r.prefix_cache_queries for r in reps)
        return {
            "num_replicas": len(reps),
            "num_steps": self.num_steps,
            "num_preemptions": sum(r.num_preemptions for r in reps),
            "prefix_cache_hit_rate": sum(r.prefix_cache_hits for r in reps) / queries if queries else 0.0,
            "mean_replica_utilization": (
                sum(r.busy_s for r in reps) / (len(reps) * self.duration_s) if self.duration_s > 0 else 0.0
            ),
            "roles": [r.role for r in reps],
            "kv_blocks_pulled": sum(r.num_blocks_pulled for r in reps),
            "kv_blocks_hit_on_decode": sum(r.num_blocks_hit for r in reps),
            "requests_per_replica": [r.num_requests for r in reps],
            "max_running_per_replica": [r.max_running for r in reps],
            "simulation_wall_s": self.wall_s,
        }
