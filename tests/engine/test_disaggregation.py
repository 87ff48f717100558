"""Prefill/decode disaggregation at the engine level: a kv_producer LLMEngine and a kv_consumer LLMEngine in one
process, KV pulled over ZeroMQ (tcp loopback), outputs token for token those of one colocated engine; leases,
transfer failures (both policies) and aborts end with KV usage 0 on both sides."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lmserve.config.engine import EngineArgs
from lmserve.config.kv_transfer import KVTransferConfig
from lmserve.core.outputs import RequestOutput
from lmserve.engine.kv_transfer import KVHandoff, block_nbytes, export_blocks, import_blocks
from lmserve.engine.llm_engine import LLMEngine
from lmserve.sampling_params import SamplingParams

BLOCK = 16


def _args(model: Path, **kw) -> EngineArgs:
    kw.setdefault("num_kv_blocks", 64)
    return EngineArgs.from_kwargs(str(model), max_model_len=256, block_size=BLOCK, **kw)


def _engines(model: Path, consumer_kv: dict | None = None, **kw) -> tuple[LLMEngine, LLMEngine, LLMEngine]:
    colocated = LLMEngine(_args(model, **kw).create_engine_config())
    producer = LLMEngine(_args(model, kv_transfer_config={"kv_role": "kv_producer"}, **kw).create_engine_config())
    consumer_cfg = {"kv_role": "kv_consumer", **(consumer_kv or {})}
    consumer = LLMEngine(_args(model, kv_transfer_config=consumer_cfg, **kw).create_engine_config())
    return colocated, producer, consumer


Requests = list[tuple[str, list[int], SamplingParams]]


def _run_colocated(engine: LLMEngine, requests: Requests) -> dict[str, RequestOutput]:
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def _run_pd(
    producer: LLMEngine, consumer: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]
) -> tuple[dict[str, RequestOutput], dict[str, RequestOutput], list[KVHandoff]]:
    """Each request: prefill on the producer, then (its handoff) decode on the consumer. Returns the first
    output of each request (the producer's), the final ones, and the handoffs."""
    by_id = {rid: (prompt, params) for rid, prompt, params in requests}
    for rid, prompt, params in requests:
        producer.add_request(rid, prompt, params, do_remote_decode=True)
    first: dict[str, RequestOutput] = {}
    final: dict[str, RequestOutput] = {}
    handoffs = []
    while producer.has_unfinished_requests() or consumer.has_unfinished_requests():
        for out in producer.step():
            first.setdefault(out.request_id, out)
            if out.finished:
                final[out.request_id] = out
        for h in producer.kv_producer.take_handoffs():
            handoffs.append(h)
            prompt, params = by_id[h.request_id]
            consumer.add_request(h.request_id, prompt, params, remote_kv=h)
        for out in consumer.step():
            if out.finished:
                final[out.request_id] = out
    _drain_leases(producer)
    return first, final, handoffs


def _drain_leases(producer: LLMEngine, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not producer.kv_producer.leases.idle:
        producer.kv_producer.collect()
        assert time.monotonic() < deadline, "leases still held"
        time.sleep(0.01)


def _usage(engine: LLMEngine) -> float:
    engine.kv.pool.check_invariants(engine.kv.live_tables())
    return engine.kv.usage


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def _assert_same(ref: dict[str, RequestOutput], got: dict[str, RequestOutput]) -> None:
    assert set(ref) == set(got)
    for rid, r in ref.items():
        g = got[rid]
        assert len(g.outputs) == len(r.outputs)
        for a, b in zip(r.outputs, g.outputs, strict=True):
            assert b.token_ids == a.token_ids, rid
            assert b.text == a.text, rid
            assert b.finish_reason == a.finish_reason, rid
        assert g.num_cached_tokens == r.num_cached_tokens


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="kv_role: 'kv_both'"):
        KVTransferConfig.from_value({"kv_role": "kv_both"})
    with pytest.raises(ValueError, match="kv_transfer_config.kv_role is required"):
        KVTransferConfig.from_value("{}")
    with pytest.raises(ValueError, match="kv_load_failure_policy"):
        KVTransferConfig.from_value({"kv_role": "kv_consumer", "kv_load_failure_policy": "retry"})
    with pytest.raises(ValueError, match="kv_lease_s"):
        KVTransferConfig.from_value({"kv_role": "kv_producer", "kv_lease_s": 0})
    with pytest.raises(ValueError, match="unknown keys"):
        KVTransferConfig.from_value({"kv_role": "kv_producer", "kv_lease": 3})
    assert KVTransferConfig.from_value('{"kv_role": "kv_producer"}').kv_lease_s == 30.0


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_block_export_import_roundtrip_in_the_cache_dtype(llama_dir: Path, kv_dtype: str) -> None:
    import torch

    a = LLMEngine(_args(llama_dir, kv_cache_dtype=kv_dtype).create_engine_config())
    b = LLMEngine(_args(llama_dir, kv_cache_dtype=kv_dtype).create_engine_config())
    for c in a.runner.kv_caches:
        for t in (c.k, c.v, c.k_scale, c.v_scale):
            if t is not None:
                t.copy_(torch.randn(t.shape).to(t.dtype) if t.dtype != torch.int8 else torch.randint_like(t, -127, 127))
    frames = export_blocks(a.runner.kv_caches, [3, 7])
    assert sum(f.nbytes for f in frames) == 2 * block_nbytes(a.runner.kv_caches)
    import_blocks(b.runner.kv_caches, [10, 2], frames)
    for ca, cb in zip(a.runner.kv_caches, b.runner.kv_caches, strict=True):
        for ta, tb in ((ca.k, cb.k), (ca.v, cb.v), (ca.k_scale, cb.k_scale), (ca.v_scale, cb.v_scale)):
            if ta is None:
                assert kv_dtype == "auto" and tb is None
                continue
            assert torch.equal(tb[10], ta[3]) and torch.equal(tb[2], ta[7])


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_greedy_1p1d_equals_colocated(llama_dir: Path, kv_dtype: str) -> None:
    colocated, producer, consumer = _engines(llama_dir, kv_cache_dtype=kv_dtype)
    # prompts of full blocks, a partial last block, and under one block
    requests = [
        (f"r{i}", [(5 * i + j) % 400 + 3 for j in range(n)], greedy(8))
        for i, n in enumerate([2 * BLOCK, 2 * BLOCK + 5, 7, 40])
    ]
    requests.append(("n2", [9, 8, 7, 6, 5, 4, 3, 2, 1] * 3, greedy(6, n=2)))
    ref = _run_colocated(colocated, requests)
    first, got, handoffs = _run_pd(producer, consumer, requests)
    _assert_same(ref, got)
    for rid, out in first.items():  # the producer's output is the first token, not final
        assert not out.finished and [len(o.token_ids) for o in out.outputs] == [1] * len(out.outputs), rid
        assert out.outputs[0].token_ids[0] == ref[rid].outputs[0].token_ids[0]
    assert len(handoffs) == len(requests)
    m = consumer.get_metrics()
    assert m["kv_role"] == "kv_consumer" and m["kv_transfer_blocks_pulled_total"] > 0
    # n = 2: the second sequence finds the prompt's full blocks the first one pulled
    assert m["kv_transfer_blocks_hit_total"] >= 1
    assert producer.get_metrics()["kv_transfer_leases_pulled_total"] == 6  # one lease per live sequence
    assert _usage(producer) == 0 and _usage(consumer) == 0


def test_decode_side_prefix_hit_pulls_only_the_missing_blocks(llama_dir: Path) -> None:
    colocated, producer, consumer = _engines(llama_dir)
    system = [300 + j for j in range(3 * BLOCK)]
    first_req = [("a", system + [1, 2, 3], greedy(4))]
    _run_pd(producer, consumer, first_req)
    pulled = consumer.get_metrics()["kv_transfer_blocks_pulled_total"]
    assert pulled == 4  # 3 full blocks + the partial one
    second = [("b", system + [7, 8], greedy(5))]
    ref = _run_colocated(colocated, first_req + second)
    _, got, _ = _run_pd(producer, consumer, second)
    _assert_same({"b": ref["b"]}, got)
    m = consumer.get_metrics()
    assert m["kv_transfer_blocks_pulled_total"] - pulled == 1  # only the partial block crossed
    assert m["kv_transfer_blocks_hit_total"] == 3
    assert _usage(producer) == 0 and _usage(consumer) == 0


def test_seeded_sampling_and_logprobs_match_colocated(llama_dir: Path) -> None:
    colocated, producer, consumer = _engines(llama_dir)
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=1234, logprobs=2, ignore_eos=True)
    requests = [("s", [11, 22, 33, 44, 55], params), ("s2", list(range(3, 40)), SamplingParams(
        max_tokens=6, temperature=1.0, seed=7, n=2, ignore_eos=True))]
    ref = _run_colocated(colocated, requests)
    _, got, _ = _run_pd(producer, consumer, requests)
    _assert_same(ref, got)
    for a, b in zip(ref["s"].outputs[0].logprobs, got["s"].outputs[0].logprobs, strict=True):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        for (id_a, lp_a), (id_b, lp_b) in zip(a.top_logprobs, b.top_logprobs, strict=True):  # (-inf: filtered)
            assert id_a == id_b and (lp_a == lp_b or lp_a == pytest.approx(lp_b, abs=1e-5))


