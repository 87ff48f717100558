"""Sampler: processors against their reference definitions, filters against exact distributions."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from lmserve.sample.sampler import Sampler, SamplerOutput, SamplingMetadata
from lmserve.sampling_params import SamplingParams

NUM_SAMPLES = 20_000
TV_BOUND = 0.03  # expected TV at 20k samples is ~0.006; every wrong filter below is > 2 * TV_BOUND away

# A fixed distribution over 10 tokens, deliberately not sorted by token id.
BASE_PROBS = [0.10, 0.35, 0.05, 0.25, 0.04, 0.15, 0.03, 0.02, 0.007, 0.003]


def _base_logits() -> torch.Tensor:
    return torch.tensor(BASE_PROBS).log()


def _meta(
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    eos: list[int] | None = None,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata(
        params=params,
        generators=generators or [None] * n,
        prompt_token_ids=prompts or [[] for _ in range(n)],
        output_token_ids=outputs or [[] for _ in range(n)],
        eos_token_ids=eos or [],
    )


def _empirical(logits_row: torch.Tensor, params: SamplingParams, seed: int = 0) -> list[float]:
    """Sample NUM_SAMPLES tokens by running one batch of identical rows."""
    torch.manual_seed(seed)
    logits = logits_row.unsqueeze(0).repeat(NUM_SAMPLES, 1)
    out = Sampler()(logits, _meta([params] * NUM_SAMPLES))
    counts = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=logits.shape[1])
    return (counts.float() / NUM_SAMPLES).tolist()


def _tv(p: list[float], q: list[float]) -> float:
    return 0.5 * sum(abs(a - b) for a, b in zip(p, q, strict=True))


def _renormalised(probs: list[float], keep: set[int]) -> list[float]:
    total = sum(probs[i] for i in keep)
    return [probs[i] / total if i in keep else 0.0 for i in range(len(probs))]


def _softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    s = sum(e)
    return [v / s for v in e]


def _by_prob(probs: list[float]) -> list[int]:
    return sorted(range(len(probs)), key=lambda i: -probs[i])


def _check_distribution(params: SamplingParams, expected: list[float], wrong: list[list[float]]) -> None:
    # The test has power: each plausible bug's distribution is far from the right one.
    for w in wrong:
        assert _tv(expected, w) > 2 * TV_BOUND
    emp = _empirical(_base_logits(), params)
    assert _tv(emp, expected) < TV_BOUND, (emp, expected)
    # Filtered tokens are never drawn, not just rarely.
    assert all(e == 0 for e, x in zip(emp, expected, strict=True) if x == 0)
    exact = Sampler().compute_probs(_base_logits().unsqueeze(0), _meta([params]))[0].tolist()
    assert exact == pytest.approx(expected, abs=1e-5)


def test_temperature_distribution() -> None:
    t = 0.6
    expected = _softmax([math.log(p) / t for p in BASE_PROBS])
    _check_distribution(SamplingParams(temperature=t), expected, wrong=[BASE_PROBS])


def test_top_k_distribution() -> None:
    order = _by_prob(BASE_PROBS)
    expected = _renormalised(BASE_PROBS, set(order[:3]))
    wrong = [_renormalised(BASE_PROBS, set(order[:k])) for k in (2, 4)]
    _check_distribution(SamplingParams(top_k=3), expected, wrong)


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    # Sorted: .35, .25, .15, .10 -> cumulative .35, .60, .75, .85; top_p=.72 is reached at the 3rd token.
    order = _by_prob(BASE_PROBS)
    expected = _renormalised(BASE_PROBS, set(order[:3]))
    wrong = [_renormalised(BASE_PROBS, set(order[:k])) for k in (2, 4)]
    _check_distribution(SamplingParams(top_p=0.72), expected, wrong)


def test_top_p_always_keeps_one_token() -> None:
    exact = Sampler().compute_probs(_base_logits().unsqueeze(0), _meta([SamplingParams(top_p=0.01)]))
    assert exact[0].tolist() == pytest.approx([1.0 if i == 1 else 0.0 for i in range(10)])


def test_min_p_distribution() -> None:
    # Threshold 0.4 * 0.35 = 0.14 keeps .35, .25, .15 (and drops .10).
    order = _by_prob(BASE_PROBS)
    expected = _renormalised(BASE_PROBS, set(order[:3]))
    wrong = [_renormalised(BASE_PROBS, set(order[:k])) for k in (2, 4)]
    _check_distribution(SamplingParams(min_p=0.4), expected, wrong)


def _reference_pipeline(t: float, k: int, top_p: float, min_p: float) -> list[float]:
    """Temperature -> top-k -> top-p (on the renormalised top-k) -> min-p, written out by definition."""
    scaled = _softmax([math.log(p) / t for p in BASE_PROBS])
    order = _by_prob(scaled)
    after_k = _renormalised(scaled, set(order[:k]))
    cum, keep_p = 0.0, set()
    for i in order:
        if cum >= top_p:
            break
        keep_p.add(i)
        cum += after_k[i]
    after_p = _renormalised(after_k, keep_p)
    top = max(after_p)
    return _renormalised(after_p, {i for i, p in enumerate(after_p) if p >= min_p * top})


def test_temperature_top_k_top_p_chain() -> None:
    # Top-p runs on the renormalised top-k: here it keeps 4 tokens, on the full distribution it would keep 5.
    expected = _reference_pipeline(1.5, 6, 0.8, 0.0)
    wrong = [
        _reference_pipeline(1.5, 10, 0.8, 0.0),  # top-p not renormalised after top-k
        _reference_pipeline(1.0, 6, 0.8, 0.0),  # temperature skipped
        _reference_pipeline(1.5, 6, 1.0, 0.0),  # top-p skipped
    ]
    _check_distribution(SamplingParams(temperature=1.5, top_k=6, top_p=0.8), expected, wrong)


def test_min_p_with_other_filters() -> None:
    expected = _reference_pipeline(1.5, 6, 0.8, 0.45)
    wrong = [_reference_pipeline(1.5, 6, 0.8, 0.0)]
    _check_distribution(SamplingParams(temperature=1.5, top_k=6, top_p=0.8, min_p=0.45), expected, wrong)


def test_seeded_rows_sample_correct_distribution() -> None:
    n = 4000
    params = SamplingParams(top_k=3, seed=1)
    gens: list[torch.Generator | None] = [torch.Generator().manual_seed(s) for s in range(n)]
    out = Sampler()(_base_logits().unsqueeze(0).repeat(n, 1), _meta([params] * n, generators=gens))
    counts = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=10).float() / n
    expected = _renormalised(BASE_PROBS, set(_by_prob(BASE_PROBS)[:3]))
    assert _tv(counts.tolist(), expected) < 0.05


def test_greedy_is_argmax_and_all_greedy_fast_path() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0.0) for _ in range(6)]
    out = Sampler()(logits, _meta(params))
    assert isinstance(out, SamplerOutput)
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None
    # Mixed batch: greedy rows stay argmax next to sampled rows.
    params[1] = SamplingParams(temperature=1.0)
    params[4] = SamplingParams(temperature=0.8, top_p=0.5)
    out = Sampler()(logits, _meta(params))
    for i in (0, 2, 3, 5):
        assert out.sampled_token_ids[i] == int(logits[i].argmax())


def test_sampler_does_not_modify_input_logits() -> None:
    logits = torch.randn(3, 20)
    before = logits.clone()
    params = [
        SamplingParams(repetition_penalty=1.5, presence_penalty=1.0, logit_bias={3: 5.0}, top_p=0.9),
        SamplingParams(temperature=0, min_tokens=2),
        SamplingParams(top_k=2, min_p=0.1),
    ]
    Sampler()(logits, _meta(params, prompts=[[1, 2], [3], []], outputs=[[4], [], [5]], eos=[0]))
    assert torch.equal(logits, before)


def test_repetition_penalty_matches_hf() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 30) * 3
    prompts = [[1, 2, 3, 3], [5, 29], [0]]
    outputs = [[7, 1, 9], [], [4, 4, 11]]
    penalties = [1.3, 0.7, 1.0]
    got = Sampler().apply_logits_processors(
        logits,
        _meta([SamplingParams(repetition_penalty=p) for p in penalties], prompts=prompts, outputs=outputs),
    )
    for i, pen in enumerate(penalties):
        ids = torch.tensor([prompts[i] + outputs[i]])
        ref = RepetitionPenaltyLogitsProcessor(penalty=pen)(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(got[i : i + 1], ref)
    # Both signs were exercised.
    assert (logits[0, [1, 2, 3, 7, 9]] > 0).any() and (logits[0, [1, 2, 3, 7, 9]] < 0).any()


def test_presence_frequency_penalties_match_openai_formula() -> None:
    torch.manual_seed(2)
    logits = torch.randn(2, 12)
    prompts = [[0, 1, 2], [3]]  # prompt tokens are not penalised by presence/frequency
    outputs = [[5, 5, 5, 6, 1], [3, 3, 8]]
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5),
    ]
    got = Sampler().apply_logits_processors(logits, _meta(params, prompts=prompts, outputs=outputs))
    expected = logits.clone()
    for i, p in enumerate(params):
        for tok in range(12):
            c = outputs[i].count(tok)
            expected[i, tok] -= p.presence_penalty * (c > 0) + p.frequency_penalty * c
    torch.testing.assert_close(got, expected)


def test_repetition_then_presence_order() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0)
    got = Sampler().apply_logits_processors(logits, _meta([params], prompts=[[1]], outputs=[[0]]))
    torch.testing.assert_close(got, torch.tensor([[2.0 / 2 - 1.0, -4.0, 1.0]]))


def test_logit_bias() -> None:
    logits = torch.zeros(2, 8)
    logits[:, 2] = 5.0
    params = [
        SamplingParams(temperature=0, logit_bias={6: 10.0, 2: -3.0, 99: 50.0}),
        SamplingParams(temperature=0),
    ]
    meta = _meta(params)
    got = Sampler().apply_logits_processors(logits, meta)
    expected = logits.clone()
    expected[0, 6] += 10.0
    expected[0, 2] -= 3.0  # id 99 is outside the vocab: ignored
    torch.testing.assert_close(got, expected)
    assert Sampler()(logits, meta).sampled_token_ids == [6, 2]
    # A -100 bias effectively bans a token even when sampling.
    banned = SamplingParams(logit_bias={2: -100.0}, temperature=1.0)
    out = Sampler()(logits[:1].repeat(50, 1), _meta([banned] * 50))
    assert 2 not in out.sampled_token_ids


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(4, 6)
    logits[:, 0] = 10.0  # EOS is by far the most likely
    logits[:, 1] = 9.0  # a stop token id
    params = [
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[1]),
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[1]),  # already long enough
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[1], ignore_eos=True),
        SamplingParams(temperature=0, min_tokens=0),
    ]
    outputs = [[4, 4], [4, 4, 4], [], []]
    meta = _meta(params, outputs=outputs, eos=[0])
    got = Sampler().apply_logits_processors(logits, meta)
    assert got[0, 0] == float("-inf") and got[0, 1] == float("-inf")
    assert got[1, 0] == 10.0 and got[1, 1] == 9.0
    assert got[2, 0] == 10.0 and got[2, 1] == float("-inf")  # ignore_eos: EOS cannot end it anyway
    assert Sampler()(logits, meta).sampled_token_ids == [2, 0, 0, 0]
    # Also under random sampling.
    out = Sampler()(logits[:1].repeat(50, 1), _meta([SamplingParams(min_tokens=1)] * 50, eos=[0]))
    assert 0 not in out.sampled_token_ids


def test_greedy_rows_see_penalties() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    params = SamplingParams(temperature=0, repetition_penalty=1.2)
    assert Sampler()(logits, _meta([params], outputs=[[0]])).sampled_token_ids == [1]


def test_same_seed_same_token_regardless_of_batch() -> None:
    torch.manual_seed(3)
    vocab = 64
    target = torch.randn(vocab)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    other = [SamplingParams(temperature=0.7), SamplingParams(temperature=0), SamplingParams(top_k=5, seed=9)]

    def run(position: int, batch_size: int, steps: int = 5) -> list[int]:
        gen = torch.Generator().manual_seed(1234)
        other_gen = torch.Generator().manual_seed(9)
        tokens = []
        for _ in range(steps):
            rows_params = [other[j % len(other)] for j in range(batch_size)]
            gens: list[torch.Generator | None] = [other_gen if p.seed else None for p in rows_params]
            rows_params[position], gens[position] = params, gen
            logits = torch.randn(batch_size, vocab)
            logits[position] = target
            tokens.append(Sampler()(logits, _meta(rows_params, generators=gens)).sampled_token_ids[position])
        return tokens

    reference = run(0, 1)
    assert run(2, 4) == reference
    assert run(5, 7) == reference
    assert len(set(reference)) > 1  # the draws are really random across steps
    # A different seed gives a different stream.
    different = [
        Sampler()(
            target.unsqueeze(0), _meta([params], generators=[torch.Generator().manual_seed(s)])
        ).sampled_token_ids[0]
        for s in range(20)
    ]
    assert len(set(different)) > 1


def test_logprobs_from_raw_logits() -> None:
    torch.manual_seed(4)
    logits = torch.randn(4, 40)
    params = [
        SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.5),
        SamplingParams(),
        SamplingParams(logprobs=0, temperature=0),
        SamplingParams(logprobs=20, top_k=3),
    ]
    out = Sampler()(logits, _meta(params, prompts=[[1, 2], [], [], []]))
    assert out.logprobs is not None and len(out.logprobs) == 4
    assert out.logprobs[1] is None
    ref = torch.log_softmax(logits, dim=-1)
    for i in (0, 2, 3):
        lp = out.logprobs[i]
        assert lp is not None
        tok = out.sampled_token_ids[i]
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(float(ref[i, tok]), abs=1e-5)
        assert lp.rank == int((ref[i] > ref[i, tok]).sum()) + 1
        n = params[i].logprobs
        assert len(lp.top_logprobs) == n
        top_vals, top_ids = ref[i].topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in lp.top_logprobs] == top_ids.tolist()
        assert [v for _, v in lp.top_logprobs] == pytest.approx(top_vals.tolist(), abs=1e-5)
    assert out.logprobs[2] is not None and out.logprobs[2].rank == 1  # greedy picks the argmax


def test_logprobs_on_all_greedy_fast_path() -> None:
    logits = torch.randn(2, 10)
    out = Sampler()(logits, _meta([SamplingParams(temperature=0, logprobs=2)] * 2))
    assert out.logprobs is not None
    for i in range(2):
        lp = out.logprobs[i]
        assert lp is not None and lp.rank == 1
        assert lp.logprob == pytest.approx(float(torch.log_softmax(logits[i], -1).max()), abs=1e-6)
