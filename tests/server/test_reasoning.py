"""Reasoning and tool-call parsers end to end: scripted models (tests/scripted_model.py) with chat templates written
for the tests in each family's format, served in-process and called with the official `openai` client and
LangChain's ChatOpenAI. Each family's thinking lands in reasoning_content and its answer in content, identically
streamed and not; each tool-call format gives the same tool_calls as the Hermes form of the same calls."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI

from lmserve.config.engine import EngineArgs
from lmserve.engine.async_engine import AsyncEngine
from lmserve.engine.llm_engine import LLMEngine
from lmserve.entrypoints.openai.serve_cli import add_parser, chat_settings_of, run_serve
from lmserve.entrypoints.openai.server import build_app
from lmserve.parsers.chat_settings import ChatSettings
from tests.helpers import require_extra
from tests.scripted_model import build_scripted_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAME = "scripted"
WEATHER = {"city": "Verona", "days": 3}
TIME = {"zone": "UTC"}
CALLS = [("get_weather", WEATHER), ("get_time", TIME)]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}, "required": ["zone"]}}},
]  # fmt: skip
MSG = [{"role": "user", "content": "Weather and time in Verona?"}]
THOUGHT, ANSWER = "I need the weather and the time.", "Let me check."

CHATML = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{{ tool_doc }}"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{{ gen }}{% endif %}"
)


def chatml(tool_doc: str, gen: str) -> str:
    return CHATML.replace("{{ tool_doc }}", tool_doc).replace("{{ gen }}", gen)


QWEN3_GEN = "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
QWEN35_GEN = "<think>\n{% if enable_thinking is defined and not enable_thinking %}\n</think>\n\n{% endif %}"


def _hermes(name: str, args: dict) -> str:
    return "\n<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def _xml(name: str, args: dict) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"\n<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _harmony(name: str, args: dict) -> str:
    return f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"


@dataclass
class Family:
    template: str
    script: list[str]
    reasoning: str | None  # the expected reasoning_content
    content: str | None  # the expected content beside the calls
    reasoning_tokens: int  # the scripted tokens up to the reasoning's end
    special: tuple[str, ...] = ()
    settings: dict[str, str] | None = None  # ChatSettings (default: chosen from the template)


FAMILIES = {
    # Qwen3: <think> written by the model; Hermes calls
    "qwen3+hermes": Family(
        chatml("<tool_call>", QWEN3_GEN), ["<think>", f"\n{THOUGHT}\n", "</think>", "\n\n", ANSWER,
        _hermes(*CALLS[0]), _hermes(*CALLS[1])], THOUGHT, ANSWER, 3),
    # Qwen3.5 / Qwen3-Coder: the template opens <think>; XML calls with values typed by the schema
    "qwen3+qwen3_coder": Family(
        chatml("<function=NAME>\n<parameter=NAME>\nvalue\n</parameter>\n</function>", QWEN35_GEN),
        [THOUGHT, "</think>", "\n\n", ANSWER, _xml(*CALLS[0]), _xml(*CALLS[1])], THOUGHT, ANSWER, 2),
    # DeepSeek-R1: the template opens <think>; Mistral's [TOOL_CALLS] (a special token) and a JSON list
    "deepseek_r1+mistral": Family(
        "{% for m in messages %}<｜User｜>{{ m['content'] }}{% endfor %}{% if tools %}[AVAILABLE_TOOLS]"
        "{{ tools | tojson }}[/AVAILABLE_TOOLS] [TOOL_CALLS]{% endif %}<｜Assistant｜><think>\n",
        [THOUGHT, "</think>", "\n\n", ANSWER, "[TOOL_CALLS]",
         json.dumps([{"name": n, "arguments": a} for n, a in CALLS])], THOUGHT, ANSWER, 2, special=("[TOOL_CALLS]",)),
    # Granite's plain-text markers; Llama 3's JSON after <|python_tag|> (a special token)
    "granite+llama3_json": Family(
        "<|system|>Write 'Here is my thought process:', then 'Here is my response:'.{% for m in messages %}<|user|>"
        "{{ m['content'] }}{% endfor %}{% if tools %}{{ tools | tojson }} Environment: ipython<|python_tag|>"
        "{% endif %}<|assistant|>",
        ["Here is my thought process:", f" {THOUGHT}", " Here is my response:", "<|python_tag|>",
         json.dumps({"name": CALLS[0][0], "parameters": CALLS[0][1]}), "; ",
         json.dumps({"name": CALLS[1][0], "parameters": CALLS[1][1]})], THOUGHT, None, 3, special=("<|python_tag|>",)),
    # no reasoning; pythonic calls (the flag names the parser: no template marker shows it)
    "none+pythonic": Family(
        "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}{% if tools %}{{ tools | tojson }}"
        "{% endif %}<|assistant|>",
        ['[get_weather(city="Verona", days=3), get_time(zone="UTC")]'], None, None, 0,
        settings={"tool_parser": "pythonic"}),
    # gpt-oss harmony: analysis channel, then commentary messages to functions.*
    "gpt_oss+openai": Family(
        "{% for m in messages %}<|start|>user<|message|>{{ m['content'] }}<|end|>{% endfor %}{% if tools %}"
        "<|start|>developer<|message|>{{ tools | tojson }} (calls: <|channel|>commentary)<|end|>{% endif %}"
        "<|start|>assistant",
        ["<|channel|>analysis<|message|>", THOUGHT, "<|end|>" + _harmony(*CALLS[0]), json.dumps(WEATHER),
         "<|call|>" + _harmony(*CALLS[1]), json.dumps(TIME), "<|call|>"], THOUGHT, None, 3),
}  # fmt: skip


@pytest.fixture(scope="module")
def apps(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Iterator[Any]:
    """family name → its served app (built on first use)."""
    root, built, engines = tmp_path_factory.mktemp("scripted"), {}, []

    def get(name: str, script: list[str] | None = None, settings: ChatSettings | None = None) -> FastAPI:
        key = (name, tuple(script or ()), settings is not None)
        if key not in built:
            fam = FAMILIES[name]
            path = build_scripted_model(root / f"m{len(built)}", script or fam.script, fam.template,
                                        special=fam.special, tokenizer_dir=tokenizer_dir)  # fmt: skip
            e = AsyncEngine(LLMEngine.from_engine_args(EngineArgs.from_kwargs(str(path), num_kv_blocks=64)))
            engines.append(e)
            settings = settings or (ChatSettings(**fam.settings) if fam.settings else None)
            built[key] = build_app(e, served_model_name=NAME, chat_settings=settings)
        return built[key]

    yield get
    for e in engines:
        e.shutdown()


def run(app: FastAPI, fn: Any) -> Any:
    async def main() -> Any:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test/v1") as http:
            return await fn(openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http,
                                               max_retries=0), http)  # fmt: skip

    return asyncio.run(main())


def both(app: FastAPI, **kwargs: Any) -> tuple[Any, list[Any]]:
    """The non-streamed response and the streamed chunks of the same request."""
    kwargs = {"model": NAME, "messages": MSG, "max_tokens": 40, "temperature": 0.0, **kwargs}

    async def go(c: openai.AsyncOpenAI, _: Any) -> tuple[Any, list[Any]]:
        r = await c.chat.completions.create(**kwargs)
        s = await c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
        return r, [chunk async for chunk in s]

    return run(app, go)


def streamed(chunks: list[Any]) -> dict[str, Any]:
    """What a stream adds up to; asserts every reasoning delta comes before the first content or call delta."""
    out: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}, "finish_reason": None, "usage": None}
    answered = False
    for ch in chunks:
        out["usage"] = ch.usage or out["usage"]
        for c in ch.choices:
            d = c.delta
            r = getattr(d, "reasoning_content", None)
            if r:
                assert not answered, "reasoning after content"
                assert getattr(d, "reasoning", None) == r
                out["reasoning"] += r
            if d.content or d.tool_calls:
                answered = True
            out["content"] += d.content or ""
            for tc in d.tool_calls or []:
                call = out["calls"].setdefault(tc.index, ["", ""])
                call[0] += tc.function.name or ""
                call[1] += tc.function.arguments or ""
            out["finish_reason"] = c.finish_reason or out["finish_reason"]
    out["calls"] = [(n, json.loads(a)) for _, (n, a) in sorted(out["calls"].items())]
    return out


def calls_of(message: Any) -> list[tuple[str, dict]]:
    return [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls or []]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_format_gives_the_hermes_calls(apps: Any, family: str) -> None:
    fam = FAMILIES[family]
    r, chunks = both(apps(family), tools=TOOLS)
    (c,) = r.choices
    hermes, _ = both(apps("qwen3+hermes"), tools=TOOLS)
    assert calls_of(c.message) == calls_of(hermes.choices[0].message) == CALLS, c
    assert c.finish_reason == "tool_calls"
    assert (getattr(c.message, "reasoning_content", None), c.message.content) == (fam.reasoning, fam.content)
    if fam.reasoning is not None:
        assert c.message.reasoning == fam.reasoning  # vLLM's newer name, the same text
    s = streamed(chunks)
    assert (s["reasoning"] or None, s["content"] or None, s["calls"], s["finish_reason"]) == (
        fam.reasoning, fam.content, CALLS, "tool_calls",
    )  # fmt: skip
    details = r.usage.completion_tokens_details
    assert (details.reasoning_tokens if details else 0) == fam.reasoning_tokens
    u = s["usage"]
    assert (u.completion_tokens, u.completion_tokens_details) == (r.usage.completion_tokens, details)


@pytest.mark.parametrize("family", ["qwen3+hermes", "qwen3+qwen3_coder", "deepseek_r1+mistral", "granite+llama3_json",
                                    "gpt_oss+openai"])  # fmt: skip
def test_reasoning_without_tools_streamed_and_not(apps: Any, family: str) -> None:
    fam = FAMILIES[family]
    r, chunks = both(apps(family))
    (c,) = r.choices
    assert c.finish_reason == "stop" and c.message.tool_calls is None
    assert c.message.reasoning_content == fam.reasoning
    for marker in ("<think>", "</think>", "analysis", "thought process", THOUGHT):  # without tools calls are text
        assert marker not in (c.message.content or "")
    s = streamed(chunks)
    assert (s["reasoning"], s["content"], s["finish_reason"]) == (fam.reasoning, c.message.content, "stop")
    # include_reasoning false drops it, streamed or not; the content is the same
    r2, chunks2 = both(apps(family), extra_body={"include_reasoning": False})
    assert getattr(r2.choices[0].message, "reasoning_content", None) is None
    assert r2.choices[0].message.content == c.message.content
    assert streamed(chunks2)["reasoning"] == "" and streamed(chunks2)["content"] == s["content"]


@pytest.mark.parametrize("family", ["qwen3+hermes", "qwen3+qwen3_coder"])
@pytest.mark.parametrize("switch", [{"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}])
def test_thinking_switched_off_in_the_template(apps: Any, family: str, switch: dict) -> None:
    """The template's no-thinking prompt makes the scripted model skip its thinking: the kwarg reached it."""
    r, chunks = both(apps(family), tools=TOOLS, extra_body=switch)
    (c,) = r.choices
    assert getattr(c.message, "reasoning_content", None) is None
    assert (c.message.content, calls_of(c.message), c.finish_reason) == (ANSWER, CALLS, "tool_calls")
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    s = streamed(chunks)
    assert (s["reasoning"], s["content"], s["calls"]) == ("", ANSWER, CALLS)


