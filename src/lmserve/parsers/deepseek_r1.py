"""DeepSeek-R1 and its distillations (`--reasoning-parser deepseek_r1`): the template opens `<think>`, so the output
starts inside the reasoning (a `<think>` the model writes again is dropped) until `</think>`; a prompt that closed the
block itself (`<think></think>`: thinking off) makes the output all content."""

from __future__ import annotations

from lmserve.parsers.base import TagReasoningParser


class DeepSeekR1ReasoningParser(TagReasoningParser):
    name = "deepseek_r1"
    start_markers = ("<think>",)
    end_markers = ("</think>",)

    def opens_in_prompt(self, prompt: str) -> bool:
        return not prompt.rstrip().endswith(self.end_markers)
