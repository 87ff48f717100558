"""Anthropic's Messages API: POST /v1/messages (a chat generation under Anthropic's shape: the body becomes a chat
body, the answer a message of text and tool_use blocks with its stop_reason; streamed as message_start,
content_block_start / _delta / _stop, message_delta, message_stop) and POST /v1/messages/count_tokens (the prompt a
create would render, counted). Errors are Anthropic-shaped (errors.ANTHROPIC_PATHS)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lmserve.core.outputs import RequestOutput
from lmserve.entrypoints.openai import protocol as p
from lmserve.entrypoints.openai import protocol_anthropic as ap
from lmserve.entrypoints.openai import request_inputs as inputs
from lmserve.entrypoints.openai import tools
from lmserve.entrypoints.openai.errors import APIError, bad_request
from lmserve.entrypoints.openai.serving_chat import ChatGeneration, chat_generation
from lmserve.entrypoints.openai.state import ServerState

# chat's field names in the errors of a translated body → Anthropic's
RENAMED = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}


def _chat_body(body: ap.CountTokensRequest) -> p.ChatCompletionRequest:
    try:
        messages = ap.system_message(body.system) + ap.chat_messages(body.messages)
        chat_tools = ap.chat_tools(body.tools)
        choice, parallel = ap.chat_tool_choice(body.tool_choice, bool(chat_tools))
        template_kwargs = ap.template_kwargs(body.thinking)
    except p.RequestError as e:
        raise bad_request(str(e), e.param) from None
    if not body.messages:
        raise bad_request("messages must be a non-empty list", "messages")
    if not isinstance(body, ap.MessagesRequest):
        return p.ChatCompletionRequest(model=body.model, messages=messages, tools=chat_tools, tool_choice=choice,
                                       chat_template_kwargs=template_kwargs)  # fmt: skip
    return p.ChatCompletionRequest(
        model=body.model,
        messages=messages,
        max_completion_tokens=body.max_tokens,
        stop=body.stop_sequences,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        tools=chat_tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        chat_template_kwargs=template_kwargs,
        stream=body.stream,
    )


async def create_message(state: ServerState, body: ap.MessagesRequest, request: Request) -> Response:
    state.ready_engine()
    chat = _chat_body(body)
    try:
        gen = await chat_generation(state, chat, MessagesGeneration, f"msg_{uuid.uuid4().hex}")
    except APIError as e:
        if e.param in RENAMED:
            e.message, e.param = e.message.replace(e.param, RENAMED[e.param]), RENAMED[e.param]
        raise
    return await gen.respond(request)


def count_tokens(state: ServerState, body: ap.CountTokensRequest) -> dict[str, int]:
    """The prompt's tokens as create renders it (tools shown to templates that render them), without starting it."""
    engine = state.ready_engine()
    inputs.check_model(state, body.model)
    chat = _chat_body(body)
    try:
        plan = tools.constraint_of(chat, engine.tokenizer).tools
        template_kwargs = state.chat.template_kwargs(chat.chat_template_kwargs, None)
    except p.RequestError as e:
        raise bad_request(str(e), e.param) from None
    shown = plan.tools if plan is not None and tools.template_supports_tools(engine.tokenizer) else None
    _, ids = inputs.chat_prompt(engine, chat.messages, True, shown, template_kwargs)
    return {"input_tokens": len(ids)}


class MessagesGeneration(ChatGeneration):
    def final_response(self, finals: list[RequestOutput]) -> ap.MessageObject:  # type: ignore[override]
        choice = super().final_response(finals).choices[0]
        content: list[dict[str, Any]] = []
        if choice.message.reasoning_content:  # a reasoning parser split it off (signature: none, nothing is signed)
            content.append({"type": "thinking", "thinking": choice.message.reasoning_content, "signature": ""})
        if choice.message.content:
            content.append({"type": "text", "text": choice.message.content})
        content.extend(ap.tool_use_block(c) for c in choice.message.tool_calls or [])
        why, sequence = ap.stop_reason(choice.finish_reason, choice.stop_reason)
        usage = ap.usage_of(self.usage(finals))
        return ap.MessageObject(
            id=self.request_id, model=self.model, content=content, stop_reason=why, stop_sequence=sequence, usage=usage
        )

    async def events(self) -> AsyncIterator[str]:
        block: str | None = None  # the open block's type
        index = -1
        started = False
        latest: RequestOutput | None = None
        why, sequence = "end_turn", None
        try:
            async for _, out in self.outputs():
                latest = out
                events = []
                if not started:  # after the prompt's step: its cached tokens are known
                    started = True
                    usage = ap.usage_of(self.usage([out])).model_copy(update={"output_tokens": 0})
                    message = ap.MessageObject(id=self.request_id, model=self.model, usage=usage)
                    events.append(_event("message_start", message=message.model_dump(mode="json")))
                c = out.outputs[0]
                for chunk in self.stream_choices(0, c, out):
                    choice = chunk.choices[0]
                    pieces = [("thinking", choice.delta.reasoning_content), ("text", choice.delta.content)]
                    for kind, piece in pieces:
                        if not piece:
                            continue
                        if block != kind:
                            if block is not None:
                                events.append(_event("content_block_stop", index=index))
                            index, block = index + 1, kind
                            events.append(_event("content_block_start", index=index, content_block=_EMPTY[kind]))
                        delta = {"type": f"{kind}_delta", kind: piece}
                        events.append(_event("content_block_delta", index=index, delta=delta))
                    for call in choice.delta.tool_calls or []:
                        if block is not None:
                            events.append(_event("content_block_stop", index=index))
                        index, block = index + 1, "tool_use"
                        start = {"type": "tool_use", "id": call.id, "name": call.function.name, "input": {}}
                        events.append(_event("content_block_start", index=index, content_block=start))
                        events.append(_event("content_block_delta", index=index, delta={
                            "type": "input_json_delta", "partial_json": call.function.arguments}))  # fmt: skip
                    if choice.finish_reason is not None:
                        why, sequence = ap.stop_reason(choice.finish_reason, choice.stop_reason)
                if events:
                    yield "".join(events)
            end = [] if block is None else [_event("content_block_stop", index=index)]
            usage = ap.usage_of(self.usage([latest]))
            end.append(_event("message_delta", delta={"stop_reason": why, "stop_sequence": sequence},
                              usage=usage.model_dump()))  # fmt: skip
            end.append(_event("message_stop"))
            yield "".join(end)
        except APIError as e:
            yield _event("error", error=e.anthropic_body()["error"])


_EMPTY = {"text": {"type": "text", "text": ""}, "thinking": {"type": "thinking", "thinking": "", "signature": ""}}


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


def add_messages_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/messages")
    async def messages(body: ap.MessagesRequest, request: Request) -> Response:
        return await create_message(state, body, request)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(body: ap.CountTokensRequest) -> JSONResponse:
        return JSONResponse(count_tokens(state, body))
