"""entrypoints/openai/parsers: every reasoning and tool-call parser on whole outputs (expected values written by
hand), and streamed in pieces split at every position, one character at a time and all at once: the pieces add up
to the whole output's fields, and no marker leaks into either field."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from lmserve.parsers import (
    TOOL_PARSERS,
    ToolParser,
    detect_parsers,
    reasoning_parser,
    tool_parser,
)

CH, MSG = "<|channel|>", "<|message|>"

# (parser, prompt, output) → (reasoning, content)
REASONING = [
    ("qwen3", "", "<think>\nLet me see.\n</think>\n\nHello!", ("Let me see.", "Hello!")),
    ("qwen3", "", "Hello, no thinking.", (None, "Hello, no thinking.")),
    ("qwen3", "", "<think>cut short by max_tok", ("cut short by max_tok", None)),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "opened</think>Answer", ("opened", "Answer")),
    ("qwen3", "", "  <thinking> is not the marker", (None, "  <thinking> is not the marker")),
    ("qwen3", "", "<think></think>Only <think> as text", (None, "Only <think> as text")),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "Reasoning.\n</think>\n\nThe answer.", ("Reasoning.", "The answer.")),
    ("deepseek_r1", "<｜Assistant｜>", "<think>R1 writes it</think>A", ("R1 writes it", "A")),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "never closed", ("never closed", None)),
    ("deepseek_r1", "<｜Assistant｜><think>\n\n</think>\n\n", "thinking off", (None, "thinking off")),
    ("granite", "", "Here is my thought process: hmm.\nHere is my response: Fine.", ("hmm.", "Fine.")),
    ("granite", "", "Here's my thought process:x Here's my response:y", ("x", "y")),
    ("granite", "", "Plain answer.", (None, "Plain answer.")),
    ("gpt_oss", "", f"{CH}analysis{MSG}Think.<|end|><|start|>assistant{CH}final{MSG}Answer.", ("Think.", "Answer.")),
    ("gpt_oss", "", f"{CH}analysis{MSG}A<|end|><|start|>assistant{CH}analysis{MSG}B<|end|>"
                    f"<|start|>assistant{CH}final{MSG}C<|return|>", ("A\n\nB", "C")),
    ("gpt_oss", "", f"{CH}analysis{MSG}cut", ("cut", None)),
    ("gpt_oss", "", f"{CH}final{MSG}Direct.", (None, "Direct.")),
]  # fmt: skip


def splits(text: str) -> Iterator[list[str]]:
    """The text in two pieces at every position, one character at a time, and whole."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    yield [text]


@pytest.mark.parametrize("name, prompt, text, want", REASONING)
def test_reasoning_whole_and_streamed(name: str, prompt: str, text: str, want: tuple) -> None:
    cls = reasoning_parser(name)
    assert cls(prompt).extract(text) == want
    for pieces in splits(text):
        p = cls(prompt)
        r, c = "", ""
        for piece in pieces:
            dr, dc = p.feed(piece)
            r, c = r + dr, c + dc
            for marker in ("<think", "</think", "<|", "Here is my", "think>"):
                if marker not in (want[0] or "") and marker not in (want[1] or ""):
                    assert marker not in r and marker not in c, (pieces, r, c)
        dr, dc = p.finish()
        assert (r + dr or None, c + dc or None) == want, pieces


def test_reasoning_end_offset() -> None:
    text = "<think>ab</think>\n\nanswer"
    assert reasoning_parser("qwen3")().reasoning_end(text) == len("<think>ab</think>")
    assert reasoning_parser("qwen3")().reasoning_end("plain") == 0


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known: qwen3, deepseek_r1"):
        reasoning_parser("qwen4")
    with pytest.raises(ValueError, match="known: hermes, qwen3_coder"):
        tool_parser("nope")


# ---- tool calls: each format of the same two calls gives the same calls as the Hermes form --------------------

WEATHER = {"city": "Verona", "days": 3, "metric": True, "tags": ["a", "b"]}
TIME = {"zone": "UTC"}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "tags": {"type": "array"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}}}},
]  # fmt: skip


def _hermes(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def _xml(name: str, args: dict) -> str:
    params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n" for k, v in args.items()
    )
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _harmony(name: str, args: dict) -> str:
    return f"<|start|>assistant{CH}commentary to=functions.{name} <|constrain|>json{MSG}{json.dumps(args)}<|call|>"


def _canonical_harmony(name: str, args: dict) -> str:  # as the gpt_oss reasoning parser passes it on
    return f"{CH}commentary to=functions.{name}{MSG}{json.dumps(args)}<|call|>"


PREFIX = "Let me check."
TWO_CALLS = {
    "hermes": f"{PREFIX}\n\n{_hermes('get_weather', WEATHER)}\n{_hermes('get_time', TIME)}",
    "qwen3_coder": f"{PREFIX}\n{_xml('get_weather', WEATHER)}\n{_xml('get_time', TIME)}",
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(WEATHER)
    + '}; {"name": "get_time", "parameters": ' + json.dumps(TIME) + "}",
    "mistral": f'{PREFIX}[TOOL_CALLS][{{"name": "get_weather", "arguments": {json.dumps(WEATHER)}}}, '
    f'{{"name": "get_time", "arguments": {json.dumps(TIME)}}}]',
    "mistral_v11": f"{PREFIX}[TOOL_CALLS]get_weather[ARGS]{json.dumps(WEATHER)}[TOOL_CALLS]get_time[ARGS]"
    + json.dumps(TIME),
    "pythonic": '[get_weather(city="Verona", days=3, metric=True, tags=["a", "b"]), get_time(zone="UTC")]',
    "openai": f"{PREFIX}{_canonical_harmony('get_weather', WEATHER)}{_canonical_harmony('get_time', TIME)}",
    "openai_raw": f"{CH}final{MSG}{PREFIX}<|end|>{_harmony('get_weather', WEATHER)}{_harmony('get_time', TIME)}",
}  # fmt: skip
WITH_PREFIX = {"hermes", "qwen3_coder", "mistral", "mistral_v11", "openai", "openai_raw"}


