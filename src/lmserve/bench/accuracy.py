"""Held-out accuracy of an engine configuration: perplexity and greedy next-token agreement (`score`).

Scoring runs through the engine itself with `prompt_logprobs=1` on the bundled model's held-out text
(`heldout_windows`), so whatever path the configuration takes (kernels, packed weights, KV dtype) is measured.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from lmserve.default_model import default_model_path
from lmserve.sampling_params import SamplingParams

HELDOUT_PATH = os.path.join(os.path.dirname(default_model_path()), "heldout.jsonl")


def heldout_texts() -> list[str]:
    """The held-out documents, Shakespeare / Milton first, then classical Chinese poems."""
    with open(HELDOUT_PATH, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def heldout_windows(llm, window: int = 256, max_tokens: int | None = None) -> list[list[int]]:
    """The held-out text tokenized by `llm`'s tokenizer, cut into consecutive windows of `window` tokens
    (the last shorter one dropped when under 2 tokens), `max_tokens` in all at most."""
    if window < 2:
        raise ValueError(f"window: must be >= 2, got {window}")
    windows: list[list[int]] = []
    total = 0
    for text in heldout_texts():
        ids = llm.engine.tokenize(text)[1]
        for start in range(0, len(ids), window):
            chunk = ids[start : start + window]
            if max_tokens is not None:
                chunk = chunk[: max_tokens - total]
            if len(chunk) >= 2:
                windows.append(chunk)
                total += len(chunk)
            if max_tokens is not None and total >= max_tokens:
                return windows
    return windows


@dataclass
class Scores:
    """Per scored position (every window token but its first): the true token's logprob and the argmax."""

    logprobs: list[float]
    argmax_ids: list[int]

    @property
    def num_positions(self) -> int:
        return len(self.logprobs)

    @property
    def perplexity(self) -> float:
        return math.exp(-sum(self.logprobs) / len(self.logprobs))

    def agreement(self, other: Scores) -> float:
        """Fraction of positions where both configurations predict the same greedy next token."""
        assert other.num_positions == self.num_positions, "scores of different texts"
        same = sum(a == b for a, b in zip(self.argmax_ids, other.argmax_ids, strict=True))
        return same / self.num_positions


def score(llm, windows: list[list[int]]) -> Scores:
    """Teacher-forced scoring of `windows` through `llm` (an `LLM`)."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    outs = llm.generate(windows, params, use_tqdm=False)
    logprobs: list[float] = []
    argmax_ids: list[int] = []
    for out in outs:
        for entry in out.prompt_logprobs[1:]:
            logprobs.append(entry.logprob)
            argmax_ids.append(entry.top_logprobs[0][0])
    return Scores(logprobs, argmax_ids)
