"""Ollama's API on the same engine: POST /api/chat and /api/generate (newline-delimited JSON, streamed unless
`stream` is false), GET /api/tags, POST /api/show, GET /api/ps, GET /api/version; pull / push / create / delete /
copy answer 400 (the server serves the model it was started with). A request becomes the OpenAI side's request
model (protocol_ollama) and runs through the same checks and Generation; errors are Ollama's {"error": "..."}."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from lmserve.core.outputs import CompletionOutput, RequestOutput
from lmserve.entrypoints.openai import protocol as p
from lmserve.entrypoints.openai import protocol_ollama as po
from lmserve.entrypoints.openai import request_inputs as inputs
from lmserve.entrypoints.openai import tools
from lmserve.entrypoints.openai.errors import APIError, bad_request, from_validation_errors
from lmserve.entrypoints.openai.generation import Generation
from lmserve.entrypoints.openai.sse import ClientGone, SSEResponse, cancel_on_disconnect
from lmserve.entrypoints.openai.state import ServerState
from lmserve.lora.request import LoRARequest
from lmserve.parsers import ReasoningParser

NS = 1_000_000_000
M = TypeVar("M", bound=BaseModel)


def ollama_error(e: APIError) -> JSONResponse:
    return JSONResponse({"error": e.message}, status_code=e.status_code, headers=e.headers)


async def answered(state: ServerState, fn: Callable[[], Awaitable[Response]]) -> Response:
    """`fn`'s response, or its APIError as Ollama's error body (counted like the OpenAI routes' refusals)."""
    try:
        return await fn()
    except APIError as e:
        if state.metrics is not None and 400 <= e.status_code < 500:
            state.metrics.on_request_rejected("invalid_request")
        return ollama_error(e)


async def parse(model: type[M], request: Request) -> M:
    """The body as `model`; 400 naming the first bad field."""
    raw = await request.body()
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as e:
        raise from_validation_errors(list(e.errors())) from None


def model_name(state: ServerState, name: str) -> LoRARequest | None:
    """The adapter `name` names (None: the base model); Ollama's `:latest` tag is the served name's own."""
    if not name:
        raise bad_request("model is required", "model")
    base = name.removesuffix(":latest")
    try:
        return inputs.check_model(state, base)
    except APIError:
        raise APIError(404, f"model '{name}' not found", param="model") from None


def renamed(e: APIError) -> APIError:
    """An OpenAI-side refusal with the field the Ollama client sent named (options.num_predict for max_tokens)."""
    name = po.PARAM_NAMES.get(e.param or "")
    if name is not None:
        e.message, e.param = f"{name}: {e.message}", name
    return e


def now_iso() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


class NDJSONResponse(SSEResponse):
    """application/x-ndjson, one JSON object a line; aborts its requests however the stream ends."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        StreamingResponse.__init__(self, content, media_type="application/x-ndjson")
        self._on_close = on_close


class OllamaGeneration(Generation):
    """One /api/chat or /api/generate request: its stream lines and final object (one prompt, one sequence)."""

    def __init__(self, *args: Any, chat: bool, context: list[int] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chat = chat
        self.context = context  # /api/generate: the tokens before the prompt's, for the answer's `context`
        self.tool_calls: tools.ToolCallFormatter | None = None
        self.reasoning: ReasoningParser | None = None  # the server's reasoning parser for this output
        self.show_thinking = True  # think false: the thinking (if the model still writes some) is dropped
        self._content = ""  # streamed with a reasoning parser: the content so far

    def line(self, text: str | None = None, calls: list[p.ToolCall] | None = None, thinking: str = "") -> dict:
        out: dict[str, Any] = {"model": self.model, "created_at": now_iso()}
        thinking = thinking if self.show_thinking else ""
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text or ""}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = [
                    {"function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                    for c in calls
                ]
            out["message"] = message
        else:
            out["response"] = text or ""
            if thinking:
                out["thinking"] = thinking
        out["done"] = False
        return out

    def final(
        self, out: RequestOutput, text: str | None = None, calls: list[p.ToolCall] | None = None, thinking: str = ""
    ) -> dict:
        c = out.outputs[0]
        body = self.line(text, calls, thinking)
        m, end = out.metrics, time.time()
        first = m.first_token_time or end
        scheduled = m.first_scheduled_time or first
        reason = "stop" if c.finish_reason is None else str(c.finish_reason)
        body.update(
            done=True,
            done_reason="stop" if reason == "abort" else reason,
            total_duration=int(((m.finished_time or end) - m.arrival_time) * NS),
            load_duration=0,  # the model was loaded when the server started
            prompt_eval_count=len(out.prompt_token_ids) - out.num_cached_tokens,
            prompt_eval_duration=int((first - scheduled) * NS),
            eval_count=len(c.token_ids),
            eval_duration=int(((m.last_token_time or first) - first) * NS),
        )
        if not self.chat:
            body["context"] = (self.context or []) + list(out.prompt_token_ids) + list(c.token_ids)
        return body

    def message_of(self, c: CompletionOutput) -> tuple[str | None, list[p.ToolCall] | None, str]:
        """(content, tool calls, thinking) of the finished output."""
        thinking = ""
        if self.reasoning is not None:
            thought, content = self.reasoning.extract(c.text)
            thinking, c = thought or "", dataclasses.replace(c, text=content or "")
        if self.tool_calls is None:
            return c.text, None, thinking
        message, _ = self.tool_calls.message(c)
        return message.content, message.tool_calls, thinking

    def content_step(self, c: CompletionOutput) -> tuple[str, CompletionOutput]:
        """(this step's thinking, `c` with only its content as text and delta), streamed."""
        if self.reasoning is None:
            return "", c
        thought, content = self.reasoning.feed(c.delta_text)
        if c.finished:
            more_thought, more_content = self.reasoning.finish()
            thought, content = thought + more_thought, content + more_content
        self._content += content
        return thought, dataclasses.replace(c, text=self._content, delta_text=content)

    async def respond(self, request: Request) -> Response:
        self.start()
        if self.body.stream:
            return NDJSONResponse(self.lines(), on_close=self.abort)
        try:
            finals = await cancel_on_disconnect(request, self.collect())
        except ClientGone:
            return Response(status_code=499)
        finally:
            self.abort()
        text, calls, thinking = self.message_of(finals[0].outputs[0])
        return JSONResponse(self.final(finals[0], text, calls, thinking))

    async def lines(self) -> AsyncIterator[str]:
        try:
            async for _, out in self.outputs():
                thought, c = self.content_step(out.outputs[0])
                chunks = [self.line(thinking=thought)] if thought and self.show_thinking else []
                if self.tool_calls is None:
                    parts = [(c.delta_text, None)] if c.delta_text else []
                else:
                    parts = [(d.content, _calls(d.tool_calls)) for d, _ in self.tool_calls.deltas(0, c)]
                chunks += [self.line(text, calls) for text, calls in parts if text or calls]
                if c.finished:
                    chunks.append(self.final(out))
                if chunks:
                    yield "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in chunks)
        except APIError as e:
            yield json.dumps({"error": e.message}) + "\n"
        except Exception as e:  # the stream has started: report in-band, never drop silently
            yield json.dumps({"error": f"internal server error: {type(e).__name__}: {e}"}) + "\n"


def _calls(deltas: list[p.DeltaToolCall] | None) -> list[p.ToolCall] | None:
    if not deltas:
        return None
    return [
        p.ToolCall(id=d.id or "", function=p.FunctionCall(name=d.function.name or "", arguments=d.function.arguments))
        for d in deltas
        if d.function is not None
    ]


def _load_answer(gen_model: str, chat: bool) -> JSONResponse:
    """Ollama answers an empty prompt / message list by loading the model: done, reason "load"."""
    body: dict[str, Any] = {"model": gen_model, "created_at": now_iso()}
    body.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    body.update(done=True, done_reason="load")
    return JSONResponse(body)


def _template_kwargs(state: ServerState, name: str, think: bool | str | None) -> dict[str, Any]:
    """The chat template's kwargs for `think`: true / false → enable_thinking, "low" / "medium" / "high" →
    reasoning_effort (gpt-oss); 400 when the server has no reasoning parser to tell thinking from content."""
    if think not in (None, False) and state.chat.reasoning_cls is None:
        raise bad_request(f'"{name}" does not support thinking', "think")
    if isinstance(think, str) and think not in ("low", "medium", "high"):
        raise bad_request(f'think must be true, false, "low", "medium" or "high", got {think!r}', "think")
    try:
        kwargs = state.chat.template_kwargs(None, think if isinstance(think, str) else None)
    except p.RequestError as e:
        raise bad_request(str(e), "think") from None
    if isinstance(think, bool):
        kwargs["enable_thinking"] = think
    return kwargs


async def _run(
    state: ServerState,
    request: Request,
    body: po.ChatRequest | po.GenerateRequest,
    openai_body: p.ChatCompletionRequest | p.CompletionRequest,
    render: Callable[[tools.ToolPlan | None], tuple[str, list[int]]],
    lora: LoRARequest | None,
    context: list[int] | None = None,
) -> Response:
    """The shared tail of /api/chat and /api/generate: params, constraint, prompt (its text for the reasoning
    parser), lengths, generation."""
    engine = state.ready_engine()
    chat = isinstance(body, po.ChatRequest)
    try:
        params = inputs.sampling_params_of(engine, openai_body, {})
        constraint = inputs.constraint_of(engine, openai_body)
        text, prompt = render(constraint.tools)
        reasoning = state.chat.reasoning(text)
        params = await inputs.apply_constraint(engine, constraint, params, reasoning)  # after the thinking
        if state.chat.keeps_special_tokens or (constraint.tools is not None and state.chat.tools.keeps_special_tokens):
            params = dataclasses.replace(params, skip_special_tokens=False)  # the parsers' markers are special
        num_ctx = body.options.num_ctx if body.options is not None else None
        if num_ctx is not None:
            if len(prompt) >= num_ctx:
                raise bad_request(
                    f"options.num_ctx: the prompt is {len(prompt)} tokens, the context num_ctx={num_ctx}",
                    "options.num_ctx",
                )
            room = num_ctx - len(prompt)
            cap = room if params.max_tokens is None else min(room, params.max_tokens)
            params = dataclasses.replace(params, max_tokens=cap)
        inputs.check_lengths(engine, [prompt], params, "max_tokens")
    except APIError as e:
        raise renamed(e) from None
    kind = "chat" if chat else "generate"
    gen = OllamaGeneration(
        state, engine, f"ollama-{kind}-{uuid.uuid4().hex}", [prompt], params, openai_body,
        lora_request=lora, chat=chat, context=context,
    )  # fmt: skip
    gen.model = body.model
    gen.reasoning, gen.show_thinking = reasoning, body.think is not False
    if constraint.tools is not None:
        gen.tool_calls = tools.ToolCallFormatter(constraint.tools, state.chat.tools)
    return await gen.respond(request)


async def api_chat(state: ServerState, request: Request) -> Response:
    body = await parse(po.ChatRequest, request)
    lora = model_name(state, body.model)
    engine = state.ready_engine()
    template_kwargs = _template_kwargs(state, body.model, body.think)
    if not body.messages:
        return _load_answer(body.model, chat=True)
    fields = po.sampling_fields(body.options, engine.config.scheduler.max_model_len)
    rf = po.response_format(body.format)
    openai_body = p.ChatCompletionRequest.model_validate(
        {"messages": po.chat_messages(body.messages), "stream": body.stream, "tools": body.tools or None,
         "response_format": rf, **fields}
    )  # fmt: skip

    def render(plan: tools.ToolPlan | None) -> tuple[str, list[int]]:
        shown = plan.tools if plan is not None and tools.template_supports_tools(engine.tokenizer) else None
        return inputs.chat_prompt(engine, openai_body.messages, True, shown, template_kwargs)

    return await _run(state, request, body, openai_body, render, lora)


async def api_generate(state: ServerState, request: Request) -> Response:
    body = await parse(po.GenerateRequest, request)
    lora = model_name(state, body.model)
    engine = state.ready_engine()
    template_kwargs = _template_kwargs(state, body.model, body.think)
    for field in ("suffix", "template"):
        if getattr(body, field):
            raise bad_request(f"{field} is not supported by this server", field)
    if body.images:
        raise bad_request("images: this server serves a text model", "images")
    if not body.prompt:
        return _load_answer(body.model, chat=False)
    fields = po.sampling_fields(body.options, engine.config.scheduler.max_model_len)
    openai_body = p.CompletionRequest.model_validate(
        {"prompt": body.prompt, "stream": body.stream, "response_format": po.response_format(body.format),
         "max_tokens": fields.pop("max_tokens", None), **fields}
    )  # fmt: skip
    context = body.context or []
    if any(not 0 <= t < engine.config.model.vocab_size for t in context):
        raise bad_request(f"context: token ids must be in [0, {engine.config.model.vocab_size})", "context")

    def render(plan: tools.ToolPlan | None) -> tuple[str, list[int]]:
        if body.raw or not getattr(engine.tokenizer, "chat_template", None):
            text = body.prompt if body.system is None else body.system + "\n" + body.prompt
            return text, context + inputs.encode(engine.tokenizer, text, "prompt", add_special_tokens=not context)
        messages = [p.ChatMessage(role="user", content=body.prompt)]
        if body.system is not None:
            messages.insert(0, p.ChatMessage(role="system", content=body.system))
        text, ids = inputs.chat_prompt(engine, messages, True, None, template_kwargs)
        return text, context + ids

    return await _run(state, request, body, openai_body, render, lora, context=context)


def add_ollama_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/api/chat")
    async def chat(request: Request) -> Response:
        return await answered(state, lambda: api_chat(state, request))

    @app.post("/api/generate")
    async def generate(request: Request) -> Response:
        return await answered(state, lambda: api_generate(state, request))

    @app.get("/api/version")
    async def version() -> JSONResponse:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as package_version

        try:
            v = package_version("lmserve")
        except PackageNotFoundError:
            v = "0.0.0"
        return JSONResponse({"version": v})

    @app.get("/api/tags")
    async def tags() -> Response:
        return await answered(state, lambda: _json({"models": [model_entry(state)]}))

    @app.get("/api/ps")
    async def ps() -> Response:
        async def body() -> JSONResponse:
            entry = model_entry(state)
            engine = state.ready_engine()
            entry.update(expires_at="9999-12-31T23:59:59Z", size_vram=0,
                         context_length=engine.config.scheduler.max_model_len)  # fmt: skip
            return JSONResponse({"models": [entry]})

        return await answered(state, body)

    @app.post("/api/show")
    async def show(request: Request) -> Response:
        async def body() -> JSONResponse:
            req = await parse(po.ModelRequest, request)
            model_name(state, req.model or req.name)
            return JSONResponse(show_body(state))

        return await answered(state, body)

    for path, method in [("/api/pull", "post"), ("/api/push", "post"), ("/api/create", "post"),
                         ("/api/delete", "delete"), ("/api/copy", "post")]:  # fmt: skip
        getattr(app, method)(path)(_refusal(state, path))


def _refusal(state: ServerState, path: str) -> Callable[[], Awaitable[Response]]:
    async def refuse() -> Response:
        action = path.rsplit("/", 1)[1]
        return ollama_error(bad_request(
            f"{action} is not supported: this server serves the model it was started with "
            f"({state.served_model_name!r}); restart it with another model to serve that one"
        ))  # fmt: skip

    return refuse


async def _json(obj: dict[str, Any]) -> JSONResponse:
    return JSONResponse(obj)


def model_details(state: ServerState) -> dict[str, Any]:
    mc = state.ready_engine().config.model
    quant = state.ready_engine().config.quantization
    return {
        "parent_model": "",
        "format": "gguf" if str(mc.path).endswith(".gguf") else "safetensors",
        "family": mc.family,
        "families": [mc.family],
        "parameter_size": "",
        "quantization_level": (quant.method if quant is not None else mc.dtype).upper(),
    }


def model_entry(state: ServerState) -> dict[str, Any]:
    name = state.served_model_name
    return {
        "name": name,
        "model": name,
        "modified_at": now_iso(),
        "size": 0,
        "digest": uuid.uuid5(uuid.NAMESPACE_URL, str(state.ready_engine().config.model.path)).hex,
        "details": model_details(state),
    }


def capabilities(state: ServerState) -> list[str]:
    engine = state.ready_engine()
    if engine.config.runner == "pooling":
        return ["embedding"]
    caps = ["completion"]
    if tools.template_supports_tools(engine.tokenizer):
        caps.append("tools")
    if state.chat.reasoning_cls is not None:
        caps.append("thinking")
    return caps


def show_body(state: ServerState) -> dict[str, Any]:
    engine = state.ready_engine()
    mc, family = engine.config.model, engine.config.model.family
    defaults = engine.generation_defaults
    template = getattr(engine.tokenizer, "chat_template", None) or ""
    return {
        "license": "",
        "modelfile": f"# served by lmserve\nFROM {mc.path}\n",
        "parameters": "\n".join(f"{k} {v}" for k, v in defaults.items()),
        "template": template if isinstance(template, str) else json.dumps(template),
        "details": model_details(state),
        "model_info": {
            "general.architecture": family,
            f"{family}.context_length": engine.config.scheduler.max_model_len,
            f"{family}.embedding_length": mc.hidden_size,
            f"{family}.block_count": mc.num_layers,
            f"{family}.attention.head_count": mc.num_heads,
            f"{family}.attention.head_count_kv": mc.num_kv_heads,
            f"{family}.vocab_size": mc.vocab_size,
        },
        "capabilities": capabilities(state),
        "modified_at": now_iso(),
    }
