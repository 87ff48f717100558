"""Moving KV blocks between engines (prefill/decode disaggregation): KVHandoff, block export / import, the producer's
leases (KVLeases) and KV server (KVServer), the consumer's puller (KVPuller).

ZeroMQ carries raw tensor bytes (ipc in one server, tcp between hosts; nothing unpickled). Blocks are copied and freed
only under KVLeases.lock, so a block is never reused mid-copy. See docs/disaggregation.md.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import zmq

from lmserve.model.kv_cache import KVCache
from lmserve.sample.sampler import TokenLogprobs

logger = logging.getLogger(__name__)


# ---- the handoff record ----------------------------------------------------------------------------------


@dataclass
class ChildHandoff:
    """One sequence of a handed-off request, as the prefill engine left it after its first token."""

    index: int
    output_token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)  # the producer's blocks of the prompt's KV; [] if finished
    finish_reason: str | None = None  # it finished on the prefill side (EOS, a stop string, max_tokens)
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    generator_state: bytes | None = None  # a seeded sequence's torch.Generator state after its first token
    lease_id: str = ""  # the producer's id of the sequence: its KV lease (the decode side's ids may differ)


@dataclass
class KVHandoff:
    """vLLM's kv_transfer_params: where a request's prompt KV waits and what the decode side continues from."""

    request_id: str
    producer_address: str  # the producer's KV server (ZeroMQ address)
    num_tokens: int  # prompt tokens whose KV the blocks hold
    children: list[ChildHandoff]
    block_size: int
    kv_cache_dtype: str
    num_cached_tokens: int = 0  # the prefill side's prefix-cache hit (what usage reports)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None  # TTFT is the prefill side's
    first_token_delivered: bool = False  # the client streamed it already (one serve); else the decode side emits it

    def to_params(self) -> dict[str, Any]:
        """The JSON object a prefill server answers in `kv_transfer_params` (and a decode server is sent)."""
        return {"do_remote_prefill": True, **msgspec.to_builtins(self)}

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> KVHandoff:
        """The inverse of to_params; ValueError naming kv_transfer_params for a malformed one."""
        fields_ = {k: v for k, v in params.items() if k not in ("do_remote_prefill", "do_remote_decode")}
        try:
            return msgspec.convert(fields_, cls)
        except msgspec.ValidationError as e:
            raise ValueError(f"kv_transfer_params: {e}") from None


# ---- block export / import -------------------------------------------------------------------------------


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def cache_tensors(caches: list[KVCache]) -> list[torch.Tensor]:
    """Every tensor a block has a slice of, in a fixed order: per layer K, V, then their scales (8-bit caches)."""
    out = []
    for c in caches:
        out.extend(t for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None)
    return out


def block_nbytes(caches: list[KVCache]) -> int:
    """Bytes one block moves (values and scales, every layer)."""
    return sum(t[0].numel() * t.element_size() for t in cache_tensors(caches))


def export_blocks(caches: list[KVCache], block_ids: list[int]) -> list[memoryview]:
    """The blocks' bytes: one contiguous buffer per cache tensor, blocks in the given order."""
    idx = torch.tensor(block_ids, dtype=torch.long)
    frames = []
    for t in cache_tensors(caches):
        rows = _bytes(t).index_select(0, idx).contiguous()
        frames.append(memoryview(rows.view(torch.uint8).numpy()).cast("B"))
    return frames


def import_blocks(caches: list[KVCache], block_ids: list[int], frames: list[Any]) -> None:
    """Write frames (export_blocks of the same geometry) into the local blocks block_ids."""
    tensors = cache_tensors(caches)
    assert len(frames) == len(tensors), f"{len(frames)} frames for {len(tensors)} cache tensors: another KV layout"
    idx = torch.tensor(block_ids, dtype=torch.long)
    for t, frame in zip(tensors, frames, strict=True):
        dst = _bytes(t)
        expected = len(block_ids) * dst[0].numel() * dst.element_size()
        buf = memoryview(frame).cast("B")
        assert buf.nbytes == expected, f"a KV frame of {buf.nbytes} bytes, expected {expected}: another KV layout"
        with warnings.catch_warnings():  # a received frame is read-only; it is only read
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(buf, dtype=torch.uint8)
        dst.index_copy_(0, idx, src.view(dst.dtype).view(len(block_ids), *dst.shape[1:]))