def test_bad_chat_template_kwargs_are_400(apps: Any) -> None:
    async def go(_: Any, http: httpx.AsyncClient) -> list[httpx.Response]:
        bodies = [{"chat_template_kwargs": [1]}, {"chat_template_kwargs": {"messages": []}}, {"reasoning_effort": 3}]
        return [await http.post("/chat/completions", json={"model": NAME, "messages": MSG, **b}) for b in bodies]

    params = [(r.status_code, r.json()["error"]["param"]) for r in run(apps("qwen3+hermes"), go)]
    assert params == [(400, "chat_template_kwargs"), (400, "chat_template_kwargs"), (400, "reasoning_effort")]


JSON_SCRIPT = ["<think>", THOUGHT, "</think>", "\n\n", '{"days": 3}']
DAYS = {"type": "object", "properties": {"days": {"type": "integer"}}, "required": ["days"]}


@pytest.mark.parametrize("family", ["qwen3+hermes", "qwen3+qwen3_coder"])
def test_structured_output_applies_after_the_reasoning(apps: Any, family: str) -> None:
    """The grammar would refuse the thinking (the scripted model's first token is not JSON); with the reasoning
    parser it applies from </think>: the thinking is free text, the answer the schema's JSON."""
    script = JSON_SCRIPT if family == "qwen3+hermes" else JSON_SCRIPT[1:]
    app = apps(family, script)
    rf = {"type": "json_schema", "json_schema": {"name": "d", "schema": DAYS}}
    r, chunks = both(app, response_format=rf)
    (c,) = r.choices
    assert (c.message.reasoning_content, c.message.content, c.finish_reason) == (THOUGHT, '{"days": 3}', "stop")
    assert (streamed(chunks)["reasoning"], streamed(chunks)["content"]) == (THOUGHT, '{"days": 3}')
    named = {"type": "function", "function": {"name": "get_days"}}
    tool = {"type": "function", "function": {"name": "get_days", "parameters": DAYS}}
    r, chunks = both(app, tools=[tool], tool_choice=named)
    (c,) = r.choices
    assert (c.message.reasoning_content, calls_of(c.message), c.finish_reason) == (
        THOUGHT, [("get_days", {"days": 3})], "tool_calls",
    )  # fmt: skip


