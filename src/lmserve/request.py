"""Request state: everything that changes with every generated token."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from lmserve.lora.request import LoRARequest
from lmserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # a decode side's request whose prompt KV is being pulled
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class Request:
    """One sequence. The scheduler only reads num_tokens and num_computed_tokens (one counter model):
    prefill, chunked prefill, prefix hits and recompute after preemption are the same arithmetic."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens, or what is left of max_model_len
    eos_token_ids: tuple[int, ...] = ()
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.time)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at first admission
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    metrics: RequestMetrics = field(init=False)
    generator: Any = None  # torch.Generator for seeded sampling, set by the engine
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its full blocks
    # the disk tier (core/block_pool.disk_hash_blocks): its full blocks' stable digests, and the payloads of disk hits
    # read while it waits for admission (kept so a head of the queue that cannot start yet is not read again)
    disk_block_keys: list[bytes] = field(default_factory=list)
    disk_payloads: dict[bytes, bytes] = field(default_factory=dict)
    kv_prefetch: Any = None  # a Future while its disk blocks are read in the background (engine/kv_tier.py)
    detokenizer: Any = None  # IncrementalDetokenizer, set by the engine
    logprobs: list[Any] | None = None  # TokenLogprobs per output token, when asked for
    cumulative_logprob: float | None = None  # summed while logprobs are computed (best_of ranks by it)
    prompt_logprobs: list[Any] | None = None  # [None, TokenLogprobs for prompt token 1, ...] when asked for
    delta_text: str = ""  # text added by the last step (after stop-string hold-back)
    num_delta_tokens: int = 0  # tokens added since the last output was made
    structured_output: Any = None  # StructuredOutputRequest (grammar matcher) when constrained, set by the engine
    # Speculative decoding: proposals for the next step, tentatively appended after all_token_ids (the
    # scheduler schedules 1 + len(spec_token_ids) tokens); the draft's distributions they were sampled from
    # (None: one-hot, e.g. n-gram or greedy); how many leading positions hold this request's draft-model KV.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: Any = None
    num_draft_computed_tokens: int = 0
    spec_acceptance: Any = None  # AcceptanceTracker (spec_decode/acceptance.py): how many tokens to propose
    lora_request: LoRARequest | None = None  # the adapter it runs under (None: the base model)
    lora_slot: int = -1  # the compute slot the scheduler gave its adapter while running (core/lora_slots.py)
    # a pooling request (sampling_params.pooling): the runner's sum of hidden rows so far (mean pooling), the
    # first row (cls); its pooled vector (or scores) once its prompt is computed
    pooling_state: Any = None
    pooled: list[float] | None = None
    state_slot: int = -1  # a hybrid model's recurrent-state slot while running (core/state_pool.py)
    decode_snapshot: Any = None  # the BlockKey of its latest decode-time state snapshot (core/state_snapshots.py)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def lora_int_id(self) -> int:
        """0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_grammar_ready(self) -> bool:
        """False while the request's grammar is still compiling: the scheduler leaves it waiting (and admits
        the requests behind it)."""
        return self.structured_output is None or self.structured_output.is_ready

    @property
    def is_kv_ready(self) -> bool:
        """False while its prefix blocks are being read from the disk tier: the scheduler admits others first."""
        return self.kv_prefetch is None or self.kv_prefetch.done()

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> bool:
        """After a new token: set finish_reason if the request is done. Returns whether it is."""
        params = self.sampling_params
        num_output = len(self.output_token_ids)
        if num_output >= params.min_tokens:
            last = self.output_token_ids[-1]
            if not params.ignore_eos and last in self.eos_token_ids:
                self.finish_reason, self.stop_reason = FinishReason.STOP, None
                return True
            if params.stop_token_ids and last in params.stop_token_ids:
                self.finish_reason, self.stop_reason = FinishReason.STOP, last
                return True
        if num_output >= self.max_tokens or len(self.all_token_ids) >= max_model_len:
            self.finish_reason = FinishReason.LENGTH
            return True
        return False
