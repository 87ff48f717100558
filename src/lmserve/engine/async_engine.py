"""AsyncEngine: the synchronous LLMEngine on its own thread, streaming outputs to asyncio consumers.

Event loops send add / abort commands that the engine thread applies between steps; each step's outputs go back
through loop.call_soon_threadsafe to the RequestStreams, and an immutable EngineSnapshot is published after each
step. If the engine thread dies, pending streams fail with EngineDeadError. Admission: admission.py.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

# Admission, snapshots and streams live in admission.py / snapshot.py / streams.py (shared with the engine-core
# client); the "as" imports keep the names importable from here, as before.
from lmserve.config.engine import EngineArgs
from lmserve.core.outputs import RequestOutput
from lmserve.engine.admission import Admission, _Room, measure_room
from lmserve.engine.admission import QueueFullError as QueueFullError
from lmserve.engine.admission import num_unstartable as num_unstartable
from lmserve.engine.closing import shut_down_at_exit
from lmserve.engine.input_processor import Prompt
from lmserve.engine.llm_engine import LLMEngine
from lmserve.engine.snapshot import BLOCK_MAP_INTERVAL_S as BLOCK_MAP_INTERVAL_S
from lmserve.engine.snapshot import BlockMapWatch, EngineSnapshot, take_snapshot
from lmserve.engine.streams import EngineDeadError, RequestStream, StatLogger, _deliver, _Delivery
from lmserve.lora.request import LoRARequest
from lmserve.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    stream: RequestStream
    prompt: Prompt
    params: SamplingParams
    arrival_time: float
    num_seqs: int
    num_blocks: int  # to start all num_seqs (admission's estimate)
    lora_request: LoRARequest | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Watch:
    on: bool


@dataclass
class _ResetPrefixCache:
    include_disk: bool = False


class AsyncEngine:
    """Runs LLMEngine.step() in a dedicated thread; add/abort are queued and applied between steps.

    add_request / generate must be called from a running event loop; abort / snapshot from any thread.
    """

    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_queued_requests: int | None = None,
        retry_after_s: int = 1,
        tokenizer: Any = None,
        num_threads: int | None = None,
    ) -> None:
        self._admission = Admission(max_queued_requests, retry_after_s)  # raises on a bad bound
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        # torch intra-op threads of the engine thread (None: leave torch's setting). See serve_cli: the
        # thread that loads the model should use 1, so that only the engine thread owns an OpenMP team.
        self.num_threads = num_threads
        self.engine = engine
        self.config = engine.config
        self.max_queued_requests = max_queued_requests
        self.retry_after_s = retry_after_s
        # The engine thread detokenizes with engine.tokenizer; callers tokenize with their own copy so the
        # two threads never share a (not thread-safe) Rust tokenizer object. A deep copy, not a second load:
        # a GGUF tokenizer is converted from the file's metadata, which takes seconds.
        self.tokenizer = tokenizer or copy.deepcopy(engine.tokenizer)
        self.stat_loggers: list[StatLogger] = []
        self._commands: deque[_Add | _Abort | _Watch | _ResetPrefixCache] = deque()
        self._wakeup = threading.Event()
        self._lock = self._admission.lock  # guards the admission counters and _dead
        self._admission.room = self._measure_room()  # the scheduler as of the latest step or applied commands
        self._dead: BaseException | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._num_aborted = 0  # engine thread only
        self._block_map_watch = BlockMapWatch()  # engine thread only
        self._ids = itertools.count()
        self._snapshot = self._take_snapshot()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> AsyncEngine:
        return cls(LLMEngine.from_engine_args(args), **kwargs)

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> AsyncEngine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lmserve-engine", daemon=True)
            self._thread.start()
            shut_down_at_exit(self)
        return self

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread (pending requests fail), then close the engine: its processes, threads and
        memory (engine/closing.py). Idempotent; requests after it raise EngineDeadError."""
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._lock:
            if self._dead is None:
                self._dead = EngineDeadError("engine was shut down")
        if self._thread is None or not self._thread.is_alive():  # (a step still running keeps its engine)
            self.engine.close()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """The model's generation_config.json sampling fields (for requests that leave them unset)."""
        return self.engine.generation_defaults

    # ---- requests (event-loop side) ---------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, as LLMEngine.tokenize does it, with this side's tokenizer."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return self.engine.tokenize(prompt)[1]  # only type-checks a list of ids

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """LLMEngine.validate (reads only frozen config): resolved max_tokens, or ValueError."""
        return self.engine.validate(prompt_token_ids, params)

    async def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """Compile a constraint on the engine's grammar pool (or find it cached) without blocking the event
        loop; raises GrammarError (a ValueError with the library's reason) if it is refused. The engine then
        finds it compiled when the request arrives."""
        await asyncio.wrap_future(self.engine.structured.compile(params))

    def add_request(
        self,
        request_id: str | None,
        prompt: Prompt,
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Validate and queue a request; returns its stream at once.

        Raises ValueError (bad input), QueueFullError (waiting queue at its bound) or EngineDeadError.
        """
        loop = asyncio.get_running_loop()
        if self._thread is None:
            self.start()
        prompt_ids = self.tokenize(prompt)
        self.validate(prompt_ids, params)
        request_id = f"req-{next(self._ids)}" if request_id is None else request_id
        stream = RequestStream(self, request_id, loop)
        num_seqs = params.actual_best_of
        num_blocks = num_seqs * -(-(len(prompt_ids) + 1) // self.config.cache.block_size)
        arrival_time = time.time() if arrival_time is None else arrival_time
        cmd = _Add(stream, prompt_ids, params, arrival_time, num_seqs, num_blocks, lora_request)
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"engine is not running: {self._dead!r}")
            self._admission.reserve(num_seqs, num_blocks)
            self._commands.append(cmd)
        self._wakeup.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Drop a request (idempotent; unknown or finished ids are ignored). Callable from any thread."""
        self._commands.append(_Abort(request_id))
        self._wakeup.set()

    def watch_block_map(self, on: bool) -> None:
        """Subscribe (on=True) or unsubscribe one watcher of the KV block map: while any watches, snapshots carry
        `block_map`, rebuilt on the engine thread at most every BLOCK_MAP_INTERVAL_S; otherwise it costs nothing.
        Callable from any thread; pair every on with an off."""
        self._commands.append(_Watch(on))
        self._wakeup.set()

    def reset_prefix_cache(self, include_disk: bool = False) -> None:
        """Forget every cached prefix (LLMEngine.reset_prefix_cache; include_disk: the disk tier's too) before the
        adds queued after this call. Callable from any thread."""
        self._commands.append(_ResetPrefixCache(include_disk))
        self._wakeup.set()

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; if the consumer stops iterating early, the request is aborted."""
        stream = self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    # ---- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self.num_threads is not None:
                import torch

                torch.set_num_threads(self.num_threads)
            while not self._stopping:
                self._wakeup.clear()  # before draining, so a command queued after the drain wakes us
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self._publish_snapshot(idle=True)
                    self._wakeup.wait()
                    continue
                outputs = self.engine.step()
                self._publish_snapshot()
                self._dispatch(outputs)
            self._fail_all(EngineDeadError("engine was shut down"))
        except BaseException as e:  # the loop's death must reach every waiting client
            logger.exception("engine loop died")
            self._fail_all(EngineDeadError(f"engine loop died: {e!r}"), cause=e)

    def _apply_commands(self) -> None:
        delivery: dict[asyncio.AbstractEventLoop, _Delivery] = {}
        num_applied_seqs = num_applied_blocks = 0
        while self._commands:
            cmd = self._commands.popleft()
            if isinstance(cmd, _Abort):
                self._apply_abort(cmd.request_id)
                continue
            if isinstance(cmd, _Watch):
                self._block_map_watch.watch(cmd.on)
                continue
            if isinstance(cmd, _ResetPrefixCache):
                self.engine.reset_prefix_cache(cmd.include_disk)
                continue
            num_applied_seqs += cmd.num_seqs
            num_applied_blocks += cmd.num_blocks
            rid = cmd.stream.request_id
            try:
                lora = {} if cmd.lora_request is None else {"lora_request": cmd.lora_request}
                self.engine.add_request(rid, cmd.prompt, cmd.params, cmd.arrival_time, **lora)
            except Exception as e:  # one bad request fails alone, not the engine
                delivery.setdefault(cmd.stream._loop, _Delivery()).items.append((cmd.stream, e))
                continue
            self._streams[rid] = cmd.stream
        if num_applied_seqs:  # one update: the applied sequences move from pending to waiting
            self._admission.applied(num_applied_seqs, num_applied_blocks, self._measure_room())
        self._send(delivery)

    def _apply_abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return  # finished already, or never added
        self.engine.abort_request(request_id)
        self._num_aborted += 1
        for stat in self.stat_loggers:
            stat.on_request_aborted()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.time()
        delivery: dict[asyncio.AbstractEventLoop, _Delivery] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted while this step ran
            for stat in self.stat_loggers:
                stat.on_request_output(out, stream.last_token_time, now)
            stream.last_token_time = out.metrics.last_token_time
            if out.finished:
                del self._streams[out.request_id]
            delivery.setdefault(stream._loop, _Delivery()).items.append((stream, out))
        self._send(delivery)

    @staticmethod
    def _send(delivery: dict[asyncio.AbstractEventLoop, _Delivery]) -> None:
        for loop, d in delivery.items():
            try:
                loop.call_soon_threadsafe(_deliver, d.items)
            except RuntimeError:  # that event loop is closed; its consumers are gone
                pass

    def _take_snapshot(self, idle: bool = False) -> EngineSnapshot:
        self._block_map_watch.refresh(self.engine, idle)
        return take_snapshot(self.engine, self._num_aborted, block_map=self._block_map_watch.latest)

    def _publish_snapshot(self, idle: bool = False) -> None:
        snap = self._take_snapshot(idle)
        room = self._measure_room()
        with self._lock:
            self._admission.room = room
        self._snapshot = snap

    def _measure_room(self) -> _Room:
        """Engine thread (or before it starts)."""
        return _Room() if self.max_queued_requests is None else measure_room(self.engine)

    def _fail_all(self, error: EngineDeadError, cause: BaseException | None = None) -> None:
        if cause is not None:
            error.__cause__ = cause
        with self._lock:
            self._dead = error
            pending = list(self._commands)
            self._commands.clear()
        streams = list(self._streams.values()) + [c.stream for c in pending if isinstance(c, _Add)]
        self._streams.clear()
        delivery: dict[asyncio.AbstractEventLoop, _Delivery] = {}
        for stream in streams:
            delivery.setdefault(stream._loop, _Delivery()).items.append((stream, error))
        self._send(delivery)
