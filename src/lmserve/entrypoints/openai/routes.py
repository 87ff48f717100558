"""The API's routes: GET /health, GET /metrics, GET /v1/models, POST /tokenize, POST /detokenize, POST
/reset_prefix_cache, and the two generation endpoints, whose work is serving_completion's and serving_chat's (the
web pages and the dashboard feed are dashboard.py's)."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lmserve.entrypoints.openai import protocol as p
from lmserve.entrypoints.openai import request_inputs as inputs
from lmserve.entrypoints.openai.serving_chat import create_chat_completion
from lmserve.entrypoints.openai.serving_completion import create_completion
from lmserve.entrypoints.openai.state import ServerState, engine_health


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        engine = state.engine
        if engine is None:
            status = "load_failed" if state.load_error is not None else "loading"
            return JSONResponse({"status": status}, status_code=503)
        code, body = engine_health(engine)
        return JSONResponse(body, status_code=code)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = state.metrics.render()  # type: ignore[union-attr]
        return Response(body, media_type=content_type)

    @app.get("/v1/models", response_model=p.ModelList)
    async def models() -> p.ModelList:
        engine = state.ready_engine()
        created, max_len = int(time.time()), engine.config.scheduler.max_model_len
        card = p.ModelCard(id=state.served_model_name, created=created, root=engine.config.model.path,
                           max_model_len=max_len)  # fmt: skip
        adapters = [] if state.loras is None else list(state.loras.by_name.values())
        cards = [p.ModelCard(id=a.lora_name, created=created, root=a.lora_path, parent=state.served_model_name,
                             max_model_len=max_len) for a in adapters]  # fmt: skip
        return p.ModelList(data=[card, *cards])

    @app.post("/tokenize", response_model=p.TokenizeResponse)
    async def tokenize(body: p.TokenizeRequest) -> p.TokenizeResponse:
        engine = state.ready_engine()
        inputs.check_model(state, body.model)
        ids = inputs.tokenize_body(engine, body)
        return p.TokenizeResponse(
            count=len(ids), max_model_len=engine.config.scheduler.max_model_len, tokens=ids
        )

    @app.post("/detokenize", response_model=p.DetokenizeResponse)
    async def detokenize(body: p.DetokenizeRequest) -> p.DetokenizeResponse:
        engine = state.ready_engine()
        inputs.check_model(state, body.model)
        return p.DetokenizeResponse(prompt=inputs.detokenize_tokens(engine, body.tokens))

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(include_disk: bool = False) -> Response:
        """Every engine forgets its cached prefixes before any request sent after the answer (vLLM's endpoint of
        the name; benchmarks call it between runs of the same prompts). Running requests are not disturbed.
        `?include_disk=true`: the KV disk tier's blocks are deleted too."""
        state.ready_engine().reset_prefix_cache(include_disk)
        return Response(status_code=200)

    @app.post("/v1/completions", response_model=p.CompletionResponse)
    async def completions(body: p.CompletionRequest, request: Request) -> Response:
        return await create_completion(state, body, request)

    @app.post("/v1/chat/completions", response_model=p.ChatCompletionResponse)
    async def chat_completions(body: p.ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(state, body, request)