def _parser(fmt: str) -> ToolParser:
    return tool_parser(fmt.removesuffix("_v11").removesuffix("_raw"))


def _calls(calls: list) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("fmt", sorted(TWO_CALLS))
def test_tool_calls_whole_and_streamed(fmt: str) -> None:
    parser, text = _parser(fmt), TWO_CALLS[fmt]
    want_content = PREFIX if fmt in WITH_PREFIX else None
    _, hermes_calls = tool_parser("hermes").extract(TWO_CALLS["hermes"], TOOLS)
    content, calls = parser.extract(text, TOOLS)
    assert (content, _calls(calls)) == (want_content, _calls(hermes_calls))
    assert _calls(calls) == [("get_weather", WEATHER), ("get_time", TIME)]
    for pieces in splits(text):
        stream = parser.stream(TOOLS)
        sent = "".join(stream.feed(piece) for piece in pieces)
        rest, got, deltas = stream.finish()
        assert (sent + rest or None) == want_content, pieces
        assert _calls(got) == _calls(calls)
        # the deltas: per call, its id and name first, then arguments that concatenate to valid JSON
        by_index: dict[int, list] = {}
        for d in deltas:
            by_index.setdefault(d.index, []).append(d)
        assert [ds[0].name for _, ds in sorted(by_index.items())] == ["get_weather", "get_time"]
        assert all(ds[0].id for ds in by_index.values())
        assert [json.loads("".join(d.arguments or "" for d in ds)) for _, ds in sorted(by_index.items())] == [
            WEATHER, TIME,
        ]  # fmt: skip


MALFORMED = {
    "hermes": ['Text <tool_call>{"name": "get_time", "arguments": {"zone": "UT', "<tool_call>[1, 2]</tool_call>"],
    "qwen3_coder": ["<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n</function>",
                    "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC"],
    "llama3_json": ['{"name": "get_time", "parameters": {"zone": "UT', '{"no_name": 1}', '{"name": "f"} trailing'],
    "mistral": ['[TOOL_CALLS][{"name": "get_time", "arguments": {', "[TOOL_CALLS]"],
    "pythonic": ["[get_time(zone=UTC)]", "[get_time(zone='UTC'", "[1, 2]", "[f(*a)]"],
    "openai": [f"{CH}commentary to=functions.get_time{MSG}{{\"zone\": "],
}  # fmt: skip


@pytest.mark.parametrize("fmt, text", [(f, t) for f, texts in MALFORMED.items() for t in texts])
def test_malformed_calls_are_content(fmt: str, text: str) -> None:
    parser = tool_parser(fmt)
    assert parser.extract(text, TOOLS) == (text, [])
    for pieces in splits(text):
        stream = parser.stream(TOOLS)
        sent = "".join(stream.feed(piece) for piece in pieces)
        rest, calls, deltas = stream.finish()
        assert (sent + rest, calls, deltas) == (text, [], [])


@pytest.mark.parametrize("fmt", sorted(TOOL_PARSERS))
def test_plain_text_is_content(fmt: str) -> None:
    text = "Just an answer: 3 < 4, with (parentheses)."
    parser = tool_parser(fmt)
    assert parser.extract(text, TOOLS) == (text, [])
    stream = parser.stream(TOOLS)
    sent = "".join(stream.feed(ch) for ch in text)
    assert sent + stream.finish()[0] == text


def test_qwen3_coder_converts_by_schema() -> None:
    text = _xml("get_weather", {"city": "42", "days": "7", "metric": "false", "tags": '["x"]'})
    _, (call,) = tool_parser("qwen3_coder").extract(text, TOOLS)
    assert json.loads(call.arguments) == {"city": "42", "days": 7, "metric": False, "tags": ["x"]}
    _, (call,) = tool_parser("qwen3_coder").extract(text, None)  # no schema: JSON where it parses
    assert json.loads(call.arguments) == {"city": 42, "days": 7, "metric": False, "tags": ["x"]}


def test_mistral_ids_are_nine_characters() -> None:
    _, calls = tool_parser("mistral").extract(TWO_CALLS["mistral"], TOOLS)
    assert [len(c.id) for c in calls] == [9, 9] and all(c.id.isalnum() for c in calls)


def test_detect_parsers_from_templates() -> None:
    assert detect_parsers("{{ '<think>\\n' }}<tool_call>") == ("qwen3", "hermes")
    assert detect_parsers("<function=x><parameter=y>") == (None, "qwen3_coder")
    assert detect_parsers("<｜Assistant｜><think>") == ("deepseek_r1", None)
    assert detect_parsers("<|start|>assistant<|channel|>final") == ("gpt_oss", "openai")
    assert detect_parsers("[TOOL_CALLS]") == (None, "mistral")
    assert detect_parsers("<|python_tag|>") == (None, "llama3_json")
    assert detect_parsers(None) == (None, None)
