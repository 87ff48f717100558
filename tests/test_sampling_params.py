"""SamplingParams validation and normalisation: every bad value raises ValueError naming its field."""

from __future__ import annotations

import pytest

from lmserve.sampling_params import SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert p.n == 1 and p.best_of is None and p.actual_best_of == 1
    assert p.temperature == 1.0 and not p.greedy
    assert p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0
    assert p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.seed is None
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias == {}
    assert not p.include_stop_str_in_output and not p.ignore_eos
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.use_beam_search and p.length_penalty == 1.0
    assert p.stop_holdback_chars == 0


def test_greedy_and_normalisation() -> None:
    assert SamplingParams(temperature=0).greedy
    p = SamplingParams(
        temperature=1,
        stop="###",
        stop_token_ids=(5, 6),
        logit_bias={"42": 5, 7: -100.0},
        best_of=3,
        n=2,
        max_tokens=None,
        min_tokens=100,
    )
    assert isinstance(p.temperature, float)
    assert p.stop == ["###"] and p.stop_token_ids == [5, 6]
    assert p.logit_bias == {42: 5.0, 7: -100.0}
    assert all(isinstance(k, int) for k in p.logit_bias)
    assert p.actual_best_of == 3
    assert SamplingParams(stop=["ab", "abcd"]).stop_holdback_chars == 3
    assert SamplingParams(stop=["abcd"], include_stop_str_in_output=True).stop_holdback_chars == 0


@pytest.mark.parametrize("top_k", [0, -1, 1, 50])
def test_top_k_accepted(top_k: int) -> None:
    assert SamplingParams(top_k=top_k).top_k == top_k


BAD_VALUES: list[tuple[str, dict[str, object]]] = [
    ("n", {"n": 0}),
    ("n", {"n": 1.5}),
    ("n", {"n": "2"}),
    ("best_of", {"n": 3, "best_of": 2}),
    ("best_of", {"best_of": 0}),
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": "0.7"}),
    ("temperature", {"temperature": float("nan")}),
    ("temperature", {"temperature": True}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 2.0}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.01}),
    ("top_p", {"top_p": "1"}),
    ("min_p", {"min_p": -0.01}),
    ("min_p", {"min_p": 1.5}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("presence_penalty", {"presence_penalty": -2.01}),
    ("frequency_penalty", {"frequency_penalty": -3}),
    ("frequency_penalty", {"frequency_penalty": None}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": -1.0}),
    ("seed", {"seed": 1.5}),
    ("seed", {"seed": "42"}),
    ("max_tokens", {"max_tokens": -1}),
    ("max_tokens", {"max_tokens": 3.0}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 20, "max_tokens": 10}),
    ("stop", {"stop": ""}),
    ("stop", {"stop": ["ok", ""]}),
    ("stop", {"stop": [1]}),
    ("stop", {"stop": 5}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("stop_token_ids", {"stop_token_ids": ["3"]}),
    ("stop_token_ids", {"stop_token_ids": 3}),
    ("include_stop_str_in_output", {"include_stop_str_in_output": "yes"}),
    ("ignore_eos", {"ignore_eos": 1}),
    ("logprobs", {"logprobs": -1}),
    ("logprobs", {"logprobs": 21}),
    ("logprobs", {"logprobs": True}),
    ("prompt_logprobs", {"prompt_logprobs": 21}),
    ("prompt_logprobs", {"prompt_logprobs": -1}),
    ("logit_bias", {"logit_bias": {5: 101}}),
    ("logit_bias", {"logit_bias": {5: -100.5}}),
    ("logit_bias", {"logit_bias": {"abc": 1}}),
    ("logit_bias", {"logit_bias": {-3: 1}}),
    ("logit_bias", {"logit_bias": {5: "1"}}),
    ("logit_bias", {"logit_bias": [(5, 1)]}),
    ("skip_special_tokens", {"skip_special_tokens": None}),
    ("spaces_between_special_tokens", {"spaces_between_special_tokens": 0}),
    ("use_beam_search", {"use_beam_search": "false"}),
    ("length_penalty", {"length_penalty": "1"}),
    ("length_penalty", {"length_penalty": float("inf")}),
]


@pytest.mark.parametrize(("field_name", "kwargs"), BAD_VALUES, ids=[f"{f}-{kw}" for f, kw in BAD_VALUES])
def test_bad_value_raises_naming_field(field_name: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=field_name) as err:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    # The message also states what is allowed, not just that something is wrong.
    assert "must" in str(err.value)


def test_boundaries_accepted() -> None:
    SamplingParams(
        top_p=1.0,
        min_p=1.0,
        presence_penalty=2,
        frequency_penalty=-2,
        logprobs=20,
        prompt_logprobs=0,
        logit_bias={1: 100, 2: -100},
        min_tokens=16,
        max_tokens=16,
        temperature=0.0,
    )
