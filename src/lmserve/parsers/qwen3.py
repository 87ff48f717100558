"""Qwen3 / Qwen3.5 / QwQ reasoning (`--reasoning-parser qwen3`): `<think>...</think>` at the output's start, or
from the start when the template opened `<think>` in the prompt; no `<think>` (enable_thinking false) is all content."""

from __future__ import annotations

from lmserve.parsers.base import TagReasoningParser


class Qwen3ReasoningParser(TagReasoningParser):
    name = "qwen3"
    start_markers = ("<think>",)
    end_markers = ("</think>",)
