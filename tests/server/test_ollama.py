"""Ollama's API with the official `ollama` client (in-process ASGI server, the bundled model): chat and generate
streamed and not (the same greedy text as /v1/chat/completions), the final object's counts and durations, format
through structured outputs, tools round-tripped, list / show / ps / version, and the {"error": ...} refusals."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from fastapi import FastAPI

from lmserve.config.engine import EngineArgs
from lmserve.default_model import default_model_path
from lmserve.engine.async_engine import AsyncEngine
from lmserve.engine.llm_engine import LLMEngine
from lmserve.entrypoints.openai.server import build_app
from lmserve.sampling_params import StructuredOutputsParams
from tests.helpers import require_extra
from tests.scripted_model import build_scripted_model

require_extra("test", "ollama")
import ollama  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAME = "bundled"
MSG = [{"role": "user", "content": "Tell me about Verona."}]
GREEDY = {"temperature": 0, "num_predict": 8}
HERMES = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    args = EngineArgs.from_kwargs(default_model_path(), num_kv_blocks=128)
    e = AsyncEngine(LLMEngine.from_engine_args(args))
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def app(engine: AsyncEngine) -> FastAPI:
    return build_app(engine, served_model_name=NAME)


def run(app: FastAPI, fn) -> Any:
    """fn(ollama.AsyncClient, httpx.AsyncClient) on a fresh event loop over the in-process ASGI transport."""

    async def main() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            client = ollama.AsyncClient(host="http://test", transport=transport)
            return await fn(client, http)

    return asyncio.run(main())


async def _collect(stream) -> list[Any]:
    return [part async for part in await stream]


def test_chat_greedy_matches_openai_and_streams_the_same_text(app: FastAPI) -> None:
    async def go(c: ollama.AsyncClient, http: httpx.AsyncClient) -> tuple[Any, list[Any], dict[str, Any]]:
        whole = await c.chat(model=NAME, messages=MSG, options=GREEDY, stream=False)
        parts = await _collect(c.chat(model=NAME + ":latest", messages=MSG, options=GREEDY, stream=True))
        ref = await http.post("/v1/chat/completions", json={"messages": MSG, "temperature": 0, "max_tokens": 8})
        return whole, parts, ref.json()

    whole, parts, ref = run(app, go)
    assert whole.message.role == "assistant"
    assert whole.message.content == ref["choices"][0]["message"]["content"]
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 8
    assert whole.prompt_eval_count == ref["usage"]["prompt_tokens"]  # the first request: nothing cached
    assert whole.total_duration > 0 and whole.total_duration >= whole.prompt_eval_duration + whole.eval_duration
    assert whole.load_duration == 0
    assert [x.done for x in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(x.message.content for x in parts) == whole.message.content
    assert parts[-1].eval_count == 8 and parts[-1].done_reason == "length"


def test_generate_streamed_and_not_with_context(app: FastAPI, engine: AsyncEngine) -> None:
    async def go(c: ollama.AsyncClient, http: httpx.AsyncClient) -> tuple[Any, list[Any], dict[str, Any]]:
        whole = await c.generate(model=NAME, prompt="ROMEO:", raw=True, options=GREEDY)
        parts = await _collect(c.generate(model=NAME, prompt="ROMEO:", raw=True, options=GREEDY, stream=True))
        ref = await http.post("/v1/completions", json={"prompt": "ROMEO:", "temperature": 0, "max_tokens": 8})
        return whole, parts, ref.json()

    whole, parts, ref = run(app, go)
    assert whole.response == ref["choices"][0]["text"]
    assert "".join(x.response for x in parts) == whole.response
    prompt_ids = engine.tokenizer.encode("ROMEO:")
    assert list(whole.context[: len(prompt_ids)]) == prompt_ids and len(whole.context) == len(prompt_ids) + 8
    assert list(parts[-1].context) == list(whole.context)


def test_format_schema_constrains_the_output(app: FastAPI) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "maximum": 99}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = run(app, lambda c, _: c.chat(model=NAME, messages=MSG, format=schema, options={"temperature": 1, "seed": 3}))
    jsonschema.validate(json.loads(r.message.content), schema)
    r = run(app, lambda c, _: c.generate(model=NAME, prompt="x", format="json", options={"num_predict": 40}))
    assert r.done_reason == "length" or isinstance(json.loads(r.response), dict)


def test_tool_calls_round_trip(app: FastAPI, engine: AsyncEngine) -> None:
    """The model's output forced (as a scripted model would write it) to a Hermes tool call: the client gets it
    as an Ollama tool call with its arguments as an object, streamed and not, and the call and a tool answer
    go back in the next request."""
    forced = StructuredOutputsParams(regex=r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Rome"\}\}')
    real_add, before = engine.add_request, engine.tokenizer.chat_template

    def add(rid: Any, prompt: Any, params: Any, *args: Any, **kw: Any) -> Any:
        return real_add(rid, prompt, dataclasses.replace(params, structured_outputs=forced), *args, **kw)

    engine.add_request, engine.tokenizer.chat_template = add, HERMES
    try:
        r = run(app, lambda c, _: c.chat(model=NAME, messages=MSG, tools=[WEATHER], options={"num_predict": 40}))
        (call,) = r.message.tool_calls
        assert call.function.name == "get_weather" and call.function.arguments == {"city": "Rome"}
        parts = run(app, lambda c, _: _collect(c.chat(model=NAME, messages=MSG, tools=[WEATHER], stream=True)))
        calls = [tc for x in parts for tc in x.message.tool_calls or []]
        assert [(tc.function.name, tc.function.arguments) for tc in calls] == [("get_weather", {"city": "Rome"})]
        follow = [*MSG, r.message, {"role": "tool", "content": "22 C", "tool_name": "get_weather"}]
        r2 = run(app, lambda c, _: c.chat(model=NAME, messages=follow, tools=[WEATHER], options={"num_predict": 40}))
        assert r2.done and r2.prompt_eval_count >= 1  # (its prefix, the first request's prompt, is cached)
    finally:
        engine.add_request, engine.tokenizer.chat_template = real_add, before


def test_list_show_ps_version(app: FastAPI, engine: AsyncEngine) -> None:
    async def go(c: ollama.AsyncClient, http: httpx.AsyncClient) -> tuple[Any, ...]:
        return await c.list(), await c.show(NAME), await c.ps(), (await http.get("/api/version")).json()

    listed, shown, ps, version = run(app, go)
    assert [m.model for m in listed.models] == [NAME]
    assert listed.models[0].details.family == engine.config.model.family
    family = engine.config.model.family
    assert shown.modelinfo[f"{family}.context_length"] == engine.config.scheduler.max_model_len
    assert shown.modelinfo[f"{family}.embedding_length"] == engine.config.model.hidden_size
    assert shown.capabilities == ["completion"] and shown.template == engine.tokenizer.chat_template
    assert ps.models[0].model == NAME and ps.models[0].context_length == engine.config.scheduler.max_model_len
    assert isinstance(version["version"], str)


@pytest.mark.parametrize(
    "path, body, status, needle",
    [
        ("/api/chat", {"model": "nope", "messages": MSG}, 404, "model 'nope' not found"),
        ("/api/chat", {"messages": MSG}, 400, "model is required"),
        ("/api/chat", {"model": NAME, "messages": MSG, "options": {"num_ctx": 10**6}}, 400, "options.num_ctx"),
        ("/api/chat", {"model": NAME, "messages": MSG, "options": {"num_ctx": 4}}, 400, "options.num_ctx"),
        ("/api/chat", {"model": NAME, "messages": MSG, "options": {"temperature": -1}}, 400, "options.temperature"),
        ("/api/chat", {"model": NAME, "messages": MSG, "options": {"num_predict": 0}}, 400, "options.num_predict"),
        ("/api/chat", {"model": NAME, "messages": MSG, "options": {"mirostat": 1}}, 400, "options.mirostat"),
        ("/api/chat", {"model": NAME, "messages": MSG, "options": {"top_k": "5"}}, 400, "options.top_k"),
        ("/api/chat", {"model": NAME, "messages": MSG, "think": True}, 400, "does not support thinking"),
        ("/api/chat", {"model": NAME, "messages": MSG, "format": "xml"}, 400, "format"),
        ("/api/chat", {"model": NAME, "messages": [{"role": "robot"}]}, 400, "messages[0].role"),
        ("/api/generate", {"model": NAME, "prompt": "x", "suffix": "y"}, 400, "suffix"),
        ("/api/generate", {"model": NAME, "prompt": "x", "context": [10**9]}, 400, "context"),
        ("/api/show", {"model": "other"}, 404, "not found"),
        ("/api/pull", {"model": "llama3"}, 400, "serves the model it was started with"),
        ("/api/create", {"model": "x"}, 400, "not supported"),
    ],
)
def test_refusals_in_ollamas_error_shape(app: FastAPI, path: str, body: dict, status: int, needle: str) -> None:
    r = run(app, lambda _, http: http.post(path, json=body))
    assert r.status_code == status, r.text
    assert list(r.json()) == ["error"] and needle in r.json()["error"], r.json()


def test_client_raises_response_error_and_load_answer(app: FastAPI) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        run(app, lambda c, _: c.chat(model="missing", messages=MSG))
    assert e.value.status_code == 404 and "missing" in e.value.error
    r = run(app, lambda c, _: c.generate(model=NAME, prompt=""))
    assert r.done and r.done_reason == "load" and r.response == ""
    with pytest.raises(ollama.ResponseError) as e:
        run(app, lambda c, _: c.delete(NAME))
    assert e.value.status_code == 400 and "delete is not supported" in e.value.error


THINK_TEMPLATE = (
    "{# a Qwen3-style template: <think> #}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_think_splits_thinking_through_the_reasoning_parser(tmp_path, tokenizer_dir) -> None:
    """A scripted model writes <think>I should greet.</think>Hello!: `thinking` and `content` apart, streamed and
    not; think false drops the thinking; show lists the capability."""
    script = ["<think>", "I should greet.", "</think>", "Hello!"]
    path = build_scripted_model(tmp_path / "m", script, THINK_TEMPLATE, tokenizer_dir=tokenizer_dir)
    engine = AsyncEngine(LLMEngine.from_engine_args(EngineArgs.from_kwargs(str(path), num_kv_blocks=32)))
    try:
        app = build_app(engine, served_model_name=NAME)
        r = run(app, lambda c, _: c.chat(model=NAME, messages=MSG, think=True, options={"num_predict": 10}))
        assert (r.message.thinking, r.message.content, r.done_reason) == ("I should greet.", "Hello!", "stop")
        parts = run(app, lambda c, _: _collect(c.chat(model=NAME, messages=MSG, think=True, stream=True)))
        assert "".join(x.message.thinking or "" for x in parts) == "I should greet."
        assert "".join(x.message.content for x in parts) == "Hello!"
        r = run(app, lambda c, _: c.chat(model=NAME, messages=MSG, think=False))
        assert (r.message.thinking, r.message.content) == (None, "Hello!")
        r = run(app, lambda c, _: c.generate(model=NAME, prompt="hi", think=True))
        assert (r.thinking, r.response) == ("I should greet.", "Hello!")
        assert run(app, lambda c, _: c.show(NAME)).capabilities == ["completion", "thinking"]
    finally:
        engine.shutdown()
