"""The raw bytes of vocabulary tokens, for logprobs: one place that knows how a token id maps to bytes (TokenBytes).

Bytes come from the vocabulary (byte-level BPE's byte alphabet, SentencePiece byte fallback, else the token's
UTF-8), not from decoding one token, which gives "�" for part of a character. `token_text` spells invalid UTF-8
as `bytes:\\xe5\\x89` (OpenAI's spelling); TextOffsets gives character offsets in the decoded text.
"""

from __future__ import annotations

import codecs
import json
import re
from typing import Any


def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode table, inverted: printable bytes stand for themselves, the others are
    shifted to U+0100 and up (so a space is "Ġ", a newline "Ċ")."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _gpt2_byte_alphabet()
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _decoder_types(tokenizer: Any) -> set[str]:
    """Types of the fast tokenizer's decoder pipeline ("ByteLevel", "ByteFallback", "Metaspace", ...)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    stages = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return {s.get("type", "") for s in stages}


class TokenBytes:
    """Per-tokenizer cache of token id → raw bytes. Safe to share between threads."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        types = _decoder_types(tokenizer)
        self._byte_level = "ByteLevel" in types
        self._sentencepiece = bool(types & {"ByteFallback", "Metaspace", "Replace"})
        self._added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()))
        self._cache: dict[int, bytes] = {}  # a racing fill computes the same value twice, harmlessly

    def bytes_of(self, token_id: int) -> bytes:
        """The token's raw bytes; concatenated over a sequence they are the UTF-8 of its decoded text
        (special tokens included as their text)."""
        raw = self._cache.get(token_id)
        if raw is None:
            raw = self._cache[token_id] = self._compute(token_id)
        return raw

    def token_text(self, token_id: int) -> str:
        """The token's name in the API: its text, or `bytes:\\x..` when its bytes are not whole characters."""
        raw = self.bytes_of(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _compute(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            if self._sentencepiece:
                m = _BYTE_FALLBACK.match(piece)
                if m:
                    return bytes([int(m.group(1), 16)])
                return piece.replace("▁", " ").encode("utf-8")
        return self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False).encode("utf-8")


class TextOffsets:
    """Where each token of a sequence starts in the sequence's text, fed token by token (so a stream and a
    whole response agree). The text is the tokens' bytes decoded as the detokenizer does (invalid UTF-8
    → U+FFFD, special tokens dropped when `skip_special_tokens`), and a token's offset is the number of
    characters begun before its first byte: text[offset[i]:offset[i+1]] are the characters that begin
    in token i, and a token that only continues a character gets the offset of the next one."""

    def __init__(self, token_bytes: TokenBytes, skip_special_tokens: bool) -> None:
        self._token_bytes = token_bytes
        self._skipped = token_bytes.special_ids if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._num_chars = 0  # characters completed (or replaced) so far

    def add(self, token_id: int) -> int:
        """The offset of `token_id`, which comes next in the sequence."""
        pending, _ = self._decoder.getstate()
        offset = self._num_chars + (1 if pending else 0)  # a character begun, waiting for its other bytes
        if token_id not in self._skipped:
            self._num_chars += len(self._decoder.decode(self._token_bytes.bytes_of(token_id)))
        return offset
