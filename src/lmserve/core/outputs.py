"""Dataclasses that cross the boundaries between scheduler, model runner and engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmserve.request import FinishReason, Request, RequestMetrics


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute tokens [start, start + num_new_tokens)."""

    request: Request
    num_new_tokens: int
    block_ids: list[int]  # the request's whole block table after allocation
    num_spec_tokens: int = 0  # the last num_spec_tokens of the new tokens are proposals to verify
    # a hybrid's prefix cache (core/state_snapshots.py): the snapshot slot its state slot starts from (-1: none),
    # and the snapshot (a StateSave) this chunk takes at a block boundary
    state_restore: int = -1
    state_save: Any = None

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def reaches_end(self) -> bool:
        """True when this step reaches the end of the known tokens (and proposals)."""
        return self.start + self.num_new_tokens == self.request.num_tokens + self.num_spec_tokens

    @property
    def samples(self) -> bool:
        """True when a new token is sampled after this step: it reaches the end of the known tokens and the
        request may generate (max_tokens 0 scores the prompt only: it ends there, nothing sampled)."""
        return self.reaches_end and self.request.max_tokens > 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted_ids: list[str] = field(default_factory=list)
    num_decode_tokens: int = 0  # of num_batched_tokens, those of requests past their prompt (1 + proposals each)
    # the disk tier, moved by the engine before the step runs: blocks evicted from RAM to save (block id, disk key),
    # then prefix hits found on disk to load (block id, payload)
    kv_saves: list[tuple[int, bytes]] = field(default_factory=list)
    kv_loads: list[tuple[int, bytes]] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens computed this step (prefill chunks, recompute after preemption)."""
        return self.num_batched_tokens - self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """Sampled token per request id, only for requests whose step reached the end of their tokens."""

    sampled_token_ids: dict[str, int]
    logits: Any = (
        None  # (num_sampled, vocab) float32 rows behind the samples, in scheduled order (tests, logprobs)
    )
    logprobs: dict[str, Any] = field(default_factory=dict)  # request id → TokenLogprobs, where asked for
    # request id → (first prompt position scored, TokenLogprobs per position) for prompt_logprobs requests
    prompt_logprobs: dict[str, tuple[int, list[Any]]] = field(default_factory=dict)
    # Speculative decoding. accepted_token_ids: request id → the proposals the target accepted, which come
    # before its sampled token (their TokenLogprobs in accepted_logprobs, where asked for);
    # spec_token_ids / spec_draft_probs: request id → proposals for the next step and the draft's
    # distributions they were drawn from (None: one-hot).
    accepted_token_ids: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[Any]] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_draft_probs: dict[str, Any] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)  # request id → its pooled output (worker/pooler.py)


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_batched_tokens: int
    kv_cache_usage: float  # fraction of blocks in use
    num_preemptions_total: int
    prefix_cache_queries_total: int  # tokens looked up
    prefix_cache_hits_total: int  # tokens found (in RAM or, with the disk tier, on disk)
    spec_num_drafts_total: int = 0  # verifications of at least one proposed token
    spec_num_draft_tokens_total: int = 0  # proposed tokens verified
    spec_num_accepted_tokens_total: int = 0  # of those, accepted
    num_prefill_tokens: int = 0  # of num_batched_tokens in the latest step: prompt (prefill) tokens
    num_decode_tokens: int = 0  # and decode tokens
    prefix_cache_disk_hits_total: int = 0  # of prefix_cache_hits_total, tokens read from the disk tier


@dataclass
class BlockMap:
    """The KV pool at one moment, one entry per block (plain ints, for the dashboard). A block held by several
    requests (a shared prefix, n > 1) lists the first holder as its owner and its ref count says how many."""

    owners: list[int]  # per block: index into request_ids of a request holding it, -1 when free
    ref_counts: list[int]  # per block: how many requests' tables hold it
    cached: list[int]  # per block: 1 while registered in the prefix index (reusable even once free), else 0
    request_ids: list[str]  # the owner table

    @property
    def num_blocks(self) -> int:
        return len(self.owners)


@dataclass
class CompletionOutput:
    """One sequence of a request. text / token_ids / logprobs are cumulative; the delta_* fields hold
    what this step added (what a stream sends)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: list[Any] | None = None  # TokenLogprobs per generated token, when params.logprobs is set
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs, when computed
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    prompt_logprobs: list[Any] | None = None  # None for the first prompt token, then TokenLogprobs per token
    kv_transfer_params: dict[str, Any] | None = None  # a kv_producer server's answer: where the KV waits (handoff)
    pooled: list[float] | None = None  # a pooling request's embedding (or token scores), once finished


def step_features(sched: Any, sampling: list[Any] | None = None) -> tuple[int, int, int, int, float]:
    """(prefill_tokens, prefill_segments, decode_rows, decode_context_tokens, prefill_attention_pairs) of a
    SchedulerOutput: what a step costs, for the simulator's step model and the engine's step trace. A request is
    decoding when its step starts at its last token (as Scheduler.schedule counts). `sampling`, if given, gets the
    requests whose step reaches the end of their tokens (those that sample; no speculative proposals), in
    scheduled order."""
    prefill = segments = rows = context = 0
    pairs = 0.0
    for s in sched.scheduled:
        req = s.request
        start, n = req.num_computed_tokens, s.num_new_tokens
        num_tokens = len(req.all_token_ids)
        if start >= num_tokens - 1:
            rows += 1
            context += start + n
        else:
            prefill += n
            segments += 1
            pairs += n * start + n * (n + 1) / 2
        if sampling is not None and start + n == num_tokens:
            sampling.append(req)
    return prefill, segments, rows, context, pairs
