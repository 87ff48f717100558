"""Structured outputs through the engine: the bundled model (which writes Shakespeare) at temperature 1.0 emits
only what the constraint allows; sampling within the allowed set is exact; unconstrained rows are untouched."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from lmserve import LLM, SamplingParams, StructuredOutputsParams
from lmserve.config.engine import SchedulerConfig
from lmserve.core.kv_cache_manager import KVCacheManager
from lmserve.core.scheduler import Scheduler
from lmserve.default_model import default_model_path
from lmserve.request import Request
from lmserve.sample.sampler import Sampler, SamplingMetadata
from lmserve.sample.structured_output import (
    GrammarError,
    StructuredOutputManager,
    TokenBitmask,
    close_objects,
    fill_bitmasks,
    fill_verification_bitmasks,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["king", "queen", "fool"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "lines": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 12},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 999},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["lines"],
    "additionalProperties": False,
}
CODES = {
    "type": "object",
    "properties": {
        "codes": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "minItems": 2,
            "maxItems": 4,
        }
    },
    "required": ["codes"],
    "additionalProperties": False,
}
DATE = r"\d{4}-\d{2}-\d{2}"
CHOICES = ["Montague", "Capulet", "neither house"]
ARITH_GBNF = r"""
root   ::= expr
expr   ::= term (("+" | "-") term){0,3}
term   ::= factor (("*" | "/") factor){0,2}
factor ::= [0-9]{1,3} | "(" expr ")"
"""
N = 50


def _arith_ok(text: str) -> bool:
    """A recursive-descent parser of the grammar above (independent of the grammar library)."""
    pos = 0

    def factor() -> bool:
        nonlocal pos
        if pos < len(text) and text[pos] == "(":
            pos += 1
            if not expr() or pos >= len(text) or text[pos] != ")":
                return False
            pos += 1
            return True
        start = pos
        while pos < len(text) and text[pos].isascii() and text[pos].isdigit():
            pos += 1
        return 1 <= pos - start <= 3

    def chain(sub, ops: str, most: int) -> bool:
        nonlocal pos
        if not sub():
            return False
        for _ in range(most):
            if pos >= len(text) or text[pos] not in ops:
                break
            pos += 1
            if not sub():
                return False
        return True

    def term() -> bool:
        return chain(factor, "*/", 2)

    def expr() -> bool:
        return chain(term, "+-", 3)

    return expr() and pos == len(text)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=512)


def _sp(i: int, max_tokens: int = 160, **so) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, seed=i, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**so)
    )


@pytest.mark.slow
def test_fifty_of_fifty_valid_for_every_kind_of_constraint(llm: LLM) -> None:
    kinds = [
        ("person", {"json": PERSON}),
        ("order", {"json": json.dumps(ORDER)}),  # JSON text is accepted too
        ("codes", {"json": CODES}),
        ("date", {"regex": DATE}),
        ("choice", {"choice": CHOICES}),
        ("arith", {"grammar": ARITH_GBNF}),
    ]
    prompts, params = [], []
    for _, so in kinds:
        for i in range(N):
            prompts.append("ROMEO:")
            params.append(_sp(i, **so))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for k, (name, _) in enumerate(kinds):
        texts = [o.outputs[0].text for o in outs[k * N : (k + 1) * N]]
        reasons = {o.outputs[0].finish_reason for o in outs[k * N : (k + 1) * N]}
        assert reasons == {"stop"}, (name, reasons, texts[:3])
        for text in texts:
            if name in ("person", "order", "codes"):
                jsonschema.validate(json.loads(text), {"person": PERSON, "order": ORDER, "codes": CODES}[name])
            elif name == "date":
                assert re.fullmatch(DATE, text), text
            elif name == "choice":
                assert text in CHOICES, text
            else:
                assert _arith_ok(text), text
        assert len(set(texts)) > 1 or name == "choice", f"{name}: temperature 1.0 should vary the outputs"


def test_json_object_gives_an_object_and_the_grammar_ends_the_request(llm: LLM) -> None:
    outs = llm.generate(["ROMEO:"] * 6, [_sp(i, 48, json_object=True) for i in range(6)], use_tqdm=False)
    eos = set(llm.engine.eos_token_ids)
    for o in outs:
        c = o.outputs[0]
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict), c.text
            assert c.stop_reason is None
        else:  # an unbounded object may run into max_tokens
            assert c.finish_reason == "length" and len(c.token_ids) == 48
        assert not eos & set(c.token_ids[:-1]), "EOS only at the end"


def test_max_tokens_cuts_a_constrained_output_with_length(llm: LLM) -> None:
    params = SamplingParams(
        temperature=1.0, seed=0, max_tokens=3, structured_outputs=StructuredOutputsParams(json=PERSON)
    )
    out = llm.generate(["ROMEO:"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert '{"name": "'.startswith(out.text), out.text  # a prefix of what the schema allows


def test_unconstrained_rows_keep_their_greedy_tokens_in_a_mixed_batch(llm: LLM) -> None:
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["To be, or not", "ROMEO:", "JULIET:"]
    alone = llm.generate(prompts, plain, use_tqdm=False)
    mixed_prompts = prompts + ["ROMEO:"] * 6
    mixed_params = [plain] * 3 + [_sp(i, json=PERSON) for i in range(3)] + [_sp(i, regex=DATE) for i in range(3)]
    mixed = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    for a, m in zip(alone, mixed[:3], strict=True):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids
    for o in mixed[3:6]:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)


def test_n_seeds_logprobs_stop_strings_preemption_chunked_prefill_prefix_cache() -> None:
    # 10 blocks of 16 tokens for 3 x 4 sequences of a ~50-token prompt plus ~30 output tokens: preemption by
    # recompute is certain; a budget of 32 tokens chunks the prompt; the shared prompt is a prefix-cache hit.
    small = LLM(num_kv_blocks=10, max_num_batched_tokens=32)
    prompt = "ROMEO: " + "But soft, what light through yonder window breaks? " * 3
    params = SamplingParams(
        n=4, temperature=1.0, seed=7, max_tokens=80, logprobs=2, structured_outputs=StructuredOutputsParams(json=PERSON)
    )
    outs = small.generate([prompt] * 3, params, use_tqdm=False)
    metrics = small.engine.get_metrics()
    assert metrics["num_preemptions_total"] > 0 and metrics["prefix_cache_hits_total"] > 0
    for o in outs:
        assert len(o.outputs) == 4
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), PERSON)
            assert len(c.logprobs) == len(c.token_ids) and all(len(e.top_logprobs) == 2 for e in c.logprobs)
    assert outs[0].outputs[0].text == outs[1].outputs[0].text, "same seed, same prompt, same output"
    # a stop string inside the constrained output finishes it there
    stop = SamplingParams(
        temperature=1.0, seed=3, max_tokens=60, stop=["-"], structured_outputs=StructuredOutputsParams(regex=DATE)
    )
    c = small.generate(["ROMEO:"], stop, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "-" and re.fullmatch(r"\d{4}", c.text), c.text


def test_bad_constraints_are_refused_with_the_library_reason(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"prompts\[0\]: structured_outputs.json: .*Invalid type: wat"):
        llm.generate(["x"], _sp(0, json={"type": "wat"}), use_tqdm=False)
    with pytest.raises(ValueError, match=r"(?s)structured_outputs.regex: .*unclosed group"):
        llm.generate(["x"], _sp(0, regex="(ab"), use_tqdm=False)
    # through the engine directly: the request finishes aborted with the reason once compilation fails
    engine = llm.engine
    engine.add_request("bad", "x", _sp(0, grammar="root ::= (("))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    (out,) = outs
    assert (
        out.finished
        and out.outputs[0].finish_reason == "abort"
        and "structured_outputs.grammar" in str(out.outputs[0].stop_reason)
    )
    with pytest.raises(GrammarError):  # known bad now: refused at once
        engine.add_request("bad2", "x", _sp(0, grammar="root ::= (("))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of"),
        ({"json": {"type": "object"}, "regex": "a"}, "exactly one of"),
        ({"json": "{not json"}, "structured_outputs.json: not valid JSON"),
        ({"json": [1]}, "must be a JSON schema"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", 3]}, "non-empty strings"),
        ({"regex": ""}, "non-empty string"),
        ({"json_object": False}, "exactly one of"),
    ],
)
def test_structured_outputs_params_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_refuses_min_tokens_with_a_constraint() -> None:
    with pytest.raises(ValueError, match="min_tokens cannot be combined with structured_outputs"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))
    sp = SamplingParams(structured_outputs={"choice": ["a"]})
    assert sp.structured_outputs == StructuredOutputsParams(choice=["a"])
    with pytest.raises(ValueError, match="unknown fields"):
        SamplingParams(structured_outputs={"jsn": {}})


@pytest.fixture(scope="module")
def manager() -> StructuredOutputManager:
    tok = AutoTokenizer.from_pretrained(default_model_path("target"))
    return StructuredOutputManager(tok, 8000, (0,))


def test_compilation_is_cached_per_constraint(manager: StructuredOutputManager) -> None:
    a = manager.compile(StructuredOutputsParams(json=PERSON))
    b = manager.compile(StructuredOutputsParams(json=json.dumps(PERSON)))
    assert a is b
    a.result()
    before = manager.num_compiled
    manager.compile(StructuredOutputsParams(json=PERSON)).result()
    assert manager.num_compiled == before


def test_matcher_checks_several_proposed_tokens_and_rolls_back(manager: StructuredOutputManager) -> None:
    tok = AutoTokenizer.from_pretrained(default_model_path("target"))
    req = manager.new_request(StructuredOutputsParams(regex=DATE))
    req._future.result()
    good = tok.encode("2024-01-31", add_special_tokens=False)
    bad_tail = tok.encode("2024-0x", add_special_tokens=False)
    assert req.validate_tokens(good) == len(good)
    n_ok = req.validate_tokens(bad_tail)
    assert n_ok < len(bad_tail)
    assert req.accept_tokens(good[:3]) == 3
    req.rollback(3)
    assert req.accept_tokens(good) == len(good) and req.is_accepting


def test_close_objects_closes_declared_objects_only() -> None:
    """Unspecified additionalProperties becomes false where an object declares properties, at any depth; explicit
    values, open objects, allOf branches and data (const, default, a property named "properties") are kept."""
    item = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"a": {"type": "string"}}},  # a property so named
            "tags": {"type": "array", "items": item, "default": [{"properties": {}}]},
            "pair": {"type": "array", "prefixItems": [item]},
            "any": {"anyOf": [item, {"type": "null"}]},
            "both": {"allOf": [item, {"properties": {"y": {"type": "integer"}}}]},
            "free": {"type": "object"},
            "open": {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
            "typed": {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
            "ref": {"$ref": "#/$defs/D"},
            "lit": {"const": {"properties": {"a": 1}}},
        },
        "$defs": {"D": {"type": "object", "properties": {"d": {"type": "boolean"}}}},
    }
    before = json.dumps(schema)
    out = close_objects(schema)
    assert json.dumps(schema) == before, "the input is not modified"
    closed = {**item, "additionalProperties": False}
    props = out["properties"]
    assert out["additionalProperties"] is False
    assert props["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in props and "additionalProperties" not in props["properties"]["properties"]
    assert props["tags"]["items"] == closed and props["tags"]["default"] == [{"properties": {}}]
    assert props["pair"]["prefixItems"] == [closed] and props["any"]["anyOf"][0] == closed
    assert props["both"] == schema["properties"]["both"], "allOf branches stay open (they complete each other)"
    assert props["free"] == {"type": "object"}
    assert props["open"]["additionalProperties"] is True
    assert props["typed"]["additionalProperties"] == {"type": "integer"}
    assert props["ref"] == {"$ref": "#/$defs/D"} and out["$defs"]["D"]["additionalProperties"] is False
    assert props["lit"] == schema["properties"]["lit"]
    assert close_objects(True) is True and close_objects({"type": "object"}) == {"type": "object"}


@pytest.mark.parametrize("allow", [False, True])
def test_additional_properties_default_follows_the_manager_option(allow: bool) -> None:
    """By default an object without additionalProperties admits no key past its declared ones (the model cannot
    wander into invented keys); allow_additional_properties restores JSON Schema's default. An explicit true
    is honoured either way."""
    tok = AutoTokenizer.from_pretrained(default_model_path("target"))
    mgr = StructuredOutputManager(tok, 8000, (0,), allow_additional_properties=allow)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    extra = tok.encode('{"a": 1, "b": 2}', add_special_tokens=False)
    for spec, admits in [(schema, allow), ({**schema, "additionalProperties": True}, True)]:
        req = mgr.new_request(StructuredOutputsParams(json=spec))
        req._future.result()
        assert (req.validate_tokens(extra) == len(extra)) == admits, (spec, allow)
    mgr.shutdown()


def test_verification_masks_follow_the_proposals_and_leave_the_matcher_unchanged(
    manager: StructuredOutputManager,
) -> None:
    """Row j of a verification mask is the mask after proposals d_1..d_j (compared with a matcher that consumed
    them for real); proposals are cut at the first refused token; tentative moves, also over EOS after the end of
    the grammar (which llguidance does not record), roll back to the sequence's own state."""
    tok = AutoTokenizer.from_pretrained(default_model_path("target"))
    so = StructuredOutputsParams(regex=r"\d{2}-\d{2}")
    req, ref = manager.new_request(so), manager.new_request(so)
    req._future.result()
    digits = tok.encode("12-34", add_special_tokens=False)
    assert req.valid_proposals(digits[:1], digits[1:] + [5, 6]) == digits[1:]
    assert req.valid_proposals(digits, [0, 7]) == [0], "EOS is the only token after the end"
    masks = fill_verification_bitmasks([3, 9], [req, ref], [digits, []], 8000)
    assert masks.rows == [3 + j for j in range(len(digits) + 1)] + [9]
    for j in range(len(digits) + 1):
        assert torch.equal(masks.bits[j], fill_bitmasks([0], [ref], 8000).bits[0]), j
        if j < len(digits):
            assert ref.accept_token(digits[j])
    assert torch.equal(masks.bits[-1], fill_bitmasks([0], [req], 8000).bits[0]), "the empty run: the start mask"
    assert req.validate_tokens(digits) == len(digits), "the matcher is back at the start"
    req.advance_tentatively(digits + [0, 0])  # complete, then EOS twice
    assert req.is_terminated
    req.rollback_tentative()
    assert req.validate_tokens(digits) == len(digits) and not req.is_accepting


