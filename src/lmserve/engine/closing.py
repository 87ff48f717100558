"""Ending an engine: LLMEngine.close() ends what it started (tensor-parallel ranks and their shared memory, the KV
transfer server's thread, the grammar pool) and drops its model and KV pool, giving their pages back to the OS; a
closed engine raises EngineClosedError. Engines that run a thread or processes of their own (AsyncEngine,
EngineCoreClient) are also shut down at interpreter exit, through a weak set (no engine is kept alive by it).
"""

from __future__ import annotations

import atexit
import gc
import logging
import weakref
from typing import Any

from lmserve.worker.host_memory import release_freed_memory

logger = logging.getLogger(__name__)


class EngineClosedError(RuntimeError):
    """The engine was closed (close(), a `with` block's end, or shutdown()); build a new one to go on."""


def check_open(engine: Any) -> None:
    if getattr(engine, "closed", False):
        raise EngineClosedError("this engine is closed (close() was called); create a new one to generate")


def close_engine(engine: Any) -> None:
    """LLMEngine.close(): stop the engine's processes and threads, drop its model, KV pool, draft and adapters, and
    return the freed heap to the OS. Each step runs even if an earlier one failed (logged); a second call returns."""
    if getattr(engine, "closed", False):
        return
    engine.closed = True
    stops = [role.shutdown for role in (engine.kv_producer, engine.kv_consumer) if role is not None]
    if getattr(engine, "kv_disk", None) is not None:  # the RAM prefix cache's blocks saved, for a restart
        stops.append(lambda: engine.kv_disk.close(engine.kv.pool))
    stops.append(engine.structured.shutdown)
    if engine.executor is not None:
        stops.append(engine.executor.close)
    for stop in stops:
        try:
            stop()
        except Exception:  # noqa: BLE001 (the rest must still be released)
            logger.exception("closing the engine: %s failed", getattr(stop, "__qualname__", stop))
    engine.kv_producer = engine.kv_consumer = engine.executor = None
    if getattr(engine, "kv_disk", None) is not None:
        engine.kv_disk = None
    engine.runner = None  # the model, its KV pool (unmapped when its tensors go), the draft, the LoRA slots
    gc.collect()  # (a tensor-parallel runner's model forms a cycle with its patched forward)
    release_freed_memory()


_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def shut_down_at_exit(engine: Any) -> None:
    """Call engine.shutdown() at interpreter exit if it is still alive then (and not shut down before)."""
    _LIVE.add(engine)


@atexit.register
def _shut_down_live_engines() -> None:
    for engine in list(_LIVE):
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 (exiting anyway: report, go on with the others)
            logger.exception("shutting an engine down at exit failed")
