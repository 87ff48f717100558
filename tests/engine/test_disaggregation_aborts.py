"""Disaggregation's bookkeeping of n > 1 and best_of requests at the engine level (a kv_producer and a kv_consumer
LLMEngine in one process): every sequence finishing on its first token in one step, and aborts before, during and
after the handoff on either side. The producer never fails, both KV pools return to 0, and every sequence is
counted once by finish reason on whichever side ended it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lmserve.engine.llm_engine import LLMEngine
from lmserve.sampling_params import SamplingParams
from tests.engine.test_disaggregation import _args, _assert_same, _drain_leases, _run_colocated, _run_pd, _usage

PROMPT = list(range(3, 43))


def _prompt(key: str, num_tokens: int = 60) -> list[int]:
    """A prompt of its own (nothing of it in a prefix cache); 60 tokens against a 48-token budget: the first
    sequence's prefill takes two steps, the second's three."""
    start = sum(map(ord, key)) % 300
    return [(start + 3 * j) % 500 + 3 for j in range(num_tokens)]


PARAMS = {
    "n2": SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, n=2),
    "best_of3": SamplingParams(max_tokens=30, temperature=0.9, seed=5, ignore_eos=True, n=1, best_of=3),
    "n3_seeded": SamplingParams(max_tokens=30, temperature=1.0, seed=9, ignore_eos=True, n=3, logprobs=1),
}


@pytest.fixture(scope="module")
def engines(llama_dir: Path) -> tuple[LLMEngine, LLMEngine, LLMEngine]:
    kw = {"max_num_batched_tokens": 48, "enable_prefix_caching": False}  # each sequence prefills its own prompt
    colocated = LLMEngine(_args(llama_dir, **kw).create_engine_config())
    producer = LLMEngine(_args(llama_dir, kv_transfer_config={"kv_role": "kv_producer"}, **kw).create_engine_config())
    consumer = LLMEngine(_args(llama_dir, kv_transfer_config={"kv_role": "kv_consumer"}, **kw).create_engine_config())
    return colocated, producer, consumer


def _finished(*engines: LLMEngine) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in engines:
        for reason, count in e.counters.num_finished_by_reason.items():
            out[reason] = out.get(reason, 0) + count
    return out


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def _idle(producer: LLMEngine, consumer: LLMEngine) -> None:
    for _ in range(3):  # ended requests' last steps
        producer.step()
        consumer.step()
    _drain_leases(producer)
    assert not producer.has_unfinished_requests() and not consumer.has_unfinished_requests()
    assert _usage(producer) == 0 and _usage(consumer) == 0


@pytest.mark.parametrize("name", ["n2", "best_of3", "n3_seeded"])
def test_every_sequence_finishing_on_its_first_token(engines, name: str) -> None:
    """All sequences finish (max_tokens 1) in the step that gives them their first token: the engine forgets the
    request before the producer looks at it; it is final on this side, nothing is handed off."""
    colocated, producer, consumer = engines
    params = dataclasses.replace(PARAMS[name], max_tokens=1)
    requests = [(f"first-{name}", [5, 6, 7, 8], params), (f"short-{name}", [9, 10, 11], params)]
    before = _finished(producer, consumer)
    ref = _run_colocated(colocated, requests)
    _, got, handoffs = _run_pd(producer, consumer, requests)
    _assert_same(ref, got)
    assert handoffs == []
    assert _delta(_finished(producer, consumer), before) == {"length": 2 * params.actual_best_of}
    for rid, _, _ in requests:
        assert not producer.kv_producer.holds(rid)  # the id is free again
    _idle(producer, consumer)


@pytest.mark.parametrize("name", ["n2", "best_of3", "n3_seeded"])
def test_n_sequences_handed_off_equal_colocated(engines, name: str) -> None:
    colocated, producer, consumer = engines
    requests = [(f"pd-{name}", PROMPT, PARAMS[name]), (f"pd2-{name}", PROMPT[:9], PARAMS[name])]
    before = _finished(producer, consumer)
    ref = _run_colocated(colocated, requests)
    _, got, handoffs = _run_pd(producer, consumer, requests)
    _assert_same(ref, got)
    assert len(handoffs) == 2
    assert _delta(_finished(producer, consumer), before) == {"length": 2 * PARAMS[name].actual_best_of}
    _idle(producer, consumer)


PHASES = ["queued", "prefilling", "partly_handed_off", "handed_off", "pulling", "decoding"]


@pytest.mark.parametrize("name", ["n2", "best_of3"])
@pytest.mark.parametrize("phase", PHASES)
def test_abort_in_every_phase_frees_both_sides_and_counts_each_sequence(engines, name: str, phase: str) -> None:
    _, producer, consumer = engines
    rid, params = f"ab-{name}-{phase}", PARAMS[name]
    prompt = _prompt(rid)
    before = _finished(producer, consumer)
    producer.add_request(rid, prompt, params, do_remote_decode=True)
    side = producer
    if phase != "queued":
        producer.step()  # 48 of the first sequence's 60 prompt tokens
        assert not producer.kv_producer.has_leases
    if phase == "partly_handed_off":
        producer.step()  # its other 12 (its first token: handed off) and 36 of the second's
        assert producer.kv_producer.has_leases and producer.has_unfinished_requests()
    if phase in ("handed_off", "pulling", "decoding"):
        while not (handoffs := producer.kv_producer.take_handoffs()):
            producer.step()
        assert not producer.has_unfinished_requests()
        if phase != "handed_off":
            consumer.add_request(rid, prompt, params, remote_kv=handoffs[0])
            consumer.step()  # the pull starts
            side = consumer
        if phase == "decoding":
            while not consumer.scheduler.running:
                consumer.step()
            consumer.step()
    side.abort_request(rid)
    _idle(producer, consumer)
    assert not producer.kv_producer.holds(rid)
    counted = _delta(_finished(producer, consumer), before)
    assert counted == {"abort": params.actual_best_of}, counted  # each sequence once, on the side that ended it


def _tokens(*engines: LLMEngine) -> tuple[int, int]:
    return (
        sum(e.counters.prompt_tokens_total for e in engines),
        sum(e.counters.generation_tokens_total for e in engines),
    )


@pytest.mark.parametrize("name", ["n2", "best_of3"])
def test_prompt_and_generation_tokens_counted_once(engines, name: str) -> None:
    colocated, producer, consumer = engines
    requests = [(f"tok-{name}", _prompt(f"tok-{name}", 30), PARAMS[name])]
    col0, pd0 = _tokens(colocated), _tokens(producer, consumer)
    _run_colocated(colocated, requests)
    _run_pd(producer, consumer, requests)
    col, pd = _tokens(colocated), _tokens(producer, consumer)
    assert (
        (pd[0] - pd0[0], pd[1] - pd0[1])
        == (col[0] - col0[0], col[1] - col0[1])
        == (30, 30 * PARAMS[name].actual_best_of)
    )


def test_a_failed_pull_counts_each_sequence_as_aborted(llama_dir: Path) -> None:
    producer = LLMEngine(_args(llama_dir, kv_transfer_config={"kv_role": "kv_producer"}).create_engine_config())
    consumer = LLMEngine(_args(llama_dir, kv_transfer_config={"kv_role": "kv_consumer"}).create_engine_config())
    prompt, params = _prompt("lost", 20), PARAMS["n2"]
    producer.add_request("lost", prompt, params, do_remote_decode=True)
    while not (handoffs := producer.kv_producer.take_handoffs()):
        producer.step()
    for ch in handoffs[0].children:
        producer.kv_producer.leases.release(ch.lease_id)  # the producer lost them (as if expired)
    producer.kv_producer.collect()
    consumer.add_request("lost", prompt, params, remote_kv=handoffs[0])
    while consumer.has_unfinished_requests():
        consumer.step()
    assert consumer.kv_consumer.take_failures()[0][0] == "lost"
    assert _finished(producer, consumer) == {"stop": 0, "length": 0, "abort": 2}
    assert _usage(producer) == 0 and _usage(consumer) == 0
