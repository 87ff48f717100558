"""OpenAI's Responses API: POST /v1/responses (a chat generation under another shape: the body becomes a chat body,
its answer output items), GET / DELETE /v1/responses/{id} and POST /v1/responses/{id}/cancel over the in-memory
ResponseStore, `previous_response_id` (the stored conversation continued), `background` (answered at once, polled
with GET), and the typed SSE events the openai SDK's `responses.stream()` accumulates."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from lmserve.core.outputs import RequestOutput
from lmserve.entrypoints.openai import protocol as p
from lmserve.entrypoints.openai import protocol_responses as rp
from lmserve.entrypoints.openai.errors import APIError, bad_request
from lmserve.entrypoints.openai.response_store import ResponseStore, StoredResponse
from lmserve.entrypoints.openai.serving_chat import ChatGeneration, chat_generation
from lmserve.entrypoints.openai.sse import ClientGone, SSEResponse, cancel_on_disconnect
from lmserve.entrypoints.openai.state import ServerState

# chat's field names in the errors of a translated body → the Responses field
RENAMED = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input",
           "reasoning_effort": "reasoning.effort"}  # fmt: skip
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_background_tasks: set[asyncio.Task[Any]] = set()  # held until done (the loop keeps only weak references)


def _renamed(e: APIError) -> APIError:
    for old, new in RENAMED.items():
        if e.param is not None and e.param.startswith(old):
            e.param = new + e.param[len(old) :]
        e.message = e.message.replace(old, new)
    return e


def _effort(reasoning: dict[str, Any] | None) -> str | None:
    """reasoning.effort, which reaches the chat template as chat's reasoning_effort does (chat_settings.py)."""
    effort = (reasoning or {}).get("effort")
    if effort is not None and effort not in EFFORTS:
        raise bad_request(f"reasoning.effort must be one of {', '.join(EFFORTS)}, got {effort!r}", "reasoning.effort")
    return effort


