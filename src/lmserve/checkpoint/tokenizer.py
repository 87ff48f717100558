"""The tokenizer for a model: AutoTokenizer for an HF directory or hub id, or transformers' conversion of
the tokenizer stored in a GGUF file's metadata (vocabulary, merges, special tokens, chat template)."""

from __future__ import annotations

from typing import Any


def load_tokenizer(name_or_path: str) -> Any:
    """A transformers tokenizer for `name_or_path`: a GGUF file (or a directory holding one), else anything
    `AutoTokenizer.from_pretrained` accepts."""
    from transformers import AutoTokenizer

    from lmserve.checkpoint.gguf import find_gguf_file

    gguf_file = find_gguf_file(name_or_path)
    if gguf_file is not None:
        try:
            return AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        except Exception as e:  # noqa: BLE001 - transformers raises assorted errors for a missing/odd vocabulary
            raise ValueError(
                f"tokenizer: cannot build a tokenizer from the metadata of {gguf_file.name} ({type(e).__name__}: "
                f"{e}); pass tokenizer= (--tokenizer) an HF tokenizer directory or hub id"
            ) from None
    return AutoTokenizer.from_pretrained(name_or_path)
