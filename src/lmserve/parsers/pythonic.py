"""Pythonic tool calls (`--tool-call-parser pythonic`: Llama 3.2 / 4, ToolACE): the output is a Python list of
calls with keyword arguments of literal values, `[get_weather(city="Verona"), get_time(zone="UTC")]`, optionally
between `<|python_start|>` and `<|python_end|>`."""

from __future__ import annotations

import ast
import json
from typing import Any

from lmserve.parsers.base import ToolCall, ToolParser, partial_suffix

START, END = "<|python_start|>", "<|python_end|>"


def _call(node: ast.expr) -> ToolCall:
    if not isinstance(node, ast.Call) or node.args:
        raise ValueError("not a call with keyword arguments")
    func = node.func
    parts = []
    while isinstance(func, ast.Attribute):  # a dotted name: ns.tool(...)
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        raise ValueError("not a named function")
    name = ".".join([func.id, *reversed(parts)])
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise ValueError("**kwargs")
        args[kw.arg] = ast.literal_eval(kw.value)
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def extract(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(START):
            body = body[len(START) :].removesuffix(END).strip()
        if not body.startswith("["):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return text, []
            calls = [_call(e) for e in tree.elts]
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return text, []
        return None, calls

    def stream_upto(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("[") or body.startswith(START) or partial_suffix(body, (START,)) == len(body):
            return 0  # the output may be a list of calls: nothing is content until it ends
        return len(text)
