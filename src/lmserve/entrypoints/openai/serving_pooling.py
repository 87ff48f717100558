"""The pooling endpoints, on a server running the pooling runner: POST /v1/embeddings (OpenAI's), /api/embed
(Ollama's), /score (vLLM's) and /rerank, /v1/rerank (Jina's / Cohere's). Every input is one engine request (a
prefill returning its pooled hidden state), batched by the scheduler like any other. A score is the cosine
similarity of two embeddings, or, on a yes/no scorer (--pooler-config score_tokens), p(yes) of query + document.
On a generate server each answers 400 naming the runner."""

from __future__ import annotations

import base64
import math
import struct
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lmserve.core.outputs import RequestOutput
from lmserve.engine.async_engine import AsyncEngine
from lmserve.engine.pooling import pooling_params
from lmserve.entrypoints.openai import protocol_ollama as po
from lmserve.entrypoints.openai import protocol_pooling as pp
from lmserve.entrypoints.openai import request_inputs as inputs
from lmserve.entrypoints.openai.errors import APIError, bad_request, from_value_error
from lmserve.entrypoints.openai.generation import Generation
from lmserve.entrypoints.openai.serving_ollama import NS, answered, model_name, parse
from lmserve.entrypoints.openai.sse import ClientGone, cancel_on_disconnect
from lmserve.entrypoints.openai.state import ServerState
from lmserve.sampling_params import SamplingParams


def start_pooling(state: ServerState, prompts: list[list[int]], dimensions: int | None = None) -> Generation:
    """`prompts` started as pooling requests (their finished outputs: `await gen.collect()`; then gen.abort())."""
    engine = state.ready_engine()
    try:
        params = SamplingParams(max_tokens=0, pooling=pooling_params(engine.config, engine.tokenizer, dimensions))
    except ValueError as e:
        raise from_value_error(e) from None
    inputs.check_lengths(engine, prompts, params, "input")
    gen = Generation(state, engine, f"pool-{uuid.uuid4().hex}", prompts, params, pp.PoolingBody())  # type: ignore
    gen.start()
    return gen


async def pool(
    state: ServerState, request: Request, prompts: list[list[int]], dimensions: int | None = None
) -> list[RequestOutput] | Response:
    """The finished outputs of `prompts` as pooling requests (or the 499 of a client that left)."""
    gen = start_pooling(state, prompts, dimensions)
    try:
        return await cancel_on_disconnect(request, gen.collect())
    except ClientGone:
        return Response(status_code=499)
    finally:
        gen.abort()


def tokenized(engine: AsyncEngine, items: list[str | list[int]], field: str) -> list[list[int]]:
    if not items:
        raise bad_request(f"{field} must not be empty", field)
    if len(items) > pp.MAX_INPUTS:
        raise bad_request(f"{field}: at most {pp.MAX_INPUTS} inputs per request, got {len(items)}", field)
    return [inputs.user_input(f"{field}[{i}]", engine.tokenize, x) for i, x in enumerate(items)]


def usage(prompts: list[list[int]]) -> dict[str, int]:
    n = sum(map(len, prompts))
    return {"prompt_tokens": n, "total_tokens": n}


def encode_base64(vec: list[float]) -> str:
    """OpenAI's base64 encoding: the float32 values, little-endian."""
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0


async def scores(state: ServerState, request: Request, queries: list[str], docs: list[str]) -> Any:
    """(the score of each (query, document) pair, the prompts computed) or a 499 Response."""
    engine = state.ready_engine()
    pooler = engine.config.pooler
    if pooler is not None and pooler.is_scorer:  # the pair in one prompt: p(the last score token) at its end
        pairs = tokenized(engine, [q + d for q, d in zip(queries, docs, strict=True)], "documents")
        outs = await pool(state, request, pairs)
        if isinstance(outs, Response):
            return outs
        return [o.pooled[-1] for o in outs], pairs  # type: ignore[index]
    unique = list(dict.fromkeys(queries))
    prompts = tokenized(engine, [*unique, *docs], "documents")
    outs = await pool(state, request, prompts)
    if isinstance(outs, Response):
        return outs
    vecs = {q: outs[i].pooled for i, q in enumerate(unique)}
    return [cosine(vecs[q], outs[len(unique) + i].pooled) for i, q in enumerate(queries)], prompts  # type: ignore