def test_sampling_within_the_allowed_set_is_exact(manager: StructuredOutputManager) -> None:
    """Rows of one logits vector under a choice constraint: the empirical distribution equals the target
    renormalised over the allowed tokens (after temperature and top-k) within 4.5 sigma; nothing else appears."""
    words = ["a", "b", "c", "d", "e"]
    so = StructuredOutputsParams(choice=words)
    num = 4000
    req = manager.new_request(so)
    req._future.result()
    one = fill_bitmasks([0], [req], 8000)
    mask = TokenBitmask(list(range(num)), one.bits.expand(num, -1).contiguous())
    allowed = [t for t in range(8000) if (int(mask.bits[0, t // 32]) >> (t % 32)) & 1]
    assert 3 <= len(allowed) <= 40  # single letters and the tokens that start them
    torch.manual_seed(0)
    logits = torch.randn(8000) * 3
    for params, k in [(SamplingParams(temperature=1.0), None), (SamplingParams(temperature=0.7, top_k=3), 3)]:
        meta = SamplingMetadata([params] * num, [None] * num, [[1]] * num, [[]] * num, [0], mask)
        sampled = Sampler()(logits.expand(num, -1).clone(), meta).sampled_token_ids
        target = torch.full((8000,), float("-inf"))
        target[allowed] = logits[allowed] / params.temperature
        if k is not None:  # top-k acts within the allowed set: the mask comes first
            kth = target.topk(k).values[-1]
            target[target < kth] = float("-inf")
        p = target.softmax(-1)
        counts = torch.bincount(torch.tensor(sampled), minlength=8000).double() / num
        assert set(sampled) <= {t for t in allowed if p[t] > 0}
        for t in allowed:
            sigma = math.sqrt(max(p[t] * (1 - p[t]), 1e-12) / num)
            assert abs(counts[t] - p[t]) <= 4.5 * sigma + 1e-9, (t, float(counts[t]), float(p[t]))


def test_scheduler_admits_others_while_a_grammar_compiles() -> None:
    class Pending:
        is_ready = False

    cfg = SchedulerConfig(8, 64, 64, True, "continuous")
    s = Scheduler(cfg, KVCacheManager(64, 4, True))
    grammar = Pending()
    a = Request("a", [1, 2, 3], SamplingParams(), max_tokens=4)
    a.structured_output = grammar
    b = Request("b", [4, 5], SamplingParams(), max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert [r.request.request_id for r in out.scheduled] == ["b"]
    assert list(s.waiting) == [a]
    grammar.is_ready = True
    assert [r.request.request_id for r in s.schedule().scheduled] == ["b", "a"]
