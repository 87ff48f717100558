"""Anthropic's Messages API (entrypoints/openai/serving_messages.py) with the official `anthropic` client and
LangChain's ChatAnthropic against one server per module (the bundled model, a template that renders tools, an API
key sent as x-api-key): create equals the chat completion of the same conversation, stop sequences, the event
sequence `messages.stream()` accumulates, count_tokens equal to a create's input tokens, a tool use round trip
(streamed and not), and errors in Anthropic's shape."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from lmserve.config.engine import EngineArgs
from lmserve.default_model import default_model_path
from lmserve.engine.async_engine import AsyncEngine
from lmserve.engine.llm_engine import LLMEngine
from lmserve.entrypoints.openai.server import build_app
from tests.server.test_structured_server import HERMES
from tests.thread_server import serve_in_thread

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAME = "bundled"
KEY = "sekrit"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {"name": "get_weather", "description": "Weather in a city", "input_schema": SCHEMA}
ASK = [{"role": "user", "content": "What is the weather in Verona?"}]
GREEDY = {"temperature": 0.0}  # the anthropic SDK has no sampling arguments: they go in the body as the API has them


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    e = AsyncEngine(LLMEngine.from_engine_args(EngineArgs.from_kwargs(default_model_path(), num_kv_blocks=128)))
    e.tokenizer.chat_template = HERMES  # renders tools, so tool_choice auto is served
    try:
        with serve_in_thread(build_app(e, served_model_name=NAME, api_key=KEY)) as u:
            yield u
    finally:
        e.shutdown()


@pytest.fixture(scope="module")
def client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_create_equals_the_chat_completion(client: anthropic.Anthropic, chat_client: openai.OpenAI) -> None:
    system = [{"type": "text", "text": "Answer "}, {"type": "text", "text": "briefly."}]
    m = client.messages.create(model=NAME, system=system, messages=ASK, max_tokens=24, extra_body=GREEDY)
    chat = chat_client.chat.completions.create(
        model=NAME, messages=[{"role": "system", "content": "Answer briefly."}, *ASK], max_tokens=24, temperature=0.0
    )
    choice = chat.choices[0]
    assert m.type == "message" and m.role == "assistant" and m.model == NAME and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == choice.message.content
    assert m.stop_reason == ("max_tokens" if choice.finish_reason == "length" else "end_turn")
    assert m.usage.output_tokens == chat.usage.completion_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    counted = client.messages.count_tokens(model=NAME, system=system, messages=ASK)
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_count_tokens_equals_a_fresh_creates_input_tokens(client: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": "Count me: the quick brown fox jumps over the lazy dog " + "x" * 7}]
    counted = client.messages.count_tokens(model=NAME, messages=messages, tools=[WEATHER])
    m = client.messages.create(model=NAME, messages=messages, tools=[WEATHER], max_tokens=2)
    assert m.usage.cache_read_input_tokens == 0  # nothing of this prompt was cached before
    assert counted.input_tokens == m.usage.input_tokens
    again = client.messages.create(model=NAME, messages=messages, tools=[WEATHER], max_tokens=2)
    assert again.usage.cache_read_input_tokens >= 16  # its prompt's full blocks, cached by the first
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == counted.input_tokens
    bare = client.messages.count_tokens(model=NAME, messages=messages)
    none = client.messages.count_tokens(model=NAME, messages=messages, tools=[WEATHER], tool_choice={"type": "none"})
    assert bare.input_tokens == none.input_tokens < counted.input_tokens  # the template shows tools unless none


def test_stop_sequence(client: anthropic.Anthropic, chat_client: openai.OpenAI) -> None:
    text = chat_client.chat.completions.create(model=NAME, messages=ASK, max_tokens=30, temperature=0.0)
    text = text.choices[0].message.content
    word = re.search(r"\w{3,}", text[4:]).group(0)  # a word after the start: the output stops before it
    m = client.messages.create(model=NAME, messages=ASK, max_tokens=30, extra_body=GREEDY, stop_sequences=[word])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", word)
    assert m.content[0].text == text[: text.index(word)]


def test_stream_events_accumulate_to_the_created_message(client: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = dict(model=NAME, messages=ASK, max_tokens=12, extra_body=GREEDY)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    created = client.messages.create(**kwargs)
    raw = [e.type for e in events if e.type not in ("text",)]  # "text": the helper's own per-delta event
    n = raw.count("content_block_delta")
    assert n >= 1
    assert raw == ["message_start", "content_block_start", *["content_block_delta"] * n, "content_block_stop",
                   "message_delta", "message_stop"]  # fmt: skip
    assert final.content[0].text == created.content[0].text == stream.current_message_snapshot.content[0].text
    assert final.stop_reason == created.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 12
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == (
        created.usage.input_tokens + created.usage.cache_read_input_tokens
    )


# any: one call at most (disable_parallel_tool_use), else the bundled model may write calls until max_tokens
@pytest.mark.parametrize(
    "tool_choice", [{"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True}]
)
def test_tool_use_round_trip(client: anthropic.Anthropic, tool_choice: dict[str, Any]) -> None:
    m = client.messages.create(model=NAME, messages=ASK, tools=[WEATHER], tool_choice=tool_choice, max_tokens=120,
                               extra_body={"temperature": 1.0})  # fmt: skip
    assert m.stop_reason == "tool_use", m
    assert [b.type for b in m.content] == ["tool_use"]
    use = m.content[0]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, SCHEMA)
    turns = [*ASK, {"role": "assistant", "content": m.content},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"},
                                          {"type": "text", "text": "Thanks."}]}]  # fmt: skip
    counted = client.messages.count_tokens(model=NAME, messages=turns, tools=[WEATHER])
    reply = client.messages.create(model=NAME, messages=turns, tools=[WEATHER], max_tokens=3)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == counted.input_tokens


def test_streamed_tool_use(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=NAME, messages=ASK, tools=[WEATHER], max_tokens=120,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_message()
    raw = [e.type for e in events if e.type not in ("input_json",)]
    assert raw == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                   "message_delta", "message_stop"]  # fmt: skip
    assert final.stop_reason == "tool_use" and final.content[0].type == "tool_use"
    jsonschema.validate(final.content[0].input, SCHEMA)


def _post(url: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(url + "/v1/messages", json=body, headers={"x-api-key": KEY, **headers}, timeout=60)


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 100000}, "max_tokens"),
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages[0].content[0]: block type 'image'"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "'web_search_20250305' is not supported"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "'nope'"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"thinking": {"type": "maybe"}}, "thinking.type"),
        ({"temperature": 5.0}, "temperature"),
        ({"system": [{"type": "image"}]}, "system[0]"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_in_anthropic_shape(url: str, body: dict[str, Any], needle: str) -> None:
    full = {"model": NAME, "messages": ASK, "max_tokens": 8, **body}
    r = _post(url, {k: v for k, v in full.items() if v is not None})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert needle in r.json()["error"]["message"], r.json()
    assert set(r.json()) == {"type", "error"} and set(r.json()["error"]) == {"type", "message"}


def test_keys_and_other_errors(url: str, client: anthropic.Anthropic) -> None:
    body = {"model": NAME, "messages": ASK}
    assert httpx.post(url + "/v1/messages/count_tokens", json=body, headers={"x-api-key": KEY}).status_code == 200
    bearer = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(url + "/v1/messages/count_tokens", json=body, headers=bearer).status_code == 200
    r = httpx.post(url + "/v1/messages", json={**body, "max_tokens": 2}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-opus-4", messages=ASK, max_tokens=2)
    assert e.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(url + "/v1/messages", content=b"{not json", headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_langchain_chat_anthropic(url: str) -> None:
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(model=NAME, base_url=url, api_key=KEY, max_tokens=12, temperature=0.0, max_retries=0)
    reply = llm.invoke("What is the weather in Verona?")
    assert isinstance(reply.content, str) and reply.content
    assert reply.response_metadata["stop_reason"] == "max_tokens"
    assert reply.usage_metadata["output_tokens"] == 12
    streamed = "".join(chunk.text for chunk in llm.stream("What is the weather in Verona?"))
    assert streamed == reply.content
    bound = ChatAnthropic(model=NAME, base_url=url, api_key=KEY, max_tokens=120, max_retries=0).bind_tools(
        [WEATHER], tool_choice="get_weather"
    )
    call = bound.invoke("What is the weather in Verona?").tool_calls
    assert [c["name"] for c in call] == ["get_weather"]
    jsonschema.validate(call[0]["args"], SCHEMA)
