"""A tensor-parallel group's collectives (model/parallel.Collectives) on torch.distributed: gloo on the CPU, NCCL on
CUDA; on one x86-64 host the sum all-reduce and the gather go through shared memory (shm_allreduce.py).

TPGroup is one rank's handle; the process group is built on rank 0's TCPStore (Rendezvous), not through
`init_process_group`, so several engines (data parallel, tests) can live in one process.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lmserve.distributed.shm_allreduce import ShmAllReduce

DEFAULT_TIMEOUT_S = 300.0  # a collective no peer joins within this long fails (a dead peer fails at once: its socket)
BACKENDS = ("gloo", "nccl")
ALL_REDUCE_MODES = ("auto", "shm", "backend")
ALL_REDUCE_ENV = "LMSERVE_TP_ALL_REDUCE"  # overrides Rendezvous.all_reduce (benchmarks, A/B)


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one group meet: rank 0's TCPStore."""

    host: str
    port: int
    size: int
    backend: str = "gloo"
    timeout_s: float = DEFAULT_TIMEOUT_S
    all_reduce: str = "auto"  # "auto" (shared memory when every rank is on this x86-64 host, else the backend's)
    # | "shm" (required: fails otherwise) | "backend" (gloo / NCCL always)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


class TPGroup:
    """One rank's handle on its group: sum / max all-reduce in place, gather to rank 0, barrier."""

    def __init__(self, rv: Rendezvous, rank: int, store: dist.TCPStore | None = None) -> None:
        if rv.backend not in BACKENDS:
            raise ValueError(f"distributed backend must be one of {list(BACKENDS)}, got {rv.backend!r}")
        assert 0 <= rank < rv.size, f"rank {rank} of a group of {rv.size}"
        self.rank, self.size, self.backend = rank, rv.size, rv.backend
        timeout = datetime.timedelta(seconds=rv.timeout_s)
        self.store = store or dist.TCPStore(rv.host, rv.port, rv.size, rank == 0, timeout=timeout)
        if rv.backend == "gloo":
            self.pg = dist.ProcessGroupGloo(self.store, rank, rv.size, timeout)
        else:  # CUDA: written for a machine with GPUs (kept importable here; torch's CPU build has no NCCL)
            nccl = getattr(dist, "ProcessGroupNCCL", None)
            if nccl is None:
                raise ValueError("distributed backend 'nccl' needs a CUDA build of torch; this one has none")
            torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
            self.pg = nccl(self.store, rank, rv.size, nccl.Options() if hasattr(nccl, "Options") else None)
        self._max = dist.AllreduceOptions()
        self._max.reduceOp = dist.ReduceOp.MAX
        self._gather = dist.GatherOptions()
        self._gather.rootRank = 0
        self.abort_reason: Callable[[], str | None] = lambda: None  # set by the owner: why a wait should give up
        self.shm: ShmAllReduce | None = self._shared_memory(rv)

    @property
    def all_reduce_kind(self) -> str:
        return "shm" if self.shm is not None else self.backend

    def _shared_memory(self, rv: Rendezvous) -> ShmAllReduce | None:
        """The shared-memory all-reduce, when the mode allows it and every rank is on this host (x86-64)."""
        mode = os.environ.get(ALL_REDUCE_ENV) or rv.all_reduce
        if mode not in ALL_REDUCE_MODES:
            raise ValueError(f"{ALL_REDUCE_ENV} / all_reduce must be one of {list(ALL_REDUCE_MODES)}, got {mode!r}")
        if mode == "backend":
            return None
        self.store.set(f"host/{self.rank}", f"{socket.gethostname()} {platform.machine()}")
        hosts = {self.store.get(f"host/{r}").decode() for r in range(self.size)}
        usable = len(hosts) == 1 and hosts.pop().endswith(" x86_64") and self.backend == "gloo"
        if not usable:
            if mode == "shm":
                raise ValueError("all_reduce='shm' needs every rank on one x86-64 host with the gloo backend")
            return None
        if self.rank == 0:
            path = f"/dev/shm/lmserve-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
            shm = ShmAllReduce(path, 0, self.size, create=True, alive=self._why_stop)
            self.store.set("shm/path", path)
        else:
            path = self.store.get("shm/path").decode()
            shm = ShmAllReduce(path, self.rank, self.size, create=False, alive=self._why_stop)
        self.barrier_backend()  # every rank has it mapped: the name can go (no file outlives the group)
        if self.rank == 0:
            os.unlink(path)
            shm._created = False
        return shm

    def _why_stop(self) -> str | None:
        return self.abort_reason()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (t must be contiguous); returns t."""
        if self.shm is not None and t.device.type == "cpu":
            return self.shm.all_reduce(t)
        self.pg.allreduce([t]).wait()
        return t

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        self.pg.allreduce([t], self._max).wait()
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's t (same shape) on rank 0, in rank order; None on the others. Through the shared memory
        when the all-reduce is (a CPU tensor), else the backend's gather."""
        if self.shm is not None and t.device.type == "cpu":
            return self.shm.gather(t.contiguous())
        if self.rank == 0:
            out = [torch.empty_like(t) for _ in range(self.size)]
            self.pg.gather([out], [t], self._gather).wait()
            return out
        self.pg.gather([], [t], self._gather).wait()
        return None

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1))

    def barrier_backend(self) -> None:
        self.pg.allreduce([torch.zeros(1)]).wait()

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # noqa: BLE001 (a peer already gone: nothing left to close cleanly)
                pass
