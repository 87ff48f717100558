"""Llama 3.1 / 3.2 / 3.3 JSON tool calls (`--tool-call-parser llama3_json`): the output is one call object
`{"name": ..., "parameters": {...}}` (or several joined by `;`), optionally after `<|python_tag|>`."""

from __future__ import annotations

import json
from typing import Any

from lmserve.parsers.base import ToolCall, ToolParser, partial_suffix
from lmserve.parsers.hermes import json_call

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_markers = (PYTHON_TAG,)

    def extract(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        body = body.removeprefix(PYTHON_TAG).strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except (ValueError, RecursionError):
                return text, []
            call = json_call(obj)
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            rest = body[pos:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return text, []
            pos = len(body) - len(rest)
        return None, calls

    def stream_upto(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{") or body.startswith(PYTHON_TAG):
            return 0  # the output may be a call: nothing is content until it ends
        if partial_suffix(body, (PYTHON_TAG,)) == len(body):
            return 0
        return len(text)
