"""Tensor parallelism's processes (TPExecutor): the engine runs rank 0 and drives ranks 1..N-1, spawned workers, SPMD.

Per step the model's flat inputs cross to each rank, msgpack-encoded once; workers hold no request state and
sampling happens once, on rank 0, from the gathered logits. A watcher thread sees a dead worker at once and the next
step fails. See docs/tensor_parallel.md.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import msgspec
import torch
import zmq

from lmserve.config.engine import EngineConfig
from lmserve.distributed.group import Rendezvous, TPGroup, backend_for, free_port

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 600.0
POLL_MS = 500  # an idle worker checks its parent this often


class TPForward(msgspec.Struct, tag=True):
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    decode_lens: list[int]
    decode_tables: list[list[int]]
    prefills: list[tuple[int, int, int, list[int]]]  # (start row, tokens, cached context, block ids)


class TPLogits(msgspec.Struct, tag=True):
    rows: int
    dtype: str
    data: bytes


class TPStop(msgspec.Struct, tag=True):
    pass


TPMessage = TPForward | TPLogits | TPStop


@dataclass(frozen=True)
class WorkerLaunch:
    config: EngineConfig
    rank: int
    rendezvous: Rendezvous
    address: str  # rank 0's PUSH for this rank
    num_threads: int
    cpus: tuple[int, ...] | None
    parent_pid: int | None  # a subprocess: rank 0's pid, its parent (None: a Ray actor)


def split_threads(num_threads: int, tp: int) -> int:
    """--num-threads is the TP group's: each rank gets an equal share, at least 1."""
    return max(1, num_threads // tp)


def rank_cpus(cpus: tuple[int, ...] | None, tp: int) -> list[tuple[int, ...] | None]:
    """A TP group's CPU slice divided between its ranks (disjoint, rank order); None entries: no pinning."""
    if not cpus or len(cpus) < tp:
        return [None] * tp
    per = len(cpus) // tp
    return [tuple(cpus[r * per : (r + 1) * per]) for r in range(tp)]


class _ProcessWorker:
    """A rank as a subprocess (`python -m lmserve.engine.tp_executor LAUNCH_FILE`)."""

    def __init__(self, launch: WorkerLaunch, tmp: str) -> None:
        path = os.path.join(tmp, f"rank{launch.rank}.launch")
        with open(path, "wb") as f:
            pickle.dump(launch, f)
        env = {**os.environ, "OMP_NUM_THREADS": str(launch.num_threads)}  # (PYTHONPATH and the rest inherited)
        self.proc = subprocess.Popen([sys.executable, "-m", "lmserve.engine.tp_executor", path], env=env)
        self.pid: int | str = self.proc.pid

    def wait(self) -> str:
        code = self.proc.wait()
        return f"killed by signal {-code}" if code < 0 else f"exit status {code}"

    def stop(self, timeout_s: float) -> None:
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class _RayWorker:
    """A rank as a Ray actor in bundle `rank` of the TP group's placement group (the core's own, when it runs in
    one: core_handles makes it, rank 0 in bundle 0). Non-detached: Ray ends it with its owner, the engine core."""

    def __init__(self, launch: WorkerLaunch, pg: object) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        env = {"OMP_NUM_THREADS": str(launch.num_threads)}
        if os.environ.get("PYTHONPATH"):
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        actor_cls = ray.remote(num_cpus=launch.num_threads, max_restarts=0)(_TPWorkerActor)
        strategy = PlacementGroupSchedulingStrategy(pg, launch.rank)
        self.actor = actor_cls.options(runtime_env={"env_vars": env}, scheduling_strategy=strategy).remote()
        self.ref = self.actor.run.remote(launch)
        self.pid = f"ray actor {self.actor._actor_id.hex()[:8]}"

    def wait(self) -> str:
        import ray

        try:
            ray.get(self.ref)
            return "the actor's loop returned"
        except Exception as e:  # RayActorError: the actor's process died
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def stop(self, timeout_s: float) -> None:
        import ray

        ready, _ = ray.wait([self.ref], timeout=timeout_s)
        if not ready:
            self.kill()

    def kill(self) -> None:
        import ray

        try:
            ray.kill(self.actor)
        except Exception:  # noqa: BLE001 (already gone)
            pass


class _TPWorkerActor:
    """Ray actor body (wrapped with ray.remote at launch, so Ray stays an optional import)."""

    def run(self, launch: WorkerLaunch) -> None:
        run_worker(launch)


def _placement_group(size: int, threads: int) -> tuple[object, bool]:
    """The TP group's placement group: the current one (the engine core's, rank 0 in bundle 0), else a new one
    (returned with True: this executor removes it)."""
    from ray.util import get_current_placement_group
    from ray.util.placement_group import placement_group

    pg = get_current_placement_group()
    if pg is not None and len(pg.bundle_specs) >= size:
        return pg, False
    pg = placement_group([{"CPU": threads}] * size, strategy="PACK")
    import ray

    ray.get(pg.ready(), timeout=WORKER_START_TIMEOUT_S)
    return pg, True


class TPExecutor:
    """Rank 0's side: spawns the workers, builds its own shard's ModelRunner and mirrors each model call to them."""

    def __init__(
        self,
        config: EngineConfig,
        num_threads: int | None = None,
        cpus: tuple[int, ...] | None = None,
        backend: str = "mp",
    ) -> None:
        """backend: "mp" (workers are subprocesses, ipc) or "ray" (Ray actors in a placement group, tcp on this
        node's IP; rendezvous through rank 0's TCPStore)."""
        from lmserve.worker.model_runner import ModelRunner

        if backend not in ("mp", "ray"):
            raise ValueError(f"tensor-parallel backend must be 'mp' or 'ray', got {backend!r}")
        self.size = config.tensor_parallel_size
        assert self.size > 1, "TPExecutor is for tensor_parallel_size > 1"
        threads = split_threads(num_threads or torch.get_num_threads(), self.size)
        slices = rank_cpus(cpus if backend == "mp" else None, self.size)  # (Ray places CPUs itself)
        self.failure: str | None = None
        self._dir = tempfile.mkdtemp(prefix="lmserve-tp-")
        host = "127.0.0.1"
        pg, own_pg = None, False
        if backend == "ray":
            import ray

            host = ray.util.get_node_ip_address()
            pg, own_pg = _placement_group(self.size, threads)
        rv = Rendezvous(host, free_port(host), self.size, backend_for(config.device))
        self._ctx = zmq.Context()
        self._socks: list[zmq.Socket] = []
        self._workers: list[_ProcessWorker | _RayWorker] = []
        self._enc = msgspec.msgpack.Encoder()
        self._closed = False
        self._finalizer = weakref.finalize(self, _cleanup, self._workers, self._socks, self._ctx, self._dir,
                                           pg if own_pg else None)  # fmt: skip
        for rank in range(1, self.size):
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            if backend == "ray":
                address = f"tcp://{host}:{sock.bind_to_random_port(f'tcp://{host}')}"
            else:
                address = f"ipc://{self._dir}/rank{rank}"
                sock.bind(address)
            self._socks.append(sock)
            parent = os.getpid() if backend == "mp" else None
            launch = WorkerLaunch(config, rank, rv, address, threads, slices[rank], parent)
            self._workers.append(_RayWorker(launch, pg) if backend == "ray" else _ProcessWorker(launch, self._dir))
        for rank, worker in enumerate(self._workers, start=1):  # (a weak reference: the threads keep no executor alive)
            name = f"lmserve-tp-watch-{rank}"
            args = (weakref.ref(self), rank, worker)
            threading.Thread(target=TPExecutor._watch, args=args, daemon=True, name=name).start()
        if slices[0] is not None:
            os.sched_setaffinity(0, slices[0])
        torch.set_num_threads(threads)
        self.group = TPGroup(rv, 0)  # returns once every rank joined the store (or fails after the timeout)
        self.group.abort_reason = lambda: self.failure
        self.runner = ModelRunner(config, tp=self.group)
        self.group.barrier()  # every rank has loaded its shard
        model = self.runner.model
        local_forward, local_logits = model.forward, model.compute_logits

        def forward(input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta) -> torch.Tensor:
            self._send(_forward_message(input_ids, positions, meta))
            with self._collective_errors():
                return local_forward(input_ids, positions, kv_caches, meta)

        def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
            h = hidden.contiguous()
            self._send(TPLogits(h.shape[0], str(h.dtype).removeprefix("torch."), h.cpu().numpy().tobytes()))
            with self._collective_errors():
                return local_logits(h)

        model.forward, model.compute_logits = forward, compute_logits
        logger.info("tensor parallel: %d ranks (workers %s: %s), %d threads each, %s, all-reduce %s", self.size,
                    "Ray actors" if backend == "ray" else "processes", [w.pid for w in self._workers], threads,
                    rv.backend, self.group.all_reduce_kind)  # fmt: skip

    @property
    def worker_pids(self) -> list[int | str]:
        return [w.pid for w in self._workers]

    @staticmethod
    def _watch(ref: weakref.ref[TPExecutor], rank: int, worker: _ProcessWorker | _RayWorker) -> None:
        how = worker.wait()
        self = ref()
        if self is not None and not self._closed:
            self.failure = f"tensor-parallel rank {rank} (pid {worker.pid}) died: {how}"
            logger.error("%s", self.failure)

    @contextmanager
    def _collective_errors(self) -> Iterator[None]:
        """A collective that fails (gloo: "Connection reset by peer") names the rank that died, once its watcher
        has seen it (a moment later)."""
        try:
            yield
        except RuntimeError as e:
            deadline = time.monotonic() + 1.0
            while self.failure is None and time.monotonic() < deadline:
                time.sleep(0.01)
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise RuntimeError(f"{self.failure or 'a tensor-parallel collective failed'} ({first})") from e

    def _send(self, msg: TPMessage) -> None:
        if self.failure is not None:
            raise RuntimeError(self.failure)
        data = self._enc.encode(msg)
        for sock in self._socks:
            sock.send(data, copy=False)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        data = self._enc.encode(TPStop())
        for sock in self._socks:
            try:
                sock.send(data, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for w in self._workers:
            w.stop(10)
        self.group.close()
        self._finalizer()
        model = self.runner.model
        for name in ("forward", "compute_logits"):  # the patched methods close over self: break the cycle
            model.__dict__.pop(name, None)
        self.runner = None  # (its model and KV pool go with the engine's reference)


def _cleanup(workers: list, socks: list, ctx: zmq.Context, tmp: str, pg: object | None) -> None:
    for w in workers:
        w.kill()
    for s in socks:
        s.close(0)
    ctx.term()
    shutil.rmtree(tmp, ignore_errors=True)
    if pg is not None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(pg)


def _forward_message(input_ids: torch.Tensor, positions: torch.Tensor, meta) -> TPForward:
    lens, tables = meta._decode_lists if meta.num_decode_tokens else ([], [])
    prefills = [
        (seg.start, seg.end - seg.start, seg.num_context_tokens, seg.block_table.tolist()) for seg in meta.prefills
    ]
    return TPForward(input_ids.tolist(), positions.tolist(), meta.slot_mapping.tolist(), lens, tables, prefills)


# ---- the worker process ------------------------------------------------------------------------------------------


def worker_main(launch: WorkerLaunch) -> None:
    """A subprocess rank: run_worker, then end the process at once (finalizing torch takes seconds)."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s [tp rank {launch.rank}]: %(message)s")  # fmt: skip
    try:
        run_worker(launch)
    except Exception:  # a collective failed (rank 0 or a peer died): nothing to save
        logger.exception("tensor-parallel rank %d stops", launch.rank)
        os._exit(1)
    logging.shutdown()
    os._exit(0)


def run_worker(launch: WorkerLaunch) -> None:
    """Rank r >= 1: load the shard, then run the model calls rank 0 sends until TPStop or rank 0's end."""
    from lmserve.worker.model_runner import ModelRunner

    if launch.cpus:
        os.sched_setaffinity(0, launch.cpus)
    torch.set_num_threads(launch.num_threads)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(launch.address)
    group = TPGroup(launch.rendezvous, launch.rank)
    group.abort_reason = lambda: None if _parent_alive(launch) else "rank 0's process is gone"
    try:
        runner = ModelRunner(launch.config, tp=group)
        group.barrier()
        _serve_steps(launch, sock, runner)
    finally:
        sock.close(0)
        ctx.term()
        group.close()


def _parent_alive(launch: WorkerLaunch) -> bool:
    """A subprocess checks rank 0's pid (its parent); a Ray actor ends with its owner, Ray's doing."""
    return launch.parent_pid is None or os.getppid() == launch.parent_pid


def _serve_steps(launch: WorkerLaunch, sock: zmq.Socket, runner) -> None:  # noqa: ANN001 (a ModelRunner)
    from lmserve.model.attention import AttentionMetadata, PrefillSegment
    from lmserve.model.layers import choose_small_m_paths
    from lmserve.model.parallel import local_only

    dec = msgspec.msgpack.Decoder(TPMessage)
    model, dev, bs = runner.model, runner.device, runner.block_size
    first = True
    with torch.inference_mode():
        while True:
            if not sock.poll(POLL_MS):
                if not _parent_alive(launch):
                    break  # rank 0's process is gone
                continue
            msg = dec.decode(sock.recv())
            if isinstance(msg, TPStop):
                break
            if isinstance(msg, TPLogits):
                dtype = getattr(torch, msg.dtype)
                h = torch.frombuffer(bytearray(msg.data), dtype=dtype).view(msg.rows, -1).to(dev)
                model.compute_logits(h)
                continue
            if first:
                first = False
                with local_only(model):
                    choose_small_m_paths(model)
            meta = AttentionMetadata(slot_mapping=torch.tensor(msg.slots, dtype=torch.long, device=dev))
            if msg.decode_lens:
                meta.set_decodes(msg.decode_lens, msg.decode_tables, bs)
            for start, n, ctx_tokens, blocks in msg.prefills:
                meta.prefills.append(PrefillSegment.for_chunk(start, n, ctx_tokens, blocks, bs, dev))
            ids = torch.tensor(msg.input_ids, dtype=torch.long, device=dev)
            pos = torch.tensor(msg.positions, dtype=torch.long, device=dev)
            if msg.slots:  # this rank's shard of the blocks the step writes: committed as rank 0's are
                runner.kv_pool.ensure(max(msg.slots) // bs)
            model(ids, pos, runner.kv_caches, meta)


if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        worker_main(pickle.load(f))  # our own launch file, written by TPExecutor in a private temp directory
