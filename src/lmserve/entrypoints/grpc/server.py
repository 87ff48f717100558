"""`lmserve.v1.Generation` over gRPC (grpc.aio), on the HTTP server's event loop, engine and ServerState.

GenerationServicer validates a request with the HTTP server's own code (as POST /v1/completions) and maps its
APIError to a gRPC status; grpc_frontend also serves grpc.health.v1.Health and server reflection. See docs/grpc.md.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import grpc
import pydantic
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from lmserve.core.outputs import CompletionOutput, RequestOutput
from lmserve.entrypoints.openai import protocol as p
from lmserve.entrypoints.openai import request_inputs as inputs
from lmserve.entrypoints.openai import serving_pooling as pooling
from lmserve.entrypoints.openai.errors import APIError, from_validation_errors
from lmserve.entrypoints.openai.logprobs import prompt_texts
from lmserve.entrypoints.openai.middleware import bearer_ok
from lmserve.entrypoints.openai.serving_chat import tokens_upto
from lmserve.entrypoints.openai.serving_completion import CompletionGeneration
from lmserve.entrypoints.openai.state import ServerState
from lmserve.grpc_proto import lmserve_pb2 as pb
from lmserve.grpc_proto import lmserve_pb2_grpc as pb_grpc
from lmserve.observability.prometheus import GRPC_REQUEST_ID_PREFIX

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # lmserve.v1.Generation
HEALTH_POLL_S = 0.2
GRACE_S = 5.0

_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
_UNAVAILABLE_CODES = ("engine_dead", "loading", "load_failed")  # a 500 "engine_dead" mid-request too
_REJECTED = {429: "queue_full", 503: "unavailable", 401: "unauthorized"}  # as the HTTP exception handlers count

# SamplingParams fields that are proto3 `optional` scalars: set ones are passed on, unset ones take the defaults
_OPTIONAL_FIELDS = (
    "n", "best_of", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "max_tokens", "min_tokens", "ignore_eos", "include_stop_str_in_output",
    "skip_special_tokens", "logprobs", "prompt_logprobs",
)  # fmt: skip


def completion_request(request: pb.GenerateRequest, stream: bool) -> p.CompletionRequest:
    """The gRPC request as the HTTP API's body (so the same validation runs); APIError(400) naming the field."""
    sp = request.sampling_params
    body: dict[str, Any] = {name: getattr(sp, name) for name in _OPTIONAL_FIELDS if sp.HasField(name)}
    if sp.stop:
        body["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        body["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in sp.logit_bias.items()}
    if sp.HasField("structured_outputs"):
        so = sp.structured_outputs
        kind = so.WhichOneof("kind")
        value = getattr(so, kind) if kind is not None else None
        body["structured_outputs"] = {} if kind is None else {kind: list(value.choices) if kind == "choice" else value}
    prompt = request.WhichOneof("prompt")
    if prompt == "text":
        body["prompt"] = request.text
    elif prompt == "token_ids":
        body["prompt"] = list(request.token_ids.ids)
    if request.model:
        body["model"] = request.model
    if request.echo:
        body["echo"] = True
    try:
        return p.CompletionRequest(stream=stream, **body)
    except pydantic.ValidationError as e:
        raise from_validation_errors(list(e.errors())) from None


