"""What the scheduler put in a step, as the step-time models read it: StepFeatures (prefill tokens and segments,
decode rows, their context, the prefill attention pairs; core.outputs.step_features makes them), the model terms
built from them, and the API overheads outside a step (Overheads)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

FORMAT = "lmserve-step-model-v1"
FEATURE_NAMES = (
    "prefill_tokens",
    "prefill_segments",
    "decode_rows",
    "decode_context_tokens",
    "prefill_attention_pairs",
)
LINEAR_TERMS = ("prefill_tokens", "prefill_segments", "decode_rows", "decode_context_tokens")  # the base form
QUADRATIC_TERM = "prefill_attention_pairs"
# 1 for a pure-decode step with more rows than the one-call decode stack takes (LinearStepModel.stack_rows): such a
# step runs the module path, with its Python between kernels, on every layer (a jump, not a slope, in step time)
OFF_STACK_TERM = "decode_off_stack"
# 1 for a mixed step (prefill segments beside decode rows): what such a step costs once, however many segments it
# has (the decode rows leave the one-call decode stack for the module path): without it the per-segment
# coefficient carried that fixed part for every segment, and a step of 32 new prompts beside decodes (a burst, a
# closed-loop start) came out 1.4-1.5x the served one, while a lone prefill (no stack to leave) came out too slow
MIXED_STEP_TERM = "mixed_step"
# 1 for a pure-decode step whose core's previous step computed prompt tokens: the first decode after a prefill runs
# slower than steady ones (single streams on the 2-core development machine, after a 512-token prompt: 2.07, 1.60,
# 1.34 ms for the first three decodes against 1.25 ms steady), the prefill's activations having pushed the weights
# and KV out of the caches. One step's jump: the first decode carries about two thirds of the excess, the next ones
# less (not modelled). Not a feature of one SchedulerOutput: the simulator and calibrate set it from the same core's
# previous step (mark_decode_after_prefill). A step model without it (older files, a roofline) has it 0.
POST_PREFILL_TERM = "decode_after_prefill"
TERMS = (*FEATURE_NAMES, OFF_STACK_TERM, MIXED_STEP_TERM, POST_PREFILL_TERM)
DEFAULT_TP_EFFICIENCY = 0.85  # assumed for fitted profiles (calibrate runs one process; no TP to time)

StepTimeFn = Callable[[int, int, int, int, float], float]  # (prefill, segments, rows, context, pairs) → s


@dataclass(frozen=True)
class StepFeatures:
    prefill_tokens: int = 0
    prefill_segments: int = 0
    decode_rows: int = 0
    decode_context_tokens: int = 0
    prefill_attention_pairs: float = 0.0
    decode_after_prefill: int = 0  # POST_PREFILL_TERM: 1 for a pure decode right after the core's prefill step

    def as_tuple(self) -> tuple[int, int, int, int, float]:
        """The five features of the step itself (StepTimeFn's arguments; decode_after_prefill is the core's)."""
        return (
            self.prefill_tokens,
            self.prefill_segments,
            self.decode_rows,
            self.decode_context_tokens,
            self.prefill_attention_pairs,
        )


def mark_decode_after_prefill(features: list[tuple[Any, ...]]) -> list[int]:
    """decode_after_prefill of each step of one engine core, in the order it took them (each a feature tuple:
    prefill_tokens first, decode_rows third): 1 for a pure-decode step whose previous step computed prompt tokens."""
    flags = []
    prev_prefill = False
    for f in features:
        flags.append(int(prev_prefill and f[0] == 0 and f[2] > 0))
        prev_prefill = f[0] > 0
    return flags


# ---- overheads outside the step ------------------------------------------------------------------------


@dataclass(frozen=True)
class Overheads:
    """Time a served request spends outside engine steps (constants; calibrate measures them on a server)."""

    ingress_s: float = 0.0  # client send → the engine core has the request (HTTP, tokenize, validate, route)
    egress_s: float = 0.0  # a step's end → its token chunk at the client (outputs, zmq, SSE, HTTP)
    core_step_overhead_s: float = 0.0  # per step, the core loop beyond LLMEngine.step (encode, send, drain)
    measured: bool = False
    how: str = "not measured (zeros)"
    # prefill/decode disaggregation: a KV pull between two engine cores on this machine (ZeroMQ ipc, the model's KV
    # geometry and dtype) = kv_transfer_latency_s + blocks × kv_transfer_block_s; None: not measured
    kv_transfer_latency_s: float | None = None
    kv_transfer_block_s: float | None = None
    # The API process (and, on a benchmark machine, the load generator beside it) as one FIFO server of measured CPU
    # costs: a request's arrival occupies it api_request_s before the request travels on (ingress_s is then only the
    # rest of the way), each streamed chunk api_chunk_s (+ api_first_chunk_s for a request's first, the response's
    # start; + api_last_chunk_s for its last, the finish and usage) before it travels egress_s to the client. On
    # cores it shares with an engine core's OpenMP team that work also stretches the engine's steps: a replica's step
    # is longer by api_step_stretch × the API work beside it, the service of its previous step's chunks (with their
    # first / last extras) and the api_request_s of the requests routed to it while that step ran. All 0 (the
    # default, and an older step model's): no queue, no stretch.
    api_request_s: float = 0.0
    api_chunk_s: float = 0.0
    api_first_chunk_s: float = 0.0
    api_last_chunk_s: float = 0.0
    api_step_stretch: float = 0.0  # dimensionless: step seconds per second of API work
    # A request being sent (the load generator's and the API process's work for it) stalls the engine step in
    # progress (the OpenMP team waits at its barriers for the core the kernel gave to that work): that step runs
    # api_arrival_stall_s longer per request sent on its own schedule while it runs (an open loop's arrival: the
    # load generator wakes to send; ~2.2-3.9 ms on the 2-core machine), and api_held_send_stall_s per request the
    # client's concurrency cap held until another finished (a closed loop: the client is awake, reading that last
    # chunk; ~1.3-2.5 ms). calibrate measures both, does not apply them (fit.why_send_stalls). The simulator adds
    # it to the replica's step in progress at the send (one front replica) or at the delivery (several: to the one
    # the request is routed to). 0: none (every calibrated and older step model).
    api_arrival_stall_s: float = 0.0
    api_held_send_stall_s: float = 0.0

    @property
    def api_queue(self) -> bool:
        """Whether the API process is modelled as a queue (any of its CPU costs measured)."""
        return bool(self.api_request_s or self.api_chunk_s or self.api_first_chunk_s or self.api_last_chunk_s)

    def __post_init__(self) -> None:
        for name in ("ingress_s", "egress_s", "core_step_overhead_s", "kv_transfer_latency_s", "kv_transfer_block_s",
                     "api_request_s", "api_chunk_s", "api_first_chunk_s", "api_last_chunk_s",
                     "api_step_stretch", "api_arrival_stall_s", "api_held_send_stall_s"):  # fmt: skip
            value = getattr(self, name)
            if value is None and name.startswith("kv_"):
                continue
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"overheads.{name} must be a number of seconds >= 0, got {value!r}")
