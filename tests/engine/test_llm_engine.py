"""Engine-level behaviour: validation with numbers, stop conditions, stop strings, seeds, n, streaming
deltas, metrics."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from lmserve import LLM, SamplingParams
from lmserve.config.engine import EngineArgs
from lmserve.default_model import default_model_path
from tests.hf_reference import hf_greedy, hf_model


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), num_kv_blocks=32, block_size=16, max_model_len=128)


def test_prompt_longer_than_max_model_len_names_numbers(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"prompt is 200 tokens, but max_model_len is 128"):
        llm.generate([[5] * 200], SamplingParams(max_tokens=4), use_tqdm=False)


def test_max_model_len_that_cannot_fit_the_pool(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"max_model_len=256 does not fit the KV pool: 4 blocks x 16 tokens = 64"):
        LLM(str(llama_dir), num_kv_blocks=4, block_size=16, max_model_len=256)
    # left on auto, max_model_len shrinks to what the pool holds, and prompts are checked against that
    small = LLM(str(llama_dir), num_kv_blocks=4, block_size=16)
    assert small.engine.config.scheduler.max_model_len == 64
    with pytest.raises(ValueError, match=r"prompt is 100 tokens, but max_model_len is 64"):
        small.generate([[5] * 100], SamplingParams(max_tokens=10), use_tqdm=False)


def test_unchunked_budget_checked_against_the_pool_sized_max_model_len() -> None:
    """Without chunked prefill the budget must hold the longest prompt: max_model_len after it shrank to the
    pool (43 blocks x 16 = 688 tokens here), not the model's 1024 positions."""
    args = dict(model=default_model_path("target"), num_kv_blocks=43, block_size=16, enable_chunked_prefill=False)
    sched = EngineArgs(**args, max_num_batched_tokens=688).create_engine_config().scheduler
    assert (sched.max_model_len, sched.max_num_batched_tokens) == (688, 688)
    refused = r"max_num_batched_tokens \(687\) must be >= max_model_len \(688, .*43 blocks x 16 tokens"
    with pytest.raises(ValueError, match=refused):
        EngineArgs(**args, max_num_batched_tokens=687).create_engine_config()
    # left on auto, the budget covers the pool-sized max_model_len
    assert EngineArgs(**args).create_engine_config().scheduler.max_num_batched_tokens >= 688


def test_kv_pool_sized_by_the_memory_ledger(llama_dir: Path) -> None:
    from lmserve.memory import ledger as memory
    llm = LLM(str(llama_dir), kv_cache_memory_gib=0.001, block_size=8)
    cache = llm.engine.config.cache
    # tiny llama: 2 layers x 2 KV heads x head_dim 16 x fp32 → 2*2*2*16*4 = 512 B per token
    assert cache.kv_bytes_per_token == memory.kv_bytes_per_token(2, 2, 16, 4) == 512
    assert cache.num_blocks == memory.max_num_kv_blocks(int(0.001 * 2**30), 8, 512) == 262
    k_cache = llm.engine.runner.kv_caches[0].k
    assert tuple(k_cache.shape) == (262, 8, 2, 16)
    m = llm.get_metrics()
    assert m["kv_cache_capacity_tokens"] == 262 * 8 and m["kv_cache_bytes_per_token"] == 512
    actual = sum(c.nbytes for c in llm.engine.runner.kv_caches)
    assert m["kv_cache_capacity_bytes"] == actual, "the ledger's figure is what the engine allocated"


def test_bad_prompt_in_batch_loses_nothing(llm: LLM) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        llm.generate(["good", [7] * 500, "also good"], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests(), "nothing half-queued"
    # requests already in the engine survive a rejected newcomer
    engine = llm.engine
    engine.add_request("keep", "hello there", params)
    with pytest.raises(ValueError):
        engine.add_request("bad", [], params)
    with pytest.raises(ValueError, match="use_beam_search: beam search runs through LLM.beam_search"):
        engine.add_request("beam", "x", SamplingParams(use_beam_search=True))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("keep", "again", params)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["keep"] and len(done[0].outputs[0].token_ids) == 5


def test_unknown_engine_argument_and_bad_values(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown engine arguments"):
        LLM(str(llama_dir), num_kv_block=3)
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(str(llama_dir), scheduling_policy="fifo")
    with pytest.raises(ValueError, match="max_model_len=4096 exceeds"):
        LLM(str(llama_dir), max_model_len=4096)
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(llama_dir), dtype="int4")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(str(llama_dir), enable_chunked_prefill=False, max_num_batched_tokens=64)


def test_unsupported_architecture_lists_supported(tmp_path: Path, llama_dir: Path) -> None:
    import json

    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM"):
        EngineArgs(model=str(tmp_path)).create_engine_config()


def test_sliding_window_model_runs_past_its_window(tmp_path: Path, tokenizer_dir: Path) -> None:
    from tests.helpers import build_model

    d = build_model(tmp_path / "m", "mistral", tokenizer_dir, sliding_window=8)
    llm = LLM(str(d), num_kv_blocks=16)
    assert llm.engine.config.scheduler.max_model_len > 8, "max_model_len is no longer capped at the window"
    assert llm.engine.config.model.layer_sliding_windows == (8, 8)
    out = llm.generate(["hello world"], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(d, out[0].prompt_token_ids, 16)


def test_eos_and_stop_token_ids_finish_with_stop(llm: LLM, llama_dir: Path) -> None:
    prompt = "def fib(n):"
    ids = llm.get_tokenizer().encode(prompt)
    ref = hf_greedy(llama_dir, ids, 12)
    stop_tok = ref[3]
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_tok]), use_tqdm=False
    )
    c = out[0].outputs[0]
    first = ref.index(stop_tok)
    assert c.token_ids == ref[: first + 1] and c.finish_reason == "stop" and c.stop_reason == stop_tok
    # the same token as EOS: finish_reason stop, no stop_reason; ignore_eos runs to max_tokens
    saved_eos, llm.engine.eos_token_ids = llm.engine.eos_token_ids, (stop_tok,)
    try:
        eos = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0].outputs[0]
        assert eos.token_ids == ref[: first + 1] and eos.finish_reason == "stop" and eos.stop_reason is None
        ign = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
        assert ign[0].outputs[0].token_ids == ref
        low = SamplingParams(max_tokens=12, temperature=0, min_tokens=first + 2)
        assert len(llm.generate([prompt], low, use_tqdm=False)[0].outputs[0].token_ids) >= first + 2
    finally:
        llm.engine.eos_token_ids = saved_eos


