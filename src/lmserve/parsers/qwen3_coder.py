"""Qwen3-Coder / Qwen3.5 XML tool calls (`--tool-call-parser qwen3_coder`, Qwen3CoderToolParser):
`<tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call>`, each value converted by the
tool's JSON schema (convert).
"""

from __future__ import annotations

import json
import re
from typing import Any

from lmserve.parsers.base import ToolCall, ToolParser

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def _schema_type(tools: list[dict[str, Any]] | None, function: str, param: str) -> Any:
    for tool in tools or []:
        fn = tool.get("function", {})
        if fn.get("name") == function:
            prop = ((fn.get("parameters") or {}).get("properties") or {}).get(param) or {}
            if "type" in prop:
                return prop["type"]
            if "enum" in prop:
                return "enum"
    return None


def convert(value: str, kind: Any) -> Any:
    """A parameter's text as the JSON value its schema type says; ValueError when it is not one.

    "3" → 3 for an integer, JSON for objects and arrays, true/false for booleans; an untyped parameter stays text
    unless it is JSON.
    """
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds or kind == "enum":
        if kind == "enum":
            try:
                return json.loads(value)
            except ValueError:
                return value
        return value
    if value == "null" and "null" in kinds:
        return None
    for k in kinds:
        try:
            if k == "integer":
                return int(value)
            if k == "number":
                f = float(value)
                return int(f) if f.is_integer() and re.fullmatch(r"-?\d+", value) else f
            if k == "boolean":
                if value.lower() in ("true", "false"):
                    return value.lower() == "true"
                raise ValueError(value)
            if k in ("object", "array"):
                out = json.loads(value)
                if isinstance(out, dict if k == "object" else list):
                    return out
                raise ValueError(value)
        except ValueError:
            continue
    if kind is None:
        try:
            return json.loads(value)
        except ValueError:
            return value
    raise ValueError(f"{value!r} is not of type {kind}")


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    start_markers = ("<tool_call>", "<function=")

    def extract(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[ToolCall]]:
        start = min((i for i in (text.find(m) for m in self.start_markers) if i >= 0), default=-1)
        if start < 0:
            return text, []
        blocks = [m.group(1) for m in _BLOCK.finditer(text, start)] or [text[start:]]
        calls = []
        for block in blocks:
            fns = list(_FUNCTION.finditer(block))
            if not fns or _FUNCTION.sub("", block).strip():
                return text, []  # no complete function, or text beside it: not a call
            for fn in fns:
                name, body = fn.group(1).strip(), fn.group(2)
                args: dict[str, Any] = {}
                for param in _PARAMETER.finditer(body):
                    key = param.group(1).strip()
                    value = param.group(2).removeprefix("\n").removesuffix("\n")
                    try:
                        args[key] = convert(value, _schema_type(tools, name, key))
                    except ValueError:
                        return text, []
                if _PARAMETER.sub("", body).strip():
                    return text, []
                calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return (text[:start].rstrip() or None), calls
