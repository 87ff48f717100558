"""One generation request of the OpenAI API, whatever its endpoint: its engine requests started (one per prompt;
429 / 503 refusals), their outputs merged as they arrive, collected for one answer or streamed as SSE events, and
aborted however the client leaves. What a choice, a chunk and the final body look like is the endpoint's
(serving_completion.CompletionGeneration, serving_chat.ChatGeneration)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from lmserve.core.outputs import CompletionOutput, RequestOutput
from lmserve.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream
from lmserve.engine.disaggregation import KVTransferError
from lmserve.engine.token_bytes import TextOffsets
from lmserve.entrypoints.openai import logprobs as lp_fmt
from lmserve.entrypoints.openai import protocol as p
from lmserve.entrypoints.openai.errors import APIError, from_value_error
from lmserve.entrypoints.openai.sse import ChunkTemplate, ClientGone, SSEResponse, cancel_on_disconnect, sse, sse_json
from lmserve.entrypoints.openai.state import ServerState
from lmserve.lora.request import LoRARequest
from lmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class Generation:
    """The endpoint-independent part; subclasses give `final_response`, `stream_choices` and `chunk`."""

    def __init__(
        self,
        state: ServerState,
        engine: AsyncEngine,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        body: p.CompletionRequest | p.ChatCompletionRequest,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.state = state
        self.lora_request = lora_request  # the adapter the body's `model` named (None: the base model)
        self._lora_held = False
        self.engine = engine
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.body = body
        self.model = state.served_model_name if lora_request is None else lora_request.lora_name
        self.created = int(time.time())
        self.streams: list[RequestStream] = []
        self._templates: dict[int, ChunkTemplate] = {}  # per streamed choice: its plain text chunk (plain_event)

    # -- start

    def start(self) -> None:
        kv = {} if self.body.kv_transfer_params is None else {"kv_transfer_params": self.body.kv_transfer_params}
        if self.lora_request is not None and self.state.loras is not None:  # in use until abort(): no unload
            self.state.loras.acquire(self.lora_request)
            self._lora_held = True
        try:
            if kv and (len(self.prompts) != 1 or not hasattr(self.engine, "config") or self.engine.config.kv_transfer
                       is None):  # fmt: skip
                raise ValueError("kv_transfer_params: needs one prompt and a server with --kv-transfer-config")
            for i, ids in enumerate(self.prompts):
                kw = {} if self.lora_request is None else {"lora_request": self.lora_request}
                self.streams.append(self.engine.add_request(f"{self.request_id}-{i}", ids, self.params, **kv, **kw))
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
        if self._lora_held and self.state.loras is not None:
            self._lora_held = False
            self.state.loras.release(self.lora_request)

    async def respond(self, request: Request) -> Response:
        self.start()
        if self.body.stream:
            return SSEResponse(self.events(), on_close=self.abort)
        try:
            finals = await cancel_on_disconnect(request, self.collect())
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the requests are aborted
        finally:
            self.abort()
        body = self.final_response(finals).model_dump_json()
        if finals and finals[0].kv_transfer_params is not None:  # a kv_producer server's answer (lmserve router)
            body = body[:-1] + ',"kv_transfer_params":' + json.dumps(finals[0].kv_transfer_params) + "}"
        return Response(body, media_type="application/json")

    # -- merged outputs of all prompts

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
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
        except KVTransferError as e:  # kv_load_failure_policy fail
            raise APIError(503, f"the request's KV could not be loaded: {e}", code="kv_transfer_failed") from e
        except ValueError as e:
            raise from_value_error(e) from e
        except APIError:
            raise
        except Exception as e:
            logger.exception("request %s failed", self.request_id)
            raise APIError(500, f"request failed in the engine: {type(e).__name__}: {e}") from e
        finally:
            self.abort()

    async def collect(self) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(self.streams)
        async for i, out in self.outputs():
            finals[i] = out
        assert all(f is not None and f.finished for f in finals), "stream ended before its final output"
        return finals  # type: ignore[return-value]

    # -- formatting

    def usage(self, finals: Iterable[RequestOutput | None]) -> p.Usage:
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

    def ordered_choices(self, finals: list[RequestOutput]) -> list[tuple[int, CompletionOutput]]:
        """(choice index, output) of every prompt's n choices, in the answer's order (prompt-major)."""
        n = self.params.n
        pairs = [(i * n + c.index, c) for i, f in enumerate(finals) for c in f.outputs]
        pairs.sort(key=lambda ic: ic[0])
        return pairs

    def text_offsets(self) -> TextOffsets:
        assert self.state.token_bytes is not None, "token_bytes is set with the engine"
        return TextOffsets(self.state.token_bytes, self.params.skip_special_tokens)

    def prompt_logprobs(self, final: RequestOutput) -> p.PromptLogprobs | None:
        """vLLM's `prompt_logprobs` view of a prompt's scores, when the body asked for them."""
        k = self.body.prompt_logprobs
        if k is None:
            return None
        assert self.state.token_bytes is not None, "token_bytes is set with the engine"
        return lp_fmt.prompt_logprobs_view(self.state.token_bytes, final.prompt_logprobs, k)

    def final_response(self, finals: list[RequestOutput]) -> Any:
        raise NotImplementedError

    # -- streaming

    def first_events(self) -> str | None:
        """What goes out before any token (chat: each choice's role)."""
        return None

    def stream_choices(self, idx: int, c: CompletionOutput, out: RequestOutput) -> list[Any]:
        """This step's chunks (each a whole chunk model) for choice `idx`, whose output `c` changed."""
        raise NotImplementedError

    def chunk(self, choices: list[Any], usage: p.Usage | None = None) -> Any:
        raise NotImplementedError

    def is_plain_step(self, idx: int, c: CompletionOutput) -> bool:
        """Whether this step only adds text to choice `idx` (no logprobs, not its first or last chunk, nothing
        else the endpoint adds): then its chunk is `text_chunk(idx, c.delta_text)`."""
        return False

    def text_chunk(self, idx: int, text: str) -> Any:
        """The chunk of a plain step of choice `idx` (is_plain_step) whose new text is `text`."""
        raise NotImplementedError

    def plain_event(self, idx: int, c: CompletionOutput) -> str | None:
        """The SSE event of a plain step (the common token step), spliced into choice `idx`'s template of
        text_chunk (sse.ChunkTemplate, built once); None: this step's chunks need their models."""
        if not self.is_plain_step(idx, c):
            return None
        template = self._templates.get(idx)
        if template is None:
            template = self._templates[idx] = ChunkTemplate(self.text_chunk(idx, ChunkTemplate.MARKER))
        return template(c.delta_text)

    async def events(self) -> AsyncIterator[str]:
        n = self.params.n
        latest: list[RequestOutput | None] = [None] * len(self.streams)
        finished: set[int] = set()
        try:
            first = self.first_events()
            if first is not None:
                yield first
            async for i, out in self.outputs():
                latest[i] = out
                events = []  # one event per choice that changed this step; one write for all of them
                for c in out.outputs:
                    idx = i * n + c.index
                    if not (c.delta_text or c.delta_token_ids) and (not c.finished or idx in finished):
                        continue
                    if c.finished:
                        finished.add(idx)
                    event = self.plain_event(idx, c)
                    if event is not None:
                        events.append(event)
                    else:
                        events.extend(sse(chunk) for chunk in self.stream_choices(idx, c, out))
                if events:
                    yield "".join(events)
            opts = self.body.stream_options
            if opts is not None and opts.include_usage:
                yield sse(self.chunk([], usage=self.usage(latest)))
        except APIError as e:
            yield sse_json(e.body())
        except Exception as e:  # the stream has started: report in-band, never drop silently
            logger.exception("stream %s failed", self.request_id)
            yield sse_json(APIError(500, f"internal server error: {type(e).__name__}: {e}").body())
        yield "data: [DONE]\n\n"


def delta_logprobs(c: CompletionOutput) -> list[Any] | None:
    """The logprob entries of this step's new tokens of `c` (None without logprobs)."""
    if c.logprobs is None:
        return None
    return c.logprobs[len(c.logprobs) - len(c.delta_token_ids) :]


def reason(c: CompletionOutput) -> str | None:
    return None if c.finish_reason is None else str(c.finish_reason)


def finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0
