"""Structured outputs: grammars compiled off the step loop, one matcher per constrained sequence, token bitmasks.

StructuredOutputManager compiles (cached, on a thread pool), StructuredOutputRequest holds a sequence's matcher,
fill_bitmasks / fill_verification_bitmasks give the sampler its masks. The grammar engine is llguidance.
The flow, including speculative decoding, is in docs/structured_outputs.md.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import torch

from lmserve.sampling_params import StructuredOutputsParams

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON is generated compactly (one space after `,` and `:`, no other whitespace): a model cannot wander
into unbounded whitespace, and the text is what json.dumps writes. A schema's "x-guidance" key overrides."""

MAX_CACHED_GRAMMARS = 512
PARALLEL_MASK_MIN_ROWS = 16
"""Below this many constrained rows, masks are filled on the step thread (tens of µs each); from here on,
llguidance's executor fills them in parallel (its thread wake-ups cost more than small batches save)."""


class GrammarError(ValueError):
    """A constraint the grammar library refuses; `field` is the StructuredOutputsParams kind, the message is
    the library's reason."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"structured_outputs.{field}: {reason}")
        self.field = field
        self.reason = reason


# Keywords whose value is one subschema, a list of them, or a map of names to them (JSON Schema 2020-12 and
# draft 7's `items` list / `definitions`). Other values (const, enum, default, examples, ...) are data, not schemas.
_SUBSCHEMA = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "unevaluatedItems",
              "contains", "propertyNames", "not", "if", "then", "else")  # fmt: skip
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Beside these, a schema's own "additionalProperties" would also refuse the properties the other branches declare.
_COMBINATORS = ("allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas")


def close_objects(schema: Any) -> Any:
    """A copy of `schema` in which every object schema that declares `properties` (or `patternProperties`) but
    says nothing about `additionalProperties` gets `"additionalProperties": false`: the object closes after its
    declared properties (xgrammar's strict mode, vLLM's default). JSON Schema's default (any further key) lets a
    model invent keys until max_tokens, which is what client libraries' schemas without the keyword get.

    An explicit `additionalProperties` (true or a schema) or `unevaluatedProperties` is kept. Left open too: an
    object without declared properties (`{"type": "object"}`, json_object: any object), and one whose properties
    are completed by combinators beside them or that is itself an `allOf` branch (closing each branch of an
    intersection would refuse the keys the other branches declare)."""
    return _close(schema, in_all_of=False)


def _close(schema: Any, in_all_of: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if key in out and isinstance(out[key], dict):
            out[key] = _close(out[key], False)
    for key in _SUBSCHEMA_LISTS:
        if key in out and isinstance(out[key], list):
            out[key] = [_close(s, key == "allOf") for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if key in out and isinstance(out[key], dict):
            out[key] = {name: _close(s, False) for name, s in out[key].items()}
    declares = isinstance(out.get("properties"), dict) or isinstance(out.get("patternProperties"), dict)
    said = "additionalProperties" in out or "unevaluatedProperties" in out
    if declares and not said and not in_all_of and not any(k in out for k in _COMBINATORS):
        out["additionalProperties"] = False
    return out


def grammar_text(kind: str, spec: str, allow_additional_properties: bool = False) -> str:
    """llguidance's grammar for one constraint (not yet checked against a tokenizer). JSON schemas get
    `close_objects` unless `allow_additional_properties` (llguidance 1.9 has no option for this default)."""
    if kind == "json" and not allow_additional_properties:
        spec = json.dumps(close_objects(json.loads(spec)))
    if kind in ("json", "json_object"):
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(spec)))
    assert kind == "grammar", f"unknown structured output kind {kind!r}"
    return llguidance.grammar_from("grammar", spec)  # GBNF (llama.cpp) or Lark


def after_reasoning(
    kind: str,
    spec: str,
    grammar: str,
    start: tuple[str, ...],
    end: tuple[str, ...],
    special_id: Callable[[str], int | None] = lambda m: None,
) -> str:
    """A Lark grammar: a reasoning block (free text up to the first of `end`; optional and opened by one of `start`
    when given), blanks, then the constraint. `special_id(marker)`: the marker's token id when the tokenizer holds
    it as one special token (matched as that token, not as text). The grammar itself cannot be nested: ValueError."""
    if kind in ("json", "json_object"):
        body = "%json " + json.dumps(json.loads(grammar)["grammars"][0]["json_schema"])  # closed, with x-guidance
    elif kind == "regex":
        body = "/" + re.sub(r"(?<!\\)/", r"\/", spec) + "/"
    elif kind == "choice":
        body = " | ".join(json.dumps(c) for c in json.loads(spec))
    else:
        raise ValueError("a grammar constraint cannot follow a reasoning block; use json, regex or choice")

    def regex(markers: list[str]) -> str:
        return "(?:" + "|".join(re.escape(m).replace("/", "\\/") for m in markers) + ")"

    def split(markers: tuple[str, ...]) -> tuple[list[str], list[str]]:
        tokens = [f"<[{i}]>" for m in markers if (i := special_id(m)) is not None]
        return tokens, [m for m in markers if special_id(m) is None]

    end_tokens, end_texts = split(end)
    alts = ([f"/(?s:.*)/ ({' | '.join(end_tokens)})"] if end_tokens else []) + (["thinklazy"] if end_texts else [])
    rules = f"thinktext: {' | '.join(alts)}\n"
    if end_texts:
        rules += f"thinklazy[lazy]: /(?s:.*){regex(end_texts)}/\n"
    if start:
        start_tokens, start_texts = split(start)
        opener = " | ".join(start_tokens + ([f"/{regex(start_texts)}/"] if start_texts else []))
        rules = f"start: (think ws)? body\nthink: ({opener}) thinktext\n" + rules
    else:
        rules = "start: thinktext ws body\n" + rules
    return llguidance.grammar_from("lark", rules + "ws: /[ \\t\\r\\n]*/\nbody: " + body + "\n")


class StructuredOutputManager:
    """Compiles constraints for one tokenizer on a small thread pool and caches the results.

    Thread-safe: the engine thread calls `compile` from add_request, the HTTP side calls it to refuse a bad
    schema with a 400 before the request is queued (the engine then finds it cached)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        num_threads: int = 1,
        allow_additional_properties: bool = False,
    ) -> None:
        self._hf_tokenizer = tokenizer
        self._allow_additional_properties = allow_additional_properties  # see grammar_text; the same for all
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer: Any = None  # built on first use (~0.1 s for 8k tokens, ~1 s for 150k)
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="lmserve-grammar")
        self._cache: OrderedDict[tuple[Any, ...], Future] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # grammars actually compiled (cache misses)

    def compile(self, params: StructuredOutputsParams) -> Future:
        """Future of the template matcher for `params`; raises GrammarError from `.result()` if refused."""
        key = (params.kind, params.spec, params.reasoning_start, params.reasoning_end)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, *key)
            self._cache[key] = fut
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            return fut

    def new_request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        return StructuredOutputRequest(self.compile(params), params.kind)

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos_token_ids
                )
            return self._ll_tokenizer

    def _special_id(self, marker: str) -> int | None:
        """The id of `marker` when it is one token the grammar engine holds as special (e.g. <think>), else None."""
        ids = self._hf_tokenizer.encode(marker, add_special_tokens=False)
        return ids[0] if len(ids) == 1 and self._tokenizer().is_special_token(ids[0]) else None

    def _compile(self, kind: str, spec: str, reasoning_start: tuple[str, ...], reasoning_end: tuple[str, ...]) -> Any:
        try:
            grammar = grammar_text(kind, spec, self._allow_additional_properties)
            if reasoning_end:
                grammar = after_reasoning(kind, spec, grammar, reasoning_start, reasoning_end, self._special_id)
        except ValueError as e:
            raise GrammarError(kind, str(e)) from None
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar)
        if matcher.is_error():
            raise GrammarError(kind, matcher.get_error())
        self.num_compiled += 1
        return matcher

    @staticmethod
    def wait_any(requests: list[StructuredOutputRequest], timeout_s: float = 0.02) -> None:
        """Block until one of the requests' grammars is compiled (or refused), at most `timeout_s`."""
        concurrent.futures.wait({r._future for r in requests}, timeout_s, concurrent.futures.FIRST_COMPLETED)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class StructuredOutputRequest:
    """The grammar state of one sequence. `is_ready` is what the scheduler reads (a plain bool).

    The matcher is advanced on every kept token. Preemption needs nothing: recompute keeps the output
    tokens, the matcher has consumed them, and the next token is sampled after them. For speculative decoding,
    `valid_proposals` cuts proposals at the first refused token, and `advance_tentatively` /
    `rollback_tentative` move over proposals within one call (drafting, verification masks).
    """

    def __init__(self, future: Future, kind: str) -> None:
        self._future = future
        self.kind = kind
        self._matcher: Any = None
        self._num_tentative = 0  # tokens consumed by advance_tentatively, not yet rolled back

    @property
    def is_ready(self) -> bool:
        return self._future.done() and self._future.exception() is None

    @property
    def is_compiling(self) -> bool:
        return not self._future.done()

    @property
    def error(self) -> str | None:
        """The library's reason when compilation failed, else None (also while compiling)."""
        if not self._future.done() or self._future.exception() is None:
            return None
        return str(self._future.exception())

    @property
    def matcher(self) -> Any:
        if self._matcher is None:
            assert self.is_ready, "the matcher is used only once its grammar compiled"
            self._matcher = self._future.result().deep_copy()
        return self._matcher

    def accept_token(self, token_id: int) -> bool:
        """Advance on a sampled token; False if the grammar refuses it (the mask should have prevented that)."""
        return self.matcher.consume_token(token_id)

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order, the grammar would accept from here (the state is unchanged)."""
        return self.matcher.validate_tokens(token_ids)

    def accept_tokens(self, token_ids: list[int]) -> int:
        """Advance over the longest accepted prefix of `token_ids`; returns its length."""
        n = self.validate_tokens(token_ids)
        if n:
            assert self.matcher.consume_tokens(token_ids[:n]), "validated tokens were refused"
        return n

    def rollback(self, num_tokens: int) -> None:
        assert self.matcher.rollback(num_tokens), f"cannot roll back {num_tokens} tokens"

    # ---- speculative decoding: tentative moves over tokens that are not the sequence's yet ----------------

    def advance_tentatively(self, token_ids: list[int]) -> None:
        """Consume tokens the grammar accepts (this step's new tokens, proposals) until `rollback_tentative`."""
        for t in token_ids:
            recorded = not self.matcher.is_stopped()  # llguidance takes EOS after the end without recording it
            assert self.matcher.consume_token(t), f"tentative token {t} violates the grammar"
            self._num_tentative += recorded

    def rollback_tentative(self) -> None:
        """Back to the state after the sequence's own tokens (undo every `advance_tentatively`)."""
        if self._num_tentative:
            self.rollback(self._num_tentative)
            self._num_tentative = 0

    def valid_proposals(self, new_token_ids: list[int], proposals: list[int]) -> list[int]:
        """The longest prefix of `proposals` the grammar accepts after the not yet consumed `new_token_ids`."""
        num_valid = self.validate_tokens(new_token_ids + proposals) - len(new_token_ids)
        return proposals[: max(0, num_valid)]

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and admits nothing more (so the sequence stops)."""
        return self.matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete match (EOS is allowed now)."""
        return self.matcher.is_accepting()


@dataclass
class TokenBitmask:
    """Allowed tokens of the constrained rows of one step: bit t % 32 of word t // 32 of `bits[j]` is set iff
    token t may follow in row `rows[j]` of the logits. Unconstrained rows are not listed and cost nothing."""

    rows: list[int]
    bits: torch.Tensor  # (len(rows), ceil(vocab / 32)) int32, on the CPU


_executor: Any = None
_executor_lock = threading.Lock()


def _parallel_executor() -> Any:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        return _executor


def fill_bitmasks(rows: list[int], requests: list[StructuredOutputRequest], vocab_size: int) -> TokenBitmask:
    """Each request's next-token mask (in parallel by llguidance's executor for large batches)."""
    # (llguidance.torch's wrappers do the same, but importing it pulls in torch.compile machinery.)
    bits = torch.empty((len(requests), (vocab_size + 31) // 32), dtype=torch.int32)
    row_bytes = bits.shape[1] * bits.element_size()
    matchers = [r.matcher for r in requests]
    if len(matchers) < PARALLEL_MASK_MIN_ROWS:
        for j, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(bits.data_ptr() + j * row_bytes, row_bytes)
    else:
        _parallel_executor().unsafe_compute_mask_ptr(
            [(m, j) for j, m in enumerate(matchers)], bits.data_ptr(), row_bytes, len(matchers)
        )
    return TokenBitmask(rows, bits)


def fill_verification_bitmasks(
    first_rows: list[int], requests: list[StructuredOutputRequest], proposals: list[list[int]], vocab_size: int
) -> TokenBitmask:
    """Masks for verifying proposals: request i with proposals d_1..d_k scores rows first_rows[i] + j,
    j = 0..k, and row j gets the mask of the grammar state after d_1..d_j (the matcher moves over the
    proposals, which the grammar accepts, and back)."""
    rows = [r + j for r, d in zip(first_rows, proposals, strict=True) for j in range(len(d) + 1)]
    bits = torch.empty((len(rows), (vocab_size + 31) // 32), dtype=torch.int32)
    row_bytes = bits.shape[1] * bits.element_size()
    out = 0
    for req, drafts in zip(requests, proposals, strict=True):
        for j in range(len(drafts) + 1):
            req.matcher.unsafe_compute_mask_ptr(bits.data_ptr() + out * row_bytes, row_bytes)
            out += 1
            if j < len(drafts):
                req.advance_tentatively(drafts[j : j + 1])
        req.rollback_tentative()
    return TokenBitmask(rows, bits)
