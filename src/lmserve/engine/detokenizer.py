"""Incremental detokenization and stop-string matching for one streamed sequence (IncrementalDetokenizer).

Each step decodes a short window of the newest tokens (vLLM's prefix_offset / read_offset), holding back unfinished
UTF-8, space cleanup and possible stop-string prefixes; without a stop match the deltas plus flush() equal
`tokenizer.decode(output_ids)`. min_tokens follows vLLM: no stop string may end within the first min_tokens tokens.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from lmserve.sampling_params import SamplingParams

# transformers' PreTrainedTokenizerBase.clean_up_tokenization, in order (str.replace chain).
_CLEANUP_REPLACEMENTS: tuple[tuple[str, str], ...] = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


@dataclass
class DetokenizerUpdate:
    """New text of one step; `stop_str` is the stop string that ended the sequence, else None."""

    delta_text: str
    stop_str: str | None = None


def _longest_suffix_prefix(text: str, patterns: list[str], limit: int) -> int:
    """Length (<= limit) of the longest suffix of `text` that is a proper prefix of one of `patterns`."""
    for k in range(min(limit, len(text)), 0, -1):
        suffix = text[-k:]
        if any(len(p) > k and p.startswith(suffix) for p in patterns):
            return k
    return 0


class _StreamingReplace:
    """str.replace(old, new) applied to a text that arrives in pieces, with the same result.

    str.replace scans left to right for non-overlapping matches, so everything before the last
    len(old) - 1 characters that could still begin a match is final and can be released.
    """

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new
        self._buf = ""

    def feed(self, text: str) -> str:
        buf = self._buf + text
        out: list[str] = []
        while (i := buf.find(self.old)) != -1:
            out.append(buf[:i])
            out.append(self.new)
            buf = buf[i + len(self.old) :]
        hold = _longest_suffix_prefix(buf, [self.old], len(self.old) - 1)
        out.append(buf[: len(buf) - hold])
        self._buf = buf[len(buf) - hold :]
        return "".join(out)

    def finish(self) -> str:
        rest, self._buf = self._buf, ""
        return rest


def _decode_kwargs(tokenizer: Any, params: SamplingParams) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"skip_special_tokens": params.skip_special_tokens}
    if not getattr(tokenizer, "is_fast", False):
        # Only slow (Python) tokenizers implement it; fast ones would silently ignore it.
        kwargs["spaces_between_special_tokens"] = params.spaces_between_special_tokens
    return kwargs


_CLEANUP_KW = "clean_up_tokenization_spaces"


def _backend_decoder(tokenizer: Any, kwargs: dict[str, Any]) -> Any:
    """The `tokenizers` decode that tokenizer.decode(ids, **kwargs) comes down to, or None: for a transformers
    TokenizersBackend whose decode and _decode are the library's own and that applies no cleanup for these kwargs,
    decode(ids) is backend.decode(ids, skip_special_tokens=...) after two Python layers (to_py_obj and the
    cleanup checks), ~20 µs a call with the caches cold as a decode step leaves them, twice a step."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or set(kwargs) - {"skip_special_tokens", _CLEANUP_KW}:
        return None
    if cls.decode is not PreTrainedTokenizerBase.decode or cls._decode is not TokenizersBackend._decode:
        return None
    cleanup = kwargs.get(_CLEANUP_KW)
    if cleanup if cleanup is not None else tokenizer.clean_up_tokenization_spaces:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    return None if backend is None else backend.decode


_CLEANS_UP: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _tokenizer_cleans_up(tokenizer: Any) -> bool:
    """Whether tokenizer.decode applies clean_up_tokenization (transformers skips it for BPE in v5).

    Probed once per tokenizer (not per request) on real text rather than read from attributes, since
    the rules differ between versions.
    """
    try:
        return _CLEANS_UP[tokenizer]
    except (KeyError, TypeError):
        pass
    result = _probe_cleanup(tokenizer)
    try:
        _CLEANS_UP[tokenizer] = result
    except TypeError:  # not weak-referenceable: probe every time
        pass
    return result


