"""RequestStream: one request's outputs as an async iterator, fed from the engine's thread by one
call_soon_threadsafe per step and event loop (_Delivery, _deliver); EngineDeadError, what a stream raises when
its engine is gone; and the StatLogger protocol the engine calls with every output. Shared by AsyncEngine and
EngineCoreClient.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from lmserve.core.outputs import RequestOutput


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (crashed or shut down); requests can no longer be served."""


class StatLogger(Protocol):
    """Receives per-request events on the engine thread (must be cheap and thread-safe)."""

    def on_request_output(self, output: RequestOutput, prev_token_time: float | None, now: float) -> None: ...

    def on_request_aborted(self) -> None: ...


class _Aborts(Protocol):
    """The engine a stream belongs to (AsyncEngine or EngineCoreClient): all a stream asks of it."""

    def abort(self, request_id: str) -> None: ...


class RequestStream:
    """The outputs of one request, in order, as an async iterator. Create with AsyncEngine.add_request.

    Iteration ends after the output with `finished=True`; an engine failure is raised from `__anext__`.
    `abort()` (idempotent, non-blocking) tells the engine to drop the request and free its KV blocks.
    """

    def __init__(self, engine: _Aborts, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False  # the final output (or an error) was received, or the request was aborted
        self.last_token_time: float | None = None  # engine-thread bookkeeping for inter-token latency

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)

    def _put(self, item: RequestOutput | BaseException) -> None:  # event-loop thread
        self._queue.put_nowait(item)


@dataclass
class _Delivery:
    """Items to hand to streams living on one event loop, sent in one call_soon_threadsafe."""

    items: list[tuple[RequestStream, RequestOutput | BaseException]] = field(default_factory=list)


def _deliver(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream._put(item)
