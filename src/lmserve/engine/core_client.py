"""EngineCoreClient: AsyncEngine's interface, with the engine in separate engine-core processes.

The API process tokenizes, validates, routes (router.choose_core) and admits here; a receiver thread delivers the
cores' StepOutputs to the RequestStreams and a watcher thread per core fails a dead core's streams at once.
Launching: core_handles.py; CPU slices: cpu_slices.py. Layout, routing and faults: docs/processes.md.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from lmserve.config.engine import EngineConfig
from lmserve.core.outputs import RequestOutput
from lmserve.engine.admission import Admission
from lmserve.engine.closing import shut_down_at_exit
from lmserve.engine.core import CoreLaunch
from lmserve.engine.core_handles import CoreView, _ProcessHandle, _RayHandle, bind_host, ray_init
from lmserve.engine.cpu_slices import CPU_POLICIES, DEFAULT_CPU_POLICY, cpu_slices, default_num_threads
from lmserve.engine.disaggregation import KVTransferError
from lmserve.engine.input_processor import InputProcessor, Prompt
from lmserve.engine.kv_transfer import KVHandoff
from lmserve.engine.messages import (
    AbortRequests,
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
from lmserve.engine.router import AFFINITY_ENTRIES as AFFINITY_ENTRIES
from lmserve.engine.router import AFFINITY_SLACK as AFFINITY_SLACK
from lmserve.engine.router import choose_core
from lmserve.engine.snapshot import EngineSnapshot, aggregate_snapshots, dead_snapshot
from lmserve.engine.streams import EngineDeadError, RequestStream, StatLogger, _deliver, _Delivery
from lmserve.lora.request import LoRARequest
from lmserve.request import FinishReason
from lmserve.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

BACKENDS = ("mp", "ray")


@dataclass
class _Stream:
    stream: RequestStream
    core: CoreView
    prompt_token_ids: list[int]


class EngineCoreClient:
    """The engine client over N engine-core processes (or Ray actors). Same members as AsyncEngine.

    add_request must be called from a running event loop; abort / snapshot from any thread."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        data_parallel_size: int = 1,
        backend: str = "mp",
        num_threads: int | None = None,
        cpu_policy: str = DEFAULT_CPU_POLICY,
        max_queued_requests: int | None = None,
        retry_after_s: int = 1,
        tokenizer: Any = None,
        startup_timeout_s: float = 600.0,
    ) -> None:
        from lmserve.checkpoint.generation_defaults import sampling_defaults
        from lmserve.checkpoint.tokenizer import load_tokenizer
        from lmserve.sample.structured_output import StructuredOutputManager

        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        if backend not in BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {BACKENDS}, got {backend!r}")
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if cpu_policy not in CPU_POLICIES:
            raise ValueError(f"cpu_policy must be one of {sorted(CPU_POLICIES)}, got {cpu_policy!r}")
        Admission(max_queued_requests)  # checks the bound
        self.config = config
        self.data_parallel_size = data_parallel_size
        self.backend = backend
        self.num_threads = num_threads or default_num_threads(data_parallel_size)
        self.cpu_policy = cpu_policy
        self.max_queued_requests = max_queued_requests
        self.retry_after_s = retry_after_s
        self.startup_timeout_s = startup_timeout_s
        self.tokenizer = tokenizer or load_tokenizer(config.tokenizer)
        self.generation_defaults: dict[str, Any] = sampling_defaults(config.model.path, config.generation_config)
        self._inputs = InputProcessor(config, copy.deepcopy(self.tokenizer))
        eos = self._inputs.eos_token_ids
        self._structured = StructuredOutputManager(
            self._inputs.tokenizer, config.model.vocab_size, eos,
            allow_additional_properties=config.structured_outputs_allow_additional_properties,
        )  # fmt: skip
        self.stat_loggers: list[StatLogger] = []
        self._lock = threading.Lock()  # guards _streams, the cores' pending / streams / alive, _affinity, _dead
        self._send_lock = threading.Lock()  # zmq sockets and the encoder are not thread-safe
        self._codec = Codec()
        self._cores: list[CoreView] = []
        self._streams: dict[str, _Stream] = {}
        self._tails = LogprobTails()  # the cumulative logprobs of running requests (they cross as tails)
        self._affinity: OrderedDict[int, int] = OrderedDict()  # first-block hash → core index
        self._num_block_map_watchers = 0
        self._dead: EngineDeadError | None = None
        self._started = False
        self._stopping = False
        self._ids = itertools.count()
        self._threads: list[threading.Thread] = []
        self._ctx: zmq.Context | None = None
        self._pull: zmq.Socket | None = None
        self._ipc_dir: str | None = None
        self._ray_started = False

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> EngineCoreClient:
        """Start the cores and wait until every one has loaded its model (raises if one fails to)."""
        if self._started:
            return self
        self._started = True
        shut_down_at_exit(self)
        try:
            self._launch()
        except BaseException:
            self.shutdown()
            raise
        return self

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop every core (Shutdown, then terminate / kill after `timeout_s`) and join it; fail what is left."""
        if self._stopping:
            return
        self._stopping = True
        for core in self._cores:
            if core.alive:
                self._send(core, Shutdown())
        deadline = time.monotonic() + timeout_s
        for core in self._cores:
            core.handle.stop(max(0.1, deadline - time.monotonic()))
        with self._lock:
            if self._dead is None:
                self._dead = EngineDeadError("engine was shut down")
            victims = list(self._streams.values())
            self._streams.clear()
        self._fail([v.stream for v in victims], self._dead)
        for t in self._threads:
            t.join(2.0)
        for core in self._cores:
            core.socket.close(linger=0)
        if self._pull is not None:
            self._pull.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        if self._ray_started:
            import ray

            ray.shutdown()
        self._structured.shutdown()

    @property
    def is_running(self) -> bool:
        return self._started and not self._stopping and self._dead is None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    @property
    def degraded_error(self) -> str | None:
        """Why some (not all) engine cores died; None while all live."""
        dead = [f"{self._core_name(c.index)}: {c.error}" for c in self._cores if not c.alive]
        return "; ".join(dead) if dead and self._dead is None else None

    def _core_name(self, index: int) -> str:
        """How errors and /health name core `index` (pd_client adds its role)."""
        return f"engine core {index}"

    @property
    def core_pids(self) -> list[int | None]:
        return [c.pid for c in self._cores]

    def snapshot(self) -> EngineSnapshot:
        snaps = [c.snapshot for c in self._cores if c.snapshot is not None]
        assert snaps, "snapshot() before start()"
        if len(snaps) == 1:
            return snaps[0]
        return aggregate_snapshots(snaps)

    # ---- requests (event-loop side) ---------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, as the engine tokenizes it."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return self._inputs.tokenize(prompt)[1]

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """The engine's validation: resolved max_tokens, or ValueError."""
        return self._inputs.validate(prompt_token_ids, params)

    async def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """Compile a constraint here (raises GrammarError if refused), before the request is queued."""
        await asyncio.wrap_future(self._structured.compile(params))

    def add_request(
        self,
        request_id: str | None,
        prompt: Prompt,
        params: SamplingParams,
        arrival_time: float | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Validate, route and queue a request; returns its stream at once. kv_transfer_params: the two-server
        form of disaggregation (pd_client.remote_kv_fields: {"do_remote_decode": true} or a producer's answer).
        A LoRA adapter travels with the request (every core loads it from its path on first use: adapters are on
        every core; the prefix-affinity key is salted with the adapter, as the prefix cache's chain).

        Raises ValueError (bad input), QueueFullError (the chosen core's queue at its bound) or EngineDeadError.
        """
        loop = asyncio.get_running_loop()
        if not self._started:
            self.start()
        prompt_ids = self.tokenize(prompt)
        self.validate(prompt_ids, params)
        kv_fields = remote_kv_fields(self.config, kv_transfer_params, params)
        request_id = f"req-{next(self._ids)}" if request_id is None else request_id
        stream = RequestStream(self, request_id, loop)  # type: ignore[arg-type]
        num_seqs = params.actual_best_of
        num_blocks = num_seqs * -(-(len(prompt_ids) + 1) // self.config.cache.block_size)
        arrival_time = time.time() if arrival_time is None else arrival_time
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"engine is not running: {self._dead}")
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            core = self._route(prompt_ids, 0 if lora_request is None else lora_request.lora_int_id)
            with core.admission.lock:
                core.admission.reserve(num_seqs, num_blocks)
            core.pending[request_id] = (num_seqs, num_blocks)
            core.streams.add(request_id)
            self._streams[request_id] = _Stream(stream, core, prompt_ids)
        message = self._add_message(request_id, prompt_ids, params, arrival_time)
        if lora_request is not None:
            kv_fields = {**(kv_fields or {}), "lora_request": lora_request}
        self._send(core, msgspec.structs.replace(message, **kv_fields) if kv_fields else message)
        return stream

    def _add_message(self, request_id: str, prompt_ids: list[int], params: SamplingParams, arrival: float) -> Any:
        """The AddRequest a new request's first core gets (pd_client: a prefill core's, do_remote_decode)."""
        return AddRequest(request_id, prompt_ids, params, arrival)

    def abort(self, request_id: str) -> None:
        """Drop a request (idempotent; unknown or finished ids are ignored). Callable from any thread."""
        with self._lock:
            entry = self._streams.pop(request_id, None)
            if entry is None:
                return
            entry.core.streams.discard(request_id)
            self._tails.forget(request_id)
        if entry.core.alive:
            self._send(entry.core, AbortRequests([request_id]))
        for stat in self.stat_loggers:
            stat.on_request_aborted()

    def watch_block_map(self, on: bool) -> None:
        """As AsyncEngine.watch_block_map: every live core is told; snapshots carry the map while watched."""
        with self._lock:
            self._num_block_map_watchers += 1 if on else -1
            assert self._num_block_map_watchers >= 0, "watch_block_map(False) without a matching True"
            if not self._num_block_map_watchers:
                for core in self._cores:
                    core.block_map = None
        self._broadcast(WatchBlockMap(on))

    def reset_prefix_cache(self, include_disk: bool = False) -> None:
        """As AsyncEngine.reset_prefix_cache: every live core forgets its cached prefixes before the adds sent
        after this call (one socket per core keeps the order)."""
        self._broadcast(ResetPrefixCache(include_disk))

    def _broadcast(self, message: Any) -> None:
        """`message` to every live core."""
        with self._lock:
            cores = [c for c in self._cores if c.alive]
        for core in cores:
            self._send(core, message)

    def _send(self, core: CoreView, message: Any) -> None:
        with self._send_lock:
            try:
                core.socket.send(self._codec.encode(message), zmq.NOBLOCK)
            except zmq.ZMQError as e:  # closed at shutdown; a dead core is handled by its watcher
                logger.debug("send to engine core %d failed: %s", core.index, e)

    # ---- routing ----------------------------------------------------------------------------

    def _route(self, prompt_ids: list[int], lora_int_id: int = 0) -> CoreView:
        """The core for a new request (with _lock held): engine/router.choose_core on the live cores' loads."""
        loads = {c.index: c.load() for c in self._cores if c.alive}
        assert loads, "routing with no live core (dead_error is set first)"
        block_size = self.config.cache.block_size
        return self._cores[choose_core(loads, self._affinity, prompt_ids, block_size, lora_int_id=lora_int_id)]

    # ---- start-up ---------------------------------------------------------------------------

    def _launch(self) -> None:
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        if self.backend == "ray":
            host = ray_init(self)
            output_address = f"tcp://{host}:{self._pull.bind_to_random_port(f'tcp://{bind_host(host)}')}"
        else:
            self._ipc_dir = tempfile.mkdtemp(prefix="lmserve-")
            output_address = f"ipc://{self._ipc_dir}/out"
            self._pull.bind(output_address)
        slices = cpu_slices(self.data_parallel_size, self.num_threads)
        env = {"OMP_NUM_THREADS": str(self.num_threads), **CPU_POLICIES[self.cpu_policy]}
        for i in range(self.data_parallel_size):
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            if self.backend == "ray":
                input_address = f"tcp://{host}:{sock.bind_to_random_port(f'tcp://{bind_host(host)}')}"
            else:
                input_address = f"ipc://{self._ipc_dir}/in-{i}"
                sock.bind(input_address)
            launch = CoreLaunch(
                config=self._core_config(i, host if self.backend == "ray" else None),
                engine_index=i,
                input_address=input_address,
                output_address=output_address,
                num_threads=self.num_threads,
                cpus=slices[i] if slices else None,
                measure_room=self.max_queued_requests is not None,
                parent_pid=os.getpid() if self.backend == "mp" else None,
                log_level=logging.getLogger().getEffectiveLevel(),
                cpu_backoff=self.cpu_policy == "adaptive",
                backend=self.backend,
            )
            handle = _RayHandle(launch, env) if self.backend == "ray" else _ProcessHandle(launch, env)
            admission = Admission(self.max_queued_requests, self.retry_after_s)
            self._cores.append(CoreView(i, handle, sock, admission, self.num_threads))
        self._wait_ready()
        for core in self._cores:
            t = threading.Thread(target=self._watch, args=(core,), name=f"lmserve-watch-{core.index}", daemon=True)
            t.start()
            self._threads.append(t)
        t = threading.Thread(target=self._receive, name="lmserve-receive", daemon=True)
        t.start()
        self._threads.append(t)

    def _core_config(self, index: int, host: str | None) -> EngineConfig:
        """Core `index`'s engine config (pd_client gives each its KV-transfer role); host: the Ray cluster IP."""
        return self.config

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while any(c.snapshot is None for c in self._cores):
            for core in self._cores:
                if core.snapshot is None and core.handle.exited():
                    why = core.error or core.handle.status()
                    raise RuntimeError(f"engine core {core.index} exited during start-up: {why}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine cores not ready after {self.startup_timeout_s:.0f} s")
            if not self._pull.poll(100):  # type: ignore[union-attr]
                continue
            msg = self._codec.decode_output(self._pull.recv())  # type: ignore[union-attr]
            core = self._cores[msg.engine_index]
            if isinstance(msg, CoreReady):
                core.snapshot, core.pid = msg.snapshot, msg.pid
                core.admission.applied(0, 0, msg.snapshot.room)
            elif isinstance(msg, CoreFailed):
                core.error = msg.error
        logger.info(
            "%d engine core(s) ready (%s backend, %d thread(s) each, pids %s)",
            len(self._cores), self.backend, self.num_threads, self.core_pids,
        )  # fmt: skip

    # ---- the receiver and watcher threads -----------------------------------------------------

    def _receive(self) -> None:
        codec = Codec()  # this thread's own decoder
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stopping:
            try:
                if not poller.poll(200):
                    continue
                data = self._pull.recv(zmq.NOBLOCK)  # type: ignore[union-attr]
            except zmq.Again:
                continue
            except zmq.ZMQError:
                return  # closed at shutdown
            msg = codec.decode_output(data)
            core = self._cores[msg.engine_index]
            if isinstance(msg, StepOutputs):
                self._on_step(core, msg)
            elif isinstance(msg, CoreFailed):
                core.error = msg.error

    def _on_step(self, core: CoreView, msg: StepOutputs) -> None:
        if msg.handoffs and self.config.kv_transfer is not None:
            _end_handed_off(msg)  # a kv_producer server: the request's answer is its first token and the handoff
        now = time.time()
        delivery: dict[asyncio.AbstractEventLoop, _Delivery] = {}
        num_seqs = num_blocks = 0
        with self._lock:
            for rid in itertools.chain(msg.added, (f.request_id for f in msg.failed)):
                s, b = core.pending.pop(rid, (0, 0))
                num_seqs, num_blocks = num_seqs + s, num_blocks + b
            if msg.snapshot.block_map is not None:
                core.block_map = msg.snapshot.block_map
            elif core.block_map is not None and self._num_block_map_watchers:
                msg.snapshot = dataclasses.replace(msg.snapshot, block_map=core.block_map)
            if core.alive:  # (a dead core's last messages may still arrive: its gauges stay 0)
                core.snapshot = msg.snapshot
            for f in msg.failed:
                entry = self._streams.pop(f.request_id, None)
                core.streams.discard(f.request_id)
                if entry is not None:
                    err = _add_error(f.error_type, f.message)
                    delivery.setdefault(entry.stream._loop, _Delivery()).items.append((entry.stream, err))
            items: list[tuple[_Stream, RequestOutput]] = []
            for out in msg.outputs:
                entry = self._streams.get(out.request_id)
                if entry is None:
                    continue  # aborted while this step ran
                self._tails.join(out)  # logprobs came as tails (messages.py)
                if out.finished:
                    del self._streams[out.request_id]
                    core.streams.discard(out.request_id)
                items.append((entry, out))
        core.admission.applied(num_seqs, num_blocks, msg.snapshot.room)
        for entry, out in items:
            out.prompt_token_ids = entry.prompt_token_ids
            stream = entry.stream
            for stat in self.stat_loggers:
                stat.on_request_output(out, stream.last_token_time, now)
            stream.last_token_time = out.metrics.last_token_time
            delivery.setdefault(stream._loop, _Delivery()).items.append((stream, out))
        _send_delivery(delivery)

    def _watch(self, core: CoreView) -> None:
        """Blocks until the core's process (actor) ends; unless shutting down, that is a failure."""
        status = core.handle.wait_exit()
        if self._stopping:
            return
        reason = core.error or status
        logger.error("engine core %d (pid %s) died: %s", core.index, core.pid, reason)
        error = EngineDeadError(f"{self._core_name(core.index)} died: {reason}")
        with self._lock:
            core.alive = False
            core.error = reason
            victims = [self._streams.pop(rid) for rid in core.streams if rid in self._streams]
            core.streams.clear()
            if core.snapshot is not None:
                core.snapshot = dead_snapshot(core.snapshot, len(victims))
            if not any(c.alive for c in self._cores):
                self._dead = error
        self._fail([v.stream for v in victims], error)

    @staticmethod
    def _fail(streams: list[RequestStream], error: BaseException) -> None:
        delivery: dict[asyncio.AbstractEventLoop, _Delivery] = {}
        for stream in streams:
            delivery.setdefault(stream._loop, _Delivery()).items.append((stream, error))
        _send_delivery(delivery)


def remote_kv_fields(config: EngineConfig, kv_params: dict[str, Any] | None, params: SamplingParams) -> dict:
    """A request's kv_transfer_params (the two-server form) → AddRequest's fields; ValueError naming the field."""
    if kv_params is None:
        return {}
    role = config.kv_transfer.kv_role if config.kv_transfer is not None else None
    if kv_params.get("do_remote_decode"):
        if role != "kv_producer":
            raise ValueError("kv_transfer_params.do_remote_decode: this server is not a kv_producer "
                             "(--kv-transfer-config '{\"kv_role\": \"kv_producer\"}')")  # fmt: skip
        if params.actual_best_of > params.n:  # ranked only at the end: no first-token answer to hand back
            raise ValueError("best_of: best_of > n cannot be split over a prefill and a decode server")
        return {"do_remote_decode": True}
    if kv_params.get("do_remote_prefill"):
        if role != "kv_consumer":
            raise ValueError("kv_transfer_params.do_remote_prefill: this server is not a kv_consumer")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: computed on the prefill server; do not send it to the decode server")
        return {"remote_kv": KVHandoff.from_params(kv_params)}
    raise ValueError("kv_transfer_params: expected do_remote_decode or a prefill server's kv_transfer_params")


def _end_handed_off(msg: StepOutputs) -> None:
    """A kv_producer server's handed-off requests end here: their first-token output becomes final, carrying the
    handoff (kv_transfer_params) for the router to forward."""
    by_id = {h.request_id: h for h in msg.handoffs}
    for out in msg.outputs:
        handoff = by_id.get(out.request_id)
        if handoff is not None:
            out.finished = True
            out.kv_transfer_params = handoff.to_params()
            for c in out.outputs:
                if c.finish_reason is None:
                    c.finish_reason = FinishReason.LENGTH


def _add_error(error_type: str, message: str) -> Exception:
    """The exception of an add the core refused: ValueError stays the input's fault (a 400)."""
    if error_type == "KVTransferError":
        return KVTransferError(message)
    return ValueError(message) if error_type == "ValueError" else RuntimeError(f"{error_type}: {message}")


def _send_delivery(delivery: dict[asyncio.AbstractEventLoop, _Delivery]) -> None:
    for loop, d in delivery.items():
        try:
            loop.call_soon_threadsafe(_deliver, d.items)
        except RuntimeError:  # that event loop is closed; its consumers are gone
            pass