class GenerationServicer(pb_grpc.GenerationServicer):
    """Generate / GenerateStream: a protocol.CompletionRequest through request_inputs and CompletionGeneration.

    An APIError becomes a status (`_STATUS`) whose message starts with the field, with `lmserve-param` (and
    `retry-after`) trailing metadata. The RPC's done callback is the only abort: a cancelled streaming handler
    suspended in a write never resumes, so a `finally` in it would run only at garbage collection.
    """

    def __init__(self, state: ServerState) -> None:
        self.state = state

    # -- errors and auth

    def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        key = self.state.api_key
        if not key:
            return
        metadata = {k.lower(): v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        if not bearer_ok(metadata.get("authorization", ""), key):
            raise APIError(401, "missing or invalid API key: send metadata 'authorization: Bearer KEY'")

    async def _fail(self, context: grpc.aio.ServicerContext, e: APIError) -> None:
        code = _STATUS.get(e.status_code, grpc.StatusCode.INTERNAL)
        if e.code in _UNAVAILABLE_CODES:
            code = grpc.StatusCode.UNAVAILABLE
        reason = _REJECTED.get(e.status_code) or ("invalid_request" if 400 <= e.status_code < 500 else None)
        if reason is not None and self.state.metrics is not None:
            self.state.metrics.on_request_rejected(reason, "grpc")
        message = e.message
        trailing: list[tuple[str, str]] = []
        if e.param:
            trailing.append(("lmserve-param", e.param))
            if not message.startswith(e.param):
                message = f"{e.param}: {message}"
        if e.code:
            trailing.append(("lmserve-error-code", e.code))
        for k, v in (e.headers or {}).items():
            if k.lower() == "retry-after":
                trailing.append(("retry-after", v))
        await context.abort(code, message, tuple(trailing))

    async def _internal(self, context: grpc.aio.ServicerContext, e: Exception) -> None:
        logger.exception("gRPC request failed")
        await context.abort(grpc.StatusCode.INTERNAL, f"internal server error: {type(e).__name__}: {e}")

    # -- generation

    async def _start(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, stream: bool
    ) -> tuple[CompletionGeneration, asyncio.Event]:
        """The generation, started, and an event set when the RPC's deadline aborted it."""
        state = self.state
        engine = state.ready_engine()
        body = completion_request(request, stream)
        lora = inputs.check_model(state, body.model)
        params = inputs.sampling_params_of(engine, body, {})
        params, _ = await inputs.constrain(engine, body, params)
        prompts = inputs.completion_prompts(engine, body.prompt)
        inputs.check_lengths(engine, prompts, params, "max_tokens")
        gen = CompletionGeneration(
            state, engine, f"{GRPC_REQUEST_ID_PREFIX}{uuid.uuid4().hex}", prompts, params, body, lora_request=lora
        )
        if body.echo:
            gen.echo_texts = prompt_texts(body.prompt)
        # split_reasoning: a reasoning parser per choice (see lmserve.proto), else None
        split = request.split_reasoning and not body.echo and state.chat.reasoning_cls is not None
        gen.reasoning_prompt = engine.tokenizer.decode(prompts[0]) if split else None  # type: ignore[attr-defined]
        gen.start()
        # The deadline is also the server's own: abort then, whatever the transport reports (and when); the
        # handler then ends the RPC with DEADLINE_EXCEEDED (the aborted stream must not end as a normal one).
        expired = asyncio.Event()

        def expire() -> None:
            expired.set()
            gen.abort()

        remaining = context.time_remaining()
        timer = None if remaining is None else asyncio.get_running_loop().call_later(max(0.0, remaining), expire)

        def done(_: Any) -> None:
            gen.abort()
            if timer is not None:
                timer.cancel()

        context.add_done_callback(done)
        if context.done():  # ended while validating: the callback may have run before it was added
            done(None)
        return gen, expired

    def _choice(
        self, c: CompletionOutput, text: str, token_ids: list[int], entries: list[Any] | None, reasoning: str = ""
    ) -> pb.Choice:
        choice = pb.Choice(index=c.index, text=text, token_ids=token_ids, reasoning=reasoning)
        if c.finished:
            choice.finish_reason = str(c.finish_reason)
            if isinstance(c.stop_reason, str):
                choice.stop_str = c.stop_reason
            elif isinstance(c.stop_reason, int):
                choice.stop_token_id = c.stop_reason
        if entries:
            choice.logprobs.extend(self._token_logprobs(entries))
        return choice

    def _token_logprobs(self, entries: list[Any], num_top: int | None = None) -> list[pb.TokenLogprob]:
        """TokenLogprobs as messages (None entries, the first prompt token's, skipped), num_top alternatives each
        (None: all the entry has)."""
        tb = self.state.token_bytes
        assert tb is not None, "token_bytes is set with the engine"
        out = []
        for e in entries:
            if e is None:
                continue
            top = [
                pb.TopLogprob(token_id=t, token=tb.token_text(t), token_bytes=tb.bytes_of(t), logprob=lp)
                for t, lp in (e.top_logprobs if num_top is None else e.top_logprobs[:num_top])
            ]
            out.append(
                pb.TokenLogprob(
                    token_id=e.token_id,
                    token=tb.token_text(e.token_id),
                    token_bytes=tb.bytes_of(e.token_id),
                    logprob=e.logprob,
                    rank=e.rank,
                    top_logprobs=top,
                )
            )
        return out

    def _prompt_part(self, gen: CompletionGeneration, out: RequestOutput) -> tuple[str, list[pb.TokenLogprob]]:
        """What the first message puts in front: the echoed prompt's text and the prompt logprobs."""
        echo = gen.echo(0, out)
        k = gen.body.prompt_logprobs
        prompt_lp = self._token_logprobs(out.prompt_logprobs or [], k) if k is not None else []
        return ("" if echo is None else echo.text), prompt_lp

    def _usage(self, gen: CompletionGeneration, finals: list[RequestOutput | None]) -> pb.Usage:
        u = gen.usage(finals)
        reasoning_tokens = 0
        if gen.reasoning_prompt is not None:  # type: ignore[attr-defined]
            parser = self.state.chat.reasoning(gen.reasoning_prompt)  # type: ignore[attr-defined]
            assert parser is not None
            for c in (c for f in finals if f is not None for c in f.outputs):
                end = parser.reasoning_end(c.text)
                reasoning_tokens += tokens_upto(gen.engine.tokenizer, c.token_ids, end, gen.params.skip_special_tokens)
        return pb.Usage(
            prompt_tokens=u.prompt_tokens,
            completion_tokens=u.completion_tokens,
            total_tokens=u.total_tokens,
            cached_prompt_tokens=u.prompt_tokens_details.cached_tokens,
            reasoning_tokens=reasoning_tokens,
        )

    def _split(self, gen: CompletionGeneration, c: CompletionOutput) -> tuple[str, str]:
        """(reasoning, text) of a finished choice: the text alone without split_reasoning."""
        if gen.reasoning_prompt is None:  # type: ignore[attr-defined]
            return "", c.text
        parser = self.state.chat.reasoning(gen.reasoning_prompt)  # type: ignore[attr-defined]
        assert parser is not None
        reasoning, content = parser.extract(c.text)
        return reasoning or "", content or ""

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        gen, expired = await self._start(request, context, stream=False)
        finals = await gen.collect()
        if expired.is_set():
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded: the request was aborted")
        outputs = sorted(finals[0].outputs, key=lambda c: c.index)
        echoed, prompt_lp = self._prompt_part(gen, finals[0])
        splits = [self._split(gen, c) for c in outputs]
        return pb.GenerateResponse(
            id=gen.request_id,
            model=gen.model,
            choices=[
                self._choice(c, echoed + text, c.token_ids, c.logprobs, reasoning)
                for c, (reasoning, text) in zip(outputs, splits, strict=True)
            ],
            usage=self._usage(gen, finals),
            prompt_logprobs=prompt_lp,
        )

    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        gen, expired = await self._start(request, context, stream=True)
        finished: set[int] = set()
        started: set[int] = set()  # choices whose first message went out (with the echoed prompt)
        echoed, prompt_lp = "", None  # from the first output: the prompt is computed by then
        parsers: dict[int, Any] = {}  # split_reasoning: each choice's streaming reasoning parser
        async for _, out in gen.outputs():
            if expired.is_set():
                break
            if prompt_lp is None:
                echoed, prompt_lp = self._prompt_part(gen, out)
            choices = []
            for c in out.outputs:
                if not (c.delta_text or c.delta_token_ids) and (not c.finished or c.index in finished):
                    continue
                if c.finished:
                    finished.add(c.index)
                n_new = len(c.delta_token_ids)
                delta_lp = c.logprobs[len(c.logprobs) - n_new :] if c.logprobs is not None else None
                delta, reasoning = c.delta_text, ""
                if gen.reasoning_prompt is not None:  # type: ignore[attr-defined]
                    prompt = gen.reasoning_prompt  # type: ignore[attr-defined]
                    parser = parsers.setdefault(c.index, self.state.chat.reasoning(prompt))
                    reasoning, delta = parser.feed(c.delta_text)
                    if c.finished:
                        more_r, more_d = parser.finish()
                        reasoning, delta = reasoning + more_r, delta + more_d
                text = delta if c.index in started else echoed + delta
                started.add(c.index)
                choices.append(self._choice(c, text, c.delta_token_ids, delta_lp, reasoning))
            usage = self._usage(gen, [out]) if out.finished else None
            if choices or usage is not None:
                response = pb.GenerateResponse(id=gen.request_id, model=gen.model, choices=choices, usage=usage)
                response.prompt_logprobs.extend(prompt_lp)
                prompt_lp = []  # sent: the later messages carry none
                yield response
        if expired.is_set():
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded: the request was aborted")

    # -- tokenizer and models

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        engine = self.state.ready_engine()
        inputs.check_model(self.state, request.model or None)
        special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        ids = inputs.tokenize_body(engine, p.TokenizeRequest(prompt=request.text, add_special_tokens=special))
        return pb.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.config.scheduler.max_model_len)

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        engine = self.state.ready_engine()
        inputs.check_model(self.state, request.model or None)
        return pb.DetokenizeResponse(text=inputs.detokenize_tokens(engine, list(request.tokens)))

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        engine = self.state.ready_engine()
        card = pb.ModelCard(
            id=self.state.served_model_name,
            root=engine.config.model.path,
            max_model_len=engine.config.scheduler.max_model_len,
            owned_by="lmserve",
        )
        return pb.ListModelsResponse(models=[card])

    # -- pooling

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        engine = self.state.ready_engine()
        inputs.check_model(self.state, request.model or None)
        items: list[str | list[int]] = [*request.texts, *(list(t.ids) for t in request.token_ids)]
        prompts = pooling.tokenized(engine, items, "texts")
        dims = request.dimensions if request.HasField("dimensions") else None
        gen = pooling.start_pooling(self.state, prompts, dims)
        context.add_done_callback(lambda _: gen.abort())
        try:
            finals = await gen.collect()
        finally:
            gen.abort()
        return pb.EmbedResponse(
            model=request.model or self.state.served_model_name,
            embeddings=[pb.Embedding(values=o.pooled) for o in finals],
            prompt_tokens=sum(map(len, prompts)),
        )