def test_stop_string_cuts_text_and_frees_blocks(llm: LLM) -> None:
    prompt = "import json"
    full = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False)
    text = full[0].outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]), use_tqdm=False
    )
    c = out[0].outputs[0]
    assert c.text == text[: text.index(stop)]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert len(c.token_ids) < 20
    assert llm.engine.kv.pool.num_free_blocks == 32


def test_min_tokens_holds_back_stop_strings_for_each_sequence(llm: LLM) -> None:
    """No stop string may end in the text of the first min_tokens tokens (vLLM); n sequences each."""
    m, free_params = 10, SamplingParams(n=3, max_tokens=24, min_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    free = llm.generate(["hello"], free_params, use_tqdm=False)[0].outputs
    tok = llm.get_tokenizer()
    boundaries = [tok.decode(c.token_ids[:m]) for c in free]
    assert all(" " in b and not b.endswith("\ufffd") for b in boundaries), "each sequence has an early stop string"
    assert any(" " in c.text[len(b) :] for c, b in zip(free, boundaries, strict=True)), "and some a later one"
    for include in (False, True):
        params = dataclasses.replace(free_params, stop=[" "], include_stop_str_in_output=include)
        outs = llm.generate(["hello"], params, use_tqdm=False)[0].outputs
        for c, ref, b in zip(outs, free, boundaries, strict=True):
            assert c.token_ids == ref.token_ids[: len(c.token_ids)] and len(c.token_ids) > m
            if " " in ref.text[len(b) :]:
                cut = ref.text.index(" ", len(b)) + include
                assert (c.text, c.finish_reason, c.stop_reason) == (ref.text[:cut], "stop", " ")
            else:
                assert (c.text, c.finish_reason, c.token_ids) == (ref.text, "length", ref.token_ids)
    assert llm.engine.kv.pool.num_free_blocks == 32


def test_static_and_continuous_batching_use_the_prefix_cache_alike(llama_dir: Path) -> None:
    """The soak's reproduction: budget 16, a warmed 64-token prefix, 3 prompts sharing it (same cache hits,
    counters and tokens under both policies)."""
    prefix = [(7 * i) % 200 + 3 for i in range(64)]
    prompts = [prefix + [11 + i] * 16 for i in range(3)]  # the first fills the budget: under static, 2 join
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    results = {}
    for policy in ("continuous", "static"):
        llm = LLM(str(llama_dir), num_kv_blocks=32, block_size=16, max_num_batched_tokens=16, scheduling_policy=policy)
        llm.generate([prefix + [5]], params, use_tqdm=False)  # warm the prefix
        outs = llm.generate(prompts, params, use_tqdm=False)
        m = llm.engine.get_metrics()
        results[policy] = (
            [o.num_cached_tokens for o in outs],
            [o.outputs[0].token_ids for o in outs],
            (m["prefix_cache_queries_total"], m["prefix_cache_hits_total"]),
        )
    assert results["static"] == results["continuous"]
    assert results["static"][0] == [64, 64, 64]
    assert results["static"][2] == (65 + 3 * 80, 3 * 64)


def test_reset_prefix_cache_forgets_prefixes_and_spares_running_requests(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=32, block_size=16)
    engine, pool = llm.engine, llm.engine.kv.pool
    prompt = [(7 * i) % 200 + 3 for i in range(40)]  # two full blocks and a partial one
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 32
    engine.reset_prefix_cache()
    pool.check_invariants()
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    # mid-generation (its prompt's blocks cached by `again`): the request keeps its blocks and its tokens
    engine.add_request("running", prompt, params)
    final = []
    for k in range(64):
        if k == 3:
            assert engine.has_unfinished_requests() and pool.num_free_blocks < pool.num_blocks
            engine.reset_prefix_cache()
            pool.check_invariants([engine.kv.req_to_blocks["running"]])
        final += [o for o in engine.step() if o.finished]
        if not engine.has_unfinished_requests():
            break
    assert [o.outputs[0].token_ids for o in final] == [first.outputs[0].token_ids]
    assert final[0].num_cached_tokens == 32  # (hit before the reset)
    pool.check_invariants()
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 0  # its prompt blocks forgotten


def test_streamed_deltas_concatenate_to_final_text(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("s", "The capital of France is", SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    deltas, tokens = [], []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            tokens += out.outputs[0].delta_token_ids
            final = out
    assert final is not None and final.finished
    assert "".join(deltas) == final.outputs[0].text
    assert tokens == final.outputs[0].token_ids
    assert final.metrics.first_token_time >= final.metrics.first_scheduled_time >= final.metrics.arrival_time
    assert final.metrics.finished_time >= final.metrics.first_token_time


def test_seeded_sampling_reproducible_across_batches(llm: LLM) -> None:
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate(["hello world"], p, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(
        ["something else", "hello world", "def f():"],
        [SamplingParams(max_tokens=12, temperature=0.7, ignore_eos=True), p, SamplingParams(max_tokens=3)],
        use_tqdm=False,
    )
    assert mixed[1].outputs[0].token_ids == alone
    other = llm.generate(
        ["hello world"],
        SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True),
        use_tqdm=False,
    )
    assert other[0].outputs[0].token_ids != alone


def test_n_sequences_share_prompt(llm: LLM) -> None:
    out = llm.generate(
        ["hello"], SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True), use_tqdm=False
    )
    assert [c.index for c in out[0].outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out[0].outputs)
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1, "different seeds per sequence"


def test_logprobs_are_log_softmax_of_model_logits(llm: LLM, llama_dir: Path) -> None:
    prompt = "def fib(n):"
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True), use_tqdm=False
    )
    c = out[0].outputs[0]
    ids = out[0].prompt_token_ids + c.token_ids
    with torch.inference_mode():
        logits = hf_model(llama_dir)(torch.tensor([ids])).logits[0].float()
    for i, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        ref = torch.log_softmax(logits[len(out[0].prompt_token_ids) - 1 + i], -1)
        assert lp.token_id == tok and lp.rank == 1
        assert abs(lp.logprob - float(ref[tok])) < 1e-4
        assert [t for t, _ in lp.top_logprobs] == ref.topk(3).indices.tolist()


