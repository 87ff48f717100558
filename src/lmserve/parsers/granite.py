"""IBM Granite 3.x thinking (`--reasoning-parser granite`): plain-text markers, "Here is my thought process:" (or
"Here's ...") opens the reasoning at the output's start and "Here is my response:" (or "Here's ...") ends it."""

from __future__ import annotations

from lmserve.parsers.base import TagReasoningParser


class GraniteReasoningParser(TagReasoningParser):
    name = "granite"
    start_markers = ("Here is my thought process:", "Here's my thought process:")
    end_markers = ("Here is my response:", "Here's my response:")

    def opens_in_prompt(self, prompt: str) -> bool:
        return False  # the model writes its own opening phrase
