"""The OpenAI-compatible HTTP server: `build_app(engine)` → a FastAPI app.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, POST /tokenize, POST /detokenize,
GET /health, GET /metrics; the web pages and the dashboard feed (dashboard.py). Every refusal is an
OpenAI-shaped error body (errors.py): 400 for bad input naming the field, 401 without the API key, 404 for an
unknown model, 413 for an oversized body, 429 with Retry-After when too many requests wait for the full engine
(async_engine), 503 while loading or after the engine loop died, 500 only for our own failures. A client that
disconnects (streaming or not) aborts its engine requests at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lmserve.core.outputs import CompletionOutput, RequestOutput
from lmserve.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream
from lmserve.engine.token_bytes import TextOffsets, TokenBytes
from lmserve.entrypoints.openai import logprobs as lp_fmt
from lmserve.entrypoints.openai import protocol as p
from lmserve.entrypoints.openai import tools
from lmserve.entrypoints.openai.dashboard import PAGES, add_web_routes
from lmserve.entrypoints.openai.errors import APIError, bad_request, from_validation_errors, from_value_error
from lmserve.metrics import Metrics
from lmserve.sampling_params import SamplingParams
from lmserve.structured_output import GrammarError

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 2**20
MAX_SEQS_PER_REQUEST = 256  # n × number of prompts
OPEN_PATHS = ("/health", "/metrics", "/docs", "/redoc", "/openapi.json", "/static/")
OPEN_PAGES = frozenset(PAGES)  # exact paths: the web pages, which ask for the key themselves
LOADING_RETRY_AFTER_S = 5


@dataclass
class ServerState:
    served_model_name: str
    api_key: str | None
    max_request_body_bytes: int
    engine: AsyncEngine | None = None
    token_bytes: TokenBytes | None = None  # of the engine's tokenizer, for logprobs
    metrics: Metrics | None = None
    load_error: BaseException | None = None

    def ready_engine(self) -> AsyncEngine:
        engine = self.engine
        if engine is None:
            if self.load_error is not None:
                raise APIError(503, f"the model failed to load: {self.load_error}", code="load_failed")
            raise APIError(
                503,
                "the model is still loading",
                code="loading",
                headers={"Retry-After": str(LOADING_RETRY_AFTER_S)},
            )
        if engine.dead_error is not None:
            raise APIError(503, f"the engine loop is not running: {engine.dead_error}", code="engine_dead")
        return engine


def build_app(
    engine: AsyncEngine | Callable[[], AsyncEngine],
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    on_ready: Callable[[AsyncEngine], None] | None = None,
    frontends: Sequence[Callable[[ServerState], AbstractAsyncContextManager[Any]]] = (),
) -> FastAPI:
    """The server for `engine`: a started-or-not engine client (AsyncEngine, or EngineCoreClient with the
    engine in separate processes), or a loader called in a background thread at start-up (then /health is
    503 until it returns; `served_model_name` is required). The engine is started here (or after loading);
    a loaded engine is shut down when the app's lifespan ends, one passed in is left to its owner. `frontends`
    (e.g. the gRPC server) run for the app's lifespan on its event loop, serving the same ServerState; they
    stop before the engine does."""
    loader = None if hasattr(engine, "add_request") else engine
    if loader is not None and not served_model_name:
        raise ValueError("served_model_name is required when the engine is loaded in the background")
    name = served_model_name or engine.config.model.path  # type: ignore[union-attr]
    state = ServerState(name, api_key, max_request_body_bytes)
    state.metrics = Metrics(name, lambda: state.engine.snapshot() if state.engine is not None else None)

    def attach(e: AsyncEngine) -> None:
        e.stat_loggers.append(state.metrics)  # type: ignore[arg-type]
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
    app.add_middleware(_GuardMiddleware, state=state)
    _add_exception_handlers(app, state)
    _add_routes(app, state)
    add_web_routes(app, state)
    return app


# ---- middleware: API key and body size ----------------------------------------------------------


class _GuardMiddleware:
    """Checks `Authorization: Bearer KEY` (when a key is set; the scheme in any case, RFC 7235), caps the
    request body (413), and answers an unhandled exception with a 500 body itself: raised further, it would
    make the HTTP server drop the keep-alive connection under the client's next request."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        key = self.state.api_key
        if key and not (scope["path"].startswith(OPEN_PATHS) or scope["path"] in OPEN_PAGES):
            if not bearer_ok(headers.get(b"authorization", b"").decode("latin-1"), key):
                err = APIError(
                    401,
                    "missing or invalid API key: send 'Authorization: Bearer KEY'",
                    code="invalid_api_key",
                )
                err.headers = {"WWW-Authenticate": "Bearer"}
                await err.response()(scope, receive, send)
                return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self._call_app(scope, receive, send)
            return
        limit = self.state.max_request_body_bytes
        too_large = APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await too_large.response()(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                await too_large.response()(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: waits for http.disconnect

        await self._call_app(scope, replay, send)

    async def _call_app(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            if started:
                raise  # half a response went out: only closing the connection can end it
            logger.exception("unhandled error on %s", scope.get("path"))
            await _internal_error(e).response()(scope, receive, send)


def bearer_ok(authorization: str, key: str) -> bool:
    """Whether an `Authorization` value is `Bearer KEY` (scheme case-insensitive), compared in constant time."""
    scheme, _, credentials = authorization.partition(" ")
    given = credentials.strip(" ").encode("latin-1", "replace") if scheme.lower() == "bearer" else b""
    return hmac.compare_digest(given, key.encode())


def _internal_error(e: Exception) -> APIError:
    return APIError(500, f"internal server error: {type(e).__name__}: {e}")


def _add_exception_handlers(app: FastAPI, state: ServerState) -> None:
    def count(status: int) -> None:
        reason = {429: "queue_full", 503: "unavailable", 413: "too_large", 401: "unauthorized"}.get(status)
        if reason is None and 400 <= status < 500:
            reason = "invalid_request"
        if reason is not None and state.metrics is not None:
            state.metrics.on_request_rejected(reason)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        count(exc.status_code)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        count(400)
        return from_validation_errors(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))
        return err.response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return _internal_error(exc).response()


# ---- routes -------------------------------------------------------------------------------------


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        engine = state.engine
        if engine is None:
            status = "load_failed" if state.load_error is not None else "loading"
            return JSONResponse({"status": status}, status_code=503)
        if engine.dead_error is not None:
            return JSONResponse({"status": "dead", "error": str(engine.dead_error)}, status_code=503)
        degraded = getattr(engine, "degraded_error", None)  # some of several engine cores died
        if degraded is not None:
            return JSONResponse({"status": "degraded", "error": degraded})
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = state.metrics.render()  # type: ignore[union-attr]
        return Response(body, media_type=content_type)

    @app.get("/v1/models", response_model=p.ModelList)
    async def models() -> p.ModelList:
        engine = state.ready_engine()
        card = p.ModelCard(
            id=state.served_model_name,
            created=int(time.time()),
            root=engine.config.model.path,
            max_model_len=engine.config.scheduler.max_model_len,
        )
        return p.ModelList(data=[card])

    @app.post("/tokenize", response_model=p.TokenizeResponse)
    async def tokenize(body: p.TokenizeRequest) -> p.TokenizeResponse:
        engine = state.ready_engine()
        _check_model(state, body.model)
        ids = _tokenize(engine, body)
        return p.TokenizeResponse(
            count=len(ids), max_model_len=engine.config.scheduler.max_model_len, tokens=ids
        )

    @app.post("/detokenize", response_model=p.DetokenizeResponse)
    async def detokenize(body: p.DetokenizeRequest) -> p.DetokenizeResponse:
        engine = state.ready_engine()
        _check_model(state, body.model)
        return p.DetokenizeResponse(prompt=_detokenize(engine, body.tokens))

    @app.post("/v1/completions", response_model=p.CompletionResponse)
    async def completions(body: p.CompletionRequest, request: Request) -> Response:
        engine = state.ready_engine()
        _check_model(state, body.model)
        params = _sampling_params(engine, body, {})
        params, _ = await _constrain(engine, body, params)
        prompts = _completion_prompts(engine, body.prompt)
        if len(prompts) * params.actual_best_of > MAX_SEQS_PER_REQUEST:
            raise bad_request(f"n × number of prompts must be at most {MAX_SEQS_PER_REQUEST}", "n")
        _check_lengths(engine, prompts, params, "max_tokens")
        gen = _Generation(state, engine, f"cmpl-{uuid.uuid4().hex}", prompts, params, body)
        if body.echo:
            gen.echo_texts = lp_fmt.prompt_texts(body.prompt)
        return await gen.respond(request)

    @app.post("/v1/chat/completions", response_model=p.ChatCompletionResponse)
    async def chat_completions(body: p.ChatCompletionRequest, request: Request) -> Response:
        engine = state.ready_engine()
        _check_model(state, body.model)
        max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        params = _sampling_params(engine, body, {"max_tokens": max_param, "logprobs": "top_logprobs"})
        if not body.messages:
            raise bad_request("messages must be a non-empty list", "messages")
        params, constraint = await _constrain(engine, body, params)
        plan = constraint.tools
        shown = plan.tools if plan is not None and tools.template_supports_tools(engine.tokenizer) else None
        prompts = [_render_chat(engine, body.messages, body.add_generation_prompt, shown)]
        _check_lengths(engine, prompts, params, max_param)
        gen = _Generation(state, engine, f"chatcmpl-{uuid.uuid4().hex}", prompts, params, body)
        if plan is not None:
            gen.tool_calls = tools.ToolCallFormatter(plan)
        return await gen.respond(request)


def _tokenize(engine: AsyncEngine, body: p.TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    if body.messages is not None:
        return _render_chat(engine, body.messages, body.add_generation_prompt)
    return _encode(engine.tokenizer, body.prompt, "prompt", add_special_tokens=body.add_special_tokens)


def _detokenize(engine: AsyncEngine, tokens: list[int]) -> str:
    vocab = engine.config.model.vocab_size
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"tokens out of range [0, {vocab}): {bad[:5]}", "tokens")
    return engine.tokenizer.decode(tokens)


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.served_model_name:
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {state.served_model_name!r}",
            param="model",
            code="model_not_found",
        )


def _sampling_params(
    engine: AsyncEngine, body: p.CompletionRequest | p.ChatCompletionRequest, rename: dict[str, str]
) -> SamplingParams:
    try:
        params = p.to_sampling_params(body, engine.generation_defaults)
    except p.RequestError as e:
        raise bad_request(str(e), e.param) from None
    except ValueError as e:
        raise from_value_error(e, rename) from None
    vocab = engine.config.model.vocab_size
    bad_bias = [t for t in params.logit_bias or {} if t >= vocab]
    if bad_bias:
        raise bad_request(
            f"logit_bias keys must be token ids < {vocab} (the vocabulary), got {bad_bias[:5]}", "logit_bias"
        )
    bad_stop = [t for t in params.stop_token_ids if t >= vocab]
    if bad_stop:
        raise bad_request(
            f"stop_token_ids must be < {vocab} (the vocabulary), got {bad_stop[:5]}", "stop_token_ids"
        )
    return params


async def _constrain(
    engine: AsyncEngine, body: p.CompletionRequest | p.ChatCompletionRequest, params: SamplingParams
) -> tuple[SamplingParams, tools.Constraint]:
    """The request's output constraint (response_format, structured_outputs, guided_*, tools) in `params`, its
    grammar compiled (or found cached) off the event loop: a schema the library refuses is a 400 naming the field."""
    try:
        constraint = tools.constraint_of(body, engine.tokenizer)
    except p.RequestError as e:
        raise bad_request(str(e), e.param) from None
    so = constraint.structured_outputs
    if so is None:
        return params, constraint
    try:
        params = dataclasses.replace(params, structured_outputs=so)
    except ValueError as e:
        raise from_value_error(e) from None
    try:
        await engine.compile_grammar(so)
    except GrammarError as e:
        raise bad_request(
            f"{constraint.param}: refused by the grammar compiler: {e.reason}", constraint.param
        ) from None
    return params, constraint


def _completion_prompts(engine: AsyncEngine, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif not prompt:
        raise bad_request("prompt is empty: give a string, a list of strings or token ids", "prompt")
    elif isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if len(items) > p.MAX_PROMPTS:
        raise bad_request(f"at most {p.MAX_PROMPTS} prompts per request, got {len(items)}", "prompt")
    out = []
    for i, item in enumerate(items):
        field = "prompt" if len(items) == 1 else f"prompt[{i}]"
        out.append(_user_input(field, engine.tokenize, item))
    return out


def _encode(tokenizer: Any, text: str, field: str, **kwargs: Any) -> list[int]:
    return _user_input(field, tokenizer.encode, text, **kwargs)


def _user_input(field: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args) on request text (tokenizer, chat template): whatever it raises is the input's fault → 400."""
    try:
        return fn(*args, **kwargs)
    except APIError:
        raise
    except Exception as e:
        raise bad_request(f"{field}: cannot be tokenized: {type(e).__name__}: {e}", field) from None


def _render_chat(
    engine: AsyncEngine,
    messages: list[p.ChatMessage],
    add_generation_prompt: bool,
    tool_list: list[dict[str, Any]] | None = None,
) -> list[int]:
    tok = engine.tokenizer
    if not getattr(tok, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    if not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    conversation = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls is not None:
            msg["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        conversation.append(msg)
    extra = {"tools": tool_list} if tool_list else {}
    try:
        text = tok.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )
    except Exception as e:  # the template's own checks (role order, ...) raise jinja errors
        raise bad_request(f"messages: the chat template rejected them: {e}", "messages") from None
    return _encode(tok, text, "messages", add_special_tokens=False)


def _check_lengths(
    engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams, max_param: str
) -> None:
    max_model_len = engine.config.scheduler.max_model_len
    for i, ids in enumerate(prompts):
        where = f"prompt[{i}]: " if len(prompts) > 1 else ""
        try:
            engine.validate(ids, params)
        except ValueError as e:
            err = from_value_error(e, {"max_tokens": max_param})
            err.message = where + err.message
            raise err from None
        if params.max_tokens is not None and len(ids) + params.max_tokens > max_model_len:
            raise bad_request(
                f"{where}prompt ({len(ids)} tokens) + {max_param} ({params.max_tokens}) = "
                f"{len(ids) + params.max_tokens} tokens exceeds max_model_len ({max_model_len}); "
                f"lower {max_param} to at most {max_model_len - len(ids)}",
                max_param,
            )


# ---- one generation request: start, stream or collect, format -----------------------------------


class _ClientGone(Exception):
    pass


class _Generation:
    def __init__(
        self,
        state: ServerState,
        engine: AsyncEngine,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        body: p.CompletionRequest | p.ChatCompletionRequest,
    ) -> None:
        self.state = state
        self.engine = engine
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.body = body
        self.chat = isinstance(body, p.ChatCompletionRequest)
        self.model = state.served_model_name
        self.created = int(time.time())
        self.streams: list[RequestStream] = []
        self.tool_calls: tools.ToolCallFormatter | None = None  # chat with tools: formats tool_calls
        # completions with echo: per prompt its text as sent (None for token ids), and what echo puts in front
        self.echo_texts: list[str | None] | None = None
        self._echoed: dict[int, lp_fmt.EchoedPrompt] = {}

    # -- start

    def _start(self) -> None:
        try:
            for i, ids in enumerate(self.prompts):
                self.streams.append(self.engine.add_request(f"{self.request_id}-{i}", ids, self.params))
        except QueueFullError as e:
            self.abort()
            raise APIError(
                429,
                str(e),
                code="queue_full",
                error_type="rate_limit_error",
                headers={"Retry-After": str(e.retry_after_s)},
            ) from None
        except EngineDeadError as e:
            self.abort()
            raise APIError(503, f"the engine loop is not running: {e}", code="engine_dead") from None
        except ValueError as e:
            self.abort()
            raise from_value_error(e) from None

    def abort(self) -> None:
        for s in self.streams:
            s.abort()

    async def respond(self, request: Request) -> Response:
        self._start()
        if self.body.stream:
            return _SSEResponse(self._events(), on_close=self.abort)
        try:
            finals = await _cancel_on_disconnect(request, self._collect())
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it; the requests are aborted
        finally:
            self.abort()
        return Response(self._final_response(finals).model_dump_json(), media_type="application/json")

    # -- merged outputs of all prompts

    async def _outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from every stream as they arrive; engine failures become APIError."""
        try:
            if len(self.streams) == 1:
                async for out in self.streams[0]:
                    yield 0, out
                return
            queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

            async def pump(i: int, stream: RequestStream) -> None:
                try:
                    async for out in stream:
                        queue.put_nowait((i, out))
                    queue.put_nowait((i, None))
                except Exception as e:
                    queue.put_nowait((i, e))

            tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
            try:
                remaining = len(tasks)
                while remaining:
                    i, item = await queue.get()
                    if item is None:
                        remaining -= 1
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        yield i, item
            finally:
                for t in tasks:
                    t.cancel()
        except EngineDeadError as e:
            raise APIError(
                500, f"the engine loop died while serving this request: {e}", code="engine_dead"
            ) from e
        except ValueError as e:
            raise from_value_error(e) from e
        except APIError:
            raise
        except Exception as e:
            logger.exception("request %s failed", self.request_id)
            raise APIError(500, f"request failed in the engine: {type(e).__name__}: {e}") from e
        finally:
            self.abort()

    async def _collect(self) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(self.streams)
        async for i, out in self._outputs():
            finals[i] = out
        assert all(f is not None and f.finished for f in finals), "stream ended before its final output"
        return finals  # type: ignore[return-value]

    # -- formatting

    def _usage(self, finals: Iterable[RequestOutput | None]) -> p.Usage:
        finals = [f for f in finals if f is not None]
        prompt_tokens = sum(len(ids) for ids in self.prompts)
        completion_tokens = sum(len(c.token_ids) for f in finals for c in f.outputs)
        cached = sum(f.num_cached_tokens for f in finals)
        return p.Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached),
        )

    def _final_response(self, finals: list[RequestOutput]) -> p.CompletionResponse | p.ChatCompletionResponse:
        n = self.params.n
        pairs = [(i * n + c.index, c) for i, f in enumerate(finals) for c in f.outputs]
        pairs.sort(key=lambda ic: ic[0])
        usage = self._usage(finals)
        if self.chat:
            choices = []
            for idx, c in pairs:
                message, reason = p.AssistantMessage(content=c.text), _reason(c)
                if self.tool_calls is not None:
                    message, reason = self.tool_calls.message(c)
                choices.append(
                    p.ChatChoice(
                        index=idx,
                        message=message,
                        logprobs=self._chat_logprobs(c.logprobs),
                        finish_reason=reason,
                        stop_reason=c.stop_reason,
                    )
                )
            return p.ChatCompletionResponse(
                id=self.request_id,
                created=self.created,
                model=self.model,
                choices=choices,
                usage=usage,
                prompt_logprobs=self._prompt_logprobs(finals[0]),
            )
        choices = [self._completion_choice(idx, c, finals[idx // n], c.text, c.logprobs) for idx, c in pairs]
        return p.CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _text_offsets(self) -> TextOffsets:
        assert self.state.token_bytes is not None, "token_bytes is set with the engine"
        return TextOffsets(self.state.token_bytes, self.params.skip_special_tokens)

    def _completion_choice(
        self,
        idx: int,
        c: CompletionOutput,
        final: RequestOutput,
        text: str,
        entries: list[Any] | None,
        offsets: TextOffsets | None = None,
        first: bool = True,
    ) -> p.CompletionChoice:
        """A /v1/completions choice (or a stream's chunk of it: `text` / `entries` its new part, `offsets` the
        choice's, kept across chunks); the choice's first part carries the echoed prompt and prompt_logprobs."""
        echo = self._echo(idx // self.params.n, final)
        base = len(echo.text) if echo is not None else 0  # the completion's offsets count the echoed prompt
        logprobs = self._completion_logprobs(entries, offsets or self._text_offsets(), base)
        if echo is not None and first:
            text, logprobs = echo.text + text, lp_fmt.joined(echo.logprobs, logprobs)
        return p.CompletionChoice(
            index=idx,
            text=text,
            logprobs=logprobs,
            finish_reason=_reason(c) if c.finished else None,
            stop_reason=c.stop_reason if c.finished else None,
            prompt_logprobs=self._prompt_logprobs(final) if first else None,
        )

    def _echo(self, i: int, final: RequestOutput) -> lp_fmt.EchoedPrompt | None:
        """Prompt i's echo (built once, shared by its choices), or None without echo."""
        if self.echo_texts is None:
            return None
        if i not in self._echoed:
            assert self.state.token_bytes is not None, "token_bytes is set with the engine"
            num_top = self.body.logprobs if isinstance(self.body, p.CompletionRequest) else None
            tb, skip = self.state.token_bytes, self.params.skip_special_tokens
            prompt_lp = final.prompt_logprobs
            self._echoed[i] = lp_fmt.echo_prompt(tb, self.echo_texts[i], self.prompts[i], prompt_lp, num_top, skip)
        return self._echoed[i]

    def _prompt_logprobs(self, final: RequestOutput) -> p.PromptLogprobs | None:
        k = self.body.prompt_logprobs
        if k is None:
            return None
        assert self.state.token_bytes is not None, "token_bytes is set with the engine"
        return lp_fmt.prompt_logprobs_view(self.state.token_bytes, final.prompt_logprobs, k)

    def _completion_logprobs(
        self, entries: list[Any] | None, offsets: TextOffsets, base: int = 0
    ) -> p.CompletionLogprobs | None:
        """`offsets` carries the choice's text position from one call to the next (one per choice)."""
        if entries is None:
            return None
        assert self.state.token_bytes is not None, "token_bytes is set with the engine"
        return lp_fmt.completion_logprobs(self.state.token_bytes, entries, offsets, base=base)

    def _chat_logprobs(self, entries: list[Any] | None) -> p.ChatLogprobs | None:
        if entries is None:
            return None
        tb = self.state.token_bytes
        assert tb is not None, "token_bytes is set with the engine"
        content = []
        for e in entries:
            if e is None:
                continue
            top = [
                p.TopLogprob(token=tb.token_text(t), logprob=_finite(lp), bytes=list(tb.bytes_of(t)))
                for t, lp in e.top_logprobs
            ]
            content.append(
                p.ChatTokenLogprob(
                    token=tb.token_text(e.token_id),
                    logprob=_finite(e.logprob),
                    bytes=list(tb.bytes_of(e.token_id)),
                    top_logprobs=top,
                )
            )
        return p.ChatLogprobs(content=content)

    # -- streaming

    async def _events(self) -> AsyncIterator[str]:
        n = self.params.n
        latest: list[RequestOutput | None] = [None] * len(self.streams)
        finished: set[int] = set()
        offsets: dict[int, TextOffsets] = {}  # per choice
        prompt_lp_sent = False
        try:
            if self.chat:  # the role goes out at once, before any token
                yield "".join(
                    _sse(
                        self._chunk(
                            [p.ChatChunkChoice(index=i, delta=p.DeltaMessage(role="assistant", content=""))]
                        )
                    )
                    for i in range(len(self.streams) * n)
                )
            async for i, out in self._outputs():
                latest[i] = out
                events = []  # one event per choice that changed this step; one write for all of them
                for c in out.outputs:
                    idx = i * n + c.index
                    if not (c.delta_text or c.delta_token_ids) and (not c.finished or idx in finished):
                        continue
                    if c.finished:
                        finished.add(idx)
                    if self.chat and self.tool_calls is not None:  # none while a call is held back
                        choices = self.tool_calls.chunk_choices(idx, c, self._chat_logprobs)
                    else:
                        choices = [self._chunk_choice(idx, c, offsets, out)]
                    for choice in choices:
                        prompt_lp = None
                        if self.chat and not prompt_lp_sent:  # chat: in the first chunk with output
                            prompt_lp, prompt_lp_sent = self._prompt_logprobs(out), True
                        events.append(_sse(self._chunk([choice], prompt_logprobs=prompt_lp)))
                if events:
                    yield "".join(events)
            opts = self.body.stream_options
            if opts is not None and opts.include_usage:
                yield _sse(self._chunk([], usage=self._usage(latest)))
        except APIError as e:
            yield _sse_json(e.body())
        except Exception as e:  # the stream has started: report in-band, never drop silently
            logger.exception("stream %s failed", self.request_id)
            yield _sse_json(APIError(500, f"internal server error: {type(e).__name__}: {e}").body())
        yield "data: [DONE]\n\n"

    def _chunk_choice(self, idx: int, c: CompletionOutput, offsets: dict[int, TextOffsets], out: RequestOutput) -> Any:
        n_new = len(c.delta_token_ids)
        delta_lp = c.logprobs[len(c.logprobs) - n_new :] if c.logprobs is not None else None
        reason = _reason(c) if c.finished else None
        stop_reason = c.stop_reason if c.finished else None
        if self.chat:
            return p.ChatChunkChoice(
                index=idx,
                delta=p.DeltaMessage(content=c.delta_text),
                logprobs=self._chat_logprobs(delta_lp),
                finish_reason=reason,
                stop_reason=stop_reason,
            )
        first = idx not in offsets
        if first:
            offsets[idx] = self._text_offsets()
        return self._completion_choice(idx, c, out, c.delta_text, delta_lp, offsets[idx], first)

    def _chunk(
        self, choices: list[Any], usage: p.Usage | None = None, prompt_logprobs: p.PromptLogprobs | None = None
    ) -> Any:
        cls = p.ChatCompletionChunk if self.chat else p.CompletionChunk
        chunk = cls(id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage)
        return chunk if prompt_logprobs is None else chunk.model_copy(update={"prompt_logprobs": prompt_logprobs})


def _reason(c: CompletionOutput) -> str | None:
    return None if c.finish_reason is None else str(c.finish_reason)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def _sse(model: Any) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def _sse_json(obj: dict[str, Any]) -> str:
    import json

    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _cancel_on_disconnect(request: Request, coro: Any) -> Any:
    """Await `coro`, cancelling it if the client disconnects first (then raise _ClientGone)."""
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
    raise _ClientGone


class _SSEResponse(StreamingResponse):
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
