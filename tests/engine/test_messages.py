"""lmserve.engine.messages: every message type survives encode → typed decode unchanged (no pickle)."""

from __future__ import annotations

import msgspec
import pytest

from lmserve.core.outputs import CompletionOutput, RequestOutput
from lmserve.engine.async_engine import EngineSnapshot, _Room
from lmserve.engine.messages import (
    AbortRequests,
    AddFailure,
    AddRequest,
    Codec,
    CoreFailed,
    CoreReady,
    LogprobTails,
    Shutdown,
    StepOutputs,
)
from lmserve.request import FinishReason, RequestMetrics
from lmserve.sample.sampler import TokenLogprobs
from lmserve.sampling_params import SamplingParams, StructuredOutputsParams


def _snapshot(room: _Room | None = None) -> EngineSnapshot:
    metrics = {"num_requests_running": 2, "kv_cache_usage": 0.5, "kv_cache_dtype": "int8",
               "finished_requests_by_reason": {"stop": 1, "length": 0, "abort": 2}}  # fmt: skip
    return EngineSnapshot(metrics, num_batched_tokens=7, num_aborted_requests_total=2, time=12.5, room=room)


def _output() -> RequestOutput:
    lp = TokenLogprobs(token_id=5, logprob=-0.25, rank=1, top_logprobs=[(5, -0.25), (9, -1.5)])
    done = CompletionOutput(
        index=0, text="héllo ✓", token_ids=[5, 6], finish_reason=FinishReason.STOP, stop_reason="\n",
        logprobs=[lp, lp], cumulative_logprob=-0.5, delta_text="✓", delta_token_ids=[6],
    )  # fmt: skip
    running = CompletionOutput(index=1, text="a", token_ids=[7], stop_reason=3)
    return RequestOutput(
        request_id="cmpl-1-0", prompt=None, prompt_token_ids=[1, 2, 3], outputs=[done, running], finished=False,
        num_cached_tokens=16, metrics=RequestMetrics(1.0, 1.5, 2.0, 2.5, None), prompt_logprobs=[None, lp],
    )  # fmt: skip


MESSAGES = [
    AddRequest("r1", [1, 2, 3], SamplingParams(), 1.0),
    AddRequest(
        "r2",
        [4],
        SamplingParams(
            n=2, best_of=3, temperature=0.7, seed=3, stop=["x", "yz"], stop_token_ids=[9], logit_bias={5: -2.0},
            logprobs=2, prompt_logprobs=1, max_tokens=None, skip_special_tokens=False,
            structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "int"}}}),
        ),
        2.0,
    ),  # fmt: skip
    AddRequest("r3", [4], SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"])), 3.0),
    AbortRequests(["r1", "r2"]),
    Shutdown(),
    CoreReady(engine_index=1, pid=123, snapshot=_snapshot(_Room(1, 2, 3, 4))),
    StepOutputs(0, [_output()], _snapshot(), added=["r1"], failed=[AddFailure("r2", "ValueError", "bad")]),
    StepOutputs(2, [], _snapshot()),
    CoreFailed(0, "RuntimeError: boom"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message) -> None:
    codec = Codec()
    data = codec.encode(message)
    is_input = isinstance(message, AddRequest | AbortRequests | Shutdown)
    back = codec.decode_input(data) if is_input else codec.decode_output(data)
    assert back == message
    assert type(back) is type(message)


def test_logprobs_come_back_as_token_logprobs() -> None:
    codec = Codec()
    msg = codec.decode_output(codec.encode(StepOutputs(0, [_output()], _snapshot())))
    out = msg.outputs[0]
    assert all(type(lp) is TokenLogprobs for lp in out.outputs[0].logprobs)
    assert out.prompt_logprobs[0] is None and type(out.prompt_logprobs[1]) is TokenLogprobs
    assert out.outputs[0].logprobs[0].top_logprobs == [(5, -0.25), (9, -1.5)]
    assert out.outputs[0].finish_reason is FinishReason.STOP and out.outputs[0].finished


def test_sampling_params_checks_run_on_decode() -> None:
    """A message is decoded into the real dataclass, whose __post_init__ refuses what the constructor would."""
    codec = Codec()
    data = msgspec.msgpack.encode({"type": "AddRequest", "request_id": "r", "prompt_token_ids": [1],
                                   "params": {"n": 0}, "arrival_time": 0.0})  # fmt: skip
    with pytest.raises(msgspec.ValidationError, match="n must be an integer >= 1"):
        codec.decode_input(data)
    with pytest.raises(msgspec.ValidationError):  # not a message at all
        codec.decode_input(msgspec.msgpack.encode({"type": "Pickle", "payload": b"x"}))


def test_fields_added_to_the_dataclasses_cross_without_code() -> None:
    """The encoding follows the dataclasses' fields: a snapshot's optional fields come through as given."""
    codec = Codec()
    snap = _snapshot(_Room(0, 5, 10, 3))
    back = codec.decode_output(codec.encode(CoreReady(0, 1, snap))).snapshot
    assert back.room == _Room(0, 5, 10, 3) and back.engines == ()


def _lp(i: int) -> TokenLogprobs:
    return TokenLogprobs(token_id=i, logprob=-0.1 * i, rank=1, top_logprobs=[(i, -0.1 * i), (i + 1, -2.0)])


def _step(n: int, finished: bool, prompt: int = 3, rid: str = "r") -> RequestOutput:
    """The engine's cumulative output after n generated tokens (two sequences, prompt logprobs for `prompt`)."""
    seqs = [
        CompletionOutput(index=i, text="x" * n, token_ids=list(range(n)), logprobs=[_lp(10 * i + t) for t in range(n)],
                         finish_reason=FinishReason.LENGTH if finished else None)
        for i in range(2)
    ]  # fmt: skip
    return RequestOutput(
        request_id=rid,
        prompt=None,
        prompt_token_ids=[],
        outputs=seqs,
        finished=finished,
        num_cached_tokens=0,
        metrics=RequestMetrics(1.0, 1.5, 2.0, 2.5, None),
        prompt_logprobs=[None] + [_lp(t) for t in range(1, prompt)],
    )


def test_logprobs_cross_as_tails_and_are_joined_back_cumulative() -> None:
    """Each unfinished step carries only the new entries; the client's outputs equal the engine's cumulative ones;
    a finished output crosses whole; an aborted request leaves nothing behind on either side."""
    core, client, codec = LogprobTails(), LogprobTails(), Codec()
    for n, finished in [(1, False), (2, False), (5, False), (6, True)]:
        engine_out = _step(n, finished)
        wire = core.cut(engine_out)
        assert engine_out == _step(n, finished), "cut copies, never changes the engine's output"
        if finished:
            assert wire is engine_out
        else:
            sent = {1: 1, 2: 1, 5: 3}[n]
            assert [len(c.logprobs) for c in wire.outputs] == [sent, sent]
            assert len(wire.prompt_logprobs) == (3 if n == 1 else 0), "prompt logprobs cross once"
        back = codec.decode_output(codec.encode(StepOutputs(0, [wire], _snapshot()))).outputs[0]
        client.join(back)
        assert back == engine_out
    assert not core._counts and not client._joined
    client.join(
        codec.decode_output(codec.encode(StepOutputs(0, [core.cut(_step(2, False, rid="a"))], _snapshot()))).outputs[0]
    )
    assert core._counts and client._joined
    core.forget("a")
    client.forget("a")
    assert not core._counts and not client._joined
