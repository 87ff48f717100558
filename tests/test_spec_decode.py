"""Speculative decoding end to end on tiny models: greedy output identical to no speculation for both proposers
(also under chunked prefill, prefix hits, preemption and n > 1), the sampled distribution equal to the target's,
stop strings inside an accepted run, KV blocks all free after every run, and config errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmserve import LLM, SamplingParams
from lmserve.default_model import default_model_path
from lmserve.spec_decode.proposer import ngram_lookup
from tests.helpers import build_model
from tests.test_structured_output import CHOICES, DATE, PERSON

PROMPTS = [
    "def fib(n):\n    return",
    "The capital of France is Paris. The capital of",
    "import collections\nimport collections\nimport",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    """Drafts sharing the tiny families' tokenizer: a smaller random llama (mostly rejected proposals)."""
    root = tmp_path_factory.mktemp("drafts")
    small = build_model(
        root / "small", "llama", tokenizer_dir, seed=1, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64,
    )  # fmt: skip
    return {"small": small}


def generate(model: Path | str, prompts, params, **engine_args):
    llm = LLM(str(model), **engine_args)
    outs = llm.generate(prompts, params, use_tqdm=False)
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks, "KV blocks left in use after the run"
    pool.check_invariants([])
    return outs, llm


def token_ids(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def spec_configs(draft_dirs, target: Path) -> dict[str, dict]:
    return {
        "ngram": NGRAM,
        "draft-small": {"model": str(draft_dirs["small"]), "num_speculative_tokens": 3},
        "draft-self": {"method": "draft_model", "model": str(target), "num_speculative_tokens": 4},
    }


@pytest.mark.parametrize("family", ["llama-gqa", "llama3-rope-untied", "qwen2", "qwen3", "mistral"])
def test_greedy_identical_to_no_speculation(model_dirs, draft_dirs, family) -> None:
    target = model_dirs[family]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ref, _ = generate(target, PROMPTS, params, num_kv_blocks=64)
    for name, cfg in spec_configs(draft_dirs, target).items():
        if name == "draft-small" and family not in ("llama-gqa", "qwen3"):
            continue  # one random draft against two families is enough; the self-draft covers the rest
        outs, llm = generate(target, PROMPTS, params, num_kv_blocks=64, speculative_config=cfg)
        assert token_ids(outs) == token_ids(ref), f"{family} with {name}"
        m = llm.get_metrics()
        assert m["spec_decode_num_draft_tokens_total"] > 0, f"{name} never proposed"
        if name == "draft-self":
            assert m["spec_decode_acceptance_rate"] > 0.9, "a draft equal to the target is accepted"
            assert m["spec_decode_mean_accepted_length"] > 3


@pytest.mark.parametrize(
    "engine_args",
    [
        {"max_num_batched_tokens": 6, "num_kv_blocks": 64},  # chunked prefill; the budget also cuts proposals
        {"num_kv_blocks": 10, "block_size": 4},  # a small pool: preemption
        {"enable_prefix_caching": False, "num_kv_blocks": 64},
    ],
    ids=["chunked", "preemption", "no-prefix-cache"],
)
def test_greedy_identity_under_scheduling_pressure(llama_dir, draft_dirs, engine_args) -> None:
    prompts = [p + " x" * i for i, p in enumerate(PROMPTS * 2)]  # shared prefixes: prefix-cache hits
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, n=2)
    ref, base = generate(llama_dir, prompts, params, **engine_args)
    for cfg in spec_configs(draft_dirs, llama_dir).values():
        outs, llm = generate(llama_dir, prompts, params, speculative_config=cfg, **engine_args)
        assert token_ids(outs) == token_ids(ref), cfg
        if engine_args["num_kv_blocks"] == 10:
            assert llm.get_metrics()["num_preemptions_total"] > 0, "the small pool should preempt"
    if engine_args.get("enable_prefix_caching", True):
        assert base.get_metrics()["prefix_cache_hits_total"] > 0


