"""lmserve.engine.core: the engine-core loop on a thread of the test, over inproc ZeroMQ sockets (the same
code an engine-core process runs): one message per step, acks, aborts before the next step, shutdown."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from lmserve.config.engine import EngineArgs
from lmserve.engine.core import CoreLaunch, EngineCore
from lmserve.engine.llm_engine import LLMEngine
from lmserve.engine.messages import AbortRequests, AddRequest, Codec, CoreReady, Shutdown, StepOutputs
from lmserve.sampling_params import SamplingParams
from tests.helpers import steps_held_after_first

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Harness:
    def __init__(self, model_dir: Path, parent_pid: int | None = None) -> None:
        config = EngineArgs.from_kwargs(str(model_dir), num_kv_blocks=64, max_model_len=256).create_engine_config()
        self.engine = LLMEngine(config)
        self.ctx = zmq.Context()
        self.to_core, core_in = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        core_out, self.from_core = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        self.to_core.bind("inproc://in")
        core_in.connect("inproc://in")
        self.from_core.bind("inproc://out")
        core_out.connect("inproc://out")
        launch = CoreLaunch(config, 3, "inproc://in", "inproc://out", 1, measure_room=True, parent_pid=parent_pid)
        self.core = EngineCore(self.engine, launch, core_in, core_out, Codec())
        self.codec = Codec()
        self.thread = threading.Thread(target=self.core.run, daemon=True)
        self.thread.start()
        ready = self.recv()
        assert isinstance(ready, CoreReady) and ready.engine_index == 3 and ready.pid == os.getpid()
        assert ready.snapshot.room is not None and ready.snapshot.room.num_free_blocks == 64

    def send(self, msg) -> None:
        self.to_core.send(self.codec.encode(msg))

    def recv(self, timeout_ms: int = 60_000):
        assert self.from_core.poll(timeout_ms), "no message from the core"
        return self.codec.decode_output(self.from_core.recv())

    def close(self) -> None:
        self.send(Shutdown())
        self.thread.join(10)
        assert not self.thread.is_alive(), "the core did not leave its loop on Shutdown"
        self.ctx.destroy(linger=0)


@pytest.fixture
def harness(llama_dir: Path) -> Iterator[Harness]:
    h = Harness(llama_dir)
    yield h
    h.close()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def test_one_message_per_step_with_acks_and_outputs_like_the_engine(harness: Harness, llama_dir: Path) -> None:
    prompt = [5, 6, 7, 8, 9]
    harness.send(AddRequest("a", prompt, greedy(4), 1.0))
    messages: list[StepOutputs] = []
    while not (messages and messages[-1].outputs and messages[-1].outputs[0].finished):
        messages.append(harness.recv())
    assert messages[0].added == ["a"] and all(not m.added for m in messages[1:])
    steps = [m.snapshot.metrics["num_steps_total"] for m in messages]
    assert steps == list(range(steps[0], steps[0] + len(messages))) and steps[0] == 1  # one message per step
    final = messages[-1].outputs[0]
    assert final.prompt_token_ids == []  # the client fills it in
    assert [len(m.outputs[0].outputs[0].delta_token_ids) for m in messages] == [1, 1, 1, 1]
    # the same tokens as an engine of our own
    ref = LLMEngine(harness.engine.config)
    ref.add_request("a", prompt, greedy(4))
    while ref.has_unfinished_requests():
        outs = ref.step()
    assert final.outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert messages[-1].snapshot.metrics["num_requests_running"] == 0


def test_abort_applies_before_the_next_step_and_frees_kv(harness: Harness) -> None:
    # every step after the first waits until the abort is sent: the request is mid-generation by construction,
    # and exactly one step (the one under way) can run between the first output and the abort
    with steps_held_after_first(harness.engine) as release:
        harness.send(AddRequest("long", [5, 6, 7], greedy(200), 1.0))
        first = harness.recv()
        assert first.outputs[0].request_id == "long"
        harness.send(AbortRequests(["long", "unknown"]))
        release.set()
    # at most the step already under way can still carry an output; then the abort is applied
    msg = harness.recv()
    if msg.outputs:
        msg = harness.recv()
    assert not msg.outputs
    assert msg.snapshot.num_aborted_requests_total == 1  # the unknown id is not counted
    assert msg.snapshot.metrics["kv_cache_usage"] == 0.0
    assert msg.snapshot.metrics["finished_requests_by_reason"]["abort"] == 1


def test_a_refused_add_fails_alone(harness: Harness) -> None:
    # the first "dup" is still running when the second arrives: every step after its first waits until both are sent
    with steps_held_after_first(harness.engine):
        harness.send(AddRequest("dup", [5, 6], greedy(50), 1.0))
        harness.send(AddRequest("dup", [5, 6], greedy(2), 1.0))
    failed, added = [], []
    while not failed or not added:
        msg = harness.recv()
        failed += msg.failed
        added += msg.added
    assert added == ["dup"]
    assert failed[0].request_id == "dup" and failed[0].error_type == "ValueError" and "in use" in failed[0].message
    harness.send(AbortRequests(["dup"]))


def test_the_loop_ends_when_its_parent_is_gone(llama_dir: Path) -> None:
    h = Harness(llama_dir, parent_pid=os.getppid() + 1_000_000)  # not our parent: as if the API process died
    h.thread.join(5)
    assert not h.thread.is_alive()
    h.ctx.destroy(linger=0)