# ---- the producer: leases and the KV server -------------------------------------------------------------


@dataclass
class _Lease:
    request: Any  # the detached Request (its blocks are in the KVCacheManager's table under its id)
    block_ids: list[int]
    deadline: float


class KVLeases:
    """The producer's handed-off requests whose blocks it still holds, until pulled, released or expired."""

    def __init__(self, lease_s: float, clock=time.monotonic) -> None:
        self.lease_s = lease_s
        self.clock = clock
        self.lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}  # child request id → lease
        self._ended: list[Any] = []  # requests whose lease ended on the server thread: the engine frees them
        self.num_expired_total = 0
        self.num_pulled_total = 0

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def idle(self) -> bool:
        """Nothing held and nothing to free (read without the lock: a stale answer only delays a free)."""
        return not self._leases and not self._ended

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases

    def grant(self, request: Any, block_ids: list[int]) -> None:
        with self.lock:
            assert request.request_id not in self._leases, f"{request.request_id} already holds a KV lease"
            self._leases[request.request_id] = _Lease(request, block_ids, self.clock() + self.lease_s)

    def export(self, request_id: str, block_ids: list[int], caches: list[KVCache]) -> list[memoryview] | str:
        """Server thread: the blocks' bytes, ending the lease; or why not (an error text)."""
        with self.lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return f"no KV lease for request {request_id!r} (expired, released or never granted)"
            unknown = sorted(set(block_ids) - set(lease.block_ids))
            if unknown:
                return f"blocks {unknown[:5]} are not request {request_id!r}'s"
            frames = export_blocks(caches, block_ids) if block_ids else []
            self._ended.append(self._leases.pop(request_id).request)
            self.num_pulled_total += 1
            return frames

    def release(self, request_id: str) -> None:
        """The lease ends without a pull (the consumer had every block cached, or the request was aborted)."""
        with self.lock:
            lease = self._leases.pop(request_id, None)
            if lease is not None:
                self._ended.append(lease.request)

    def collect(self, free: Any) -> int:
        """Engine thread: free (KVCacheManager.free) every ended or expired lease's request; returns how many."""
        now = self.clock()
        with self.lock:
            expired = [rid for rid, lease in self._leases.items() if lease.deadline <= now]
            for rid in expired:
                logger.warning("KV lease of request %s expired after %.1f s without a pull: blocks freed", rid,
                               self.lease_s)  # fmt: skip
                self._ended.append(self._leases.pop(rid).request)
            self.num_expired_total += len(expired)
            ended, self._ended = self._ended, []
            for request in ended:
                free(request)
        return len(ended)


class KVServer:
    """The producer's thread answering pulls: ROUTER socket; `pull` → [header, *frames], `release` → nothing."""

    def __init__(self, bind_address: str, leases: KVLeases, caches: list[KVCache], geometry: dict[str, Any]) -> None:
        self.leases = leases
        self.caches = caches
        self.geometry = geometry
        self._bind = bind_address
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.address: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="lmserve-kv-server", daemon=True)

    def start(self) -> str:
        self._thread.start()
        self._ready.wait(30)
        if self.address is None:
            raise RuntimeError(f"kv_transfer_config: the KV server could not bind {self._bind}: {self._error}")
        return self.address

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            if self._bind.endswith(":*"):
                port = sock.bind_to_random_port(self._bind[:-2])
                self.address = f"{self._bind[:-2]}:{port}"
            else:
                sock.bind(self._bind)
                self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._error = e
            self._ready.set()
            sock.close()
            return
        self._ready.set()
        encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(dict)
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                ident, kind, header = sock.recv_multipart()
                msg = decoder.decode(header)
                if kind == b"release":
                    self.leases.release(msg["request_id"])
                    continue
                assert kind == b"pull", f"unknown KV message {kind!r}"
                result = self.leases.export(msg["request_id"], msg["block_ids"], self.caches)
                if isinstance(result, str):
                    reply = {"ticket": msg["ticket"], "ok": False, "error": result}
                    sock.send_multipart([ident, encoder.encode(reply)])
                else:
                    reply = {"ticket": msg["ticket"], "ok": True, "geometry": self.geometry}
                    sock.send_multipart([ident, encoder.encode(reply), *result], copy=False)
        finally:
            sock.close()