def test_prefix_hits_and_second_run_identical(llama_dir) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    cfg = {"model": str(llama_dir), "num_speculative_tokens": 4}
    llm = LLM(str(llama_dir), num_kv_blocks=64, speculative_config=cfg)
    ref, _ = generate(llama_dir, PROMPTS, params, num_kv_blocks=64)
    first = llm.generate(PROMPTS, params, use_tqdm=False)
    second = llm.generate(PROMPTS, params, use_tqdm=False)  # prompts now hit the prefix cache
    assert llm.get_metrics()["prefix_cache_hits_total"] > 0
    assert token_ids(first) == token_ids(second) == token_ids(ref)
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks


def test_verification_runs_are_decode_rows(llama_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run of 1 + k tokens is verified as k + 1 decode queries (each over its own prefix), in the same step as
    plain decodes, with no prefill segment: the decode kernels (and, where the rows fit, the one-call stack) take
    it. Greedy output is that of no speculation."""
    from lmserve.model.decoder import DecoderModel

    seen = []
    orig = DecoderModel.forward

    def record(self, input_ids, positions, kv_caches, meta):
        seen.append((meta.num_decode_tokens, len(meta.prefills), positions.tolist()))
        return orig(self, input_ids, positions, kv_caches, meta)

    monkeypatch.setattr(DecoderModel, "forward", record)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompt = "a b c a b c a b c a b c"
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(str(llama_dir), num_kv_blocks=64, speculative_config=ngram)
    outs = llm.generate([prompt], params, use_tqdm=False)
    verifying = [(n, pos) for n, segs, pos in seen if n > 1 and segs == 0]
    assert verifying, seen
    assert all(pos == list(range(pos[0], pos[0] + n)) for n, pos in verifying), "one request's consecutive positions"
    assert llm.get_metrics()["spec_decode_num_draft_tokens_total"] > 0
    monkeypatch.setattr(DecoderModel, "forward", orig)
    ref, _ = generate(llama_dir, [prompt], params, num_kv_blocks=64)
    assert token_ids(outs) == token_ids(ref)


def test_bundled_pair_greedy_identical() -> None:
    prompts = ["ROMEO: But soft, what light through yonder window breaks?", "床前明月光，疑是地上霜。"]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    ref, _ = generate(default_model_path(), prompts, params, num_kv_blocks=32)
    for cfg in ({"method": "draft_model"}, {"method": "ngram"}):
        outs, llm = generate(default_model_path(), prompts, params, num_kv_blocks=32, speculative_config=cfg)
        assert token_ids(outs) == token_ids(ref), cfg
        assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in ref]
    assert llm.get_metrics()["spec_decode_num_draft_tokens_total"] > 0


def test_logprobs_and_usage_match_without_speculation(llama_dir) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    ref, base = generate(llama_dir, PROMPTS, params, num_kv_blocks=64)
    cfg = {"model": str(llama_dir), "num_speculative_tokens": 4}
    outs, llm = generate(llama_dir, PROMPTS, params, num_kv_blocks=64, speculative_config=cfg)
    for a, b in zip(ref, outs, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids
        assert [lp.token_id for lp in ca.logprobs] == [lp.token_id for lp in cb.logprobs]
        assert [lp.rank for lp in ca.logprobs] == [lp.rank for lp in cb.logprobs]
        assert [[t for t, _ in lp.top_logprobs] for lp in ca.logprobs] == [
            [t for t, _ in lp.top_logprobs] for lp in cb.logprobs
        ]
        assert torch.allclose(torch.tensor([lp.logprob for lp in ca.logprobs]),
                              torch.tensor([lp.logprob for lp in cb.logprobs]), atol=1e-4)  # fmt: skip
        assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-3)
    assert llm.get_metrics()["generation_tokens_total"] == base.get_metrics()["generation_tokens_total"]
    steps, base_steps = llm.get_metrics()["num_steps_total"], base.get_metrics()["num_steps_total"]
    assert steps < base_steps, "accepted runs need fewer steps"


def test_stop_string_inside_accepted_run(llama_dir) -> None:
    """A self-draft accepts every proposal, so a stop string mid-output lands inside an accepted run: output,
    finish reason, usage and the streamed deltas are exactly those without speculation."""
    plain = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    (ref,), _ = generate(llama_dir, PROMPTS[:1], plain, num_kv_blocks=64)
    text = ref.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "pick a visible stop string"
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
    cfg = {"model": str(llama_dir), "num_speculative_tokens": 6}
    results = {}
    for name, extra in (("plain", {}), ("spec", {"speculative_config": cfg})):
        llm = LLM(str(llama_dir), num_kv_blocks=64, **extra)
        llm.engine.add_request("r", PROMPTS[0], params)
        deltas, delta_ids, final = [], [], None
        while llm.engine.has_unfinished_requests():
            for out in llm.engine.step():
                deltas.append(out.outputs[0].delta_text)
                delta_ids += out.outputs[0].delta_token_ids
                final = out
        c = final.outputs[0]
        assert "".join(deltas) == c.text and delta_ids == c.token_ids, "stream equals the final output"
        results[name] = (c.text, c.token_ids, c.finish_reason, c.stop_reason,
                         llm.get_metrics()["generation_tokens_total"])  # fmt: skip
        assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks
    assert results["spec"] == results["plain"]
    assert results["plain"][3] == stop and stop not in results["plain"][0]
    assert len(results["plain"][1]) < 30, "the stop string ended the request early"


def test_max_tokens_and_eos_inside_accepted_run(llama_dir) -> None:
    cfg = {"model": str(llama_dir), "num_speculative_tokens": 5}
    for max_tokens in (1, 2, 3, 7, 11):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, min_tokens=min(max_tokens, 2))
        ref, _ = generate(llama_dir, PROMPTS, params, num_kv_blocks=64)
        outs, _ = generate(llama_dir, PROMPTS, params, num_kv_blocks=64, speculative_config=cfg)
        assert token_ids(outs) == token_ids(ref)
        assert [o.outputs[0].finish_reason for o in outs] == [o.outputs[0].finish_reason for o in ref]


def test_seeded_sampling_reproducible(llama_dir, draft_dirs) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=123, n=2)
    cfg = {"model": str(draft_dirs["small"]), "num_speculative_tokens": 3}
    a, _ = generate(llama_dir, PROMPTS, params, num_kv_blocks=64, speculative_config=cfg)
    b, _ = generate(llama_dir, PROMPTS, params, num_kv_blocks=64, speculative_config=cfg)
    assert token_ids(a) == token_ids(b)


# ---- the sampled distribution equals the target's ------------------------------------------------------------


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def _noise_floor(p: torch.Tensor, num_samples: int, reps: int = 50) -> float:
    """The largest TV between p and the histogram of num_samples exact draws from p, over reps tries."""
    g = torch.Generator().manual_seed(0)
    return max(
        _tv(torch.bincount(torch.multinomial(p, num_samples, True, generator=g), minlength=len(p)) / num_samples, p)
        for _ in range(reps)
    )


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampled_second_token_follows_target_distribution(llama_dir, draft_dirs, tokenizer_dir, top_p) -> None:
    """Token 2 comes out of verification (token 1 from the prefill, then k proposals from a different random
    draft). Its marginal must be sum_t1 p(t1) p(t2 | t1) of the processed target distribution."""
    from transformers import AutoModelForCausalLM

    from lmserve.worker.sampler import Sampler, SamplingMetadata

    prompt = "def fib(n):"
    params = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=3, ignore_eos=True)
    n_samples = 3000
    cfg = {"model": str(draft_dirs["small"]), "num_speculative_tokens": 2, "disable_by_batch_size": 10**6}
    llm = LLM(str(llama_dir), num_kv_blocks=2048, max_num_seqs=n_samples, speculative_config=cfg)
    sp = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=3, ignore_eos=True, n=n_samples)
    (out,) = llm.generate([prompt], sp, use_tqdm=False)
    m = llm.get_metrics()
    assert m["spec_decode_num_draft_tokens_total"] >= n_samples, "every sequence verified a proposal"
    assert 0 < m["spec_decode_num_accepted_tokens_total"] < m["spec_decode_num_draft_tokens_total"]
    second = torch.tensor([c.token_ids[1] for c in out.outputs])

    hf = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    ids = llm.get_tokenizer().encode(prompt)
    sampler = Sampler()

    def probs(logits: torch.Tensor, outputs: list[list[int]]) -> torch.Tensor:
        meta = SamplingMetadata([params] * len(outputs), [None] * len(outputs), [ids] * len(outputs), outputs, [0])
        return sampler.compute_probs(logits, meta)

    with torch.no_grad():
        p1 = probs(hf(torch.tensor([ids])).logits[:, -1].float(), [[]])[0]
        firsts = torch.nonzero(p1).squeeze(1)
        batch = torch.cat([torch.tensor([ids] * len(firsts)), firsts[:, None]], dim=1)
        p2 = probs(hf(batch).logits[:, -1].float(), [[int(t)] for t in firsts])
    expected = (p1[firsts, None] * p2).sum(0)
    observed = torch.bincount(second, minlength=len(expected)).float() / n_samples
    tv, floor = _tv(observed, expected), _noise_floor(expected, n_samples)
    assert tv <= floor * 1.1, f"TV {tv:.4f} vs noise floor {floor:.4f}"


def test_rejection_sampler_matches_target_against_noise_floor() -> None:
    """Unit check with an explicit p and a very different draft q on a small vocabulary: the first emitted token
    (accepted proposal or residual draw) is distributed as p, under temperature and top-p/top-k/min-p."""
    from lmserve.core.outputs import ScheduledRequest
    from lmserve.request import Request
    from lmserve.spec_decode.rejection_sampler import verify
    from lmserve.worker.sampler import Sampler, SamplingMetadata

    vocab, n = 12, 8000
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, vocab, generator=g) * 2
    q = torch.softmax(torch.randn(vocab, generator=g) * 3, dim=0)
    sampler = Sampler()
    for params in (
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.7),
        SamplingParams(temperature=1.3, top_k=5, min_p=0.05, presence_penalty=0.5),
    ):
        p = sampler.compute_probs(logits[:1], SamplingMetadata([params], [None], [[1, 2]], [[]], []))[0]
        batch = []
        for d in torch.multinomial(q, n, True, generator=g).tolist():  # n requests, one proposal each, one call
            req = Request("r", [1, 2], params, max_tokens=10)
            req.spec_token_ids, req.spec_draft_probs = [d], q[None]
            batch.append(ScheduledRequest(req, 2, [0], num_spec_tokens=1))
        firsts = [v.token_ids[0] for v in verify(sampler, logits.repeat(n, 1), batch)]
        observed = torch.bincount(torch.tensor(firsts), minlength=vocab).float() / n
        tv, floor = _tv(observed, p), _noise_floor(p, n)
        assert tv <= floor * 1.1, f"{params}: TV {tv:.4f} vs noise floor {floor:.4f}"


def test_ngram_lookup() -> None:
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3], 1, 3, 2) == [9, 1], "longest suffix match, what followed it"
    assert ngram_lookup([5, 1, 2, 7, 1, 2], 2, 2, 3) == [7, 1, 2]
    assert ngram_lookup([1, 2, 3, 4], 1, 3, 2) == [], "no earlier occurrence"
    assert ngram_lookup([4, 8, 4, 9, 4], 1, 1, 1) == [9], "the latest earlier occurrence wins"


# ---- configuration ------------------------------------------------------------------------------------------


def test_config_errors_name_the_key(llama_dir, tmp_path, tokenizer_dir) -> None:
    bad = [
        ({"method": "ngram", "bogus": 1}, "unknown keys"),
        ({"method": "medusa"}, "speculative_config.method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "draft_model"}, "speculative_config.model"),  # no default draft for this target
        ({"method": "draft_model", "model": str(tmp_path)}, "speculative_config.model"),
        ("{not json", "not valid JSON"),
    ]
    for cfg, message in bad:
        with pytest.raises(ValueError, match=message):
            LLM(str(llama_dir), num_kv_blocks=16, speculative_config=cfg)
    other_vocab = build_model(tmp_path / "v", "llama", tokenizer_dir, vocab_size=600)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(llama_dir), num_kv_blocks=16, speculative_config={"model": str(other_vocab)})
    with pytest.raises(ValueError, match="draft's KV"):
        LLM(str(llama_dir), kv_cache_memory_gib=1e-6, speculative_config={"model": str(llama_dir)})
    ok = LLM(str(llama_dir), num_kv_blocks=16, speculative_config=json.dumps(NGRAM))
    assert ok.engine.config.speculative.prompt_lookup_max == 3


def test_draft_kv_is_counted_by_the_ledger(llama_dir) -> None:
    budget = 2**20
    plain = LLM(str(llama_dir), kv_cache_memory_gib=budget / 2**30).engine.config.cache
    spec = LLM(
        str(llama_dir), kv_cache_memory_gib=budget / 2**30, speculative_config={"model": str(llama_dir)}
    ).engine.config.cache
    assert spec.draft_kv_bytes_per_token == plain.kv_bytes_per_token
    assert spec.num_blocks == plain.num_blocks // 2, "the same budget holds half the blocks with an equal draft"
    assert spec.pool_bytes <= budget


def test_no_proposals_in_steps_larger_than_the_threshold(llama_dir) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cfg = {"model": str(llama_dir), "num_speculative_tokens": 3, "disable_by_batch_size": 2}
    ref, _ = generate(llama_dir, PROMPTS, params, num_kv_blocks=64)
    outs, llm = generate(llama_dir, PROMPTS, params, num_kv_blocks=64, speculative_config=cfg)
    assert token_ids(outs) == token_ids(ref)
    assert llm.get_metrics()["spec_decode_num_draft_tokens_total"] == 0, "3 requests per step > threshold 2"
    outs, llm = generate(llama_dir, PROMPTS[:2], params, num_kv_blocks=64, speculative_config=cfg)
    assert llm.get_metrics()["spec_decode_num_draft_tokens_total"] > 0, "2 requests per step: speculation on"


def test_cli_flag_reaches_the_engine_config(llama_dir) -> None:
    import argparse

    from lmserve.config import EngineArgs
    from lmserve.entrypoints.engine_args_cli import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--num-kv-blocks", "8", "--speculative-config", json.dumps(NGRAM)])
    config = EngineArgs.from_kwargs(str(llama_dir), **engine_kwargs(args)).create_engine_config()
    assert config.speculative.method == "ngram" and config.speculative.num_speculative_tokens == 3


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int8"])
def test_bundled_pair_with_a_quantized_kv_cache(kv_cache_dtype: str) -> None:
    """Speculation over a 16- or 8-bit target cache: blocks (values and scales) all free after the run, proposals
    accepted, and greedy output equal to the same cache without speculation up to a near-tie: verification reads
    its own rows in full precision where a plain decode step reads them back quantized, so the first difference,
    if any, must come late (the draft's cache stays in the draft's dtype)."""
    prompts = ["ROMEO: But soft, what light through yonder window breaks?", "床前明月光，疑是地上霜。"]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    engine = dict(num_kv_blocks=32, kv_cache_dtype=kv_cache_dtype)
    ref, _ = generate(default_model_path(), prompts, params, **engine)
    outs, llm = generate(default_model_path(), prompts, params, speculative_config={"method": "draft_model"}, **engine)
    m = llm.get_metrics()
    assert m["kv_cache_dtype"] == kv_cache_dtype
    assert m["spec_decode_num_accepted_tokens_total"] > 0
    for got, want in zip(token_ids(outs), token_ids(ref), strict=True):
        same = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(want))
        assert same >= min(12, len(want), len(got)), (kv_cache_dtype, got, want)


# ---- structured outputs under speculation ---------------------------------------------------------------------

CONSTRAINTS = [{"json": PERSON}, {"regex": DATE}, {"choice": CHOICES}]
SPEC_METHODS = [{"method": "draft_model"}, {"method": "ngram", "prompt_lookup_min": 1}]


def _constrained(so: dict, **kw) -> SamplingParams:
    from lmserve import StructuredOutputsParams

    return SamplingParams(structured_outputs=StructuredOutputsParams(**so), **kw)


def _check_valid(so: dict, text: str) -> None:
    import re

    import jsonschema

    if "json" in so:
        jsonschema.validate(json.loads(text), so["json"])
    elif "regex" in so:
        assert re.fullmatch(so["regex"], text), text
    else:
        assert text in so["choice"], text


@pytest.mark.parametrize("cfg", SPEC_METHODS, ids=["draft", "ngram"])
def test_constrained_greedy_identical_under_speculation_and_proposals_verified(cfg) -> None:
    """JSON schema, regex and choice requests under speculation: proposals are verified for them (draft tokens
    counted), and greedy outputs, finish reasons and the unconstrained rows of a mixed batch are token for token
    those without speculation."""
    prompts = ["ROMEO:", "JULIET: Give me my Romeo; and, when he shall die,", "ROMEO:"]
    constrained = [
        (p, _constrained(so, temperature=0.0, max_tokens=64), so) for p, so in zip(prompts, CONSTRAINTS, strict=True)
    ]
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    mixed = constrained[:2] + [(p, plain, None) for p in prompts[:2]]
    ref = LLM(num_kv_blocks=64)
    llm = LLM(num_kv_blocks=64, speculative_config=cfg)
    for batch in (constrained, mixed):
        want = ref.generate([p for p, _, _ in batch], [sp for _, sp, _ in batch], use_tqdm=False)
        got = llm.generate([p for p, _, _ in batch], [sp for _, sp, _ in batch], use_tqdm=False)
        assert token_ids(got) == token_ids(want)
        assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]
        if batch is constrained:
            assert llm.get_metrics()["spec_decode_num_draft_tokens_total"] > 0, "constrained requests got proposals"
        for (_, _, so), o in zip(batch, got, strict=True):
            if so is not None:
                assert o.outputs[0].finish_reason == "stop"
                _check_valid(so, o.outputs[0].text)
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_invariants([])


@pytest.mark.slow
@pytest.mark.parametrize("cfg", SPEC_METHODS, ids=["draft", "ngram"])
def test_constrained_sampling_under_speculation_always_valid(cfg) -> None:
    """Temperature 1, 20 sequences per constraint: 20/20 parse and validate, with proposals accepted."""
    llm = LLM(num_kv_blocks=256, speculative_config=dict(cfg, disable_by_batch_size=64))
    n = 20
    params = [_constrained(so, temperature=1.0, seed=5, n=n, max_tokens=96) for so in CONSTRAINTS]
    outs = llm.generate(["ROMEO:"] * len(params), params, use_tqdm=False)
    for so, o in zip(CONSTRAINTS, outs, strict=True):
        assert len(o.outputs) == n
        for c in o.outputs:
            assert c.finish_reason == "stop", (so, c.text)
            _check_valid(so, c.text)
    m = llm.get_metrics()
    assert m["spec_decode_num_accepted_tokens_total"] > 0
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks


def test_constrained_speculation_under_preemption_keeps_the_matcher_in_step() -> None:
    """A pool too small for the batch: sequences are preempted and recomputed mid-output while proposals are
    verified; the matcher only ever holds the kept output tokens, so greedy outputs equal the unconstrained
    pool's and seeded samples stay valid."""
    prompts = ["ROMEO: " + "But soft, what light through yonder window breaks? " * 2 + str(i) for i in range(4)]
    greedy = _constrained({"json": PERSON}, temperature=0.0, max_tokens=80)
    engine = dict(num_kv_blocks=10, max_num_batched_tokens=32)
    ref, _ = generate(default_model_path(), prompts, greedy, num_kv_blocks=64)
    outs, llm = generate(default_model_path(), prompts, greedy, speculative_config={"method": "draft_model"}, **engine)
    m = llm.get_metrics()
    assert m["num_preemptions_total"] > 0 and m["spec_decode_num_draft_tokens_total"] > 0
    assert token_ids(outs) == token_ids(ref)
    sampled = _constrained({"json": PERSON}, temperature=1.0, seed=3, n=3, max_tokens=80)
    outs, llm = generate(default_model_path(), prompts[:2], sampled, speculative_config={"method": "draft_model"},
                         **engine)  # fmt: skip
    assert llm.get_metrics()["num_preemptions_total"] > 0
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text
            _check_valid({"json": PERSON}, c.text)


def test_constrained_stop_string_and_max_tokens_inside_an_accepted_run() -> None:
    """A self-draft accepts nearly everything, so runs are long: a stop string, max_tokens and the grammar's end
    all fall inside accepted runs, and output, finish reason and stop reason equal those without speculation."""
    target = str(default_model_path("target"))
    cases = [
        _constrained({"regex": DATE}, temperature=0.0, max_tokens=40, stop=["-"]),
        _constrained({"json": PERSON}, temperature=0.0, max_tokens=7),
        _constrained({"json": PERSON}, temperature=0.0, max_tokens=60, stop=['"age"']),
        _constrained({"choice": CHOICES}, temperature=0.0, max_tokens=40),
    ]
    self_draft = {"method": "draft_model", "model": target, "num_speculative_tokens": 6}
    ref, _ = generate(target, ["ROMEO:"] * len(cases), cases, num_kv_blocks=64)
    outs, llm = generate(target, ["ROMEO:"] * len(cases), cases, num_kv_blocks=64, speculative_config=self_draft)
    assert llm.get_metrics()["spec_decode_acceptance_rate"] > 0.9
    for a, b in zip(ref, outs, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert (cb.token_ids, cb.text, cb.finish_reason, cb.stop_reason) == (
            ca.token_ids, ca.text, ca.finish_reason, ca.stop_reason)  # fmt: skip
    assert [o.outputs[0].finish_reason for o in outs] == ["stop", "length", "stop", "stop"]
    assert llm.get_metrics()["generation_tokens_total"] == sum(len(o.outputs[0].token_ids) for o in ref)


@pytest.mark.slow
def test_constrained_second_token_follows_the_masked_target_distribution(llama_dir, draft_dirs) -> None:
    """Token 2 of a constrained request comes out of verification against a random draft that drafts from the
    grammar-masked distribution. Its marginal must be sum_t1 p(t1) p(t2 | t1), each p the target renormalised
    over what the grammar allows in that state (t1's mask from the start, t2's after t1)."""
    from transformers import AutoModelForCausalLM

    from lmserve import StructuredOutputsParams
    from lmserve.structured_output import TokenBitmask, fill_bitmasks
    from lmserve.worker.sampler import Sampler, SamplingMetadata

    prompt, so = "def fib(n):", StructuredOutputsParams(regex="[a-h]+")
    n_samples = 3000
    cfg = {"model": str(draft_dirs["small"]), "num_speculative_tokens": 2, "disable_by_batch_size": 10**6}
    llm = LLM(str(llama_dir), num_kv_blocks=2048, max_num_seqs=n_samples, speculative_config=cfg)
    params = SamplingParams(temperature=1.0, max_tokens=3, n=n_samples, structured_outputs=so)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    m = llm.get_metrics()
    assert m["spec_decode_num_draft_tokens_total"] >= n_samples, "every sequence verified a proposal"
    assert 0 < m["spec_decode_num_accepted_tokens_total"] < m["spec_decode_num_draft_tokens_total"]
    second = torch.tensor([c.token_ids[1] for c in out.outputs])

    engine = llm.engine
    vocab = engine.config.model.vocab_size
    grammar = engine.structured.new_request(so)
    one = SamplingParams(temperature=1.0)
    ids = llm.get_tokenizer().encode(prompt)

    def probs(logits: torch.Tensor, outputs: list[list[int]], mask: TokenBitmask) -> torch.Tensor:
        rows = len(outputs)
        meta = SamplingMetadata([one] * rows, [None] * rows, [ids] * rows, outputs, list(engine.eos_token_ids), mask)
        return Sampler().compute_probs(logits, meta)

    hf = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    with torch.no_grad():
        p1 = probs(hf(torch.tensor([ids])).logits[:, -1].float(), [[]], fill_bitmasks([0], [grammar], vocab))[0]
        firsts = torch.nonzero(p1).squeeze(1).tolist()
        masks = []
        for t in firsts:
            grammar.advance_tentatively([t])
            masks.append(fill_bitmasks([0], [grammar], vocab).bits)
            grammar.rollback_tentative()
        mask2 = TokenBitmask(list(range(len(firsts))), torch.cat(masks))
        batch = torch.cat([torch.tensor([ids] * len(firsts)), torch.tensor(firsts)[:, None]], dim=1)
        p2 = probs(hf(batch).logits[:, -1].float(), [[t] for t in firsts], mask2)
    assert 3 <= len(firsts) < 100, "the grammar allows a small known set"
    expected = (p1[firsts, None] * p2).sum(0)
    assert set(second.tolist()) <= set(torch.nonzero(expected).squeeze(1).tolist()), "only allowed tokens"
    observed = torch.bincount(second, minlength=len(expected)).float() / n_samples
    tv, floor = _tv(observed, expected), _noise_floor(expected, n_samples)
    assert tv <= floor * 1.1, f"TV {tv:.4f} vs noise floor {floor:.4f}"


# ---- per-request adaptive speculation ------------------------------------------------------------------------


def test_acceptance_tracker_sets_k_from_recent_acceptance_and_backs_off() -> None:
    from lmserve.spec_decode.acceptance import BACKOFF_STEPS, MAX_BACKOFF_STEPS, AcceptanceTracker

    t = AcceptanceTracker()
    assert t.num_proposals(4, 0.3) == 4, "no history: the full k"
    t.record(4, 4)
    assert t.rate == 1.0 and t.num_proposals(4, 0.3) == 4
    t = AcceptanceTracker()
    t.record(4, 1)  # one accepted, the second rejected: rate 1/2
    assert t.rate == 0.5 and t.num_proposals(4, 0.3) == 1 and t.num_proposals(4, 0.2) == 2
    assert t.num_proposals(4, 0.0) == 4, "threshold 0: adaptation off"
    t.record(4, 0)
    t.record(4, 0)  # mostly rejected now
    assert t.rate < 0.3
    waits = []
    for _ in range(3):  # skip, probe with one token, the probe rejected, skip twice as long
        skipped = 0
        while (n := t.num_proposals(4, 0.3)) == 0:
            skipped += 1
        assert n == 1
        waits.append(skipped)
        t.record(1, 0)
    assert waits == [BACKOFF_STEPS, 2 * BACKOFF_STEPS, 4 * BACKOFF_STEPS]
    for _ in range(10):
        t.record(1, 0)
        while t.num_proposals(4, 0.3) == 0:
            pass
    assert t.backoff == MAX_BACKOFF_STEPS
    for _ in range(3):
        t.record(1, 1)  # good probes again: speculation comes back, k grows with the rate
    assert t.num_proposals(4, 0.3) >= 1 and t.backoff == 0


def test_adaptive_speculation_proposes_less_where_the_draft_is_rejected(tmp_path: Path) -> None:
    """A draft that is mostly rejected (the bundled draft's shape and tokenizer, random weights): adaptation
    proposes far fewer tokens than fixed k; the greedy output is the same with either and without speculation.
    (The shipped draft is distilled from the target and agrees with it ~89 % of the time, Chinese included.)"""
    import shutil

    from transformers import AutoConfig, LlamaForCausalLM

    draft = default_model_path("draft")
    torch.manual_seed(0)
    LlamaForCausalLM(AutoConfig.from_pretrained(draft)).save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(draft) / f, tmp_path / f)
    prompts = ["床前明月光，疑是地上霜。"]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    spec = {"method": "draft_model", "model": str(tmp_path)}
    ref, _ = generate(default_model_path(), prompts, params, num_kv_blocks=32)
    fixed, llm_fixed = generate(default_model_path(), prompts, params, num_kv_blocks=32,
                                speculative_config={**spec, "adaptive_threshold": 0})  # fmt: skip
    adaptive, llm = generate(default_model_path(), prompts, params, num_kv_blocks=32, speculative_config=spec)
    assert token_ids(fixed) == token_ids(adaptive) == token_ids(ref)
    f, a = llm_fixed.get_metrics(), llm.get_metrics()
    assert f["spec_decode_acceptance_rate"] < 0.5, "the premise: a poorly predicting draft"
    assert 0 < a["spec_decode_num_draft_tokens_total"] < f["spec_decode_num_draft_tokens_total"] / 2
    assert a["spec_decode_acceptance_rate"] >= f["spec_decode_acceptance_rate"]
    assert llm.engine.config.speculative.adaptive_threshold == 0.3
    with pytest.raises(ValueError, match="adaptive_threshold"):
        LLM(num_kv_blocks=16, speculative_config={"method": "ngram", "adaptive_threshold": 1.5})
