"""Logprobs in the API's shapes, echo, and prompt logprobs (what evaluation harnesses read).

completion_logprobs builds OpenAI's logprobs object, echo_prompt the echoed prompt and its logprobs part, and
prompt_logprobs_view vLLM's `prompt_logprobs` shape. The shapes are in docs/scoring.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmserve.engine.token_bytes import TextOffsets, TokenBytes
from lmserve.entrypoints.openai import protocol as p


def finite(x: float) -> float:
    """JSON has no -inf: a token the model rules out entirely gets OpenAI's floor."""
    return x if math.isfinite(x) else -9999.0


def completion_logprobs(
    tb: TokenBytes, entries: Sequence[Any], offsets: TextOffsets, num_top: int | None = None, base: int = 0
) -> p.CompletionLogprobs:
    """OpenAI's completion logprobs of a run of tokens (TokenLogprobs; a None entry, the first prompt token's, has
    null logprob and alternatives). `offsets` carries the text position from one call to the next (one per choice
    and part); `base` is added to every offset (the echoed prompt's length, for the generated part); `num_top`
    keeps that many alternatives (None: all the entry has)."""
    out = p.CompletionLogprobs()
    for e in entries:
        if e is None:
            continue
        s = tb.token_text(e.token_id)
        out.tokens.append(s)
        out.token_logprobs.append(finite(e.logprob))
        out.text_offset.append(base + offsets.add(e.token_id))
        # token_text is distinct per token (bytes:\x.. for partial characters), so no alternative is lost
        alternatives = e.top_logprobs if num_top is None else e.top_logprobs[:num_top]
        top = {tb.token_text(t): finite(lp) for t, lp in alternatives}
        top[s] = finite(e.logprob)  # the chosen token is always there, with its own logprob (k + 1 keys)
        out.top_logprobs.append(top)
    return out


@dataclass
class EchoedPrompt:
    """What echo puts in front of each of a prompt's choices."""

    text: str
    logprobs: p.CompletionLogprobs | None  # the prompt's tokens, when logprobs were asked for


def echo_prompt(
    tb: TokenBytes,
    text: str | None,
    prompt_ids: list[int],
    prompt_logprobs: list[Any] | None,
    num_top: int | None,
    skip_special_tokens: bool,
) -> EchoedPrompt:
    """The echoed prompt: `text` as sent (None for a token-id prompt: its tokens' text), and with `num_top`
    (the request's `logprobs`) the prompt part of the logprobs object.

    Prompt offsets count the characters of the prompt tokens' bytes (token_bytes.TextOffsets), so they index the
    echoed text exactly when the tokens spell the prompt, as byte-level BPE does for text without special tokens.
    """
    if text is None:
        skipped = tb.special_ids if skip_special_tokens else frozenset()
        text = b"".join(tb.bytes_of(t) for t in prompt_ids if t not in skipped).decode("utf-8", "replace")
    if num_top is None:
        return EchoedPrompt(text, None)
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt_ids), (
        f"echo with logprobs needs one prompt logprob entry per prompt token: {len(prompt_ids)} tokens, "
        f"{None if prompt_logprobs is None else len(prompt_logprobs)} entries"
    )
    offsets = TextOffsets(tb, skip_special_tokens)
    first = prompt_ids[0]
    out = p.CompletionLogprobs(
        tokens=[tb.token_text(first)], token_logprobs=[None], top_logprobs=[None], text_offset=[offsets.add(first)]
    )
    rest = completion_logprobs(tb, prompt_logprobs[1:], offsets, num_top)
    return EchoedPrompt(text, joined(out, rest))


def prompt_texts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | None]:
    """Per prompt of a /v1/completions body (in request_inputs.completion_prompts' order): its text, None for token
    ids."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [None]
    return [x if isinstance(x, str) else None for x in prompt]


def joined(*parts: p.CompletionLogprobs | None) -> p.CompletionLogprobs | None:
    """The parts one after another (None where none has logprobs)."""
    present = [x for x in parts if x is not None]
    if not present:
        return None
    out = p.CompletionLogprobs()
    for x in present:
        out.tokens += x.tokens
        out.token_logprobs += x.token_logprobs
        out.top_logprobs += x.top_logprobs
        out.text_offset += x.text_offset
    return out


def prompt_logprobs_view(tb: TokenBytes, entries: list[Any] | None, num_top: int) -> p.PromptLogprobs | None:
    """vLLM's prompt_logprobs: per prompt position None (the first) or token id → entry, with the num_top most
    likely tokens and the prompt's own (num_top or num_top + 1 entries)."""
    if entries is None:
        return None
    out: p.PromptLogprobs = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        position = {
            t: p.PromptLogprob(logprob=finite(lp), rank=r, decoded_token=tb.token_text(t))
            for r, (t, lp) in enumerate(e.top_logprobs[:num_top], start=1)
        }
        # the prompt's token with its own rank (1 + the tokens strictly more likely: a tie shares the rank)
        position[e.token_id] = p.PromptLogprob(
            logprob=finite(e.logprob), rank=e.rank, decoded_token=tb.token_text(e.token_id)
        )
        out.append(position)
    return out