def _chat_body(body: rp.ResponsesRequest, history: list[p.ChatMessage]) -> tuple[p.ChatCompletionRequest, list]:
    """The chat body of a Responses body (continuing `history`), and the conversation without the instructions."""
    try:
        conversation = history + rp.input_messages(body.input)
        tools = rp.chat_tools(body.tools)
        tool_choice = rp.chat_tool_choice(body.tool_choice)
        response_format = rp.response_format(body.text)
    except p.RequestError as e:
        raise bad_request(str(e), e.param) from None
    if not conversation:
        raise bad_request("input must not be empty", "input")
    system = [p.ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    chat = p.ChatCompletionRequest(
        model=body.model,
        messages=system + conversation,
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=body.stop,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=response_format,
        reasoning_effort=_effort(body.reasoning),
        stream=body.stream,
    )
    return chat, conversation


async def create_response(
    state: ServerState, store: ResponseStore, body: rp.ResponsesRequest, request: Request
) -> Response:
    state.ready_engine()
    if body.background and (body.stream or not body.store):
        raise bad_request("background needs store true and stream false", "background")
    history: list[p.ChatMessage] = []
    if body.previous_response_id is not None:
        prev = store.get(body.previous_response_id)
        if prev is None:
            raise bad_request(f"previous response {body.previous_response_id!r} not found", "previous_response_id")
        if prev.response.status in ("queued", "in_progress"):
            raise bad_request("the previous response has not finished", "previous_response_id")
        history = list(prev.messages)
    chat, conversation = _chat_body(body, history)
    rid = f"resp_{uuid.uuid4().hex}"
    try:
        gen = await chat_generation(state, chat, ResponsesGeneration, rid)
    except APIError as e:
        raise _renamed(e) from None
    assert isinstance(gen, ResponsesGeneration)
    gen.setup(body, store, conversation)
    return await gen.respond(request)


class ResponsesGeneration(ChatGeneration):
    def setup(self, body: rp.ResponsesRequest, store: ResponseStore, conversation: list[p.ChatMessage]) -> None:
        self.store = store if body.store else None
        self.conversation = conversation
        self.background = body.background
        self.base = rp.ResponseObject(
            id=self.request_id,
            model=self.model,
            background=body.background,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            metadata=body.metadata or {},
            parallel_tool_calls=body.parallel_tool_calls,
            previous_response_id=body.previous_response_id,
            reasoning=body.reasoning,
            store=body.store,
            temperature=body.temperature,
            text=body.text or {"format": {"type": "text"}},
            tool_choice=body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none"),
            tools=body.tools or [],
            top_p=body.top_p,
            user=body.user,
        )

    async def respond(self, request: Request) -> Response:
        self.start()
        if self.body.stream:
            return SSEResponse(self.events(), on_close=self.abort)
        if self.background:
            return self._run_in_background()
        try:
            finals = await cancel_on_disconnect(request, self.collect())
        except ClientGone:
            return Response(status_code=499)
        finally:
            self.abort()
        response = self.finish(self.output_items(self.final_response(finals)), finals[0])
        return Response(response.model_dump_json(), media_type="application/json")

    def _run_in_background(self) -> Response:
        assert self.store is not None, "background needs store"
        running = self.base.model_copy(update={"status": "in_progress"})
        entry = StoredResponse(running, [])

        async def run() -> None:
            try:
                finals = await self.collect()
                self.finish(self.output_items(self.final_response(finals)), finals[0])
            except APIError as e:
                entry.response = running.model_copy(update={"status": "failed", "error": e.body()["error"]})
            finally:
                entry.cancel = None

        task = asyncio.ensure_future(run())
        _background_tasks.add(task)
        task.add_done_callback(_background_tasks.discard)
        entry.cancel = task.cancel  # cancelling collect() aborts the engine request
        self.store.put(entry)
        return Response(running.model_dump_json(), media_type="application/json")

    # -- the answer

    def output_items(self, chat: p.ChatCompletionResponse) -> list[rp.OutputItem]:
        choice = chat.choices[0]
        calls = choice.message.tool_calls or []
        items: list[rp.OutputItem] = []
        if choice.message.reasoning_content:
            thought = rp.ReasoningText(text=choice.message.reasoning_content)
            items.append(rp.ReasoningItem(id=_item_id("rs"), content=[thought]))
        if choice.message.content or not calls:
            text = rp.OutputText(text=choice.message.content or "")
            status = _item_status(choice.finish_reason)
            items.append(rp.OutputMessage(id=_item_id("msg"), content=[text], status=status))
        items.extend(
            rp.FunctionCallItem(id=_item_id("fc"), call_id=c.id, name=c.function.name, arguments=c.function.arguments)
            for c in calls
        )
        self._finish_reason = choice.finish_reason
        return items

    def finish(self, items: list[rp.OutputItem], final: RequestOutput | None) -> rp.ResponseObject:
        """The finished response object (stored when the body asked to be)."""
        why = getattr(self, "_finish_reason", None)
        status, incomplete = "completed", None
        if why == "length":
            status, incomplete = "incomplete", rp.IncompleteDetails(reason="max_output_tokens")
        elif why == "abort":
            status = "cancelled"
        usage = rp.response_usage(self.usage([final]))
        response = self.base.model_copy(
            update={"status": status, "incomplete_details": incomplete, "output": items, "usage": usage}
        )
        if self.store is not None:
            entry = self.store.get(self.request_id)
            messages = self.conversation + [_assistant_message(items)]
            if entry is None:
                self.store.put(StoredResponse(response, messages))
            elif entry.response.status != "cancelled":
                entry.response, entry.messages = response, messages
        return response

    # -- streaming

    async def events(self) -> AsyncIterator[str]:
        ev = _Events()
        yield ev("response.created", response=self.base)
        yield ev("response.in_progress", response=self.base)
        out = _StreamedOutput(ev)
        latest: RequestOutput | None = None
        self._finish_reason = None
        try:
            async for _, step in self.outputs():
                latest = step
                events: list[str] = []
                for chunk in self.stream_choices(0, step.outputs[0], step):
                    choice = chunk.choices[0]
                    if choice.delta.reasoning_content:
                        events += out.reasoning(choice.delta.reasoning_content)
                    if choice.delta.content:
                        events += out.text(choice.delta.content)
                    for call in choice.delta.tool_calls or []:
                        events += out.call(rp.FunctionCallItem(id=_item_id("fc"), call_id=call.id,
                                                               name=call.function.name,
                                                               arguments=call.function.arguments))  # fmt: skip
                    if choice.finish_reason is not None:
                        self._finish_reason = choice.finish_reason
                if events:
                    yield "".join(events)
            if not any(isinstance(i, (rp.OutputMessage, rp.FunctionCallItem)) for i in out.items):
                yield "".join(out.text(""))  # no answer written: an empty message, as the non-streamed one has
            yield "".join(out.close(_item_status(self._finish_reason)))
            response = self.finish(out.items, latest)
            kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
            yield ev(kind, response=response)
        except APIError as e:
            yield ev("error", code=e.code, message=e.message, param=e.param)


def _assistant_message(items: list[rp.OutputItem]) -> p.ChatMessage:
    text = "".join(c.text for i in items if isinstance(i, rp.OutputMessage) for c in i.content)
    calls = [rp._call_dict(i.call_id, i.name, i.arguments) for i in items if isinstance(i, rp.FunctionCallItem)]
    return p.ChatMessage(role="assistant", content=text, tool_calls=calls or None)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason in ("length", "abort") else "completed"


class _Events:
    """The stream's events: `event: TYPE` and the JSON data with its sequence_number."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        for k, v in fields.items():
            data[k] = v.model_dump(mode="json") if hasattr(v, "model_dump") else v
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class _StreamedOutput:
    """A streamed response's output items and their events: a reasoning item or a message receives deltas until
    another item starts; a function call comes whole (the tool path sends calls once complete)."""

    def __init__(self, ev: _Events) -> None:
        self.ev = ev
        self.items: list[rp.OutputItem] = []
        self.open: rp.OutputMessage | rp.ReasoningItem | None = None

    def reasoning(self, text: str) -> list[str]:
        out = [] if isinstance(self.open, rp.ReasoningItem) else self._start(rp.ReasoningItem(id=_item_id("rs")))
        assert isinstance(self.open, rp.ReasoningItem)
        self.open.content[0].text += text
        index = len(self.items) - 1
        out.append(self.ev("response.reasoning_text.delta", item_id=self.open.id, output_index=index, content_index=0,
                           delta=text))  # fmt: skip
        return out

    def text(self, text: str) -> list[str]:
        out = [] if isinstance(self.open, rp.OutputMessage) else self._start(rp.OutputMessage(id=_item_id("msg")))
        assert isinstance(self.open, rp.OutputMessage)
        self.open.content[0].text += text
        index = len(self.items) - 1
        if text:
            out.append(self.ev("response.output_text.delta", item_id=self.open.id, output_index=index,
                               content_index=0, delta=text, logprobs=[]))  # fmt: skip
        return out

    def call(self, fc: rp.FunctionCallItem) -> list[str]:
        out = self.close("completed")
        self.items.append(fc)
        index, ev = len(self.items) - 1, self.ev
        added = fc.model_copy(update={"arguments": "", "status": "in_progress"})
        return out + [
            ev("response.output_item.added", output_index=index, item=added),
            ev("response.function_call_arguments.delta", item_id=fc.id, output_index=index, delta=fc.arguments),
            ev("response.function_call_arguments.done", item_id=fc.id, output_index=index, arguments=fc.arguments,
               name=fc.name),
            ev("response.output_item.done", output_index=index, item=fc),
        ]  # fmt: skip

    def _start(self, item: rp.OutputMessage | rp.ReasoningItem) -> list[str]:
        out = self.close("completed")
        item.status = "in_progress"
        self.items.append(item)
        self.open, index = item, len(self.items) - 1
        out.append(self.ev("response.output_item.added", output_index=index, item=item))
        part: rp.OutputText | rp.ReasoningText = (
            rp.OutputText(text="") if isinstance(item, rp.OutputMessage) else rp.ReasoningText(text="")
        )
        item.content.append(part)  # type: ignore[arg-type]
        out.append(self.ev("response.content_part.added", item_id=item.id, output_index=index, content_index=0,
                           part=part))  # fmt: skip
        return out

    def close(self, status: str) -> list[str]:
        """The open item's done events (none open: none)."""
        item, self.open = self.open, None
        if item is None:
            return []
        index, part = self.items.index(item), item.content[0]
        item.status = status
        kind = "response.output_text.done" if isinstance(item, rp.OutputMessage) else "response.reasoning_text.done"
        extra = {"logprobs": []} if isinstance(item, rp.OutputMessage) else {}
        return [
            self.ev(kind, item_id=item.id, output_index=index, content_index=0, text=part.text, **extra),
            self.ev("response.content_part.done", item_id=item.id, output_index=index, content_index=0, part=part),
            self.ev("response.output_item.done", output_index=index, item=item),
        ]


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"response {response_id!r} not found (stored responses live in memory, bounded in count "
                    "and age)", param="response_id", code="not_found")  # fmt: skip


def add_responses_routes(app: FastAPI, state: ServerState, store: ResponseStore) -> None:
    @app.post("/v1/responses")
    async def create(body: rp.ResponsesRequest, request: Request) -> Response:
        return await create_response(state, store, body, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> Response:
        entry = store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        return Response(entry.response.model_dump_json(), media_type="application/json")

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict[str, Any]:
        entry = store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        if entry.cancel is not None:
            entry.cancel()
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> Response:
        entry = store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        if not entry.response.background:
            raise bad_request("only background responses can be cancelled", "response_id")
        if entry.cancel is not None:
            entry.cancel()
            entry.cancel = None
            entry.response = entry.response.model_copy(update={"status": "cancelled"})
        return Response(entry.response.model_dump_json(), media_type="application/json")
