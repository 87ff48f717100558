"""Load generator for any OpenAI-compatible endpoint (lmserve, vLLM, llama.cpp's server), or lmserve's gRPC API
(`backend="grpc"`, `base_url="grpc://host:port"`): run_load, then finalize into RequestRecords.

The hot loop only timestamps network reads and keeps raw payloads (the client shares the server's CPUs); parsing
happens after the run. arrival_offsets_s gives the open-loop arrivals; LoadConfig.max_concurrency caps requests.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmserve.bench.datasets import BenchRequest
from lmserve.bench.metrics import RequestRecord

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
BACKENDS = ("openai", "grpc")
GRPC_SCHEME = "grpc://"


@dataclass(frozen=True)
class LoadConfig:
    base_url: str  # http(s)://host:port, or grpc://host:port with backend "grpc"
    endpoint: str = "/v1/completions"
    model: str | None = None  # None: the first model the server lists at /v1/models
    request_rate_rps: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout_s: float = 600.0  # per request
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    show_progress: bool = False
    backend: str = "openai"

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        if self.backend == "grpc":
            if not self.base_url.startswith(GRPC_SCHEME):
                raise ValueError(f"--backend grpc: --base-url must be grpc://HOST:PORT, got {self.base_url!r}")
            if self.endpoint != "/v1/completions":
                raise ValueError("--backend grpc sends completions (a text prompt); --endpoint does not apply")
        elif not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {list(ENDPOINTS)}, got {self.endpoint!r}")
        if not (self.request_rate_rps > 0):
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate_rps}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"--burstiness must be a positive number, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not self.timeout_s > 0:
            raise ValueError(f"--request-timeout must be > 0, got {self.timeout_s}")

    @property
    def url(self) -> str:
        if self.backend == "grpc":
            return self.base_url.rstrip("/") + "/lmserve.v1.Generation/GenerateStream"
        return self.base_url.rstrip("/") + self.endpoint

    @property
    def is_chat(self) -> bool:
        return self.endpoint == "/v1/chat/completions"


def arrival_offsets_s(
    num_requests: int, rate_rps: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Scheduled arrival of each request in seconds from the start; the first arrives at 0.

    Gaps are gamma-distributed with mean 1/rate and shape `burstiness` (1 = Poisson); `rate_rps = inf` sends all
    at once.
    """
    if num_requests <= 0:
        return []
    if math.isinf(rate_rps):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps_s = rng.gamma(shape=burstiness, scale=1.0 / (rate_rps * burstiness), size=num_requests - 1)
    return [0.0, *np.cumsum(gaps_s).tolist()]


@dataclass
class RawResponse:
    """What the hot loop keeps: timestamps (seconds from the start) and undecoded SSE `data:` payloads."""

    index: int
    scheduled_s: float
    send_s: float | None = None
    end_s: float | None = None
    status: int | None = None
    events: list[tuple[float, bytes]] = field(default_factory=list)
    error: str | None = None
    done: bool = False  # saw data: [DONE]


def build_payload(req: BenchRequest, cfg: LoadConfig, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": req.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": cfg.temperature,
    }
    if model is not None:
        body["model"] = model
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # vLLM, llama.cpp and lmserve extension: output lengths are exact
    if cfg.is_chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    body.update(cfg.extra_body)
    return body


def _error_message(body: str) -> str:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return body.strip()[:300] or "(empty body)"
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)[:300]
        return str(err)[:300]
    return str(obj)[:300]


async def _stream_one(
    session: Any, cfg: LoadConfig, payload: dict[str, Any], raw: RawResponse, t0: float
) -> None:
    import aiohttp

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    buf = b""
    try:
        async with session.post(cfg.url, json=payload, headers=headers) as resp:
            raw.status = resp.status
            if resp.status != 200:
                raw.error = f"HTTP {resp.status}: {_error_message(await resp.text(errors='replace'))}"
                return
            async for data in resp.content.iter_any():
                t_s = time.perf_counter() - t0
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue  # comments, event:/id: fields, blank separators
                    payload_bytes = line[5:].strip()
                    if payload_bytes == b"[DONE]":
                        raw.done = True
                    else:
                        raw.events.append((t_s, payload_bytes))
    except TimeoutError:
        raw.error = f"timed out after {cfg.timeout_s:g} s"
    except aiohttp.ClientConnectorError as e:
        raw.error = f"cannot connect to {cfg.url}: {e.os_error or e}"
    except aiohttp.ClientError as e:
        raw.error = f"{type(e).__name__}: {e}"
    finally:
        raw.end_s = time.perf_counter() - t0