def _guard_unary(servicer: GenerationServicer, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(fn)
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            servicer._authorize(context)
            return await fn(request, context)
        except APIError as e:
            await servicer._fail(context, e)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await servicer._internal(context, e)

    return handler


def _guard_stream(servicer: GenerationServicer, fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            servicer._authorize(context)
            async for item in fn(request, context):
                yield item
        except APIError as e:
            await servicer._fail(context, e)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await servicer._internal(context, e)

    return handler


def _guarded(servicer: GenerationServicer) -> GenerationServicer:
    """The servicer with every method wrapped: auth first, then APIError → a gRPC status."""
    for name in ("Generate", "Tokenize", "Detokenize", "ListModels", "Embed"):
        setattr(servicer, name, _guard_unary(servicer, getattr(servicer, name)))
    servicer.GenerateStream = _guard_stream(servicer, servicer.GenerateStream)  # type: ignore[method-assign]
    return servicer


def _serving(state: ServerState) -> int:
    engine = state.engine
    ok = engine is not None and engine.dead_error is None
    return health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING


async def _mirror_health(state: ServerState, servicer: Any, current: int | None = None) -> None:
    """Keep the health service's status equal to what /health answers (loading, ready, engine dead)."""
    while True:
        status = _serving(state)
        if status != current:
            for service in ("", SERVICE_NAME):
                await servicer.set(service, status)
            current = status
        await asyncio.sleep(HEALTH_POLL_S)


def grpc_frontend(host: str, port: int) -> Callable[[ServerState], AbstractAsyncContextManager[grpc.aio.Server]]:
    """A `build_app(frontends=...)` entry: serves gRPC on host:port for the app's lifespan."""

    @asynccontextmanager
    async def run(state: ServerState) -> AsyncIterator[grpc.aio.Server]:
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(_guarded(GenerationServicer(state)), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        server.add_insecure_port(address)  # raises RuntimeError when the port cannot be bound
        status = _serving(state)  # before the first call can ask (the servicer starts at SERVING)
        for service in ("", SERVICE_NAME):
            await health_servicer.set(service, status)
        await server.start()
        mirror = asyncio.ensure_future(_mirror_health(state, health_servicer, status))
        logger.info("gRPC %s on %s", SERVICE_NAME, address)
        try:
            yield server
        finally:
            mirror.cancel()
            await health_servicer.enter_graceful_shutdown()
            await server.stop(GRACE_S)

    return run
