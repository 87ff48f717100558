"""The engine core: one LLMEngine in its own process (or Ray actor), a busy loop fed over ZeroMQ (run_engine_core).

Each iteration drains the input socket, applies AddRequest / AbortRequests, runs engine.step() and sends one
StepOutputs (adds applied, RequestOutputs, a fresh EngineSnapshot). The process exits when its parent changes or
after Shutdown; a loop exception is reported as CoreFailed. See docs/processes.md.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import zmq

from lmserve.engine.admission import measure_room
from lmserve.engine.cpu_share import CpuShare, ThreadBackoff
from lmserve.engine.messages import (
    AbortRequests,
    AddFailure,
    AddRequest,
    Codec,
    CoreFailed,
    CoreReady,
    LogprobTails,
    ResetPrefixCache,
    Shutdown,
    StepOutputs,
    WatchBlockMap,
)
from lmserve.engine.snapshot import BlockMapWatch, EngineSnapshot, take_snapshot
from lmserve.observability.step_trace import StepTrace, trace_path

if TYPE_CHECKING:
    from lmserve.config.engine import EngineConfig
    from lmserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 100  # an idle core wakes this often to check that its parent is alive


@dataclass(frozen=True)
class CoreLaunch:
    """Everything one engine core needs to start (handed over by multiprocessing or Ray, never a socket)."""

    config: EngineConfig
    engine_index: int
    input_address: str  # the core connects a PULL socket here (the client binds the PUSH end)
    output_address: str  # the core connects a PUSH socket here (the client binds one PULL for all cores)
    num_threads: int  # torch intra-op threads of this core
    cpus: tuple[int, ...] | None = None  # pin the process to these CPUs (data parallel slices)
    measure_room: bool = False  # admission is bounded: put the scheduler's room in every snapshot
    parent_pid: int | None = None  # exit as soon as the parent is no longer this pid (None: do not check)
    cpu_backoff: bool = False  # drop to 1 torch thread while other processes use the core's CPUs (cpu_share.py)
    log_level: int = logging.WARNING  # the API process's root level: the core logs (to stderr) what it would
    backend: str = "mp"  # "ray": tensor-parallel ranks are Ray actors in the core's placement group


def run_engine_core(launch: CoreLaunch) -> None:
    """Process (or Ray actor method) entry point: load the model, serve until Shutdown or the parent's death."""
    if not logging.getLogger().handlers:  # a fresh process (spawn, Ray worker): log as the API process does
        logging.basicConfig(
            level=launch.log_level,
            format=f"%(asctime)s %(levelname)s %(name)s [engine core {launch.engine_index}]: %(message)s",
            stream=sys.stderr,
        )
    if launch.parent_pid is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the API process decides
    if launch.cpus:
        os.sched_setaffinity(0, launch.cpus)
    torch.set_num_threads(launch.num_threads)
    from lmserve.engine.llm_engine import LLMEngine

    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    out = ctx.socket(zmq.PUSH)
    for sock in (inp, out):
        sock.setsockopt(zmq.LINGER, 2000)  # a final CoreFailed still goes out
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)  # 0 = unbounded: an output is never dropped or blocks the loop
    inp.connect(launch.input_address)
    out.connect(launch.output_address)
    codec = Codec()
    status = 0
    engine = None
    try:
        # tensor parallel: the core's threads and CPUs are its group's, divided between the ranks
        tp = launch.config.tensor_parallel_size
        cpus = launch.cpus or (tuple(sorted(os.sched_getaffinity(0))) if tp > 1 else None)
        engine = LLMEngine(launch.config, launch.num_threads, cpus, launch.backend)
        EngineCore(engine, launch, inp, out, codec).run()
    except BaseException as e:
        logger.exception("engine core %d failed", launch.engine_index)
        out.send(codec.encode(CoreFailed(launch.engine_index, f"{type(e).__name__}: {e}")))
        status = 1
    finally:
        if engine is not None:
            engine.close()
        inp.close()
        out.close()
        ctx.term()
    if launch.parent_pid is not None:
        # A process of our own: end it now. The interpreter's finalization with torch loaded takes seconds
        # (measured ~8 s on a busy machine), and nothing is left to clean up.
        logging.shutdown()
        os._exit(status)
    if status:
        raise RuntimeError(f"engine core {launch.engine_index} failed")