class EndpointError(Exception):
    """The endpoint cannot be used at all (unreachable, or no model to ask for)."""


async def discover_model(session: Any, base_url: str, timeout_s: float = 10.0) -> str | None:
    """The first model id at GET /v1/models. EndpointError if the server cannot be reached; None if it
    answers without a usable list (some servers don't implement it)."""
    import aiohttp

    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return None
            data = await resp.json(content_type=None)
    except aiohttp.ClientConnectorError as e:
        raise EndpointError(f"cannot connect to {base_url}: {e.os_error or e}") from None
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, ValueError) as e:
        raise EndpointError(f"{url}: {type(e).__name__}: {e}") from None
    models = data.get("data") if isinstance(data, dict) else None
    if isinstance(models, list) and models and isinstance(models[0], dict):
        return models[0].get("id")
    return None


@dataclass
class LoadResult:
    raw: list[RawResponse]
    model: str | None
    start_wall_time: float  # time.time() at the benchmark start
    duration_s: float
    warmup_errors: list[str] = field(default_factory=list)
    fatal_error: str | None = None  # the endpoint was not usable; no request was sent


async def run_load(
    requests: list[BenchRequest], cfg: LoadConfig, warmup: list[BenchRequest] | None = None
) -> LoadResult:
    """Send `requests` by the configured arrival process and concurrency cap; warmup ones first (untimed)."""
    cfg.validate()
    offsets_s = arrival_offsets_s(len(requests), cfg.request_rate_rps, cfg.burstiness, cfg.seed)
    raw = [RawResponse(i, s) for i, s in enumerate(offsets_s)]
    opener = _grpc_client if cfg.backend == "grpc" else _http_client
    async with opener(cfg) as client:
        try:
            model = await client.discover()
        except EndpointError as e:
            return LoadResult(raw, cfg.model, time.time(), 0.0, fatal_error=str(e))
        model = cfg.model or model
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

        async def send(req: BenchRequest, r: RawResponse, t0: float) -> None:
            if sem is None:
                r.send_s = time.perf_counter() - t0
                await client.stream(req, model, r, t0)
                return
            async with sem:
                r.send_s = time.perf_counter() - t0
                await client.stream(req, model, r, t0)

        warm = [RawResponse(-1, 0.0) for _ in warmup or []]
        await asyncio.gather(*(send(q, r, time.perf_counter()) for q, r in zip(warmup or [], warm, strict=True)))
        warmup_errors = [r.error for r in warm if r.error]
        bar = _progress(len(requests), cfg.show_progress)

        async def one(req: BenchRequest, r: RawResponse, t0: float) -> None:
            delay_s = t0 + r.scheduled_s - time.perf_counter()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            await send(req, r, t0)
            if bar is not None:
                bar.update(1)

        start_wall = time.time()
        t0 = time.perf_counter()
        await asyncio.gather(*(one(q, r, t0) for q, r in zip(requests, raw, strict=True)))
        duration_s = time.perf_counter() - t0
        if bar is not None:
            bar.close()
    return LoadResult(raw, model, start_wall, duration_s, warmup_errors)


@dataclass
class _Client:
    """One backend's two operations: the model to ask for, and one timed streaming request."""

    discover: Callable[[], Awaitable[str | None]]
    stream: Callable[[BenchRequest, str | None, RawResponse, float], Awaitable[None]]


@asynccontextmanager
async def _http_client(cfg: LoadConfig) -> AsyncIterator[_Client]:
    import aiohttp

    # The semaphore is the cap; the pool must not add queueing. One connection per request: a server that
    # closes an idle keep-alive connection (llama-server does) would otherwise race the next request on it
    # ("Server disconnected"); a loopback connect costs well under a millisecond.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:

        async def stream(req: BenchRequest, model: str | None, r: RawResponse, t0: float) -> None:
            await _stream_one(session, cfg, build_payload(req, cfg, model), r, t0)

        yield _Client(lambda: discover_model(session, cfg.base_url), stream)


# ---- gRPC (lmserve.v1.Generation) ----------------------------------------------------------------------


def build_grpc_request(req: BenchRequest, cfg: LoadConfig, model: str | None) -> Any:
    """The GenerateRequest of one benchmark request: the same fields `build_payload` sends over HTTP; --extra-body
    keys are SamplingParams fields (lmserve.proto)."""
    from google.protobuf import json_format

    from lmserve.grpc_proto import lmserve_pb2 as pb
    sp = pb.SamplingParams(max_tokens=req.output_len, temperature=cfg.temperature)
    if cfg.ignore_eos:
        sp.ignore_eos = True
    if cfg.extra_body:
        json_format.ParseDict(cfg.extra_body, sp)
    if isinstance(req.prompt, list):  # token ids, as the completions API also takes them (benchmarks/bench_cpu.py)
        return pb.GenerateRequest(model=model or "", token_ids=pb.TokenIds(ids=req.prompt), sampling_params=sp)
    return pb.GenerateRequest(model=model or "", text=req.prompt, sampling_params=sp)


