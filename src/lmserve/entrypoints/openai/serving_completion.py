"""POST /v1/completions: the route's work (prompts, params, constraint, lengths) and its answer's shape —
choices with text and OpenAI's completion logprobs, `echo` (the prompt's text and logprobs in front of the first
part of each choice), vLLM's `prompt_logprobs`; streamed as text chunks with per-choice text offsets."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from lmserve.core.outputs import CompletionOutput, RequestOutput
from lmserve.engine.token_bytes import TextOffsets
from lmserve.entrypoints.openai import logprobs as lp_fmt
from lmserve.entrypoints.openai import protocol as p
from lmserve.entrypoints.openai import request_inputs as inputs
from lmserve.entrypoints.openai.errors import bad_request
from lmserve.entrypoints.openai.generation import Generation, delta_logprobs, reason
from lmserve.entrypoints.openai.state import ServerState


async def create_completion(state: ServerState, body: p.CompletionRequest, request: Request) -> Response:
    engine = state.ready_engine()
    lora = inputs.check_model(state, body.model)
    params = inputs.sampling_params_of(engine, body, {})
    params, _ = await inputs.constrain(engine, body, params)
    prompts = inputs.completion_prompts(engine, body.prompt)
    if len(prompts) * params.actual_best_of > inputs.MAX_SEQS_PER_REQUEST:
        raise bad_request(f"n × number of prompts must be at most {inputs.MAX_SEQS_PER_REQUEST}", "n")
    inputs.check_lengths(engine, prompts, params, "max_tokens")
    gen = CompletionGeneration(state, engine, f"cmpl-{uuid.uuid4().hex}", prompts, params, body, lora_request=lora)
    if body.echo:
        gen.echo_texts = lp_fmt.prompt_texts(body.prompt)
    return await gen.respond(request)


class CompletionGeneration(Generation):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # with echo: per prompt its text as sent (None for token ids), and what echo puts in front
        self.echo_texts: list[str | None] | None = None
        self._echoed: dict[int, lp_fmt.EchoedPrompt] = {}
        self._offsets: dict[int, TextOffsets] = {}  # per streamed choice: its text position across chunks

    def final_response(self, finals: list[RequestOutput]) -> p.CompletionResponse:
        n = self.params.n
        pairs = self.ordered_choices(finals)
        choices = [self.completion_choice(idx, c, finals[idx // n], c.text, c.logprobs) for idx, c in pairs]
        return p.CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=self.usage(finals)
        )

    def completion_choice(
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
        echo = self.echo(idx // self.params.n, final)
        base = len(echo.text) if echo is not None else 0  # the completion's offsets count the echoed prompt
        logprobs = self._completion_logprobs(entries, offsets or self.text_offsets(), base)
        if echo is not None and first:
            text, logprobs = echo.text + text, lp_fmt.joined(echo.logprobs, logprobs)
        return p.CompletionChoice(
            index=idx,
            text=text,
            logprobs=logprobs,
            finish_reason=reason(c) if c.finished else None,
            stop_reason=c.stop_reason if c.finished else None,
            prompt_logprobs=self.prompt_logprobs(final) if first else None,
        )

    def echo(self, i: int, final: RequestOutput) -> lp_fmt.EchoedPrompt | None:
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

    def _completion_logprobs(
        self, entries: list[Any] | None, offsets: TextOffsets, base: int = 0
    ) -> p.CompletionLogprobs | None:
        """`offsets` carries the choice's text position from one call to the next (one per choice)."""
        if entries is None:
            return None
        assert self.state.token_bytes is not None, "token_bytes is set with the engine"
        return lp_fmt.completion_logprobs(self.state.token_bytes, entries, offsets, base=base)

    def stream_choices(self, idx: int, c: CompletionOutput, out: RequestOutput) -> list[Any]:
        first = idx not in self._offsets
        if first:
            self._offsets[idx] = self.text_offsets()
        choice = self.completion_choice(idx, c, out, c.delta_text, delta_logprobs(c), self._offsets[idx], first)
        return [self.chunk([choice])]

    def is_plain_step(self, idx: int, c: CompletionOutput) -> bool:
        return idx in self._offsets and not c.finished and c.logprobs is None  # (echo: in the first chunk only)

    def text_chunk(self, idx: int, text: str) -> p.CompletionChunk:
        return self.chunk([p.CompletionChoice(index=idx, text=text)])

    def chunk(self, choices: list[Any], usage: p.Usage | None = None) -> p.CompletionChunk:
        return p.CompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )
