"""The two parser interfaces: ReasoningParser (reasoning split from content, whole or streamed) and ToolParser (tool
calls out of content, whole or streamed), their dataclasses, and the tag-based reasoning parser the families share."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One complete call: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str
    id: str = field(default_factory=call_id)


@dataclass
class ToolCallDelta:
    """One streamed piece of call `index` (OpenAI's delta.tool_calls[i]): the first carries id and name, the next
    ones argument fragments that concatenate to the call's JSON arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


def partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that is a proper beginning of one of `markers` (held back while
    streaming: the next characters may complete the marker)."""
    for k in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


def find_first(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """(index, marker) of the earliest of `markers` in text[start:]; (-1, "") when none is there."""
    best, which = -1, ""
    for m in markers:
        i = text.find(m, start)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, m
    return best, which


class ReasoningParser:
    """Splits one sequence's output into (reasoning, content). One instance per sequence: `extract` for the whole
    text, or `feed` each new piece of text and `finish` at the end while streaming; the streamed pieces add up to
    what `extract` returns for the whole text, whatever the split of the text into pieces (a marker split across
    pieces, or several markers in one, never leaks into either field).

    `prompt` is the rendered prompt's text: a template that opens the reasoning itself (`...<think>\\n`) makes the
    output start inside it."""

    name: ClassVar[str] = ""
    keeps_special_tokens: ClassVar[bool] = False  # its markers are special tokens: decode with them
    start_markers: ClassVar[tuple[str, ...]] = ()  # for structured outputs after the reasoning (grammar prefix)
    end_markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, prompt: str = "") -> None:
        self.starts_inside = self.opens_in_prompt(prompt)
        self._text = ""
        self._sent = ("", "")  # reasoning and content streamed so far

    def opens_in_prompt(self, prompt: str) -> bool:
        """Whether the prompt leaves the output inside the reasoning."""
        return False

    def split(self, text: str, final: bool) -> tuple[str, str, int]:
        """(reasoning, content, end) of `text`: `end` is where the reasoning (and its closing marker) ends in text,
        0 without reasoning. final=False: what is sure so far (a partial marker at the end is held back), each a
        prefix of what a longer text gives."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for an empty field."""
        reasoning, content, _ = self.split(text, final=True)
        return reasoning or None, content or None

    def reasoning_end(self, text: str) -> int:
        """The character offset in `text` where the reasoning ends (0: no reasoning)."""
        return self.split(text, final=True)[2]

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning_delta, content_delta) of a streamed output's next piece of text."""
        self._text += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output has ended."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning, content, _ = self.split(self._text, final)
        sent_r, sent_c = self._sent
        assert reasoning.startswith(sent_r) and content.startswith(sent_c), f"{self.name}: streamed text retracted"
        self._sent = (reasoning, content)
        return reasoning[len(sent_r) :], content[len(sent_c) :]


class TagReasoningParser(ReasoningParser):
    """Reasoning between a start and an end marker at the output's start (`<think>...</think>answer`), or from the
    output's start to the end marker when the prompt opened it. Reasoning never closed (cut by max_tokens) stays
    reasoning; an output that does not start with the start marker (after blanks) is all content. The reasoning
    is stripped of surrounding blanks, the content of leading ones."""

    def opens_in_prompt(self, prompt: str) -> bool:
        tail = prompt.rstrip()
        return any(tail.endswith(m) for m in self.start_markers)

    def split(self, text: str, final: bool) -> tuple[str, str, int]:
        body = text.lstrip()
        skipped = len(text) - len(body)
        start, marker = find_first(body[: max(map(len, self.start_markers))], self.start_markers)
        if start == 0:
            body, skipped = body[len(marker) :], skipped + len(marker)
        elif not final and any(m.startswith(body) for m in self.start_markers):
            return "", "", 0  # blanks or a start marker's beginning: either may come next
        elif not self.starts_inside:
            return "", text, 0
        end, marker = find_first(body, self.end_markers)
        if end < 0:
            keep = len(body) if final else len(body) - partial_suffix(body, self.end_markers)
            reasoning = body[:keep].strip() if final else body[:keep].lstrip()
            return (reasoning if final else reasoning.rstrip()), "", len(text)
        content = body[end + len(marker) :].lstrip()
        return body[:end].strip(), content, skipped + end + len(marker)


class ToolParser:
    """Finds a family's tool calls in content text. Stateless: `extract(text, tools)` for a whole output,
    `stream_upto(text)` for how much of a growing output is surely content (streamable before the calls are
    known); `stream(tools)` gives a ToolCallStream that uses both on pieces of text."""

    name: ClassVar[str] = ""
    keeps_special_tokens: ClassVar[bool] = False
    start_markers: ClassVar[tuple[str, ...]] = ()  # where calls begin (the default stream_upto)

    def extract(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[ToolCall]]:
        """(content, calls): content is the text before the first call (None when blank); an output with no
        call, or whose calls do not all parse, is returned whole as content with no calls."""
        raise NotImplementedError

    def stream_upto(self, text: str) -> int:
        """How many characters of `text` may be streamed as content now: up to the first call or a partial start
        marker at the end, less the blanks before it (a call that follows makes them layout)."""
        end, _ = find_first(text, self.start_markers)
        if end < 0:
            end = len(text) - partial_suffix(text, self.start_markers)
        return len(text[:end].rstrip())

    def stream(self, tools: list[dict[str, Any]] | None = None) -> ToolCallStream:
        return ToolCallStream(self, tools)


class ToolCallStream:
    """One sequence's streamed tool calls: `feed(content_delta) -> content to send`, then `finish() ->
    (content to send, call deltas)`. Calls are sent at the end, each as its id and name, then its arguments, and
    only when every call parses (so a call cut by max_tokens is never sent as a call: it is content)."""

    def __init__(self, parser: ToolParser, tools: list[dict[str, Any]] | None) -> None:
        self.parser, self.tools = parser, tools
        self.text = ""
        self.sent = 0

    def feed(self, delta: str) -> str:
        self.text += delta
        upto = self.parser.stream_upto(self.text)
        out = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return out

    def finish(self, parallel: bool = True) -> tuple[str, list[ToolCall], list[ToolCallDelta]]:
        """(the rest of the content, the calls, their deltas); parallel=False keeps the first call only."""
        content, calls = self.parser.extract(self.text, self.tools)
        if not parallel:
            calls = calls[:1]
        if not calls:
            return self.text[self.sent :], [], []
        rest = (content or "")[self.sent :]
        deltas = []
        for i, c in enumerate(calls):
            deltas += [ToolCallDelta(i, id=c.id, name=c.name, arguments=""), ToolCallDelta(i, arguments=c.arguments)]
        return rest, calls, deltas