def _grpc_chunk(msg: Any) -> bytes:
    """A GenerateStream message as the OpenAI chunk JSON `finalize` reads (text, token_ids, usage)."""
    obj: dict[str, Any] = {"choices": [{"text": c.text, "token_ids": list(c.token_ids)} for c in msg.choices]}
    if msg.HasField("usage"):
        u = msg.usage
        obj["usage"] = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens}
    return json.dumps(obj).encode()


@asynccontextmanager
async def _grpc_client(cfg: LoadConfig) -> AsyncIterator[_Client]:
    """One channel (HTTP/2 multiplexes the streams, as a gRPC client normally does); the hot loop keeps the
    messages and their arrival times, turned into `finalize`'s chunk JSON after the stream ends."""
    import grpc

    from lmserve.grpc_proto import lmserve_pb2 as pb
    from lmserve.grpc_proto import lmserve_pb2_grpc as pb_grpc
    target = cfg.base_url[len(GRPC_SCHEME) :].rstrip("/")
    metadata = (("authorization", f"Bearer {cfg.api_key}"),) if cfg.api_key else None
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def discover() -> str | None:
            try:
                models = await stub.ListModels(pb.ListModelsRequest(), metadata=metadata, timeout=10.0)
            except grpc.aio.AioRpcError as e:
                raise EndpointError(f"{target}: gRPC {e.code().name}: {e.details()}") from None
            return models.models[0].id if models.models else None

        async def stream(req: BenchRequest, model: str | None, raw: RawResponse, t0: float) -> None:
            messages: list[tuple[float, Any]] = []
            call = stub.GenerateStream(build_grpc_request(req, cfg, model), metadata=metadata, timeout=cfg.timeout_s)
            try:
                async for msg in call:
                    messages.append((time.perf_counter() - t0, msg))
                raw.status, raw.done = 200, True
            except grpc.aio.AioRpcError as e:
                raw.error = f"gRPC {e.code().name}: {e.details()}"
            finally:
                raw.end_s = time.perf_counter() - t0
                raw.events = [(t, _grpc_chunk(m)) for t, m in messages]

        yield _Client(discover, stream)


def _progress(total: int, show: bool) -> Any:
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="bench", unit="req")


# ---- after the run: parse payloads, count tokens -------------------------------------------------------


@dataclass
class _Chunk:
    t_s: float
    text: str
    role_only: bool  # a chat chunk announcing the role, carrying no token
    closing: bool  # finish_reason set, no text, no token ids: may close the stream without a token (llama.cpp)
    num_token_ids: int | None  # len(choices[0].token_ids) when the server sends ids
    cum_completion_tokens: int | None  # usage.completion_tokens on a chunk with choices (continuous stats)


def _parse_events(raw: RawResponse, is_chat: bool) -> tuple[list[_Chunk], dict[str, Any] | None, str | None]:
    """(token-candidate chunks, final usage, mid-stream error)."""
    chunks: list[_Chunk] = []
    usage: dict[str, Any] | None = None
    for t_s, payload in raw.events:
        try:
            obj = json.loads(payload)
        except json.JSONDecodeError:
            return chunks, usage, f"bad SSE payload: {payload[:200]!r}"
        if not isinstance(obj, dict):
            continue
        if "error" in obj:
            return chunks, usage, f"error in stream: {_error_message(json.dumps(obj))}"
        u = obj.get("usage")
        choices = obj.get("choices") or []
        if choices and isinstance(choices[0], dict):
            c = choices[0]
            role_only = False
            if is_chat:
                delta = c.get("delta") or {}
                text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                role_only = bool(delta.get("role")) and not text
            else:
                text = c.get("text") or ""
            ids = c.get("token_ids")
            cum = u.get("completion_tokens") if isinstance(u, dict) else None
            closing = c.get("finish_reason") is not None and not text and not ids
            chunks.append(_Chunk(t_s, text, role_only, closing, len(ids) if isinstance(ids, list) else None, cum))
        if isinstance(u, dict):
            usage = u
    return chunks, usage, None


