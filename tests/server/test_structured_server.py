"""Structured outputs and tool calls over HTTP with the official `openai` client (in-process ASGI server, the
bundled model): response_format, vLLM's extras, tools with tool_choice named / required / auto / none, streaming
and not, and the 400s for a bad schema or an unknown tool."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from fastapi import FastAPI

from lmserve.config.engine import EngineArgs
from lmserve.default_model import default_model_path
from lmserve.engine.async_engine import AsyncEngine
from lmserve.engine.llm_engine import LLMEngine
from lmserve.entrypoints.openai.server import build_app
from lmserve.entrypoints.openai.tools import parse_hermes_tool_calls

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAME = "bundled"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
MSG = [{"role": "user", "content": "What is the weather in Verona?"}]
HERMES = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    args = EngineArgs.from_kwargs(default_model_path(), num_kv_blocks=256)
    e = AsyncEngine(LLMEngine.from_engine_args(args))
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def app(engine: AsyncEngine) -> FastAPI:
    return build_app(engine, served_model_name=NAME)


def run(app: FastAPI, fn) -> Any:
    """fn(AsyncOpenAI) on a fresh event loop, over the in-process ASGI transport."""

    async def main() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test/v1") as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
            return await fn(client)

    return asyncio.run(main())


def chat(app: FastAPI, **kwargs: Any) -> Any:
    return run(app, lambda c: c.chat.completions.create(model=NAME, messages=MSG, **kwargs))


def chat_stream(app: FastAPI, **kwargs: Any) -> list[Any]:
    async def go(c: openai.AsyncOpenAI) -> list[Any]:
        stream = await c.chat.completions.create(model=NAME, messages=MSG, stream=True, **kwargs)
        return [chunk async for chunk in stream]

    return run(app, go)


def test_response_format_json_schema_chat_and_completions(app: FastAPI) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = chat(app, response_format=rf, n=3, temperature=1.0, seed=1, max_tokens=80)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    r = run(app, lambda c: c.completions.create(model=NAME, prompt="ROMEO:", max_tokens=80, temperature=1.0,
                                                 extra_body={"response_format": rf}))  # fmt: skip
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = chat(app, response_format={"type": "json_object"}, temperature=0.0, max_tokens=60)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict), text


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}}, lambda t: re.fullmatch(r"\d{4}-\d{2}-\d{2}", t)),
        ({"guided_regex": r"[a-z]{3,6}"}, lambda t: re.fullmatch(r"[a-z]{3,6}", t)),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
        ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
        ({"guided_grammar": 'root ::= "(" [0-9] "+" [0-9] ")"'}, lambda t: re.fullmatch(r"\(\d\+\d\)", t)),
    ],
)
def test_vllm_extras(app: FastAPI, extra: dict, check) -> None:
    async def go(c: openai.AsyncOpenAI) -> Any:
        return await c.completions.create(
            model=NAME, prompt="ROMEO:", max_tokens=60, temperature=1.0, n=2, seed=3, extra_body=extra
        )

    for choice in run(app, go).choices:
        assert check(choice.text), choice.text
        assert choice.finish_reason == "stop"


def test_named_tool_call_and_its_stream(app: FastAPI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(app, tools=[WEATHER, TIME], tool_choice=choice, temperature=1.0, seed=5, max_tokens=80)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    chunks = chat_stream(app, tools=[WEATHER, TIME], tool_choice=choice, temperature=1.0, seed=5, max_tokens=80)
    deltas = [tc for ch in chunks for d in [ch.choices[0].delta] if d.tool_calls for tc in d.tool_calls]
    # sent whole once complete (a call cut by max_tokens is content instead: tests/server/test_tools.py)
    (delta,) = deltas
    assert delta.id and delta.function.name == "get_weather"
    assert delta.function.arguments == call.function.arguments, "same seed: the stream has the non-streamed call"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_tool_calls_and_their_stream(app: FastAPI) -> None:
    kwargs = dict(tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, max_tokens=120,
                  parallel_tool_calls=False)  # fmt: skip
    for seed in range(3):
        r = chat(app, seed=seed, **kwargs)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        (call,) = c.message.tool_calls
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    chunks = chat_stream(app, seed=0, **kwargs)
    calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    first = chat(app, seed=0, **kwargs).choices[0].message.tool_calls[0]
    assert [(t.function.name, t.function.arguments) for t in calls] == [(first.function.name, first.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_ignores_tools(app: FastAPI) -> None:
    r = chat(app, tools=[WEATHER], tool_choice="none", temperature=0.0, max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")


def test_auto_tool_choice_with_a_hermes_template(app: FastAPI, engine: AsyncEngine) -> None:
    # The bundled template renders no tools: "auto" is refused with the reason.
    with pytest.raises(openai.BadRequestError) as e:
        chat(app, tools=[WEATHER], max_tokens=8)
    assert e.value.body["param"] == "tool_choice" and "Hermes" in e.value.body["message"]
    before = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = HERMES
    try:
        forced = (
            r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "C"\}\}</tool_call>'
        )
        extra = {"structured_outputs": {"regex": r"Let me check\. " + forced}}
        r = chat(app, tools=[WEATHER], tool_choice="auto", temperature=1.0, max_tokens=80, extra_body=extra)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content == "Let me check."
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
        chunks = chat_stream(app, tools=[WEATHER], temperature=1.0, max_tokens=80, extra_body=extra)
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
        assert content == "Let me check." and "<tool_call>" not in content  # as the message: no layout space
        assert len(calls) == 1 and calls[0].function.name == "get_weather"
        # without a call in the output, auto returns plain content
        plain = chat(app, tools=[WEATHER], temperature=0.0, max_tokens=8)
        assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason != "tool_calls"
    finally:
        engine.tokenizer.chat_template = before


def test_hermes_parser() -> None:
    content, calls = parse_hermes_tool_calls(
        'Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "b"}</tool_call>'
    )
    assert content == "Sure." and [(c.function.name, c.function.arguments) for c in calls] == [
        ("a", '{"x": 1}'),
        ("b", "{}"),
    ]
    assert parse_hermes_tool_calls("<tool_call>not json</tool_call>")[1] == []
    assert parse_hermes_tool_calls("no calls") == ("no calls", [])


@pytest.mark.parametrize(
    "kwargs, param, fragment",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
         "response_format", "Invalid type: wat"),
        ({"extra_body": {"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}},
         "guided_json", "/nope"),
        ({"extra_body": {"guided_regex": "(ab"}}, "guided_regex", "unclosed group"),
        ({"extra_body": {"structured_outputs": {"grammar": "root ::= (("}}}, "structured_outputs", "grammar"),
        ({"extra_body": {"structured_outputs": {"json": {}, "regex": "a"}}}, "structured_outputs", "exactly one"),
        ({"extra_body": {"structured_outputs": {"structural_tag": "x"}}}, "structured_outputs", "unsupported"),
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex",
         "at most one"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "'nope', which is not in tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be"),
        ({"tool_choice": "required"}, "tool_choice", "non-empty tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}],
          "tool_choice": "required"}, "tools", "Invalid type: wat"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools[1]", "given twice"),
        ({"extra_body": {"guided_choice": ["a"], "min_tokens": 2}}, "min_tokens", "structured_outputs"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400_naming_the_field(app: FastAPI, kwargs: dict, param: str, fragment: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(app, max_tokens=4, **kwargs)
    body = e.value.body
    assert body["param"] == param and fragment in body["message"], body
