"""The OpenAI-compatible HTTP server: `build_app(engine)` → a FastAPI app (its lifespan, the engine's loading and
start, the frontends beside it).

The app's parts live beside this file: state, middleware, routes, request_inputs, generation, serving_* (one per
endpoint), sse, dashboard, errors, protocol, tools, logprobs, chat_settings. Routes and error codes: docs/serving.md.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any

from fastapi import FastAPI

from lmserve.engine.async_engine import AsyncEngine
from lmserve.engine.protocol import EngineClient
from lmserve.engine.token_bytes import TokenBytes
from lmserve.entrypoints.openai.dashboard import add_web_routes
from lmserve.entrypoints.openai.kv_info import add_kv_info_route
from lmserve.entrypoints.openai.lora_modules import LoRAModules
from lmserve.entrypoints.openai.lora_routes import add_lora_routes
from lmserve.entrypoints.openai.middleware import GuardMiddleware, add_exception_handlers, bearer_ok
from lmserve.entrypoints.openai.response_store import ResponseStore
from lmserve.entrypoints.openai.routes import add_routes
from lmserve.entrypoints.openai.serving_messages import add_messages_routes
from lmserve.entrypoints.openai.serving_ollama import add_ollama_routes
from lmserve.entrypoints.openai.serving_pooling import add_pooling_routes
from lmserve.entrypoints.openai.serving_responses import add_responses_routes
from lmserve.entrypoints.openai.state import ServerState
from lmserve.observability.prometheus import Metrics
from lmserve.parsers.chat_settings import ChatSettings

__all__ = ["DEFAULT_MAX_REQUEST_BODY_BYTES", "ServerState", "bearer_ok", "build_app"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 2**20


def build_app(
    engine: AsyncEngine | Callable[[], AsyncEngine],
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    on_ready: Callable[[AsyncEngine], None] | None = None,
    frontends: Sequence[Callable[[ServerState], AbstractAsyncContextManager[Any]]] = (),
    lora_modules: LoRAModules | None = None,
    chat_settings: ChatSettings | None = None,
    response_store: ResponseStore | None = None,
) -> FastAPI:
    """The server for `engine`: a started-or-not engine client (AsyncEngine, or EngineCoreClient with the
    engine in separate processes), or a loader called in a background thread at start-up (then /health is
    503 until it returns; `served_model_name` is required). The engine is started here (or after loading);
    a loaded engine is shut down when the app's lifespan ends, one passed in is left to its owner. `frontends`
    (e.g. the gRPC server) run for the app's lifespan on its event loop, serving the same ServerState; they
    stop before the engine does. `lora_modules`: the LoRA adapters served by name (the engine needs enable_lora).
    `chat_settings`: reasoning / tool-call parsers and chat template options (default: chosen from the template).
    `response_store`: the Responses API's stored responses (default: ResponseStore's bounds)."""
    loader = None if isinstance(engine, EngineClient) else engine
    if loader is not None and not served_model_name:
        raise ValueError("served_model_name is required when the engine is loaded in the background")
    name = served_model_name or engine.config.model.path  # type: ignore[union-attr]
    state = ServerState(name, api_key, max_request_body_bytes)
    state.loras = lora_modules
    if chat_settings is not None:
        state.chat = chat_settings
    state.metrics = Metrics(name, lambda: state.engine.snapshot() if state.engine is not None else None)

    def attach(e: AsyncEngine) -> None:
        e.stat_loggers.append(state.metrics)  # type: ignore[arg-type]
        state.chat.resolve(e.tokenizer)
        e.start()
        state.token_bytes = TokenBytes(e.tokenizer)
        state.engine = e
        if on_ready is not None:
            on_ready(e)

    def load() -> None:
        try:
            attach(loader())  # type: ignore[misc]
        except BaseException as e:  # reported by /health and every route
            logger.exception("loading the model failed")
            state.load_error = e

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if loader is not None and state.engine is None and state.load_error is None:
            threading.Thread(target=load, name="lmserve-load", daemon=True).start()
        async with AsyncExitStack() as stack:
            for frontend in frontends:
                await stack.enter_async_context(frontend(state))
            yield
        if loader is not None and state.engine is not None:  # an engine passed in belongs to the caller
            await asyncio.to_thread(state.engine.shutdown)

    app = FastAPI(title="lmserve", version="0.1.0", lifespan=lifespan)
    app.state.lmserve = state
    if loader is None:
        attach(engine)  # type: ignore[arg-type]
    app.add_middleware(GuardMiddleware, state=state)
    add_exception_handlers(app, state)
    add_routes(app, state)
    add_responses_routes(app, state, response_store if response_store is not None else ResponseStore())
    add_messages_routes(app, state)
    add_ollama_routes(app, state)
    add_pooling_routes(app, state)
    add_kv_info_route(app, state)
    add_lora_routes(app, state)
    add_web_routes(app, state)
    return app
