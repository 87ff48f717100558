"""The messages between the API process (EngineCoreClient) and its engine-core processes, and their encoding (Codec).

msgpack via msgspec with typed decoders into the engine's own dataclasses (nothing unpickled from a socket);
logprobs cross as tails (LogprobTails: cut in the core, joined cumulative by the client), so a long stream with
top logprobs costs O(tokens), not O(tokens²). See docs/processes.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from lmserve.core.outputs import RequestOutput
from lmserve.engine.kv_transfer import KVHandoff
from lmserve.engine.snapshot import EngineSnapshot
from lmserve.lora.request import LoRARequest
from lmserve.sample.sampler import TokenLogprobs
from lmserve.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    do_remote_decode: bool = False  # a prefill core: stop after the first token, hand the KV off (disaggregation)
    remote_kv: KVHandoff | None = None  # a decode core: continue from this handoff
    lora_request: LoRARequest | None = None  # the adapter (each core loads it from lora_path on first use)


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class WatchBlockMap(msgspec.Struct, tag=True):
    """One dashboard started (on) or stopped (off) watching the KV block map (AsyncEngine.watch_block_map)."""

    on: bool


class ResetPrefixCache(msgspec.Struct, tag=True):
    """Forget every cached prefix (LLMEngine.reset_prefix_cache) before the adds sent after this message."""

    include_disk: bool = False  # the disk tier's blocks too


class Shutdown(msgspec.Struct, tag=True):
    """Finish at once: the core exits its loop (requests still running are dropped) and its process ends."""


CoreInput = AddRequest | AbortRequests | WatchBlockMap | ResetPrefixCache | Shutdown


class AddFailure(msgspec.Struct):
    """An add the engine refused (LLMEngine.add_request raised): the request fails alone."""

    request_id: str
    error_type: str  # "ValueError" (the request's fault, a 400) or another exception's name
    message: str


class CoreReady(msgspec.Struct, tag=True):
    """The core loaded its model and listens; sent once, before any StepOutputs."""

    engine_index: int
    pid: int
    snapshot: EngineSnapshot


class StepOutputs(msgspec.Struct, tag=True):
    """Everything one pass of the core loop produced: the adds it applied (`added`, acknowledging them to
    admission, and `failed`), the step's outputs, and the engine's snapshot after the step.

    `outputs[*].prompt_token_ids` is left empty: the client has every prompt and puts it back. The snapshot
    carries a block map only when the core rebuilt it (at most once a second while watched); the client keeps
    the latest."""

    engine_index: int
    outputs: list[RequestOutput]
    snapshot: EngineSnapshot
    added: list[str] = []
    failed: list[AddFailure] = []
    handoffs: list[KVHandoff] = []  # a prefill core's requests handed off this step (their first token is in outputs)


class CoreFailed(msgspec.Struct, tag=True):
    """The core loop raised: the process exits right after sending this."""

    engine_index: int
    error: str


CoreOutput = CoreReady | StepOutputs | CoreFailed


class Codec:
    """Encoder plus typed decoders for both directions (one per thread that uses it: not thread-safe)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._input_decoder = msgspec.msgpack.Decoder(CoreInput)
        self._output_decoder = msgspec.msgpack.Decoder(CoreOutput)

    def encode(self, message: CoreInput | CoreOutput) -> bytes:
        return self._encoder.encode(message)

    def decode_input(self, data: bytes) -> CoreInput:
        return self._input_decoder.decode(data)

    def decode_output(self, data: bytes) -> CoreOutput:
        message = self._output_decoder.decode(data)
        if isinstance(message, StepOutputs):
            for out in message.outputs:
                _restore_logprobs(out)
        return message


def _restore_logprobs(out: RequestOutput) -> None:
    if out.prompt_logprobs is not None:
        out.prompt_logprobs = _token_logprobs(out.prompt_logprobs)
    for c in out.outputs:
        if c.logprobs is not None:
            c.logprobs = _token_logprobs(c.logprobs)


def _token_logprobs(entries: list[Any]) -> list[TokenLogprobs | None]:
    return [None if e is None else msgspec.convert(e, TokenLogprobs) for e in entries]


class LogprobTails:
    """One side's record of the logprob entries that crossed, per request (see the module docstring)."""

    def __init__(self) -> None:
        self._counts: dict[str, dict[int, int]] = {}  # engine core: request → {sequence index (-1: prompt): entries}
        self._joined: dict[str, dict[int, list[Any]]] = {}  # client: request → {sequence index: entries}

    def cut(self, out: RequestOutput) -> RequestOutput:
        """out with its logprobs cut to what was not sent before (engine core; out itself is not changed)."""
        if out.finished:
            self._counts.pop(out.request_id, None)
            return out
        sent = self._counts.setdefault(out.request_id, {})
        changes: dict[str, Any] = {}
        if out.prompt_logprobs is not None:
            changes["prompt_logprobs"] = out.prompt_logprobs[sent.get(-1, 0) :]
            sent[-1] = len(out.prompt_logprobs)
        outputs = []
        for c in out.outputs:
            if c.logprobs is not None:
                n, sent[c.index] = sent.get(c.index, 0), len(c.logprobs)
                c = dataclasses.replace(c, logprobs=c.logprobs[n:])
            outputs.append(c)
        return dataclasses.replace(out, outputs=outputs, **changes)

    def forget(self, request_id: str) -> None:
        """The request ended without a finished output (aborted)."""
        self._counts.pop(request_id, None)
        self._joined.pop(request_id, None)

    def join(self, out: RequestOutput) -> None:
        """Make out's logprobs cumulative again, in place (client)."""
        if out.finished:
            self._joined.pop(out.request_id, None)
            return
        joined = self._joined.setdefault(out.request_id, {})
        if out.prompt_logprobs is not None:
            out.prompt_logprobs = _extended(joined, -1, out.prompt_logprobs)
        for c in out.outputs:
            if c.logprobs is not None:
                c.logprobs = _extended(joined, c.index, c.logprobs)


def _extended(joined: dict[int, list[Any]], key: int, tail: list[Any]) -> list[Any]:
    acc = joined.setdefault(key, [])
    acc.extend(tail)
    return list(acc)  # a copy: an output handed on earlier keeps its own
