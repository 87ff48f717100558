"""An lmserve app served by uvicorn on a loopback port in a thread of the test process: for clients that need a
real URL (the anthropic SDK brings its own HTTP stack; LangChain builds its clients) while the test keeps the
engine in hand (steps_held_after_first, its counters)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from tests.server.test_server import free_port


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, timeout_s: float = 30.0) -> Iterator[str]:
    """Serve `app` until the block ends; yields its base URL (http://127.0.0.1:PORT)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
