"""The engine's counters and the metric dicts built from them (what /metrics, snapshots and the diagnosis read)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmserve.config.engine import EngineConfig
from lmserve.core.outputs import SchedulerOutput, SchedulerStats
from lmserve.request import FinishReason


@dataclass
class EngineCounters:
    num_requests_total: int = 0
    num_finished_by_reason: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in FinishReason})
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_steps_total: int = 0
    # what the diagnosis (lmserve.observability.diagnose) reads: tokens by kind, and model-step wall time split by the
    # step's mix (decode-only steps vs steps computing prompt tokens beside decodes)
    prefill_tokens_total: int = 0
    decode_tokens_total: int = 0
    step_time_s_total: float = 0.0
    num_decode_steps_total: int = 0  # steps with only decode tokens
    decode_step_time_s_total: float = 0.0
    decode_step_seqs_total: int = 0  # sequences in those steps (their mean batch size)
    decode_step_time_min_s: float = 0.0  # the fastest decode-only step so far: the step's idle figure
    num_mixed_steps_total: int = 0  # steps with prompt tokens and decode tokens
    mixed_step_time_s_total: float = 0.0
    mixed_step_prefill_tokens_total: int = 0
    prefix_shareable_tokens_total: int = 0  # prompt tokens an earlier prompt had (SharedPrefixCounter)

    def count_step(self, sched: SchedulerOutput, elapsed_s: float) -> None:
        self.num_steps_total += 1
        self.step_time_s_total += elapsed_s
        self.prefill_tokens_total += sched.num_prefill_tokens
        self.decode_tokens_total += sched.num_decode_tokens
        if not sched.num_decode_tokens:
            return
        if not sched.num_prefill_tokens:
            self.num_decode_steps_total += 1
            self.decode_step_time_s_total += elapsed_s
            self.decode_step_seqs_total += len(sched.scheduled)
            best = self.decode_step_time_min_s
            self.decode_step_time_min_s = elapsed_s if best == 0.0 else min(best, elapsed_s)
        else:
            self.num_mixed_steps_total += 1
            self.mixed_step_time_s_total += elapsed_s
            self.mixed_step_prefill_tokens_total += sched.num_prefill_tokens


def spec_decode_metrics(s: SchedulerStats) -> dict[str, float]:
    """Speculative decoding counters, acceptance rate (accepted / proposed) and mean accepted length (tokens a
    verification step emits: accepted proposals + the one the target samples; 0 before any verification)."""
    drafts, proposed = s.spec_num_drafts_total, s.spec_num_draft_tokens_total
    accepted = s.spec_num_accepted_tokens_total
    return {
        "spec_decode_num_drafts_total": drafts,
        "spec_decode_num_draft_tokens_total": proposed,
        "spec_decode_num_accepted_tokens_total": accepted,
        "spec_decode_acceptance_rate": accepted / proposed if proposed else 0.0,
        "spec_decode_mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
    }


def step_metrics(s: SchedulerStats, c: EngineCounters) -> dict[str, float]:
    """The latest step's token split and the step-time counters the diagnosis reads."""
    return {
        "num_prefill_tokens_step": s.num_prefill_tokens,
        "num_decode_tokens_step": s.num_decode_tokens,
        "prefill_tokens_total": c.prefill_tokens_total,
        "decode_tokens_total": c.decode_tokens_total,
        "step_time_s_total": c.step_time_s_total,
        "num_decode_steps_total": c.num_decode_steps_total,
        "decode_step_time_s_total": c.decode_step_time_s_total,
        "decode_step_seqs_total": c.decode_step_seqs_total,
        "decode_step_time_min_s": c.decode_step_time_min_s,
        "num_mixed_steps_total": c.num_mixed_steps_total,
        "mixed_step_time_s_total": c.mixed_step_time_s_total,
        "mixed_step_prefill_tokens_total": c.mixed_step_prefill_tokens_total,
        "prefix_shareable_tokens_total": c.prefix_shareable_tokens_total,
    }


def config_metrics(config: EngineConfig) -> dict[str, Any]:
    """The settings a diagnosis names (scheduler, cache, the KV ledger's model shape)."""
    sc, cc, mc = config.scheduler, config.cache, config.model
    return {
        "scheduling_policy": sc.scheduling_policy,
        "enable_chunked_prefill": sc.enable_chunked_prefill,
        "enable_prefix_caching": cc.enable_prefix_caching,
        "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "max_model_len": sc.max_model_len,
        "block_size": cc.block_size,
        "num_layers": mc.num_layers,
        "num_kv_heads": mc.num_kv_heads,
        "head_dim": mc.head_dim,
    }
