"""Hermes-style tool calls (`--tool-call-parser hermes`: Hermes 2/3, Qwen2.5, Qwen3):
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after optional content."""

from __future__ import annotations

import json
import re
from typing import Any

from lmserve.parsers.base import ToolCall, ToolParser

START, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(START) + r"\s*(.*?)\s*(?:" + re.escape(END) + r"|$)", re.S)


def json_call(obj: Any) -> ToolCall | None:
    """A call from a decoded {"name": str, "arguments" | "parameters": {...}} object; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesToolParser(ToolParser):
    name = "hermes"
    start_markers = (START,)

    def extract(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[ToolCall]]:
        start = text.find(START)
        if start < 0:
            return text, []
        calls = []
        for m in _CALL.finditer(text, start):
            try:
                call = json_call(json.loads(m.group(1)))
            except (ValueError, RecursionError):
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return (text[:start].rstrip() or None), calls
