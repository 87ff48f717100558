"""Mistral tool calls (`--tool-call-parser mistral`): content, then `[TOOL_CALLS]` and a JSON list of
`{"name", "arguments"}` objects (tokenizer v3-v7), or one `[TOOL_CALLS]name[ARGS]{...}` per call (v11 and later).
`[TOOL_CALLS]` is a special token, so outputs are decoded with special tokens kept; call ids are 9 characters."""

from __future__ import annotations

import json
import random
import re
import string
from typing import Any

from lmserve.parsers.base import ToolCall, ToolParser
from lmserve.parsers.hermes import json_call

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"


def mistral_id() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True
    start_markers = (BOT,)

    def extract(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[ToolCall]]:
        start = text.find(BOT)
        if start < 0:
            return text, []
        calls: list[ToolCall] = []
        for seg in text[start + len(BOT) :].split(BOT):
            seg = seg.strip()
            try:
                if ARGS in seg:
                    name, args = seg.split(ARGS, 1)
                    obj: Any = {"name": name.strip(), "arguments": json.loads(args)}
                    if not re.fullmatch(r"[A-Za-z0-9_\-.]{1,64}", obj["name"]):
                        return text, []
                else:
                    obj = json.loads(seg)
            except (ValueError, RecursionError):
                return text, []
            for item in obj if isinstance(obj, list) else [obj]:
                call = json_call(item)
                if call is None:
                    return text, []
                calls.append(ToolCall(call.name, call.arguments, id=mistral_id()))
        if not calls:
            return text, []
        return (text[:start].rstrip() or None), calls