def test_finishing_on_the_first_token_hands_nothing_off(llama_dir: Path) -> None:
    _, producer, consumer = _engines(llama_dir)
    first, final, handoffs = _run_pd(producer, consumer, [("one", [5, 6, 7], greedy(1))])
    assert handoffs == [] and final["one"].finished and len(final["one"].outputs[0].token_ids) == 1
    assert _usage(producer) == 0


def _hand_off_one(producer: LLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> KVHandoff:
    producer.add_request(rid, prompt, params, do_remote_decode=True)
    while True:
        producer.step()
        handoffs = producer.kv_producer.take_handoffs()
        if handoffs:
            return handoffs[0]


def test_lease_expires_and_frees_the_blocks(llama_dir: Path) -> None:
    producer = LLMEngine(
        _args(llama_dir, kv_transfer_config={"kv_role": "kv_producer", "kv_lease_s": 0.2}).create_engine_config()
    )
    _hand_off_one(producer, "never-pulled", list(range(3, 40)), greedy(20))
    assert producer.kv.usage > 0 and producer.kv_producer.has_leases
    time.sleep(0.25)
    producer.kv_producer.collect()
    assert _usage(producer) == 0
    assert producer.get_metrics()["kv_transfer_leases_expired_total"] == 1


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_pull_follows_the_policy(llama_dir: Path, policy: str) -> None:
    colocated, producer, consumer = _engines(llama_dir, {"kv_load_failure_policy": policy})
    prompt, params = list(range(3, 40)), greedy(6)
    handoff = _hand_off_one(producer, "lost", prompt, params)
    producer.kv_producer.leases.release("lost")  # the producer lost it (as if expired)
    producer.kv_producer.collect()
    consumer.add_request("lost-d", prompt, params, remote_kv=handoff)  # the two-server form: another id here
    final = None
    while consumer.has_unfinished_requests():
        for out in consumer.step():
            if out.finished:
                final = out
    m = consumer.get_metrics()
    assert m["kv_transfer_failures_total"] == 1
    if policy == "fail":
        assert final.outputs[0].finish_reason == "abort"
        assert consumer.kv_consumer.take_failures()[0][0] == "lost-d"
    else:
        assert m["kv_transfer_recomputes_total"] == 1
        ref = _run_colocated(colocated, [("lost-d", prompt, params)])
        _assert_same(ref, {"lost-d": final})
    assert _usage(producer) == 0 and _usage(consumer) == 0


def test_a_producer_that_never_answers_times_out(llama_dir: Path) -> None:
    _, producer, consumer = _engines(llama_dir, {"kv_transfer_timeout_s": 0.3})
    prompt, params = list(range(3, 40)), greedy(6)
    handoff = _hand_off_one(producer, "silent", prompt, params)
    producer.kv_producer.shutdown()  # its KV server stops answering
    consumer.add_request("silent", prompt, params, remote_kv=handoff)
    t0 = time.monotonic()
    while consumer.has_unfinished_requests():
        consumer.step()
    assert time.monotonic() - t0 < 2.0
    assert consumer.kv_consumer.take_failures()[0][1].startswith("KV transfer failed: no answer")
    assert _usage(consumer) == 0


def test_abort_on_either_side_frees_both(llama_dir: Path) -> None:
    _, producer, consumer = _engines(llama_dir)
    prompt, params = list(range(3, 40)), greedy(50)
    # aborted while prefilling
    producer.add_request("p", prompt, params, do_remote_decode=True)
    producer.abort_request("p")
    # aborted after the handoff, before any pull: the lease ends at once
    _hand_off_one(producer, "h", prompt, params)
    producer.abort_request("h")
    assert _usage(producer) == 0
    # aborted on the decode side while decoding, and while its pull is outstanding
    handoff = _hand_off_one(producer, "d", prompt, params)
    consumer.add_request("d", prompt, params, remote_kv=handoff)
    while not consumer.scheduler.running:
        consumer.step()
    consumer.step()
    consumer.abort_request("d")
    handoff = _hand_off_one(producer, "w", prompt, params)
    consumer.add_request("w", prompt, params, remote_kv=handoff)
    consumer.step()  # the pull starts
    consumer.abort_request("w")
    _drain_leases(producer)
    assert not consumer.has_unfinished_requests()
    assert _usage(producer) == 0 and _usage(consumer) == 0


def test_handoff_params_round_trip_and_refusals(llama_dir: Path) -> None:
    _, producer, consumer = _engines(llama_dir)
    handoff = _hand_off_one(producer, "x", [4, 5, 6, 7], greedy(5, seed=3))
    assert KVHandoff.from_params(handoff.to_params()) == handoff
    with pytest.raises(ValueError, match="kv_transfer_params"):
        KVHandoff.from_params({"request_id": 3})
    with pytest.raises(ValueError, match="kv_producer"):
        consumer.add_request("y", [1, 2], greedy(2), do_remote_decode=True)
    with pytest.raises(ValueError, match="kv_consumer"):
        producer.add_request("y", [1, 2], greedy(2), remote_kv=handoff)
    producer.abort_request("x")
    assert _usage(producer) == 0


def test_goodput_experiment_report_distserve_definition() -> None:
    from types import SimpleNamespace

    from lmserve.bench.harness import Point
    from lmserve.bench.metrics import SLOs
    from lmserve.bench.pd_goodput import QUICK, goodput, report

    def point(config: str, rate: float, pct: float, tpot_p99: float) -> Point:
        summary = SimpleNamespace(slo_attainment_pct=pct, tpot_ms=SimpleNamespace(p99=tpot_p99),
                                  ttft_ms=SimpleNamespace(p99=100.0))  # fmt: skip
        return Point(f"{config} @ {rate}", summary, [], {"config": config, "rate_rps": rate})

    col = [point("colocated", r, pct, t) for r, pct, t in ((0.5, 100, 20), (1.0, 95, 40), (2.0, 50, 90))]
    pd = [point("1P1D", r, pct, t) for r, pct, t in ((0.5, 100, 10), (1.0, 100, 12), (2.0, 92, 15))]
    assert goodput(col) == 1.0 and goodput(pd) == 2.0
    text = "\n".join(report(QUICK, SLOs(ttft_ms=500, tpot_ms=30), (50.0, 15.0, 500.0), [0.5, 1, 2],
                            {"colocated": col, "1P1D": pd}))  # fmt: skip
    assert "1P1D's goodput 2 req/s vs colocated 1 req/s (2.00×)" in text
    assert "at 1 req/s (the highest rate both sustain): 0.30" in text


def test_handoff_messages_cross_the_core_socket() -> None:
    from lmserve.engine.kv_transfer import ChildHandoff
    from lmserve.engine.messages import AddRequest, Codec, StepOutputs
    from lmserve.sample.sampler import TokenLogprobs
    from tests.engine.test_messages import _snapshot

    lp = TokenLogprobs(7, -0.5, 1, [(7, -0.5), (3, -1.25)])
    handoff = KVHandoff("r", "ipc:///tmp/x/kv-0", 20, [ChildHandoff(0, [7], [4, 9], logprobs=[lp],
                        cumulative_logprob=-0.5, generator_state=b"\x01\x02", lease_id="r")], 16, "int8")  # fmt: skip
    codec = Codec()
    add = codec.decode_input(codec.encode(AddRequest("r", [1, 2], SamplingParams(), 1.0, remote_kv=handoff)))
    assert add.remote_kv == handoff and add.remote_kv.children[0].logprobs[0] == lp
    out = codec.decode_output(codec.encode(StepOutputs(0, [], _snapshot(), handoffs=[handoff])))
    assert out.handoffs == [handoff]


def test_memory_ledger_per_role_pool() -> None:
    from lmserve.entrypoints.cli import main
    from lmserve.memory.disaggregation import disaggregated_memory
    from lmserve.memory.presets import PRESETS, preset_names
    from lmserve.memory.report import memory_report

    shape = PRESETS[preset_names()[0]].shape()
    report = memory_report(shape, seq_len=1024, memory_bytes=64 * 2**30, kv_dtype="bf16", weight_dtype="bf16")
    pd = disaggregated_memory(report, 1, 2)
    assert pd.prefill.num_cores == 1 and pd.decode.num_cores == 2
    share = (64 * 2**30) // 3
    assert pd.decode.kv_budget_bytes_per_core == share - report.weight_bytes_per_rank
    assert pd.transfer_buffer_bytes_per_pull == 2 * report.kv_bytes_per_request
    assert "decode cores" in pd.format_table()
    with pytest.raises(ValueError, match="disaggregation"):
        disaggregated_memory(report, 0, 1)
    assert main(["memory", "--preset", preset_names()[0], "--disaggregation", "1x1"]) == 2


def test_structured_outputs_stop_strings_and_speculation_on_the_decode_side(llama_dir: Path) -> None:
    from lmserve.sampling_params import StructuredOutputsParams

    colocated = LLMEngine(_args(llama_dir).create_engine_config())
    producer = LLMEngine(_args(llama_dir, kv_transfer_config={"kv_role": "kv_producer"}).create_engine_config())
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    consumer = LLMEngine(_args(llama_dir, kv_transfer_config={"kv_role": "kv_consumer"},
                               speculative_config=ngram).create_engine_config())  # fmt: skip
    requests = [
        ("json", [5, 6, 7, 8, 9], SamplingParams(max_tokens=30, temperature=1.0, seed=3,
                                                 structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3,8}"))),
        ("stop", [40, 41, 42] * 10, greedy(40, stop=["e"])),
        ("rep", [7, 8, 9] * 12, greedy(24)),
    ]  # fmt: skip
    ref = _run_colocated(colocated, requests)
    _, got, _ = _run_pd(producer, consumer, requests)
    _assert_same(ref, got)
    assert consumer.get_metrics()["spec_decode_num_drafts_total"] > 0  # the decode side speculated
    assert _usage(producer) == 0 and _usage(consumer) == 0


def test_a_model_freeing_kv_outside_its_window_is_refused(model_dirs: dict[str, Path]) -> None:
    args = _args(model_dirs["mistral-swa"], kv_transfer_config={"kv_role": "kv_consumer"})
    with pytest.raises(ValueError, match="kv_transfer_config: a model whose every layer slides"):
        args.create_engine_config()  # at start-up, before any weight is loaded
