"""The Responses and Anthropic Messages APIs on a scripted model (tests/scripted_model.py) that writes a reasoning
block and a Hermes tool call, then EOS: reasoning output items / thinking blocks (the qwen3 parser chosen from the
template), function_call items / tool_use blocks (the hermes parser), each streamed and not with the same result,
the call's output sent back, and end_turn when no tools are given (the call is then plain text)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from lmserve.config.engine import EngineArgs
from lmserve.engine.async_engine import AsyncEngine
from lmserve.engine.llm_engine import LLMEngine
from lmserve.entrypoints.openai.server import build_app
from tests.scripted_model import build_scripted_model
from tests.thread_server import serve_in_thread

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAME = "scripted"
THOUGHT = "I should check the weather."
ARGS = {"city": "Verona", "unit": "C"}
CALL = json.dumps({"name": "get_weather", "arguments": ARGS})
SCRIPT = ["<think>", THOUGHT, "</think>", "<tool_call>", CALL, "</tool_call>"]
# Qwen3's shape: tools in a system turn, <think> and <tool_call> named (the parsers are chosen from these markers)
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> Call a tool "
    "as <tool_call>{...}</tool_call>; think in <think></think> first.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}}
ASK = [{"role": "user", "content": "Weather in Verona?"}]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Iterator[str]:
    path = build_scripted_model(tmp_path_factory.mktemp("scripted") / "m", SCRIPT, TEMPLATE,
                                tokenizer_dir=tokenizer_dir)  # fmt: skip
    e = AsyncEngine(LLMEngine.from_engine_args(EngineArgs.from_kwargs(str(path), num_kv_blocks=64)))
    try:
        with serve_in_thread(build_app(e, served_model_name=NAME)) as u:
            yield u
    finally:
        e.shutdown()


@pytest.fixture(scope="module")
def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60)


RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": SCHEMA}


def _items(response: Any) -> list[tuple[str, Any]]:
    out = []
    for item in response.output:
        if item.type == "reasoning":
            out.append(("reasoning", item.content[0].text))
        elif item.type == "function_call":
            out.append(("function_call", (item.name, json.loads(item.arguments))))
        else:
            out.append(("message", item.content[0].text))
    return out


def test_responses_reasoning_item_and_function_call(oai: openai.OpenAI, url: str) -> None:
    r = oai.responses.create(model=NAME, input=ASK, tools=[RESPONSES_TOOL], max_output_tokens=20)
    assert r.status == "completed"
    assert _items(r) == [("reasoning", THOUGHT), ("function_call", ("get_weather", ARGS))]
    assert r.usage.output_tokens == len(SCRIPT) + 1  # and the EOS
    assert r.usage.output_tokens_details.reasoning_tokens == 3  # <think>, the thought, </think>
    with oai.responses.stream(model=NAME, input=ASK, tools=[RESPONSES_TOOL], max_output_tokens=20) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert _items(final) == _items(r)
    kinds = [e.type for e in events]
    n = kinds.count("response.reasoning_text.delta")
    assert n >= 1 and "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", *["response.reasoning_text.delta"] * n,
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    call = r.output[1]
    answer = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    r2 = oai.responses.create(model=NAME, previous_response_id=r.id, tools=[RESPONSES_TOOL], max_output_tokens=20,
                              input=answer)  # fmt: skip
    assert r2.status == "completed" and _items(r2) == _items(r)  # the script starts over after any prompt


def test_responses_without_tools_the_call_is_text(oai: openai.OpenAI) -> None:
    r = oai.responses.create(model=NAME, input="Hi", max_output_tokens=20)
    assert r.status == "completed"
    assert _items(r) == [("reasoning", THOUGHT), ("message", "".join(SCRIPT[3:]))]


def _blocks(message: Any) -> list[tuple[str, Any]]:
    out = []
    for b in message.content:
        out.append((b.type, {"thinking": getattr(b, "thinking", None), "text": getattr(b, "text", None),
                             "tool_use": (getattr(b, "name", None), getattr(b, "input", None))}[b.type]))  # fmt: skip
    return out


def test_messages_thinking_and_tool_use(claude: anthropic.Anthropic) -> None:
    tool = {"name": "get_weather", "input_schema": SCHEMA}
    m = claude.messages.create(model=NAME, messages=ASK, tools=[tool], max_tokens=20)
    assert m.stop_reason == "tool_use"
    assert _blocks(m) == [("thinking", THOUGHT), ("tool_use", ("get_weather", ARGS))]
    with claude.messages.stream(model=NAME, messages=ASK, tools=[tool], max_tokens=20) as stream:
        events = [e for e in stream if e.type not in ("thinking", "input_json", "text")]  # the helper's own events
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(m) and final.stop_reason == "tool_use"
    kinds = [(e.type, e.content_block.type if e.type == "content_block_start" else None) for e in events]
    n = sum(1 for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
    assert kinds == [
        ("message_start", None), ("content_block_start", "thinking"), *[("content_block_delta", None)] * n,
        ("content_block_stop", None), ("content_block_start", "tool_use"), ("content_block_delta", None),
        ("content_block_stop", None), ("message_delta", None), ("message_stop", None),
    ]  # fmt: skip
    use = m.content[1]
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}
    turns = [*ASK, {"role": "assistant", "content": m.content}, {"role": "user", "content": [result]}]
    counted = claude.messages.count_tokens(model=NAME, messages=turns, tools=[tool])
    again = claude.messages.create(model=NAME, messages=turns, tools=[tool], max_tokens=20)
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == counted.input_tokens
    assert _blocks(again) == _blocks(m)


def test_messages_end_turn_without_tools(claude: anthropic.Anthropic, url: str) -> None:
    m = claude.messages.create(model=NAME, messages=ASK, max_tokens=20)
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert _blocks(m) == [("thinking", THOUGHT), ("text", "".join(SCRIPT[3:]))]
    off = httpx.post(url + "/v1/messages/count_tokens", json={"messages": ASK, "thinking": {"type": "disabled"}})
    on = httpx.post(url + "/v1/messages/count_tokens", json={"messages": ASK})
    assert off.status_code == on.status_code == 200  # the template ignores enable_thinking: the same prompt
    assert off.json() == on.json()
