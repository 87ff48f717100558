"""Reasoning and tool-call parsers per model family, by vLLM's names; independent of FastAPI and the engine.

reasoning_parser(name) and tool_parser(name) look parsers up; detect_parsers picks them from a chat template.
Run the tool parser on the reasoning parser's content; how a serving module calls them is in
docs/reasoning_and_tools.md.
"""

from __future__ import annotations

from lmserve.parsers.base import (
    ReasoningParser,
    TagReasoningParser,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
)
from lmserve.parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from lmserve.parsers.granite import GraniteReasoningParser
from lmserve.parsers.harmony import GptOssReasoningParser, OpenAIToolParser
from lmserve.parsers.hermes import HermesToolParser
from lmserve.parsers.llama3_json import Llama3JsonToolParser
from lmserve.parsers.mistral import MistralToolParser
from lmserve.parsers.pythonic import PythonicToolParser
from lmserve.parsers.qwen3 import Qwen3ReasoningParser
from lmserve.parsers.qwen3_coder import Qwen3CoderToolParser

__all__ = [
    "REASONING_PARSERS", "TOOL_PARSERS", "ReasoningParser", "TagReasoningParser", "ToolCall", "ToolCallDelta",
    "ToolCallStream", "ToolParser", "detect_parsers", "reasoning_parser", "tool_parser",
]  # fmt: skip

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "gpt_oss": GptOssReasoningParser,
    "openai_gptoss": GptOssReasoningParser,  # vLLM's name for it
    "granite": GraniteReasoningParser,
}
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "qwen3_xml": Qwen3CoderToolParser,  # vLLM's second name for the same format
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "openai": OpenAIToolParser,
}


def reasoning_parser(name: str) -> type[ReasoningParser]:
    """The reasoning parser class named `name`; ValueError listing the known names."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}") from None


def tool_parser(name: str) -> ToolParser:
    """The tool parser named `name`; ValueError listing the known names."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(TOOL_PARSERS)}") from None


def detect_parsers(template: str | None) -> tuple[str | None, str | None]:
    """(reasoning parser, tool parser) names for a chat template, from the markers it writes; None where none
    is recognised."""
    t = template or ""
    reasoning = None
    if "<|channel|>" in t:
        reasoning = "gpt_oss"
    elif "<think>" in t or "</think>" in t:
        reasoning = "deepseek_r1" if "<｜Assistant｜>" in t else "qwen3"
    elif "Here is my thought process:" in t:
        reasoning = "granite"
    tools = None
    if "<function=" in t and "<parameter=" in t:
        tools = "qwen3_coder"
    elif "<tool_call>" in t:
        tools = "hermes"
    elif "[TOOL_CALLS]" in t:
        tools = "mistral"
    elif "to=functions" in t or "<|channel|>" in t:
        tools = "openai"
    elif "<|python_tag|>" in t or "Environment: ipython" in t:
        tools = "llama3_json"
    return reasoning, tools