async def create_embeddings(state: ServerState, body: pp.EmbeddingRequest, request: Request) -> Response:
    engine = state.ready_engine()
    inputs.check_model(state, body.model)
    prompts = tokenized(engine, pp.embedding_inputs(body.input), "input")
    try:
        outs = await pool(state, request, prompts, body.dimensions)
    except APIError as e:
        if e.message.startswith("dimensions"):
            e.param = "dimensions"
        raise
    if isinstance(outs, Response):
        return outs
    encode = encode_base64 if body.encoding_format == "base64" else (lambda v: v)
    data = [{"object": "embedding", "index": i, "embedding": encode(o.pooled)} for i, o in enumerate(outs)]
    return JSONResponse({"object": "list", "data": data, "model": body.model or state.served_model_name,
                         "usage": usage(prompts)})  # fmt: skip


async def create_score(state: ServerState, body: pp.ScoreRequest, request: Request) -> Response:
    inputs.check_model(state, body.model)
    t1 = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    t2 = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if len(t1) == 1:
        t1 = t1 * len(t2)
    if len(t1) != len(t2) or not t2:
        raise bad_request(f"text_1 ({len(t1)}) and text_2 ({len(t2)}): one text_1, or as many as text_2", "text_2")
    got = await scores(state, request, t1, t2)
    if isinstance(got, Response):
        return got
    values, prompts = got
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(values)]
    model = body.model or state.served_model_name
    return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": model, "data": data, "usage": usage(prompts)})  # fmt: skip


async def create_rerank(state: ServerState, body: pp.RerankRequest, request: Request) -> Response:
    inputs.check_model(state, body.model)
    docs = body.texts()
    if not docs:
        raise bad_request("documents must not be empty", "documents")
    if body.top_n is not None and body.top_n < 1:
        raise bad_request(f"top_n must be >= 1, got {body.top_n}", "top_n")
    got = await scores(state, request, [body.query] * len(docs), docs)
    if isinstance(got, Response):
        return got
    values, prompts = got
    order = sorted(range(len(docs)), key=lambda i: -values[i])[: body.top_n]
    results = []
    for i in order:
        r: dict[str, Any] = {"index": i, "relevance_score": values[i]}
        if body.return_documents:
            r["document"] = {"text": docs[i]}
        results.append(r)
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": body.model or state.served_model_name,
                         "usage": {"total_tokens": usage(prompts)["total_tokens"]}, "results": results})  # fmt: skip


async def api_embed(state: ServerState, request: Request) -> Response:
    """Ollama's /api/embed: `truncate` (default true) keeps the first max_model_len tokens of a longer input."""
    started = time.time()
    body = await parse(po.EmbedRequest, request)
    model_name(state, body.model)
    engine = state.ready_engine()
    items: list[str | list[int]] = [body.input] if isinstance(body.input, str) else list(body.input)
    prompts = tokenized(engine, items, "input")
    if body.truncate:
        prompts = [ids[: engine.config.scheduler.max_model_len] for ids in prompts]
    outs = await pool(state, request, prompts, body.dimensions)
    if isinstance(outs, Response):
        return outs
    return JSONResponse({"model": body.model, "embeddings": [o.pooled for o in outs],
                         "total_duration": int((time.time() - started) * NS), "load_duration": 0,
                         "prompt_eval_count": sum(map(len, prompts))})  # fmt: skip


def add_pooling_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(body: pp.EmbeddingRequest, request: Request) -> Response:
        return await create_embeddings(state, body, request)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(body: pp.ScoreRequest, request: Request) -> Response:
        return await create_score(state, body, request)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    async def rerank(body: pp.RerankRequest, request: Request) -> Response:
        return await create_rerank(state, body, request)

    @app.post("/api/embed")
    async def embed(request: Request) -> Response:
        return await answered(state, lambda: api_embed(state, request))
