"""Admission: the `max_queued_requests` bound of one engine (Admission), shared by AsyncEngine and EngineCoreClient.

The bound counts the sequences that could not start now because the engine is full (num_unstartable: queued
minus what free sequence slots and free KV blocks could start), not those merely waiting for the next step.
A request that would leave more than `max_queued_requests` of them is refused (QueueFullError → 429).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmserve.engine.llm_engine import LLMEngine


class QueueFullError(RuntimeError):
    """Admitting the request would leave more than `max_queued_requests` sequences that cannot start
    (the engine is full); retry after `retry_after_s`."""

    def __init__(self, num_queued: int, limit: int, retry_after_s: int = 1) -> None:
        super().__init__(
            f"server is overloaded: {num_queued} sequences would wait for the running ones to finish "
            f"(max_queued_requests={limit}); retry after {retry_after_s} s"
        )
        self.num_queued = num_queued
        self.limit = limit
        self.retry_after_s = retry_after_s


def num_unstartable(
    num_free_slots: int, num_queued_seqs: int, num_queued_blocks: int, num_free_blocks: int
) -> int:
    """Queued sequences the engine could not start now: beyond the free sequence slots, or beyond what
    the free KV blocks hold at the queued sequences' average size."""
    if num_queued_seqs == 0:
        return 0
    fit_blocks = (
        num_queued_seqs
        if num_queued_blocks <= num_free_blocks
        else num_free_blocks * num_queued_seqs // num_queued_blocks
    )
    return num_queued_seqs - min(max(0, num_free_slots), fit_blocks)


@dataclass(frozen=True)
class _Room:
    """The scheduler's state that admission needs, measured on the engine thread."""

    num_free_slots: int = 0  # sequences that could join the running batch
    num_waiting_seqs: int = 0
    num_waiting_blocks: int = 0  # blocks the waiting sequences need to start (prompt + 1 token each)
    num_free_blocks: int = 0


def measure_room(engine: LLMEngine) -> _Room:
    """The engine's _Room, on the thread that owns it. O(waiting), so only when admission is bounded."""
    scheduler, kv = engine.scheduler, engine.kv
    static_batch_running = scheduler.config.scheduling_policy == "static" and scheduler.running
    return _Room(
        num_free_slots=0 if static_batch_running else scheduler.config.max_num_seqs - len(scheduler.running),
        num_waiting_seqs=len(scheduler.waiting),
        num_waiting_blocks=sum(kv.num_blocks_for(r.num_tokens + 1) for r in scheduler.waiting),
        num_free_blocks=kv.pool.num_free_blocks,
    )


class Admission:
    """The `max_queued_requests` bound of one engine: the room measured after its latest step plus the
    sequences added since but not yet applied by the engine (pending). Used by AsyncEngine (room from the
    engine thread) and by EngineCoreClient (room from each engine core's snapshots).

    `lock` guards the counters; callers hold it around `reserve` together with their own check that the
    engine is alive and the enqueueing of the add, so that a failing engine sees every reserved request."""

    def __init__(self, max_queued_requests: int | None, retry_after_s: int = 1) -> None:
        if max_queued_requests is not None and max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
        self.max_queued_requests = max_queued_requests
        self.retry_after_s = retry_after_s
        self.lock = threading.Lock()
        self.room = _Room()
        self.num_pending_seqs = 0  # sequences in adds the engine has not applied yet
        self.num_pending_blocks = 0  # blocks those need to start

    def reserve(self, num_seqs: int, num_blocks: int) -> None:
        """Count a new add as pending, or raise QueueFullError. Call with `lock` held."""
        if self.max_queued_requests is not None:
            num_queued = num_unstartable(
                self.room.num_free_slots,
                self.room.num_waiting_seqs + self.num_pending_seqs + num_seqs,
                self.room.num_waiting_blocks + self.num_pending_blocks + num_blocks,
                self.room.num_free_blocks,
            )
            if num_queued > self.max_queued_requests:
                raise QueueFullError(num_queued, self.max_queued_requests, self.retry_after_s)
        self.num_pending_seqs += num_seqs
        self.num_pending_blocks += num_blocks

    def applied(self, num_seqs: int, num_blocks: int, room: _Room | None) -> None:
        """The engine applied adds (they moved from pending to its waiting queue) and measured `room`."""
        with self.lock:
            self.num_pending_seqs -= num_seqs
            self.num_pending_blocks -= num_blocks
            if room is not None:
                self.room = room
