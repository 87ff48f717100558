"""POST /v1/chat/completions: the route's work (messages through the chat template, params, constraint and tools,
lengths) and its answer's shape — assistant messages or tool calls (tools.ToolCallFormatter), OpenAI's chat
logprobs, vLLM's top-level `prompt_logprobs`; streamed as the role first, then deltas."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from lmserve.core.outputs import CompletionOutput, RequestOutput
from lmserve.entrypoints.openai import protocol as p
from lmserve.entrypoints.openai import request_inputs as inputs
from lmserve.entrypoints.openai import tools
from lmserve.entrypoints.openai.errors import bad_request
from lmserve.entrypoints.openai.generation import Generation, delta_logprobs, finite, reason
from lmserve.entrypoints.openai.sse import sse
from lmserve.entrypoints.openai.state import ServerState


async def create_chat_completion(state: ServerState, body: p.ChatCompletionRequest, request: Request) -> Response:
    gen = await chat_generation(state, body, ChatGeneration, f"chatcmpl-{uuid.uuid4().hex}")
    return await gen.respond(request)


async def chat_generation(
    state: ServerState,
    body: p.ChatCompletionRequest,
    cls: type[ChatGeneration],
    request_id: str,
    template_kwargs: dict[str, Any] | None = None,
) -> ChatGeneration:
    """A chat body's generation, not started: `cls` formats it (the Responses and Anthropic Messages APIs translate
    their bodies to a chat body and give their own subclass); `template_kwargs` go to the chat template."""
    engine = state.ready_engine()
    lora = inputs.check_model(state, body.model)
    max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    params = inputs.sampling_params_of(engine, body, {"max_tokens": max_param, "logprobs": "top_logprobs"})
    if not body.messages:
        raise bad_request("messages must be a non-empty list", "messages")
    params, constraint = await inputs.constrain(engine, body, params)
    plan = constraint.tools
    shown = plan.tools if plan is not None and tools.template_supports_tools(engine.tokenizer) else None
    prompts = [inputs.render_chat(engine, body.messages, body.add_generation_prompt, shown, template_kwargs)]
    inputs.check_lengths(engine, prompts, params, max_param)
    gen = cls(state, engine, request_id, prompts, params, body, lora_request=lora)
    if plan is not None:
        gen.tool_calls = tools.ToolCallFormatter(plan)
    return gen


class ChatGeneration(Generation):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tool_calls: tools.ToolCallFormatter | None = None  # with tools: formats tool_calls
        self._prompt_logprobs_sent = False  # streamed: they go in the first chunk with output

    def final_response(self, finals: list[RequestOutput]) -> p.ChatCompletionResponse:
        choices = []
        for idx, c in self.ordered_choices(finals):
            message, why = p.AssistantMessage(content=c.text), reason(c)
            if self.tool_calls is not None:
                message, why = self.tool_calls.message(c)
            choices.append(
                p.ChatChoice(
                    index=idx,
                    message=message,
                    logprobs=self.chat_logprobs(c.logprobs),
                    finish_reason=why,
                    stop_reason=c.stop_reason,
                )
            )
        return p.ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self.usage(finals),
            prompt_logprobs=self.prompt_logprobs(finals[0]),
        )

    def chat_logprobs(self, entries: list[Any] | None) -> p.ChatLogprobs | None:
        if entries is None:
            return None
        tb = self.state.token_bytes
        assert tb is not None, "token_bytes is set with the engine"
        content = []
        for e in entries:
            if e is None:
                continue
            top = [
                p.TopLogprob(token=tb.token_text(t), logprob=finite(lp), bytes=list(tb.bytes_of(t)))
                for t, lp in e.top_logprobs
            ]
            content.append(
                p.ChatTokenLogprob(
                    token=tb.token_text(e.token_id),
                    logprob=finite(e.logprob),
                    bytes=list(tb.bytes_of(e.token_id)),
                    top_logprobs=top,
                )
            )
        return p.ChatLogprobs(content=content)

    # -- streaming

    def first_events(self) -> str | None:
        """The role goes out at once, before any token, for every choice."""
        role = p.DeltaMessage(role="assistant", content="")
        return "".join(
            sse(self.chunk([p.ChatChunkChoice(index=i, delta=role)])) for i in range(len(self.streams) * self.params.n)
        )

    def stream_choices(self, idx: int, c: CompletionOutput, out: RequestOutput) -> list[Any]:
        if self.tool_calls is not None:  # none while a call is held back
            choices = self.tool_calls.chunk_choices(idx, c, self.chat_logprobs)
        else:
            choices = [
                p.ChatChunkChoice(
                    index=idx,
                    delta=p.DeltaMessage(content=c.delta_text),
                    logprobs=self.chat_logprobs(delta_logprobs(c)),
                    finish_reason=reason(c) if c.finished else None,
                    stop_reason=c.stop_reason if c.finished else None,
                )
            ]
        chunks = []
        for choice in choices:
            chunk = self.chunk([choice])
            if not self._prompt_logprobs_sent:
                self._prompt_logprobs_sent = True
                prompt_lp = self.prompt_logprobs(out)
                if prompt_lp is not None:
                    chunk = chunk.model_copy(update={"prompt_logprobs": prompt_lp})
            chunks.append(chunk)
        return chunks

    def is_plain_step(self, idx: int, c: CompletionOutput) -> bool:
        return self._prompt_logprobs_sent and self.tool_calls is None and not c.finished and c.logprobs is None

    def text_chunk(self, idx: int, text: str) -> p.ChatCompletionChunk:
        return self.chunk([p.ChatChunkChoice(index=idx, delta=p.DeltaMessage(content=text))])

    def chunk(self, choices: list[Any], usage: p.Usage | None = None) -> p.ChatCompletionChunk:
        return p.ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )
