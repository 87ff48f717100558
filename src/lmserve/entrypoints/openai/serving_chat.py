"""POST /v1/chat/completions: the route's work (messages through the chat template, params, constraint and tools,
lengths) and its answer's shape — reasoning split from content (the server's reasoning parser), assistant messages
or tool calls (tools.ToolCallFormatter with the tool parser), OpenAI's chat logprobs, vLLM's top-level
`prompt_logprobs`; streamed as the role first, then deltas (reasoning before content)."""

from __future__ import annotations

import dataclasses
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
    try:
        kwargs = state.chat.template_kwargs(body.chat_template_kwargs, body.reasoning_effort)
    except p.RequestError as e:
        raise bad_request(str(e), e.param) from None
    kwargs.update(template_kwargs or {})
    constraint = inputs.constraint_of(engine, body)
    plan = constraint.tools
    shown = plan.tools if plan is not None and tools.template_supports_tools(engine.tokenizer) else None
    text, ids = inputs.chat_prompt(engine, body.messages, body.add_generation_prompt, shown, kwargs)
    # the grammar follows this prompt's reasoning block
    params = await inputs.apply_constraint(engine, constraint, params, state.chat.reasoning(text))
    if state.chat.keeps_special_tokens or (plan is not None and state.chat.tools.keeps_special_tokens):
        params = dataclasses.replace(params, skip_special_tokens=False)  # the parsers' markers are special tokens
    inputs.check_lengths(engine, [ids], params, max_param)
    gen = cls(state, engine, request_id, [ids], params, body, lora_request=lora)
    gen.prompt_text = text
    if plan is not None:
        gen.tool_calls = tools.ToolCallFormatter(plan, state.chat.tools)
    return gen


class ChatGeneration(Generation):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tool_calls: tools.ToolCallFormatter | None = None  # with tools: formats tool_calls
        self._prompt_logprobs_sent = False  # streamed: they go in the first chunk with output
        self.prompt_text = ""  # the rendered conversation (a template may open the reasoning in it)
        self._splits: dict[int, _Split] = {}  # streamed, with a reasoning parser: per choice

    def split(self, c: CompletionOutput) -> tuple[str | None, CompletionOutput]:
        """(reasoning, the output with only its content as text) of a finished choice."""
        parser = self.state.chat.reasoning(self.prompt_text)
        if parser is None:
            return None, c
        reasoning, content = parser.extract(c.text)
        return reasoning, dataclasses.replace(c, text=content or "")

    def final_response(self, finals: list[RequestOutput]) -> p.ChatCompletionResponse:
        choices = []
        for idx, whole in self.ordered_choices(finals):
            thought, c = self.split(whole)
            message, why = p.AssistantMessage(content=c.text), reason(c)
            if self.tool_calls is not None:
                message, why = self.tool_calls.message(c)
            if self.state.chat.reasoning_cls is not None and message.content == "":
                message.content = None
            if thought is not None and self.body.include_reasoning:
                message.reasoning_content = message.reasoning = thought
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

    def usage(self, finals: Any) -> p.Usage:
        """With a reasoning parser, completion_tokens_details.reasoning_tokens: the tokens up to the reasoning's end."""
        out = super().usage(finals)
        if self.state.chat.reasoning_cls is None:
            return out
        parser = self.state.chat.reasoning(self.prompt_text)
        assert parser is not None
        count = 0
        for f in finals:
            for c in [] if f is None else f.outputs:
                count += self._tokens_upto(c.token_ids, parser.reasoning_end(c.text))
        out.completion_tokens_details = p.CompletionTokensDetails(reasoning_tokens=count)
        return out

    def _tokens_upto(self, ids: list[int], chars: int) -> int:
        """The fewest of `ids` whose text holds its first `chars` characters (binary search over decodes)."""
        if chars <= 0:
            return 0
        decode = self.engine.tokenizer.decode
        skip = self.params.skip_special_tokens
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(decode(ids[:mid], skip_special_tokens=skip)) >= chars:
                hi = mid
            else:
                lo = mid + 1
        return lo

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
        choices = []
        if self.state.chat.reasoning_cls is not None:
            choices, c = self._reasoning_step(idx, c)
        if self.tool_calls is not None:  # none while a call is held back
            choices += self.tool_calls.chunk_choices(idx, c, self.chat_logprobs)
        elif self.state.chat.reasoning_cls is None:
            choices.append(
                p.ChatChunkChoice(
                    index=idx,
                    delta=p.DeltaMessage(content=c.delta_text),
                    logprobs=self.chat_logprobs(delta_logprobs(c)),
                    finish_reason=reason(c) if c.finished else None,
                    stop_reason=c.stop_reason if c.finished else None,
                )
            )
        elif c.delta_text or c.finished:
            lp = self._splits[idx].unsent_logprobs(c) if not choices else None
            choices.append(
                p.ChatChunkChoice(
                    index=idx,
                    delta=p.DeltaMessage(content=c.delta_text or None),
                    logprobs=self.chat_logprobs(lp) if lp else None,
                    finish_reason=reason(c) if c.finished else None,
                    stop_reason=c.stop_reason if c.finished else None,
                )
            )
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

    def _reasoning_step(self, idx: int, c: CompletionOutput) -> tuple[list[p.ChatChunkChoice], CompletionOutput]:
        """This step's reasoning chunk (if any), and `c` with its content only: text so far and delta."""
        split = self._splits.get(idx)
        if split is None:
            parser = self.state.chat.reasoning(self.prompt_text)
            assert parser is not None
            split = self._splits[idx] = _Split(parser)
        thought, content = split.parser.feed(c.delta_text)
        if c.finished:
            more_thought, more_content = split.parser.finish()
            thought, content = thought + more_thought, content + more_content
        split.content += content
        c = dataclasses.replace(c, text=split.content, delta_text=content)
        if not thought or not self.body.include_reasoning:
            return [], c
        lp = split.unsent_logprobs(c) if self.tool_calls is None else None
        delta = p.DeltaMessage(reasoning_content=thought, reasoning=thought)
        return [p.ChatChunkChoice(index=idx, delta=delta, logprobs=self.chat_logprobs(lp) if lp else None)], c

    def is_plain_step(self, idx: int, c: CompletionOutput) -> bool:
        return (
            self._prompt_logprobs_sent
            and self.tool_calls is None
            and self.state.chat.reasoning_cls is None
            and not c.finished
            and c.logprobs is None
        )

    def text_chunk(self, idx: int, text: str) -> p.ChatCompletionChunk:
        return self.chunk([p.ChatChunkChoice(index=idx, delta=p.DeltaMessage(content=text))])

    def chunk(self, choices: list[Any], usage: p.Usage | None = None) -> p.ChatCompletionChunk:
        return p.ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )


class _Split:
    """One streamed choice's reasoning parser, its content so far, and the logprob entries sent."""

    def __init__(self, parser: Any) -> None:
        self.parser = parser
        self.content = ""
        self.sent_logprobs = 0

    def unsent_logprobs(self, c: CompletionOutput) -> list[Any] | None:
        if c.logprobs is None:
            return None
        start, self.sent_logprobs = self.sent_logprobs, len(c.logprobs)
        return c.logprobs[start:]
