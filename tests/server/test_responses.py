"""OpenAI's Responses API (entrypoints/openai/serving_responses.py) with the official `openai` client against one
server per module (the bundled model, a template that renders tools, an API key): create equals the chat
completion of the same conversation, the typed stream `responses.stream()` accumulates, function tools and their
round trip, text.format through `responses.parse`, previous_response_id with cached tokens, the store (get, delete,
bound, TTL), background responses cancelled while held mid-generation, and 400s in OpenAI's shape."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from lmserve.config.engine import EngineArgs
from lmserve.default_model import default_model_path
from lmserve.engine.async_engine import AsyncEngine
from lmserve.engine.llm_engine import LLMEngine
from lmserve.entrypoints.openai.response_store import ResponseStore, StoredResponse
from lmserve.entrypoints.openai.server import build_app
from tests.helpers import steps_held_after_first
from tests.server.test_structured_server import HERMES
from tests.thread_server import serve_in_thread

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAME = "bundled"
KEY = "sekrit"
STORE_SIZE = 6
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_PARAMS}


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    e = AsyncEngine(LLMEngine.from_engine_args(EngineArgs.from_kwargs(default_model_path(), num_kv_blocks=128)))
    e.tokenizer.chat_template = HERMES  # renders tools, so tool_choice "auto" is served
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def url(engine: AsyncEngine) -> Iterator[str]:
    store = ResponseStore(max_entries=STORE_SIZE, ttl_s=600)
    with serve_in_thread(build_app(engine, served_model_name=NAME, api_key=KEY, response_store=store)) as u:
        yield u


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def prompt_tokens(url: str, messages: list[dict[str, Any]]) -> int:
    r = httpx.post(url + "/tokenize", json={"model": NAME, "messages": messages}, headers={"x-api-key": KEY})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_create_equals_the_chat_completion(client: openai.OpenAI) -> None:
    r = client.responses.create(model=NAME, input="Tell me of Verona.", instructions="Answer briefly.",
                                max_output_tokens=24, temperature=0.0)  # fmt: skip
    chat = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Tell me of Verona."}],
        max_tokens=24,
        temperature=0.0,
    )
    choice = chat.choices[0]
    assert r.object == "response" and r.id.startswith("resp_") and r.model == NAME
    assert r.output_text == choice.message.content and r.output[0].type == "message"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == chat.usage.total_tokens
    assert (r.status, r.incomplete_details and r.incomplete_details.reason) == (
        ("incomplete", "max_output_tokens") if choice.finish_reason == "length" else ("completed", None)
    )


def test_input_items_render_as_the_chat_conversation(client: openai.OpenAI, url: str) -> None:
    items = [
        {"type": "message", "role": "developer", "content": "Be terse."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Verona"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    r = client.responses.create(model=NAME, input=items, max_output_tokens=4, temperature=0.0)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Verona"}'}}
    chat = [
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": "Weather ?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
        {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert r.usage.input_tokens == prompt_tokens(url, chat)


def test_stream_events_accumulate_to_the_created_response(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=NAME, input="Hi", max_output_tokens=60, temperature=0.0,
                                  extra_body={"stop": ["\n"]})  # fmt: skip
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    created = client.responses.create(**kwargs)
    kinds = [e.type for e in events]
    n = kinds.count("response.output_text.delta")
    assert n >= 1
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * n,
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.status == created.status == "completed"
    assert final.output_text == deltas == created.output_text != ""
    assert final.usage.output_tokens == created.usage.output_tokens


def test_stream_cut_by_max_output_tokens_ends_incomplete(url: str) -> None:
    body = {"model": NAME, "input": "Hi", "max_output_tokens": 3, "stream": True}
    with httpx.stream("POST", url + "/v1/responses", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    last = data[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["usage"]["output_tokens"] == 3
    assert last["response"]["output"][0]["status"] == "incomplete"


@pytest.mark.parametrize("tool_choice", [{"type": "function", "name": "get_weather"}, "required"])
def test_function_call_and_its_output_round_trip(client: openai.OpenAI, url: str, tool_choice: Any) -> None:
    r = client.responses.create(model=NAME, input="Weather in Verona?", tools=[WEATHER], tool_choice=tool_choice,
                                max_output_tokens=120, temperature=1.0, parallel_tool_calls=False)  # fmt: skip
    assert r.status == "completed", r
    assert [i.type for i in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    r2 = client.responses.create(
        model=NAME,
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        max_output_tokens=4,
    )
    fn = {"name": "get_weather", "arguments": call.arguments}
    chat = [
        {"role": "user", "content": "Weather in Verona?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": fn}]},
        {"role": "tool", "content": "sunny", "tool_call_id": call.call_id},
    ]
    assert r2.previous_response_id == r.id
    assert r2.usage.input_tokens == prompt_tokens(url, chat)  # tools are not rendered: r2 sends none


def test_streamed_function_call(client: openai.OpenAI) -> None:
    with client.responses.stream(model=NAME, input="Weather?", tools=[WEATHER], max_output_tokens=120,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert final.output[0].type == "function_call" and final.output[0].arguments == done.arguments
    jsonschema.validate(json.loads(done.arguments), WEATHER_PARAMS)


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=99)


def test_text_format_parse(client: openai.OpenAI) -> None:
    for seed in (0, 1):
        r = client.responses.parse(model=NAME, input="Who?", text_format=Person, max_output_tokens=80,
                                   temperature=1.0, extra_body={"seed": seed})  # fmt: skip
        assert r.status == "completed" and isinstance(r.output_parsed, Person), r
        assert r.text.format.type == "json_schema"


def test_previous_response_id_continues_the_stored_conversation(client: openai.OpenAI, url: str) -> None:
    first = "Tell me, in the fair city of Verona, where we lay our scene, of the two households alike in dignity."
    r1 = client.responses.create(model=NAME, input=first, instructions="Be brief.", max_output_tokens=8,
                                 temperature=0.0)  # fmt: skip
    r2 = client.responses.create(model=NAME, input="More.", previous_response_id=r1.id, max_output_tokens=4)
    # the instructions are not carried over (OpenAI's rule): the stored conversation is the input and output
    chat = [{"role": "user", "content": first}, {"role": "assistant", "content": r1.output_text},
            {"role": "user", "content": "More."}]  # fmt: skip
    assert r2.usage.input_tokens == prompt_tokens(url, chat)
    r3 = client.responses.create(model=NAME, input="More.", previous_response_id=r1.id, max_output_tokens=4)
    assert r3.usage.input_tokens == r2.usage.input_tokens
    assert 16 <= r3.usage.input_tokens_details.cached_tokens < r3.usage.input_tokens  # r2's prompt blocks


def test_store_get_delete(client: openai.OpenAI) -> None:
    r = client.responses.create(model=NAME, input="Hi", max_output_tokens=5)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    deleted = httpx.delete(str(client.base_url) + f"responses/{r.id}", headers={"x-api-key": KEY})
    assert deleted.json() == {"id": r.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert e.value.body["param"] == "response_id"
    unstored = client.responses.create(model=NAME, input="Hi", max_output_tokens=5, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=NAME, input="Hi", previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"


def test_store_keeps_the_newest_entries(client: openai.OpenAI) -> None:
    ids = [client.responses.create(model=NAME, input="Hi", max_output_tokens=2).id for _ in range(STORE_SIZE + 1)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert all(client.responses.retrieve(i).id == i for i in ids[1:])


def test_store_ttl() -> None:
    store = ResponseStore(max_entries=10, ttl_s=0.05)
    entry = StoredResponse(type("R", (), {"id": "resp_a"})(), [])
    store.put(entry)
    assert store.get("resp_a") is entry
    time.sleep(0.1)
    assert store.get("resp_a") is None and len(store) == 0


def test_background_response_cancelled_mid_generation(client: openai.OpenAI, engine: AsyncEngine) -> None:
    before = engine.snapshot().num_aborted_requests_total
    with steps_held_after_first(engine.engine):
        r = client.responses.create(model=NAME, input="Hi", max_output_tokens=200, background=True)
        assert r.status == "in_progress" and r.background
        assert client.responses.retrieve(r.id).status == "in_progress"
        cancelled = client.responses.cancel(r.id)
        assert cancelled.status == "cancelled"
    deadline = time.monotonic() + 30
    while engine.snapshot().num_aborted_requests_total == before:
        assert time.monotonic() < deadline, "the cancelled response's engine request was not aborted"
        time.sleep(0.02)
    assert client.responses.retrieve(r.id).status == "cancelled"
    done = client.responses.create(model=NAME, input="Hi", max_output_tokens=5)
    with pytest.raises(openai.BadRequestError, match="only background responses"):
        client.responses.cancel(done.id)


def test_background_response_completes(client: openai.OpenAI) -> None:
    r = client.responses.create(model=NAME, input="Hi", max_output_tokens=5, background=True, temperature=0.0)
    deadline = time.monotonic() + 60
    while (got := client.responses.retrieve(r.id)).status == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    direct = client.responses.create(model=NAME, input="Hi", max_output_tokens=5, temperature=0.0)
    assert got.status == direct.status and got.output_text == direct.output_text
    assert got.usage.output_tokens == 5


@pytest.mark.parametrize(
    "body, param, needle",
    [
        ({"tools": [{"type": "web_search_preview"}]}, "tools[0]", "'web_search_preview' is not supported"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0]", "'file_search'"),
        ({"tools": [{"type": "computer_use_preview"}]}, "tools[0]", "'computer_use_preview'"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0]", "input_image"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]", "item_reference"),
        ({"max_output_tokens": 100000}, "max_output_tokens", "max_output_tokens"),
        ({"text": {"format": {"type": "xml"}}}, "text.format", "text.format.type"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "reasoning.effort"),
        ({"input": []}, "input", "input must not be empty"),
        ({"background": True, "store": False}, "background", "background"),
        ({"temperature": "hot"}, "temperature", "temperature"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_in_openai_shape(url: str, body: dict[str, Any], param: str, needle: str) -> None:
    r = httpx.post(url + "/v1/responses", json={"model": NAME, "input": "Hi", **body},
                   headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and needle in err["message"], err


def test_api_key_and_unknown_model(url: str) -> None:
    r = httpx.post(url + "/v1/responses", json={"model": NAME, "input": "Hi"}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(url + "/v1/responses", json={"model": "gpt-5", "input": "Hi"}, headers={"x-api-key": KEY})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