class EngineCore:
    """The loop around one LLMEngine (which nothing else touches)."""

    def __init__(self, engine: LLMEngine, launch: CoreLaunch, inp: zmq.Socket, out: zmq.Socket, codec: Codec) -> None:
        self.engine = engine
        self.launch = launch
        self.index = launch.engine_index
        self._in, self._out, self._codec = inp, out, codec
        self._live: set[str] = set()  # added, not finished or aborted
        self._tails = LogprobTails()  # logprobs cross as tails (messages.py)
        self._num_aborted = 0
        self._added: list[str] = []
        self._failed: list[AddFailure] = []
        self._changed = False  # something was applied since the last message
        self._block_map_watch = BlockMapWatch()
        self._backoff: ThreadBackoff | None = None
        if launch.cpu_backoff and launch.num_threads > 1 and engine.executor is None:  # (not per TP rank)
            pids = (os.getpid(),) + ((launch.parent_pid,) if launch.parent_pid else ())
            self._backoff = ThreadBackoff(launch.num_threads, CpuShare(os.sched_getaffinity(0), pids))
        path = trace_path(self.index)
        self._trace = StepTrace(engine, path) if path else None  # LMSERVE_STEP_TRACE: calibrate's served steps

    def run(self) -> None:
        try:
            self._loop()
        finally:
            if self._trace is not None:
                self._trace.close()

    def _loop(self) -> None:
        self._out.send(self._codec.encode(CoreReady(self.index, os.getpid(), self._snapshot())))
        executor = self.engine.executor
        while True:
            if executor is not None and executor.failure is not None:
                raise RuntimeError(executor.failure)  # a tensor-parallel rank died: the core fails (CoreFailed)
            busy = self.engine.has_unfinished_requests()
            if self._trace is not None and busy:
                self._trace.begin_iteration()
            if not self._drain(0 if busy else IDLE_POLL_MS):
                return  # Shutdown
            if self._trace is not None and not busy:
                self._trace.begin_iteration()  # (after the idle wait for input: that is not the loop's cost)
            if self.launch.parent_pid is not None and os.getppid() != self.launch.parent_pid:
                logger.warning("engine core %d: the API process is gone; exiting", self.index)
                return
            if self._backoff is not None and (threads := self._backoff.poll()) is not None:
                torch.set_num_threads(threads)
            outputs = self._step() if self.engine.has_unfinished_requests() else []
            handoffs = self._kv_transfer()
            if not (busy or self._changed or outputs or handoffs):
                continue
            for o in outputs:
                if o.finished:
                    self._live.discard(o.request_id)
                o.prompt_token_ids = []  # the client has it
            outputs = [self._tails.cut(o) for o in outputs]
            idle = not self.engine.has_unfinished_requests()
            msg = StepOutputs(self.index, outputs, self._snapshot(idle), self._added, self._failed, handoffs)
            self._out.send(self._codec.encode(msg))
            self._added, self._failed, self._changed = [], [], False
            if self._trace is not None:
                self._trace.end_iteration()

    def _step(self) -> list:
        """engine.step(), timed into the trace when there is one. Looked up on the engine at every call, never bound
        once: a test that holds the engine's steps (tests/helpers.steps_held_after_first) patches engine.step."""
        return self._trace.step() if self._trace is not None else self.engine.step()

    def _kv_transfer(self) -> list:
        """Disaggregation: the handoffs of a prefill core (those requests are no longer its), the KV failures of a
        decode core (their requests fail alone: AddFailure), and a producer's ended leases freed even when idle."""
        if self.engine.kv_consumer is not None:
            for rid, error in self.engine.kv_consumer.take_failures():
                self._live.discard(rid)
                self._failed.append(AddFailure(rid, "KVTransferError", error))
        if self.engine.kv_producer is None:
            return []
        if self.engine.kv_producer.collect():
            self._changed = True  # blocks were freed: the next snapshot must say so
        handoffs = self.engine.kv_producer.take_handoffs()
        for h in handoffs:
            self._live.discard(h.request_id)
            self._tails.forget(h.request_id)
        return handoffs

    def _snapshot(self, idle: bool = True) -> EngineSnapshot:
        room = measure_room(self.engine) if self.launch.measure_room else None
        block_map = self._block_map_watch.refresh(self.engine, idle)  # only a new one crosses the socket
        return take_snapshot(self.engine, self._num_aborted, room, block_map)

    def _drain(self, timeout_ms: int) -> bool:
        """Apply every queued message; False on Shutdown."""
        if not self._in.poll(timeout_ms):
            return True
        while True:
            try:
                data = self._in.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            msg = self._codec.decode_input(data)
            self._changed = True
            if isinstance(msg, AddRequest):
                self._add(msg)
            elif isinstance(msg, AbortRequests):
                for rid in msg.request_ids:
                    self._tails.forget(rid)
                    if rid in self._live:
                        self._live.discard(rid)
                        self.engine.abort_request(rid)
                        self._num_aborted += 1
                    elif self.engine.kv_producer is not None:  # handed off: its KV leases end
                        # still leased: the client aborted it before any decode core had it (counted here)
                        self._num_aborted += self.engine.kv_producer.holds(rid)
                        self.engine.abort_request(rid)
            elif isinstance(msg, WatchBlockMap):
                self._block_map_watch.watch(msg.on)
            elif isinstance(msg, ResetPrefixCache):
                self.engine.reset_prefix_cache(msg.include_disk)
            else:
                assert isinstance(msg, Shutdown), f"unknown message {msg!r}"
                return False

    def _add(self, msg: AddRequest) -> None:
        try:
            lora = {} if msg.lora_request is None else {"lora_request": msg.lora_request}
            self.engine.add_request(
                msg.request_id, msg.prompt_token_ids, msg.params, msg.arrival_time,
                do_remote_decode=msg.do_remote_decode, remote_kv=msg.remote_kv, **lora,
            )  # fmt: skip
        except Exception as e:  # one bad request fails alone, not the engine
            kind = "ValueError" if isinstance(e, ValueError) else type(e).__name__
            self._failed.append(AddFailure(msg.request_id, kind, str(e)))
            return
        self._live.add(msg.request_id)
        self._added.append(msg.request_id)
