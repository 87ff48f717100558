"""Server-sent events: the `data: ...` framing of a stream's chunks (and ChunkTemplate, the plain text chunk of
a token step written without building its model), the text/event-stream response that aborts its requests however
the stream ends, and the watch that cancels a non-streaming request whose client left."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic_core import to_json
from starlette.types import Receive, Scope, Send


class ClientGone(Exception):
    """The client of a non-streaming request disconnected before its answer (cancel_on_disconnect)."""


def sse(model: Any) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def sse_json(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ChunkTemplate:
    """The SSE event of one chunk model with only its text changing: the chunk is written once by pydantic with a
    marker for the text, and each event splices the new text, serialized by pydantic's own string encoder, in
    place of the marker. The bytes are the model's (tests/server/test_sse.py checks them against model_dump_json);
    building and dumping a chunk's two or three models costs ~6-8 µs a token, the splice ~0.3 µs."""

    MARKER = "\x00lmserve-chunk-text\x00"

    def __init__(self, chunk: Any) -> None:
        parts = chunk.model_dump_json().split(to_json(self.MARKER).decode())
        assert len(parts) == 2, "the template chunk must hold the text marker exactly once"
        self._head, self._tail = "data: " + parts[0], parts[1] + "\n\n"

    def __call__(self, text: str) -> str:
        return self._head + to_json(text).decode() + self._tail


async def cancel_on_disconnect(request: Request, coro: Any) -> Any:
    """Await `coro`, cancelling it if the client disconnects first (then raise ClientGone)."""
    main = asyncio.ensure_future(coro)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({main, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not main.done():
            main.cancel()
            await asyncio.gather(main, return_exceptions=True)
    if main in done:
        return main.result()
    raise ClientGone


class SSEResponse(StreamingResponse):
    """text/event-stream that always watches for the client leaving (whatever the ASGI spec version) and
    calls `on_close` (which aborts the engine requests) however the stream ends."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def run_then_cancel(fn: Callable[[], Any]) -> None:
                    await fn()
                    tg.cancel_scope.cancel()

                tg.start_soon(run_then_cancel, partial(self.stream_response, send))
                await run_then_cancel(partial(self.listen_for_disconnect, receive))
        except* OSError:
            pass  # the client went away while we were writing
        finally:
            self._on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