def _largest_remainder(total: int, weights: list[float]) -> list[int]:
    s = sum(weights)
    if s <= 0:
        weights, s = [1.0] * len(weights), float(len(weights))
    exact = [total * w / s for w in weights]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(exact)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def finalize(raw: RawResponse, req: BenchRequest, is_chat: bool, tokenizer: Any = None) -> RequestRecord:
    """Turn a raw response into a RequestRecord: which chunks carry tokens, and how many.

    Output token count: usage.completion_tokens when present, else the tokenizer on the whole text, else
    the number of non-empty chunks. Per-chunk counts, most exact first: cumulative usage on every chunk
    (vLLM's continuous_usage_stats), token_ids on the chunks, one per chunk when the number of chunks with
    text (or of all chunks but a chat role chunk, and but a closing chunk with only finish_reason, as
    llama.cpp streams a token whose text is still held back) equals the output token count, else the total spread
    over the chunks in proportion to their tokenized text.
    """
    rec = RequestRecord(
        index=raw.index,
        prompt_len=req.prompt_len,
        requested_output_len=req.output_len,
        scheduled_s=raw.scheduled_s,
        send_s=raw.send_s,
        end_s=raw.end_s,
    )
    if raw.error is not None:
        rec.error = raw.error
        return rec
    chunks, usage, stream_error = _parse_events(raw, is_chat)
    if stream_error is not None:
        rec.error = stream_error
        return rec
    text = "".join(c.text for c in chunks)
    rec.generated_text = text
    if usage is not None and isinstance(usage.get("prompt_tokens"), int):
        rec.server_prompt_len = usage["prompt_tokens"]

    counts: list[int] | None = None
    if chunks and all(c.cum_completion_tokens is not None for c in chunks):
        cums = [int(c.cum_completion_tokens or 0) for c in chunks]
        counts = [b - a for a, b in zip([0, *cums[:-1]], cums, strict=True)]
        rec.chunk_tokens_source = "continuous_usage"
    elif chunks and all(c.num_token_ids is not None for c in chunks):
        counts = [int(c.num_token_ids or 0) for c in chunks]
        rec.chunk_tokens_source = "token_ids"

    if usage is not None and isinstance(usage.get("completion_tokens"), int):
        total, rec.output_tokens_source = usage["completion_tokens"], "usage"
    elif counts is not None:
        total, rec.output_tokens_source = sum(counts), rec.chunk_tokens_source
    elif tokenizer is not None:
        total, rec.output_tokens_source = len(tokenizer.encode(text, add_special_tokens=False)), "tokenizer"
    else:
        total, rec.output_tokens_source = sum(1 for c in chunks if c.text), "chunks"

    if counts is None or sum(counts) != total:
        with_text = sum(1 for c in chunks if c.text)
        candidates = sum(1 for c in chunks if not c.role_only)
        closed = bool(chunks) and chunks[-1].closing  # a last chunk with only finish_reason (and usage)
        if with_text == total:
            counts = [1 if c.text else 0 for c in chunks]
            rec.chunk_tokens_source = "one_per_chunk"
        elif candidates == total:  # some tokens produced no text yet (e.g. half a UTF-8 character)
            counts = [0 if c.role_only else 1 for c in chunks]
            rec.chunk_tokens_source = "one_per_chunk"
        elif closed and candidates - 1 == total:  # llama.cpp: a chunk per token, text or not, then the closing one
            counts = [0 if c.role_only else 1 for c in chunks[:-1]] + [0]
            rec.chunk_tokens_source = "one_per_chunk"
        else:
            if tokenizer is not None:
                weights = [len(tokenizer.encode(c.text, add_special_tokens=False)) for c in chunks]
            else:
                weights = [1.0 if c.text else 0.0 for c in chunks]
            counts = _largest_remainder(total, weights) if chunks else []
            rec.chunk_tokens_source = "tokenizer_estimate" if tokenizer is not None else "text_chunk_estimate"

    kept = [(c.t_s, k) for c, k in zip(chunks, counts, strict=True) if k > 0]
    rec.chunk_times_s = [t for t, _ in kept]
    rec.chunk_num_tokens = [k for _, k in kept]
    rec.num_output_tokens = total
    if total <= 0 or not kept:
        rec.error = "the response ended without any output token"
        return rec
    rec.success = True
    return rec


def finalize_all(
    result: LoadResult, requests: list[BenchRequest], cfg: LoadConfig, tokenizer: Any = None
) -> list[RequestRecord]:
    if result.fatal_error is not None:
        return [
            RequestRecord(
                index=r.index,
                prompt_len=q.prompt_len,
                requested_output_len=q.output_len,
                scheduled_s=r.scheduled_s,
                error=result.fatal_error,
            )
            for r, q in zip(result.raw, requests, strict=True)
        ]
    return [finalize(r, q, cfg.is_chat, tokenizer) for r, q in zip(result.raw, requests, strict=True)]
