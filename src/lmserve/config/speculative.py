"""SpeculativeConfig: vLLM's `--speculative-config` keys, validated once at engine start."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

SPEC_METHODS = ("draft_model", "ngram")
SPEC_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
    "adaptive_threshold",
)
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
# Above this many requests in a step, verification stops being nearly free on a CPU (the step turns compute
# bound) and speculation is switched off for that step; see docs/performance.md.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
# Per-request adaptive k (spec_decode/acceptance.py): propose token j while acceptance^j >= this, roughly a
# proposal's cost relative to a target step: a draft forward costs much more than an n-gram lookup.
DEFAULT_ADAPTIVE_THRESHOLD = {"draft_model": 0.3, "ngram": 0.1}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "draft_model" | "ngram"
    num_speculative_tokens: int
    disable_by_batch_size: int  # no proposals in a step that schedules more requests than this
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    adaptive_threshold: float = 0.0  # per-request k from recent acceptance; 0 = always k (vLLM's behaviour)
    draft: Any = None  # ModelConfig of the draft model (method "draft_model")
    draft_kv_bytes_per_token: int = 0  # the draft's KV bytes per token (0 for ngram)

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past a verified step that the draft writes while proposing (none for n-gram)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @staticmethod
    def from_dict(
        raw: dict[str, Any] | str, target: Any, max_model_len: int, dtype: str, device: str
    ) -> SpeculativeConfig:
        """Validate the user's dict (or its JSON text) against the target ModelConfig; ValueError names
        the key."""
        if isinstance(raw, str):
            import json

            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(SPEC_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {list(SPEC_KEYS)}")
        method = raw.get("method")
        if method is None:
            method = "draft_model" if raw.get("model") is not None else None
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(SPEC_METHODS)}, got {method!r}")
        k = _positive_int(raw, "num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS)
        threshold = _positive_int(raw, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
        adaptive = raw.get("adaptive_threshold", DEFAULT_ADAPTIVE_THRESHOLD[method])
        if not isinstance(adaptive, int | float) or isinstance(adaptive, bool) or not 0 <= adaptive < 1:
            raise ValueError(f"speculative_config.adaptive_threshold must be a number in [0, 1), got {adaptive!r}")
        if method == "ngram":
            if raw.get("model") is not None:
                raise ValueError("speculative_config.model: the 'ngram' method takes no model")
            lo = _positive_int(raw, "prompt_lookup_min", 1)
            hi = _positive_int(raw, "prompt_lookup_max", max(lo, 4))
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            return SpeculativeConfig("ngram", k, threshold, lo, hi, float(adaptive))
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if key in raw:
                raise ValueError(f"speculative_config.{key} applies to the 'ngram' method only")
        draft = _draft_model_config(raw.get("model"), target, max_model_len, dtype, device)
        from lmserve.memory import ledger as memory
        draft_bpt = memory.kv_bytes_per_token(
            draft.num_layers, draft.num_kv_heads, draft.head_dim, memory.dtype_bytes(draft.dtype)
        )
        return SpeculativeConfig(
            "draft_model", k, threshold, adaptive_threshold=float(adaptive), draft=draft,
            draft_kv_bytes_per_token=draft_bpt,
        )  # fmt: skip


def _positive_int(raw: dict[str, Any], key: str, default: int) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config.{key} must be a positive integer, got {value!r}")
    return value


def _draft_model_config(path: str | None, target: Any, max_model_len: int, dtype: str, device: str) -> Any:
    from lmserve.config.model import ModelConfig
    from lmserve.default_model import default_model_path

    if path is None:
        if os.path.realpath(target.path) != os.path.realpath(default_model_path("target")):
            raise ValueError(
                "speculative_config.model: method 'draft_model' needs a draft model directory "
                "(only the bundled target has a default draft)"
            )
        path = default_model_path("draft")
    if not isinstance(path, str | os.PathLike):
        raise ValueError(f"speculative_config.model must be a directory path, got {path!r}")
    try:
        draft = ModelConfig.from_hf(path, dtype, device)
    except ValueError as e:
        raise ValueError(f"speculative_config.model: {e}") from None
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft's vocabulary ({draft.vocab_size} tokens) differs from the "
            f"target's ({target.vocab_size}); a draft must share the target's tokenizer"
        )
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(
            f"speculative_config.model: the draft handles {draft.max_position_embeddings} positions, fewer than "
            f"max_model_len={max_model_len}; lower max_model_len"
        )
    return draft
