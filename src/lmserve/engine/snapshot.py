"""EngineSnapshot: what an engine looked like after its latest step, the one thing the HTTP side reads about it
(counters, queue lengths, KV usage, admission's room, while watched its KV block map). Taken on the thread that
owns the engine (AsyncEngine's engine thread, or an engine core) and published immutable; with several engine
cores the client's snapshot is their aggregate (aggregate_snapshots).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmserve.core.outputs import BlockMap
from lmserve.engine.admission import _Room
from lmserve.observability.prometheus import CONFIG_LABELS

if TYPE_CHECKING:
    from lmserve.engine.llm_engine import LLMEngine

BLOCK_MAP_INTERVAL_S = 1.0  # a watched block map is rebuilt at most this often (on the engine thread)


@dataclass(frozen=True)
class EngineSnapshot:
    """What the engine looked like after its latest step (or after applying commands while idle)."""

    metrics: dict[str, Any]  # LLMEngine.get_metrics()
    num_batched_tokens: int  # tokens in the latest step
    num_aborted_requests_total: int
    time: float
    room: _Room | None = None  # what admission needs (measured only when max_queued_requests bounds it)
    # With several engine cores (EngineCoreClient, data parallel): the aggregate carries each core's own
    # snapshot here, in core order (() for a single engine).
    engines: tuple[EngineSnapshot, ...] = ()
    block_map: BlockMap | None = None  # only while someone watches (watch_block_map); at most BLOCK_MAP_INTERVAL_S old


def take_snapshot(
    engine: LLMEngine, num_aborted: int, room: _Room | None = None, block_map: BlockMap | None = None
) -> EngineSnapshot:
    """The engine's snapshot now, on the thread that owns it (AsyncEngine's engine thread or an engine core)."""
    metrics = engine.get_metrics()
    metrics["engine_alive"] = 1  # summed over cores: the live ones (dead_snapshot sets 0)
    return EngineSnapshot(
        metrics=metrics,
        num_batched_tokens=engine.stats().num_batched_tokens,
        num_aborted_requests_total=num_aborted,
        time=time.time(),
        room=room,
        block_map=block_map,
    )


GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage", "num_prefill_tokens_step",
          "num_decode_tokens_step", "kv_transfer_leases", "kv_transfer_waiting", "lora_num_active_slots")  # fmt: skip


def dead_snapshot(snap: EngineSnapshot, num_failed: int) -> EngineSnapshot:
    """What a dead core reports from then on: its counters as last seen (a counter never goes back), every gauge 0
    (nothing runs, waits or holds KV there), engine_alive 0, and the requests that failed with it counted."""
    m = dict(snap.metrics)
    for key in GAUGES:
        if key in m:
            m[key] = 0
    if "lora_num_requests_running_by_adapter" in m:
        m["lora_num_requests_running_by_adapter"] = {}
    m["engine_alive"] = 0
    m["num_requests_failed_total"] = m.get("num_requests_failed_total", 0) + num_failed
    return dataclasses.replace(snap, metrics=m, num_batched_tokens=0, block_map=None, time=time.time())


class BlockMapWatch:
    """The watchers of one engine's KV block map and its latest build, on the thread that owns the engine. The
    map is rebuilt at most every BLOCK_MAP_INTERVAL_S, and once more when the engine goes idle (else it would show
    the last busy moment until the next request); without watchers it costs nothing."""

    def __init__(self) -> None:
        self.num_watchers = 0
        self.latest: BlockMap | None = None
        self._time = 0.0
        self._steps = 0  # engine steps when it was built

    def watch(self, on: bool) -> None:
        self.num_watchers += 1 if on else -1
        assert self.num_watchers >= 0, "watch_block_map(False) without a matching True"
        self.latest = None  # rebuilt (or dropped) with the next snapshot

    def refresh(self, engine: LLMEngine, idle: bool) -> BlockMap | None:
        """A new map when one is due (None otherwise; `latest` keeps the current one)."""
        if not self.num_watchers:
            return None
        now, steps = time.time(), engine.counters.num_steps_total
        if self.latest is None or now - self._time >= BLOCK_MAP_INTERVAL_S or (idle and steps != self._steps):
            self.latest, self._time, self._steps = engine.block_map(), now, steps
            return self.latest
        return None


SUMMED_RATIOS = {"kv_cache_usage": "num_kv_blocks"}  # averaged, weighted by the other key
SAME_ON_EVERY_CORE = {
    "kv_cache_bytes_per_token",
    "kv_cache_scale_bytes_per_token",
    "kv_cache_dtype",
    "state_bytes_per_sequence",
    *CONFIG_LABELS,  # counters.config_metrics: every core runs the same configuration
    # the disk tier: every core sees the one shared directory
    "kv_disk_usage_bytes",
    "kv_disk_capacity_bytes",
    "kv_disk_num_blocks",
    "kv_disk_write_disabled",
}
SMALLEST_NONZERO = {"decode_step_time_min_s"}  # the fastest core's figure (0 = none yet)


def aggregate_snapshots(snaps: list[EngineSnapshot]) -> EngineSnapshot:
    """One snapshot for N cores: counters and gauges summed (dicts per key), ratios recomputed, per-core
    constants taken from the first; `engines` keeps each core's own."""
    from lmserve.engine.counters import spec_decode_metrics

    first = {k: v for s in reversed(snaps) for k, v in s.metrics.items()}  # every key (roles differ), core 0's first
    metrics: dict[str, Any] = {}
    for key, value in first.items():
        absent = 0 if isinstance(value, int | float) and not isinstance(value, bool) else value
        values = [s.metrics.get(key, absent) for s in snaps]
        if key in SAME_ON_EVERY_CORE or not isinstance(value, int | float | dict):
            metrics[key] = value
        elif key in SMALLEST_NONZERO:
            metrics[key] = min((v for v in values if v), default=0.0)
        elif key in SUMMED_RATIOS:
            weights = [s.metrics.get(SUMMED_RATIOS[key], 1) for s in snaps]
            metrics[key] = sum(v * w for v, w in zip(values, weights, strict=True)) / max(1, sum(weights))
        elif isinstance(value, dict):
            merged: dict[str, Any] = {}
            for v in values:
                for k, x in v.items():
                    merged[k] = merged.get(k, 0) + x
            metrics[key] = merged
        else:
            metrics[key] = sum(values)
    if "spec_decode_num_drafts_total" in metrics:
        from lmserve.core.outputs import SchedulerStats

        stats = SchedulerStats(
            0, 0, 0, 0.0, 0, 0, 0,
            spec_num_drafts_total=metrics["spec_decode_num_drafts_total"],
            spec_num_draft_tokens_total=metrics["spec_decode_num_draft_tokens_total"],
            spec_num_accepted_tokens_total=metrics["spec_decode_num_accepted_tokens_total"],
        )  # fmt: skip
        metrics.update(spec_decode_metrics(stats))
    return EngineSnapshot(
        metrics=metrics,
        num_batched_tokens=sum(s.num_batched_tokens for s in snaps),
        num_aborted_requests_total=sum(s.num_aborted_requests_total for s in snaps),
        time=max(s.time for s in snaps),
        engines=tuple(snaps),
        block_map=next((s.block_map for s in snaps if s.block_map is not None), None),  # the first core's
    )
