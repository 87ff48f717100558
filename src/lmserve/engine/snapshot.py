"""EngineSnapshot: what an engine looked like after its latest step, the one thing the HTTP side reads about it
(counters, queue lengths, KV usage, admission's room, while watched its KV block map). Taken on the thread that
owns the engine (AsyncEngine's engine thread, or an engine core) and published immutable; with several engine
cores the client's snapshot is their aggregate (aggregate_snapshots).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmserve.core.outputs import BlockMap
from lmserve.engine.admission import _Room

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
    return EngineSnapshot(
        metrics=engine.get_metrics(),
        num_batched_tokens=engine.stats().num_batched_tokens,
        num_aborted_requests_total=num_aborted,
        time=time.time(),
        room=room,
        block_map=block_map,
    )


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
