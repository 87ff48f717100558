"""The server in-process (httpx ASGITransport): every bad input → its status and OpenAI error body, auth, body
cap, loading / dead engine, overload → 429, non-streaming disconnect → abort, and a schemathesis fuzz pass."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmserve.config.engine import EngineArgs
from lmserve.engine.async_engine import AsyncEngine
from lmserve.engine.llm_engine import LLMEngine
from lmserve.entrypoints.openai.server import build_app
from tests.engine.test_async_engine import gate_steps
from tests.helpers import steps_held_after_first
from tests.server.test_server import make_chat_model

MAX_MODEL_LEN = 48
NAME = "tiny"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def chat_model(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_model(llama_dir, tmp_path_factory.mktemp("validation") / "model")


def new_engine(model_dir: Path, **kwargs: Any) -> AsyncEngine:
    queue = kwargs.pop("max_queued_requests", None)
    args = dict(num_kv_blocks=64, block_size=16, max_model_len=MAX_MODEL_LEN)
    args.update(kwargs)
    return AsyncEngine(
        LLMEngine.from_engine_args(EngineArgs.from_kwargs(str(model_dir), **args)), max_queued_requests=queue
    )


@pytest.fixture(scope="module")
def engine(chat_model: Path) -> Iterator[AsyncEngine]:
    e = new_engine(chat_model)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def app(engine: AsyncEngine) -> FastAPI:
    return build_app(engine, served_model_name=NAME)


def call(app: FastAPI, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
            return await c.request(method, path, **kwargs)

    return asyncio.run(run())


# ---- every bad input: status, type, param --------------------------------------------------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

BAD_INPUTS: list[tuple[str, str, Any, int, str | None, str]] = [
    # (id, path, body (bytes = raw), status, param, message fragment)
    ("bad-json", C, b'{"prompt": "x",', 400, None, "not valid JSON"),
    ("not-an-object", C, b"[1, 2]", 400, None, "JSON object"),
    ("empty-body", C, b"", 400, None, "JSON"),
    ("missing-prompt", C, {"max_tokens": 3}, 400, "prompt", "required"),
    ("prompt-wrong-type", C, {"prompt": 5}, 400, "prompt", "prompt"),
    ("prompt-float-ids", C, {"prompt": [1.5, 2]}, 400, "prompt", "prompt"),
    ("max-tokens-string", C, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "integer"),
    ("max-tokens-float", C, {"prompt": "x", "max_tokens": 5.0}, 400, "max_tokens", "integer"),
    ("max-tokens-zero", C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("temperature-string", C, {"prompt": "x", "temperature": "hot"}, 400, "temperature", "number"),
    ("temperature-negative", C, {"prompt": "x", "temperature": -0.5}, 400, "temperature", ">= 0"),
    ("temperature-too-high", C, {"prompt": "x", "temperature": 3}, 400, "temperature", "[0, 2]"),
    ("stream-not-bool", C, {"prompt": "x", "stream": "yes"}, 400, "stream", "boolean"),
    ("ignore-eos-int", C, {"prompt": "x", "ignore_eos": 1}, 400, "ignore_eos", "boolean"),
    ("n-zero", C, {"prompt": "x", "n": 0}, 400, "n", "n must be"),
    ("n-too-large", C, {"prompt": "x", "n": 1000}, 400, "n", "at most 128"),
    ("top-p-zero", C, {"prompt": "x", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("top-p-above-one", C, {"prompt": "x", "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    ("top-k-negative", C, {"prompt": "x", "top_k": -5}, 400, "top_k", "top_k"),
    ("min-p-above-one", C, {"prompt": "x", "min_p": 2}, 400, "min_p", "[0, 1]"),
    ("presence-penalty", C, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", "[-2, 2]"),
    ("frequency-penalty", C, {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty", "[-2, 2]"),
    ("repetition-penalty", C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", "> 0"),
    ("logprobs-too-many", C, {"prompt": "x", "logprobs": 21}, 400, "logprobs", "[0, 20]"),
    ("too-many-stops", C, {"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, 400, "stop", "at most 16"),
    ("empty-stop", C, {"prompt": "x", "stop": [""]}, 400, "stop", "non-empty"),
    ("stop-token-negative", C, {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids", ">= 0"),
    ("stop-token-outside-vocab", C, {"prompt": "x", "stop_token_ids": [10**6]}, 400, "stop_token_ids", "512"),
    ("logit-bias-key", C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias", "token ids"),
    ("logit-bias-value", C, {"prompt": "x", "logit_bias": {"5": 500}}, 400, "logit_bias", "[-100, 100]"),
    ("logit-bias-outside-vocab", C, {"prompt": "x", "logit_bias": {"100000": 1}}, 400, "logit_bias", "512"),
    ("seed-too-big", C, {"prompt": "x", "seed": 2**70}, 400, "seed", "64-bit"),
    (
        "min-tokens-above-max",
        C,
        {"prompt": "x", "max_tokens": 3, "min_tokens": 5},
        400,
        "min_tokens",
        "<= max",
    ),
    ("best-of-below-n", C, {"prompt": "x", "n": 3, "best_of": 2}, 400, "best_of", "[n=3, 128]"),
    ("best-of-stream", C, {"prompt": "x", "best_of": 3, "stream": True}, 400, "best_of", "cannot stream"),
    ("echo-best-of", C, {"prompt": "x", "echo": True, "n": 1, "best_of": 2}, 400, "best_of", "echo"),
    ("max-tokens-negative-echo", C, {"prompt": "x", "echo": True, "max_tokens": -1}, 400, "max_tokens", ">= 0"),
    ("prompt-logprobs-21", C, {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs", "[0, 20]"),
    ("prompt-logprobs-negative", C, {"prompt": "x", "prompt_logprobs": -1}, 400, "prompt_logprobs", "[0, 20]"),
    ("prompt-logprobs-float", C, {"prompt": "x", "prompt_logprobs": 1.0}, 400, "prompt_logprobs", "integer"),
    ("echo-not-bool", C, {"prompt": "x", "echo": 1}, 400, "echo", "boolean"),
    ("chat-echo", CHAT, {"messages": MSG, "echo": True}, 400, "echo", "not supported on chat"),
    ("chat-prompt-logprobs-21", CHAT, {"messages": MSG, "prompt_logprobs": 21}, 400, "prompt_logprobs", "20"),
    ("chat-max-tokens-zero", CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    (
        "chat-max-completion-zero",
        CHAT,
        {"messages": MSG, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
        ">= 1",
    ),
    ("empty-prompt", C, {"prompt": ""}, 400, "prompt", "empty"),
    ("empty-prompt-list", C, {"prompt": []}, 400, "prompt", "empty"),
    ("empty-token-list", C, {"prompt": [[]]}, 400, "prompt", "empty"),
    ("token-out-of-vocab", C, {"prompt": [99999]}, 400, "prompt", "out of range"),
    ("too-many-prompts", C, {"prompt": ["a"] * 200}, 400, "prompt", "at most 128"),
    ("too-many-sequences", C, {"prompt": ["a"] * 100, "n": 3}, 400, "n", "at most 256"),
    (
        "prompt-too-long",
        C,
        {"prompt": [7] * 100},
        400,
        "prompt",
        "prompt is 100 tokens, but max_model_len is 48",
    ),
    (
        "prompt-plus-max-tokens",
        C,
        {"prompt": [7] * 20, "max_tokens": 40},
        400,
        "max_tokens",
        "20 tokens) + max",
    ),
    ("unknown-model", C, {"prompt": "x", "model": "gpt-9"}, 404, "model", "does not exist"),
    ("chat-missing-messages", CHAT, {"max_tokens": 3}, 400, "messages", "required"),
    ("chat-empty-messages", CHAT, {"messages": []}, 400, "messages", "non-empty"),
    (
        "chat-bad-role",
        CHAT,
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages[0].role",
        "role",
    ),
    (
        "chat-content-int",
        CHAT,
        {"messages": [{"role": "user", "content": 5}]},
        400,
        "messages[0].content",
        "content",
    ),
    ("chat-message-not-object", CHAT, {"messages": ["hi"]}, 400, "messages[0]", "messages"),
    (
        "chat-template",
        CHAT,
        {"messages": MSG, "chat_template": "{{ 1 }}"},
        400,
        "chat_template",
        "not accepted",
    ),
    ("chat-tools", CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools[0]", "'type': 'function'"),
    ("chat-top-logprobs-alone", CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", "requires"),
    (
        "chat-top-logprobs-21",
        CHAT,
        {"messages": MSG, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
        "20",
    ),
    ("chat-logprobs-int", CHAT, {"messages": MSG, "logprobs": 3}, 400, "logprobs", "boolean"),
    (
        "chat-max-completion",
        CHAT,
        {"messages": MSG, "max_completion_tokens": 60},
        400,
        "max_completion_tokens",
        "48",
    ),
    ("chat-unknown-model", CHAT, {"messages": MSG, "model": "x"}, 404, "model", "does not exist"),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [-1, 3]}, 400, "tokens", "out of range"),
    ("tokenize-neither", "/tokenize", {}, 400, "prompt", "exactly one"),
    (
        "stream-options-without-stream",
        C,
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "only allowed when stream",
    ),
    (
        "chat-stream-options-stream-false",
        CHAT,
        {"messages": MSG, "stream": False, "stream_options": {"include_usage": False}},
        400,
        "stream_options",
        "only allowed when stream",
    ),
]

# JSON may carry lone UTF-16 surrogates ("\ud800"), which are not Unicode text: 400 naming the field.
# json.dumps escapes them (httpx's own encoder cannot), so these bodies are sent as raw bytes.
S = "abc\ud800"
SURROGATE_INPUTS: list[tuple[str, str, Any, str]] = [
    ("prompt", C, {"prompt": S}, "prompt"),
    ("prompt-list", C, {"prompt": ["ok", S]}, "prompt[1]"),
    ("stop", C, {"prompt": "x", "stop": S}, "stop"),
    ("stop-list", C, {"prompt": "x", "stop": ["ok", S]}, "stop[1]"),
    ("user", C, {"prompt": "x", "user": S}, "user"),
    ("model", C, {"prompt": "x", "model": S}, "model"),
    ("chat-content", CHAT, {"messages": [{"role": "user", "content": S}]}, "messages[0].content"),
    (
        "chat-content-part",
        CHAT,
        {"messages": MSG + [{"role": "user", "content": [{"type": "text", "text": S}]}]},
        "messages[1].content[0].text",
    ),
    ("chat-name", CHAT, {"messages": [{"role": "user", "content": "x", "name": S}]}, "messages[0].name"),
    ("tokenize-prompt", "/tokenize", {"prompt": S}, "prompt"),
    ("tokenize-messages", "/tokenize", {"messages": [{"role": "user", "content": S}]}, "messages[0].content"),
]
BAD_INPUTS += [
    (f"surrogate-{name}", path, json.dumps(body).encode(), 400, param, "lone UTF-16 surrogate")
    for name, path, body, param in SURROGATE_INPUTS
]


@pytest.mark.parametrize(
    "path, body, status, param, fragment", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_input_gets_status_and_error_body(
    app: FastAPI, engine: AsyncEngine, path: str, body: Any, status: int, param: str | None, fragment: str
) -> None:
    if isinstance(body, bytes):
        r = call(app, "POST", path, content=body, headers={"content-type": "application/json"})
    else:
        r = call(app, "POST", path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert fragment.lower() in err["message"].lower(), err["message"]
    assert engine.is_running and engine.snapshot().metrics["num_requests_waiting"] == 0


def test_reset_prefix_cache_in_process(app: FastAPI) -> None:
    body = {"prompt": list(range(3, 38)), "max_tokens": 1, "temperature": 0}  # two full 16-token blocks
    cached = [call(app, "POST", C, json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
              for _ in range(2)]  # fmt: skip
    assert cached[0] == 0 and cached[1] > 0
    r = call(app, "POST", "/reset_prefix_cache")
    assert r.status_code == 200 and r.content == b""
    assert call(app, "POST", C, json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert call(app, "GET", "/reset_prefix_cache").status_code == 405


def test_routes_and_methods_that_do_not_exist(app: FastAPI) -> None:
    r = call(app, "GET", "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = call(app, "GET", "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_valid_requests_in_process(app: FastAPI) -> None:
    r = call(app, "POST", C, json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = call(
        app, "POST", C, json={"prompt": "hi", "max_tokens": 3, "n": 2, "best_of": 4, "seed": 1, "ignore_eos": True}
    )
    assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert r.json()["usage"]["completion_tokens"] == 6, "usage counts the returned sequences"
    r = call(app, "POST", CHAT, json={"messages": MSG, "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    # no max_tokens on chat: fills what is left of max_model_len
    prompt_len = call(app, "POST", "/tokenize", json={"messages": MSG}).json()["count"]
    r = call(app, "POST", CHAT, json={"messages": MSG, "ignore_eos": True, "temperature": 0})
    assert r.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - prompt_len
    assert r.json()["choices"][0]["finish_reason"] == "length"


# ---- auth and body size --------------------------------------------------------------------------


def test_api_key(engine: AsyncEngine) -> None:
    app = build_app(engine, served_model_name=NAME, api_key="sekrit")
    body = {"prompt": "hi", "max_tokens": 1}
    r = call(app, "POST", C, json=body)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.headers["www-authenticate"] == "Bearer"
    assert call(app, "POST", C, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert call(app, "GET", "/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
    assert call(app, "POST", C, json=body, headers={"Authorization": "Bearer sekrit"}).status_code == 200
    assert call(app, "POST", "/tokenize", json={"prompt": "x"}).status_code == 401
    assert call(app, "POST", "/reset_prefix_cache").status_code == 401
    for scheme in ("bearer sekrit", "BEARER sekrit", "Bearer  sekrit"):  # RFC 7235: the scheme in any case
        assert call(app, "POST", C, json=body, headers={"Authorization": scheme}).status_code == 200, scheme
    for bad in ("Basic sekrit", "Bearersekrit", "sekrit", "Bearer sekrit2", "Bearer"):
        assert call(app, "POST", C, json=body, headers={"Authorization": bad}).status_code == 401, bad
    assert call(app, "GET", "/health").status_code == 200
    assert call(app, "GET", "/metrics").status_code == 200


def test_body_size_cap(engine: AsyncEngine) -> None:
    app = build_app(engine, served_model_name=NAME, max_request_body_bytes=1000)
    r = call(app, "POST", C, json={"prompt": "x" * 2000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    async def chunks():  # no Content-Length: counted while reading
        for _ in range(10):
            yield b" " * 200

    r = call(app, "POST", C, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert call(app, "POST", C, json={"prompt": "x", "max_tokens": 1}).status_code == 200


# ---- loading, engine death, overload -------------------------------------------------------------


def test_health_503_while_loading_then_200(chat_model: Path) -> None:
    go = threading.Event()

    def loader() -> AsyncEngine:
        go.wait(30)
        return new_engine(chat_model)

    app = build_app(loader, served_model_name=NAME)

    async def run() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                r = await c.get("/health")
                assert r.status_code == 503 and r.json()["status"] == "loading"
                r = await c.post(C, json={"prompt": "x"})
                assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "loading"
                go.set()
                deadline = time.monotonic() + 60
                while (await c.get("/health")).status_code != 200:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                r = await c.post(C, json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 200

    asyncio.run(run())
    assert not app.state.lmserve.engine.is_running, "the lifespan's end shuts the engine down"


def test_load_failure_reported(tmp_path: Path) -> None:
    def loader() -> AsyncEngine:
        raise ValueError("no such model")

    app = build_app(loader, served_model_name=NAME)

    async def run() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                deadline = time.monotonic() + 10
                while (await c.get("/health")).json()["status"] == "loading":
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                r = await c.get("/health")
                assert r.status_code == 503 and r.json()["status"] == "load_failed"
                r = await c.post(C, json={"prompt": "x"})
                assert r.status_code == 503 and "no such model" in r.json()["error"]["message"]

    asyncio.run(run())


def test_overload_429_with_retry_after_and_accepted_complete(chat_model: Path) -> None:
    engine = new_engine(chat_model, max_num_seqs=1, max_queued_requests=2)
    app = build_app(engine, served_model_name=NAME)
    try:

        async def run() -> list[httpx.Response]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
                body = {"prompt": "load", "max_tokens": 12, "ignore_eos": True}
                return await asyncio.gather(*(c.post(C, json=body) for _ in range(12)))

        responses = asyncio.run(run())
        ok = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code == 429]
        assert len(ok) + len(refused) == 12 and len(ok) >= 2 and refused
        assert all(r.json()["usage"]["completion_tokens"] == 12 for r in ok)
        for r in refused:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "queue_full"
        text = call(app, "GET", "/metrics").text
        labels = f'frontend="http",model_name="{NAME}",reason="queue_full"'
        assert f"lmserve:num_rejected_requests_total{{{labels}}} {len(refused)}.0" in text
    finally:
        engine.shutdown()


def test_engine_death_fails_pending_with_500_and_health_503(chat_model: Path) -> None:
    engine = new_engine(chat_model)
    app = build_app(engine, served_model_name=NAME)
    real_step = engine.engine.step

    def dying_step():  # fails once both requests are in and have run a little: both are mid-generation then
        m = engine.engine.get_metrics()
        if m["num_requests_total"] < 2:  # no step until the second is added (however late its client sends it)
            time.sleep(0.001)
            return []
        if m["num_steps_total"] > 3:
            raise RuntimeError("simulated device fault")
        return real_step()

    engine.engine.step = dying_step  # type: ignore[method-assign]

    async def run() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            body = {"prompt": "x", "max_tokens": 30, "ignore_eos": True}
            return await asyncio.gather(c.post(C, json=body), c.post(C, json=dict(body, stream=True)))

    plain, streamed = asyncio.run(run())
    assert streamed.status_code == 200, streamed.text
    assert plain.status_code == 500
    assert (
        plain.json()["error"]["code"] == "engine_dead" and "simulated device fault" in plain.json()["error"]["message"]
    )
    events = [ln[6:] for ln in streamed.text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]" and "engine_dead" in events[-2]
    r = call(app, "GET", "/health")
    assert r.status_code == 503 and r.json()["status"] == "dead"
    assert call(app, "POST", C, json={"prompt": "x"}).status_code == 503
    assert call(app, "GET", "/metrics").status_code == 200


def test_engine_error_on_one_request_fails_only_that_request(app: FastAPI, engine: AsyncEngine) -> None:
    real_add = engine.engine.add_request

    def picky_add(request_id, prompt, params=None, arrival_time=None):
        if params is not None and params.seed == 666:
            raise RuntimeError("this request broke the engine's add")
        return real_add(request_id, prompt, params, arrival_time)

    engine.engine.add_request = picky_add  # type: ignore[method-assign]
    try:
        r = call(app, "POST", C, json={"prompt": "x", "max_tokens": 2, "seed": 666})
        assert r.status_code == 500 and "broke the engine" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "internal_error"
        r = call(app, "POST", C, json={"prompt": "x", "max_tokens": 2, "seed": 1})
        assert r.status_code == 200
    finally:
        engine.engine.add_request = real_add  # type: ignore[method-assign]
    assert call(app, "GET", "/health").status_code == 200


# ---- bursts: the queue bound counts only what the full engine cannot start ----------------------------


def burst(app: FastAPI, num: int, gate: threading.Event | None = None, num_refused: int = 0) -> list[httpx.Response]:
    """`num` requests at once; with `gate` (the engine held before its next step), open it once
    `num_refused` answers are in (those that cannot wait for the engine)."""

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            body = {"prompt": "burst", "max_tokens": 4, "ignore_eos": True}
            tasks = [asyncio.ensure_future(c.post(C, json=dict(body, user=str(i)))) for i in range(num)]
            if gate is not None:
                deadline = time.monotonic() + 60
                while sum(t.done() for t in tasks) < num_refused:
                    assert time.monotonic() < deadline, "the refusals did not come"
                    await asyncio.sleep(0.01)
                gate.set()
            return await asyncio.gather(*tasks)

    return asyncio.run(run())


@pytest.fixture
def burst_engine(chat_model: Path) -> Iterator[AsyncEngine]:
    e = new_engine(chat_model, num_kv_blocks=512, max_num_seqs=256, max_queued_requests=16)
    yield e
    e.shutdown()


def test_burst_that_fits_the_engine_is_admitted_whole(burst_engine: AsyncEngine) -> None:
    responses = burst(build_app(burst_engine, served_model_name=NAME), 200)
    assert [r.status_code for r in responses] == [200] * 200, "200 ≤ max_num_seqs: nobody has to queue"
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in responses)


def test_burst_beyond_capacity_gets_429_and_the_admitted_complete(burst_engine: AsyncEngine) -> None:
    # held before its first step, the engine can start max_num_seqs=256 of them and 16 may wait
    responses = burst(build_app(burst_engine, served_model_name=NAME), 600, gate_steps(burst_engine), 600 - 272)
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) == 272 and len(refused) == 600 - 272
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in ok)
    assert all(r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full" for r in refused)


# ---- text that JSON allows but UTF-8 does not; tokenizers that fail; our own failures ------------------

SURROGATE_FIELDS: list[tuple[str, Any, str]] = [  # (path, body around the text, param named)
    (C, lambda t: {"prompt": t, "max_tokens": 1}, "prompt"),
    (C, lambda t: {"prompt": ["a", t], "max_tokens": 1}, "prompt[1]"),
    (C, lambda t: {"prompt": "x", "max_tokens": 1, "stop": [t]}, "stop[0]"),
    (CHAT, lambda t: {"messages": [{"role": "user", "content": t}], "max_tokens": 1}, "messages[0].content"),
    (
        CHAT,
        lambda t: {"messages": MSG + [{"role": "user", "content": [{"type": "text", "text": t}]}], "max_tokens": 1},
        "messages[1].content[0].text",
    ),
    ("/tokenize", lambda t: {"prompt": t}, "prompt"),
    ("/tokenize", lambda t: {"messages": [{"role": "user", "content": t}]}, "messages[0].content"),
]
surrogates = st.lists(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3)
text_with_surrogates = st.tuples(st.text(max_size=6), surrogates.map("".join), st.text(max_size=6)).map("".join)


@given(
    field=st.sampled_from(SURROGATE_FIELDS),
    text=st.one_of(text_with_surrogates, st.text(max_size=12)),
    escaped=st.booleans(),
)
@settings(max_examples=40, deadline=None, derandomize=True)
def test_fuzz_text_json_allows_but_utf8_does_not(app: FastAPI, field: tuple[str, Any, str], text: str, escaped: bool):
    """JSON strings with lone surrogates, as \\u escapes or as raw (CESU-8) bytes, which Python's JSON parser
    both accepts: a 400 naming the field, never a 5xx; valid text is served."""
    path, make_body, param = field
    body = make_body(text)
    raw = (json.dumps(body) if escaped else json.dumps(body, ensure_ascii=False)).encode("utf-8", "surrogatepass")
    try:  # as the server parses it: an escaped high + low surrogate pair is one valid character
        json.dumps(json.loads(raw), ensure_ascii=False).encode("utf-8")
        valid = True
    except UnicodeEncodeError:
        valid = False
    r = call(app, "POST", path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text
    if valid:  # served, or refused for another reason (empty, longer than the tiny max_model_len)
        assert r.status_code in (200, 400) and "surrogate" not in r.text, r.text
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "lone UTF-16 surrogate" in r.json()["error"]["message"]


def test_tokenizer_exceptions_are_the_inputs_fault(app: FastAPI, engine: AsyncEngine, monkeypatch) -> None:
    real_encode = engine.tokenizer.encode

    def picky_encode(text: str, *args: Any, **kwargs: Any) -> list[int]:
        if "boom" in text:
            raise RuntimeError("the tokenizer cannot take this")
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", picky_encode)
    cases = [
        (C, {"prompt": "boom"}, "prompt"),
        (C, {"prompt": ["fine", "boom"]}, "prompt[1]"),
        (CHAT, {"messages": [{"role": "user", "content": "boom"}]}, "messages"),
        ("/tokenize", {"prompt": "boom"}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "boom"}]}, "messages"),
    ]
    for path, body, param in cases:
        r = call(app, "POST", path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
        assert "cannot take this" in r.json()["error"]["message"]
    assert call(app, "POST", C, json={"prompt": "fine", "max_tokens": 1}).status_code == 200


def test_unhandled_error_is_answered_not_raised(app: FastAPI, engine: AsyncEngine, monkeypatch) -> None:
    """Raised out of the app, an exception makes uvicorn drop the keep-alive connection after the 500; the
    app answers it itself instead (httpx's ASGITransport re-raises anything the app raises)."""

    def broken_decode(*args: Any, **kwargs: Any) -> str:
        raise RuntimeError("decode is broken")

    monkeypatch.setattr(engine.tokenizer, "decode", broken_decode)
    r = call(app, "POST", "/detokenize", json={"tokens": [1, 2]})
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
    assert "decode is broken" in r.json()["error"]["message"]


# ---- a non-streaming client that leaves ----------------------------------------------------------


def test_non_streaming_disconnect_aborts(app: FastAPI, engine: AsyncEngine) -> None:
    body = json.dumps({"prompt": "bye", "max_tokens": 40, "ignore_eos": True}).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": C, "raw_path": C.encode(), "query_string": b"",
        "root_path": "", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 5555), "server": ("127.0.0.1", 80),
    }  # fmt: skip

    async def run(gone: threading.Event) -> list[dict]:
        left = asyncio.Event()
        inbox = [{"type": "http.request", "body": body, "more_body": False}]
        sent: list[dict] = []

        async def receive() -> dict:
            if inbox:
                return inbox.pop()
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        before = engine.snapshot().num_aborted_requests_total
        task = asyncio.ensure_future(app(scope, receive, send))
        deadline = time.monotonic() + 10
        while engine.snapshot().metrics["num_requests_running"] == 0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        left.set()  # the client goes away mid-generation
        await asyncio.wait_for(task, 10)
        gone.set()  # its abort is queued: it applies before the step after the held one
        while engine.snapshot().num_aborted_requests_total != before + 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        while engine.snapshot().metrics["kv_cache_usage"] != 0.0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        return sent

    # every step after the first waits until the client has gone: it leaves mid-generation by construction
    with steps_held_after_first(engine.engine) as gone:
        asyncio.run(run(gone))
    m = engine.snapshot().metrics
    assert m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0


# ---- fuzzing the OpenAPI schema ------------------------------------------------------------------

try:
    import schemathesis
    from schemathesis.checks import not_a_server_error
except ImportError:  # pragma: no cover - schemathesis is a test extra
    schemathesis = None


@pytest.fixture(scope="module")
def api_schema(app: FastAPI):
    return schemathesis.openapi.from_asgi("/openapi.json", app)


if schemathesis is not None:
    schema = schemathesis.pytest.from_fixture("api_schema")

    @schema.parametrize()
    @settings(
        max_examples=15,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    def test_fuzz_no_server_errors(case) -> None:
        """Generated bodies (valid and invalid) never get a 5xx."""
        case.call_and_validate(checks=[not_a_server_error])