def _probe_cleanup(tokenizer: Any) -> bool:
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    try:
        ids = tokenizer.encode("a . b , c", add_special_tokens=False)
        raw = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
        if " ." in raw or " ," in raw:
            return tokenizer.decode(ids) != raw
    except Exception:  # an exotic tokenizer that cannot encode the probe: trust its flag
        pass
    return True


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into streamed text deltas, stopping on stop strings.

    `tokenizer` is an HF tokenizer (PreTrainedTokenizerFast in practice). `prompt_token_ids` is kept for
    callers' reference only: the output text is decoded from the output ids alone.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self._decode_kwargs = _decode_kwargs(tokenizer, params)
        self._cleanup = (
            [_StreamingReplace(old, new) for old, new in _CLEANUP_REPLACEMENTS]
            if _tokenizer_cleans_up(tokenizer)
            else []
        )
        if self._cleanup:
            self._decode_kwargs["clean_up_tokenization_spaces"] = False  # done here, in streaming form
        self._backend_decode = _backend_decoder(tokenizer, self._decode_kwargs)
        self._skip_special = bool(params.skip_special_tokens)
        self._stops: list[str] = list(params.stop or [])
        self._max_stop_len = max((len(s) for s in self._stops), default=0)

        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""  # cleaned text that passed the UTF-8 and cleanup stages (emitted + held for stops)
        self._emitted = 0  # chars of _text returned to the caller
        self._stop_check_from = 0  # a stop string must end past this many chars of _text (min_tokens)
        self.stop_str: str | None = None
        self.finished = False

    @property
    def output_text(self) -> str:
        """Concatenation of every delta returned so far (update() and flush())."""
        return self._text[: self._emitted]

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids

    def update(self, new_token_ids: list[int]) -> DetokenizerUpdate:
        """Add the step's new tokens; return only the text that became final."""
        if self.finished:
            return DetokenizerUpdate("")
        before_min = self.params.min_tokens - len(self._token_ids)
        if 0 < before_min < len(new_token_ids):  # min_tokens falls inside: the tokens up to it go first
            head = self.update(new_token_ids[:before_min])
            tail = self.update(new_token_ids[before_min:])
            return DetokenizerUpdate(head.delta_text + tail.delta_text, tail.stop_str)
        self._token_ids.extend(new_token_ids)
        return self._advance(*self._read_new_text(final=False), final=False)

    def flush(self) -> str:
        """Release all held-back text (the request ended for another reason: length, EOS, abort)."""
        if self.finished:
            return ""
        return self._advance(*self._read_new_text(final=True), final=True).delta_text

    # ------------------------------------------------------------------ stages

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self._skip_special)
        return self.tokenizer.decode(ids, **self._decode_kwargs)

    def _read_new_text(self, final: bool) -> tuple[str, int]:
        """UTF-8 stage: text of the tokens past read_offset, unless it ends inside a character; and how many
        complete characters come before that incomplete one (held back, yet these tokens' text for min_tokens)."""
        ids = self._token_ids
        if self._read_offset == len(ids):
            return "", 0
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return "", 0  # only tokens that decode to nothing so far (skipped special tokens)
        if new_text.endswith("\ufffd") and not final:
            return "", len(new_text[len(prefix_text) :].rstrip("\ufffd"))  # wait for the rest of the character
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return new_text[len(prefix_text) :], 0

    def _advance(self, text: str, held_chars: int, final: bool) -> DetokenizerUpdate:
        for stage in self._cleanup:
            text = stage.feed(text)
            if final:
                text += stage.finish()
        if len(self._token_ids) <= self.params.min_tokens:  # the first min_tokens tokens' text: no stop
            self._stop_check_from = len(self._text) + len(text) + held_chars
        search_from = max(len(self._text), self._stop_check_from)  # stop strings must end past this
        self._text += text

        if self._stops and len(self._text) > search_from:
            match = self._find_stop(search_from)
            if match is not None:
                start, stop = match
                end = start + len(stop) if self.params.include_stop_str_in_output else start
                self._text = self._text[:end]
                self.stop_str = stop
                self.finished = True
                return DetokenizerUpdate(self._release(len(self._text)), stop)

        hold = 0
        if not final and self._stops and not self.params.include_stop_str_in_output:
            hold = _longest_suffix_prefix(
                self._text, self._stops, min(self._max_stop_len - 1, len(self._text) - self._emitted)
            )
        if final:
            self.finished = True
        return DetokenizerUpdate(self._release(len(self._text) - hold))

    def _find_stop(self, search_from: int) -> tuple[int, str] | None:
        """Earliest-completing stop string among those ending in the newly added text."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = self._text.find(stop, max(0, search_from - len(stop) + 1))
            if start != -1:
                cand = (start + len(stop), start, stop)
                if best is None or cand < best:
                    best = cand
        return None if best is None else (best[1], best[2])

    def _release(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        delta = self._text[self._emitted : upto]
        self._emitted = upto
        return delta