def test_langchain_chat_openai(apps: Any) -> None:
    """ChatOpenAI shows the answer without the thinking, and bind_tools gets the calls (tool_choice auto)."""
    require_extra("test", "langchain_openai")
    from langchain_openai import ChatOpenAI

    app = apps("qwen3+hermes")

    async def go() -> tuple[Any, Any, Any]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test/v1") as http:
            llm = ChatOpenAI(model=NAME, base_url="http://test/v1", api_key="x", http_async_client=http,
                             temperature=0.0, max_tokens=40, max_retries=0)  # fmt: skip
            plain = await llm.ainvoke(MSG)
            bound = llm.bind_tools(TOOLS)
            called = await bound.ainvoke(MSG)
            chunks = [ch async for ch in bound.astream(MSG)]
            return plain, called, sum(chunks[1:], chunks[0])

    plain, called, merged = asyncio.run(go())
    assert "<think>" not in plain.content and THOUGHT not in plain.content
    for msg in (called, merged):
        assert [(t["name"], t["args"]) for t in msg.tool_calls] == CALLS and not msg.invalid_tool_calls
        assert msg.content == ANSWER


def test_serve_flags(apps: Any, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--chat-template FILE replaces the template, --default-chat-template-kwargs reach it, --reasoning-parser
    names the parser; an unknown parser name stops `lmserve serve` at start-up, listing the known ones."""
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    template = tmp_path / "t.jinja"
    template.write_text(FAMILIES["qwen3+hermes"].template.replace("<|im_start|>assistant\n", "<|im_start|>bot\n"))
    args = parser.parse_args(["serve", "--chat-template", str(template), "--reasoning-parser", "qwen3",
                              "--default-chat-template-kwargs", '{"enable_thinking": false}'])  # fmt: skip
    app = apps("qwen3+hermes", FAMILIES["qwen3+hermes"].script, chat_settings_of(args))
    r, _ = both(app)
    assert r.choices[0].message.content.startswith(ANSWER)  # thinking off by the server's default kwargs
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    r, _ = both(app, extra_body={"chat_template_kwargs": {"enable_thinking": True}})  # the request's win
    assert r.choices[0].message.reasoning_content == THOUGHT

    async def tokenize(_: Any, http: httpx.AsyncClient) -> Any:
        return (await http.post("http://test/tokenize", json={"messages": MSG})).json()["tokens"]

    engine = app.state.lmserve.engine
    assert engine.tokenizer.decode(run(app, tokenize)).endswith("<|im_start|>bot\n")
    for flag, name in [("--reasoning-parser", "qwen4"), ("--tool-call-parser", "hermes2")]:
        assert run_serve(parser.parse_args(["serve", flag, name])) == 2
        err = capsys.readouterr().err
        assert f"{flag}: unknown" in err and ("qwen3, deepseek_r1, gpt_oss" in err or "hermes, qwen3_coder" in err)


def test_grpc_split_reasoning(apps: Any) -> None:
    """GenerateRequest.split_reasoning: Choice.reasoning beside the answer, the same in Generate and
    GenerateStream; Usage.reasoning_tokens; without it the text is the model's whole output."""
    require_extra("grpc", "grpc", "grpc_health.v1.health")
    import grpc

    from lmserve.entrypoints.grpc.server import grpc_frontend
    from lmserve.grpc_proto import lmserve_pb2 as pb
    from lmserve.grpc_proto import lmserve_pb2_grpc as pb_grpc
    from tests.server.test_server import free_port

    app, port = apps("qwen3+hermes"), free_port()
    fam = FAMILIES["qwen3+hermes"]
    prompt = fam.template.split("{% if add_generation_prompt %}")[0]  # any text: the script starts anyway
    params = pb.SamplingParams(temperature=0.0, max_tokens=40)

    async def go() -> tuple[Any, list[Any], Any]:
        async with grpc_frontend("127.0.0.1", port)(app.state.lmserve):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.GenerationStub(ch)
                req = pb.GenerateRequest(text=prompt, sampling_params=params, split_reasoning=True)
                whole = await stub.Generate(req)
                parts = [m async for m in stub.GenerateStream(req)]
                plain = await stub.Generate(pb.GenerateRequest(text=prompt, sampling_params=params))
                return whole, parts, plain

    whole, parts, plain = asyncio.run(go())
    (c,) = whole.choices
    assert (c.reasoning, c.text.startswith(ANSWER)) == (THOUGHT, True)
    assert whole.usage.reasoning_tokens == fam.reasoning_tokens
    assert "".join(ch.reasoning for m in parts for ch in m.choices) == THOUGHT
    assert "".join(ch.text for m in parts for ch in m.choices) == c.text
    assert plain.choices[0].text.startswith("<think>") and plain.choices[0].reasoning == ""
