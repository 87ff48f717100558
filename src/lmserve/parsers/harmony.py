"""gpt-oss's harmony format: `--reasoning-parser gpt_oss` (GptOssReasoningParser: the analysis channel is the
reasoning, the final channel the content) and `--tool-call-parser openai` (OpenAIToolParser: commentary messages
to `functions.NAME` are the calls). The markers are special tokens, so outputs are decoded with them kept.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from lmserve.parsers.base import ReasoningParser, ToolCall, ToolParser, partial_suffix

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass
class Message:
    channel: str
    recipient: str | None
    body: str
    complete: bool  # its end marker was seen, or the output ended after it
    stop: int  # where it ends in the text, its end marker included


def _cut_partial(text: str) -> str:
    """`text` less a marker being written at its end (from a last "<|" not yet closed by "|>")."""
    i = text.rfind("<|")
    if i >= 0 and "|>" not in text[i:]:
        return text[:i]
    if text.endswith("<"):
        return text[:-1]
    return text


def parse(text: str, final: bool) -> list[Message | str]:
    """The messages of an output, and its plain text outside any message (as str items), in order. final=False:
    an unfinished header is left out and a marker being written is cut from the end."""
    if not final:
        text = _cut_partial(text)
    out: list[Message | str] = []
    pos = 0
    while pos < len(text):
        head = text.find(CHANNEL, pos)
        start = text.find(START, pos)
        if start >= 0 and (head < 0 or start < head):
            head = start
        if head < 0:
            out.append(text[pos:])
            break
        if head > pos:
            out.append(text[pos:head])
        m = text.find(MESSAGE, head)
        if m < 0:
            if final:
                out.append(text[head:])  # a header never finished: shown as it is
            break
        header = text[head:m]
        channel = header.split(CHANNEL, 1)[1] if CHANNEL in header else ""
        channel = re.split(r"\s|<\|", channel.strip(), maxsplit=1)[0]
        recipient = _RECIPIENT.search(header)
        body_start = m + len(MESSAGE)
        ends = [(i, e) for e in (*ENDS, START) if (i := text.find(e, body_start)) >= 0]
        end, marker = min(ends) if ends else (len(text), "")
        pos = end + (len(marker) if marker != START else 0)
        complete = bool(marker) or final
        out.append(Message(channel, recipient and recipient.group(1), text[body_start:end], complete, pos))
    return out


def call_text(msg: Message) -> str:
    return f"{CHANNEL}commentary to={msg.recipient}{MESSAGE}{msg.body}{'<|call|>' if msg.complete else ''}"


class GptOssReasoningParser(ReasoningParser):
    """Analysis → reasoning, final → content; a call message passes on to the content as
    `<|channel|>commentary to=functions.NAME<|message|>ARGS<|call|>` for the openai tool parser."""

    name = "gpt_oss"
    keeps_special_tokens = True

    def split(self, text: str, final: bool) -> tuple[str, str, int]:
        reasoning, content, end = [], [], 0
        for item in parse(text, final):
            if isinstance(item, str):
                content.append(item)
            elif item.channel == "analysis" and item.recipient is None:
                reasoning.append(item.body)
                end = item.stop
            elif item.recipient is not None:
                content.append(call_text(item))
            else:
                content.append(item.body)
        return "\n\n".join(reasoning), "".join(content), end


class OpenAIToolParser(ToolParser):
    """Harmony calls: every message to `functions.NAME` (its body the JSON arguments); the text of final and
    commentary messages outside calls is the content."""

    name = "openai"
    keeps_special_tokens = True
    start_markers = (CHANNEL, START)

    def extract(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[ToolCall]]:
        items = parse(text, final=True)
        calls, content = [], []
        for item in items:
            if isinstance(item, str):
                content.append(item)
            elif item.recipient is None:
                content.append(item.body)
            else:
                try:
                    args = json.loads(item.body) if item.body.strip() else {}
                except (ValueError, RecursionError):
                    return text, []
                if not item.complete or not item.recipient.startswith("functions.") or not isinstance(args, dict):
                    return text, []
                name = item.recipient.removeprefix("functions.")
                calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        if not calls:
            return text, []
        return ("".join(content).rstrip() or None), calls

    def stream_upto(self, text: str) -> int:
        call = CHANNEL + "commentary to="
        i = text.find(call)
        before = text if i < 0 else text[:i]
        if "<|" in before:
            return 0  # raw harmony (no gpt_oss reasoning parser): the content is known at the end
        if i < 0:
            before = before[: len(before) - partial_suffix(before, (call,))]
        return len(before.rstrip())