# ---- the consumer: pulls -----------------------------------------------------------------------------------


@dataclass
class PullResult:
    ticket: int
    frames: list[Any] | None  # None: failed
    error: str | None = None
    geometry: dict[str, Any] | None = None


class KVPuller:
    """The consumer's pulls, asynchronous: `pull` sends, `poll` returns what answered or timed out. One DEALER
    socket per producer address, used only by the engine thread."""

    def __init__(self, timeout_s: float, clock=time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self._ctx = zmq.Context.instance()
        self._sockets: dict[str, zmq.Socket] = {}
        self._poller = zmq.Poller()
        self._deadlines: dict[int, float] = {}
        self._tickets = itertools.count()
        self._encoder, self._decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(dict)

    @property
    def num_in_flight(self) -> int:
        return len(self._deadlines)

    def _socket(self, address: str) -> zmq.Socket:
        sock = self._sockets.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self._sockets[address] = sock
            self._poller.register(sock, zmq.POLLIN)
        return sock

    def pull(self, address: str, request_id: str, block_ids: list[int]) -> int:
        ticket = next(self._tickets)
        header = {"request_id": request_id, "block_ids": block_ids, "ticket": ticket}
        self._socket(address).send_multipart([b"pull", self._encoder.encode(header)])
        self._deadlines[ticket] = self.clock() + self.timeout_s
        return ticket

    def release(self, address: str, request_id: str) -> None:
        self._socket(address).send_multipart([b"release", self._encoder.encode({"request_id": request_id})])

    def cancel(self, ticket: int) -> None:
        """Forget a pull (its request was aborted); a late answer is dropped."""
        self._deadlines.pop(ticket, None)

    def poll(self, timeout_ms: int = 0) -> list[PullResult]:
        results = []
        if self._deadlines:
            for sock, _ in self._poller.poll(timeout_ms):
                while True:
                    try:
                        parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    header = self._decoder.decode(parts[0].bytes)
                    if self._deadlines.pop(header["ticket"], None) is None:
                        continue  # cancelled, or timed out already
                    if header["ok"]:
                        frames = [p.buffer for p in parts[1:]]
                        results.append(PullResult(header["ticket"], frames, geometry=header["geometry"]))
                    else:
                        results.append(PullResult(header["ticket"], None, header["error"]))
        now = self.clock()
        for ticket in [t for t, d in self._deadlines.items() if d <= now]:
            del self._deadlines[ticket]
            results.append(PullResult(ticket, None, f"no answer from the producer within {self.timeout_s:g} s"))
        return results

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()


def kv_geometry(config: Any) -> dict[str, Any]:
    """What both sides of a transfer must agree on (checked on every pull and, two-server form, at start-up)."""
    mc, cc = config.model, config.cache
    return {
        "model": mc.path.rstrip("/").rsplit("/", 1)[-1],
        "vocab_size": mc.vocab_size,
        "hidden_size": mc.hidden_size,
        "num_layers": mc.num_layers,
        "num_kv_heads": mc.num_kv_heads,
        "head_dim": mc.head_dim,
        "block_size": cc.block_size,
        "kv_cache_dtype": cc.kv_cache_dtype,
    }


def geometry_mismatch(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """The first field two engines disagree on, as an error text, or None."""
    for key in ("model", "vocab_size", "hidden_size", "block_size", "kv_cache_dtype", "num_layers", "num_kv_heads",
                "head_dim"):
        if ours.get(key) != theirs.get(key):
            return f"{key}: the producer has {theirs.get(key)!r}, this consumer {ours.get(key)!r}"
    return None