def test_metrics_counters(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=32)
    llm.generate(["a b c", "d e"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    m = llm.get_metrics()
    assert m["num_requests_total"] == 2 and m["generation_tokens_total"] == 6
    assert m["finished_requests_by_reason"]["length"] == 2
    assert m["num_requests_running"] == 0 and m["kv_cache_usage"] == 0.0
    assert {"num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total"} <= set(m)


def test_prompt_logprobs_match_hf(llm: LLM, llama_dir: Path) -> None:
    prompt = "import json\nimport os\n"
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
    # run twice: the second time the prompt's blocks are cached, yet every position must still be scored
    for _ in range(2):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        ids = out.prompt_token_ids
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        with torch.inference_mode():
            ref = torch.log_softmax(hf_model(llama_dir)(torch.tensor([ids])).logits[0].float(), -1)
        for pos in range(1, len(ids)):
            lp = out.prompt_logprobs[pos]
            assert lp.token_id == ids[pos]
            assert abs(lp.logprob - float(ref[pos - 1, ids[pos]])) < 1e-4
            assert [t for t, _ in lp.top_logprobs] == ref[pos - 1].topk(2).indices.tolist()


def test_prompt_logprobs_with_chunked_prefill(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=32, max_num_batched_tokens=5)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    out = llm.generate(["import json\nimport os\nimport sys\n"], params, use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert [lp.token_id for lp in out.prompt_logprobs[1:]] == out.prompt_token_ids[1:]


def test_best_of_returns_the_most_likely_sequences(llm: LLM) -> None:
    params = SamplingParams(n=2, best_of=5, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    out = llm.generate(["hello"], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1]
    assert out.outputs[0].logprobs is None, "logprobs were not asked for"
    all5 = llm.generate(
        ["hello"],
        SamplingParams(n=5, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True, logprobs=0),
        use_tqdm=False,
    )[0]
    best = sorted(all5.outputs, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in best]


def test_config_shape_errors_name_the_field(tmp_path: Path, llama_dir: Path) -> None:
    import json

    cfg = json.loads((llama_dir / "config.json").read_text())
    for change, pattern in (
        ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
        ({"intermediate_size": None}, "intermediate_size"),
        ({"mlp_bias": True}, "mlp_bias"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=pattern):
            EngineArgs(model=str(tmp_path)).create_engine_config()


def test_lone_surrogate_prompt_is_a_value_error_naming_the_prompt() -> None:
    llm = LLM(num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt: the tokenizer cannot encode it"):
        llm.generate(["fine", "abc\ud800"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks  # nothing was queued
