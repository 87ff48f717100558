"""SamplingParams: how one request's tokens are chosen and when it stops.

Names and meanings follow vLLM / OpenAI. Validated once at construction: a bad value raises
ValueError naming the field and the allowed range, so an API layer can turn it into a 400 without
knowing every rule, and the sampler never has to re-check per step.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

MAX_LOGPROBS = 20
"""Upper bound for `logprobs` / `prompt_logprobs` (OpenAI's limit)."""

LOGIT_BIAS_LIMIT = 100.0
"""|bias| bound for `logit_bias` (OpenAI's limit)."""


def _is_int(value: object) -> bool:
    # bool is an int subclass; `temperature=True` is a client bug, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> int:
    rng = _range_text(lo, hi)
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer{rng}, got {value!r}")
    assert isinstance(value, int)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be an integer{rng}, got {value}")
    return value


def _check_float(name: str, value: object, rule: str, ok: Any) -> float:
    """Coerce an int/float to float and check `ok(value)`; `rule` is the human-readable range."""
    if not (_is_int(value) or isinstance(value, float)):
        raise ValueError(f"{name} must be a number {rule}, got {value!r}")
    v = float(value)  # type: ignore[arg-type]
    if not math.isfinite(v) or not ok(v):
        raise ValueError(f"{name} must be {rule}, got {value}")
    return v


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def _range_text(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    if lo is not None:
        return f" >= {lo}"
    if hi is not None:
        return f" <= {hi}"
    return ""


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's names): exactly one of `json` (a JSON schema, as a dict or JSON text),
    `regex`, `choice` (the output is one of these strings), `grammar` (GBNF as llama.cpp writes it, or Lark)
    or `json_object=True` (any JSON object). Enforced token by token by lmserve.sample.structured_output."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # a reasoning block the constraint follows (free text ending in one of reasoning_end; optional, and opened by
    # one of reasoning_start, when that is given; else the output starts inside it); () = none
    reasoning_start: tuple[str, ...] = ()
    reasoning_end: tuple[str, ...] = ()

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs: give exactly one of {', '.join(self.KINDS)}, got {given or 'none'}"
            )
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json: not valid JSON: {e}") from None
            else:
                parsed = self.json
            if not isinstance(parsed, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
            for c in self.choice:
                if not isinstance(c, str) or not c:
                    raise ValueError(f"structured_outputs.choice must contain non-empty strings, got element {c!r}")
            self.choice = list(self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be true when given, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as canonical text: (kind, spec) is the grammar cache key."""
        if self.json is not None:
            parsed = json.loads(self.json) if isinstance(self.json, str) else self.json
            return json.dumps(parsed, separators=(",", ":"))  # property order matters: it is generation order
        if self.json_object:
            return '{"type":"object"}'
        if self.choice is not None:
            return json.dumps(self.choice)
        return self.regex if self.regex is not None else self.grammar  # type: ignore[return-value]


@dataclass
class SamplingParams:
    """Per-request decoding options (vLLM / OpenAI names and semantics).

    Normalisations done here so consumers see one shape: `stop` is always a list[str],
    `stop_token_ids` a list[int], `logit_bias` a dict[int, float] (JSON string keys converted),
    ints given for float fields become floats.
    """

    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    seed: int | None = None
    max_tokens: int | None = 16  # 0: score the prompt only (prompt_logprobs), nothing generated
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    best_of: int | None = None  # None = n
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # HF semantics; 1 = off
    stop: list[str] | str | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-N alternatives per sampled token; 0 = only the chosen one
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float = 1.0
    structured_outputs: StructuredOutputsParams | None = None
    pooling: PoolingParams | None = None  # a pooling request (max_tokens 0): its prompt's hidden states, pooled

    def __post_init__(self) -> None:
        self.n = _check_int("n", self.n, lo=1)
        if self.best_of is not None:
            if not _is_int(self.best_of) or self.best_of < self.n:
                raise ValueError(f"best_of must be None or an integer >= n ({self.n}), got {self.best_of!r}")
        self.temperature = _check_float("temperature", self.temperature, ">= 0", lambda v: v >= 0)
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed)
        if self.max_tokens is not None:
            self.max_tokens = _check_int("max_tokens", self.max_tokens, lo=0)
        self.min_tokens = _check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        self.ignore_eos = _check_bool("ignore_eos", self.ignore_eos)
        self.top_k = _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (off) or >= 1, got {self.top_k}")
        self.top_p = _check_float("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1)
        self.min_p = _check_float("min_p", self.min_p, "in [0, 1]", lambda v: 0 <= v <= 1)
        self.presence_penalty = _check_float(
            "presence_penalty", self.presence_penalty, "in [-2, 2]", lambda v: -2 <= v <= 2
        )
        self.frequency_penalty = _check_float(
            "frequency_penalty", self.frequency_penalty, "in [-2, 2]", lambda v: -2 <= v <= 2
        )
        self.repetition_penalty = _check_float(
            "repetition_penalty", self.repetition_penalty, "> 0", lambda v: v > 0
        )
        self.stop = self._normalise_stop(self.stop)
        self.include_stop_str_in_output = _check_bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )
        if self.logprobs is not None:
            self.logprobs = _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS)
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        self.skip_special_tokens = _check_bool("skip_special_tokens", self.skip_special_tokens)
        self.spaces_between_special_tokens = _check_bool(
            "spaces_between_special_tokens", self.spaces_between_special_tokens
        )
        self.use_beam_search = _check_bool("use_beam_search", self.use_beam_search)
        self.length_penalty = _check_float("length_penalty", self.length_penalty, "finite", lambda v: True)
        if self.structured_outputs is not None:
            if isinstance(self.structured_outputs, dict):
                unknown = set(self.structured_outputs) - set(StructuredOutputsParams.KINDS)
                if unknown:
                    raise ValueError(f"structured_outputs: unknown fields {sorted(unknown)}")
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(
                    f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}"
                )
            if self.min_tokens:
                raise ValueError(
                    "min_tokens cannot be combined with structured_outputs: the grammar decides where the output "
                    f"ends (got min_tokens={self.min_tokens})"
                )

        if isinstance(self.pooling, dict):
            self.pooling = PoolingParams(**self.pooling)
        if self.pooling is not None and not isinstance(self.pooling, PoolingParams):
            raise ValueError(f"pooling must be a PoolingParams, got {self.pooling!r}")
        if self.pooling is not None and (self.max_tokens != 0 or self.n != 1 or (self.best_of or 1) != 1):
            raise ValueError("pooling: a pooling request generates nothing (max_tokens 0) and has one sequence (n 1)")

    @staticmethod
    def _normalise_stop_token_ids(value: object) -> list[int]:
        if value is None:
            return []
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got {value!r}")
        for t in value:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got element {t!r}")
        return list(value)

    @staticmethod
    def _normalise_stop(value: object) -> list[str]:
        if value is None:
            return []
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {value!r}")
        for s in items:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain only non-empty strings, got element {s!r}")
        return list(items)

    @staticmethod
    def _normalise_logit_bias(value: object) -> dict[int, float]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias in [-100, 100], got {value!r}")
        out: dict[int, float] = {}
        for key, bias in value.items():
            if isinstance(key, str) and key.isascii() and key.isdigit():
                key = int(key)  # JSON object keys are always strings
            if not _is_int(key) or key < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {key!r}")
            out[key] = _check_float(
                f"logit_bias[{key}]",
                bias,
                f"in [{-LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]",
                lambda v: -LOGIT_BIAS_LIMIT <= v <= LOGIT_BIAS_LIMIT,
            )
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def actual_best_of(self) -> int:
        """How many sequences to generate before keeping the best `n` (best_of defaults to n)."""
        return self.n if self.best_of is None else self.best_of

    @property
    def stop_holdback_chars(self) -> int:
        """Upper bound on trailing characters a stream must hold back for stop-string matching."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1


# ---- pooling requests: a prefill that returns its hidden states pooled, not tokens ----------------------------

PoolingType = Literal["last", "mean", "cls"]
POOLING_TYPES = ("last", "mean", "cls")
RUNNERS = ("auto", "generate", "pooling")


@dataclass(frozen=True)
class PoolingParams:
    pooling_type: PoolingType = "last"
    normalize: bool = True
    dimensions: int | None = None  # keep the first `dimensions` values (before normalising)
    score_token_ids: tuple[int, ...] = ()  # non-empty: the probabilities of these tokens among them, last position
    classify: bool = False  # the model's classifier head on the last position: sigmoid (one label) or softmax

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {list(POOLING_TYPES)}, got {self.pooling_type!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if (self.score_token_ids or self.classify) and self.pooling_type != "last":
            raise ValueError("score_token_ids: scoring tokens reads the last position's logits (pooling_type 'last')")

    @property
    def needs_every_position(self) -> bool:
        """Mean and first-token pooling read positions a prefix-cache hit would skip: such requests compute all."""
        return self.pooling_type != "last"


def check_runner(runner: str, pooling: PoolingParams | None) -> None:
    """A pooling request on a generating engine, or a generation request on a pooling one: ValueError naming it."""
    if runner == "pooling" and pooling is None:
        raise ValueError(
            "runner: this engine runs the pooling runner (--runner pooling): it embeds and scores, it does not "
            "generate; start one with --runner generate for completions"
        )
    if runner != "pooling" and pooling is not None:
        raise ValueError(
            "runner: this engine runs the generate runner: embeddings and scores need --runner pooling "
            "(or --runner auto with an embedding checkpoint)"
        )
