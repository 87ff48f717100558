"""A shared-memory all-reduce and gather for the ranks of one tensor-parallel group on one host (ShmAllReduce).

A /dev/shm file mapped by every rank, sequence flags spun on then slept on, slots summed in rank order (the same bits
on every rank); the C kernels (cpu_kernels.c: shm_all_reduce_f32) share the call sequence. x86-64 only (total store
order). The protocol: ShmAllReduce and docs/tensor_parallel.md.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from lmserve import kernels

FLAG_STRIDE = 8  # int64s between two ranks' flags: 64 bytes, one cache line each (LS_AR_FLAG_STRIDE in C)
DEFAULT_SLOT_BYTES = 4 * 2**20  # a 1,024-token prefill's hidden states (576 floats) in two chunks
SPINS_BEFORE_YIELD = 2000  # then the waiting rank yields its CPU between checks (a crowded machine)
CHECK_EVERY = 4096  # spins between liveness checks
WATCH_S = 0.05  # how often the watcher thread asks alive() for the C waits
SPIN_US = 50  # a C wait spins this long before it sleeps on the futex
SPIN_ENV = "LMSERVE_TP_SPIN_US"  # overrides SPIN_US (benchmarks, A/B)


def spin_us() -> int:
    """How long a C wait spins before sleeping: $LMSERVE_TP_SPIN_US, else SPIN_US."""
    text = os.environ.get(SPIN_ENV, "")
    if not text:
        return SPIN_US
    if not text.isdigit():
        raise ValueError(f"{SPIN_ENV} must be a whole number of microseconds, got {text!r}")
    return int(text)


class ShmDesc(ctypes.Structure):
    """cpu_kernels.c's struct ls_allreduce: the mapped flags and data, this rank, and how to wait."""

    _fields_ = [("flags", ctypes.c_void_p), ("data", ctypes.c_void_p)]
    _fields_ += [(n, ctypes.c_int64) for n in ("rank", "size", "slot_bytes")]
    _fields_ += [("abort", ctypes.c_void_p), ("timeout_s", ctypes.c_double), ("spin_us", ctypes.c_int64)]


class ShmAllReduce:
    """One rank's view of the map: per rank a 64-byte-apart header (flag = last call posted, waiters word), then
    2 buffers (call parity) x ranks x slot_bytes.

    Call k: wait until every peer posted k - 1 (done reading this parity's buffer), copy in, post k, wait for k,
    sum the slots in rank order; larger inputs go in slot-sized chunks. gather: only rank 0 waits and reads. With
    the kernels loaded waits spin for SPIN_US, then sleep on a futex (a poster wakes sleepers), and a watcher
    thread sets the abort word that C's wait checks; without them, spin then sched_yield.
    """

    def __init__(
        self,
        path: str,
        rank: int,
        size: int,
        create: bool,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        alive: Callable[[], str | None] | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        """create: rank 0 makes the file (the others open it after a barrier); alive(): None while the group may
        go on, else why not (a waiting rank raises it)."""
        assert slot_bytes % 64 == 0, f"slot_bytes {slot_bytes} must be a multiple of 64"
        self.path, self.rank, self.size, self.slot_bytes = path, rank, size, slot_bytes
        self.alive, self.timeout_s = alive, timeout_s
        header = size * FLAG_STRIDE * 8
        total = header + 2 * size * slot_bytes
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, total)
            self._mm = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        self._flags = np.frombuffer(self._mm, dtype=np.int64, count=size * FLAG_STRIDE)
        self._data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=header, count=total - header)
        self._created = create
        self._abort = np.zeros(1, dtype=np.int64)  # this process's abort word (the C waits read it)
        self._why: str | None = None  # alive()'s reason, once the watcher saw one
        self.desc: ShmDesc | None = None  # the C description, when the kernels are loaded
        self._closed = threading.Event()
        if kernels.available():
            self.desc = ShmDesc(
                self._flags.ctypes.data, self._data.data_ptr(), rank, size, slot_bytes, self._abort.ctypes.data,
                timeout_s, spin_us(),
            )  # fmt: skip
            if alive is not None:
                name = f"lmserve-shm-watch-{rank}"
                threading.Thread(target=self._watch, daemon=True, name=name).start()

    def _watch(self) -> None:
        while not self._closed.wait(WATCH_S):
            why = self.alive()
            if why is not None:
                self._why = why
                self._abort[0] = 1
                return

    def _next_seq(self) -> int:
        """This rank's next call: its posted flag (its call counter, shared with the C side) + 1."""
        return int(self._flags[self.rank * FLAG_STRIDE]) + 1

    def raise_for(self, rc: int) -> None:
        """Raise for a C call's nonzero return (kernels.SHM_ABORTED / SHM_TIMEOUT)."""
        if rc == kernels.SHM_ABORTED:
            raise RuntimeError(self._why or "shared-memory all-reduce: aborted")
        if rc == kernels.SHM_TIMEOUT:
            raise RuntimeError(f"shared-memory all-reduce: a peer did not arrive in {self.timeout_s} s")
        assert rc == 0, f"shared-memory all-reduce: unexpected return {rc}"

    def _slot(self, parity: int, rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        start = (parity * self.size + rank) * self.slot_bytes
        return self._data[start : start + numel * dtype.itemsize].view(dtype)

    def _post(self, seq: int) -> None:
        if self.desc is not None:
            kernels.shm_post(ctypes.byref(self.desc), seq)  # (wakes a peer sleeping in C)
        else:
            self._flags[self.rank * FLAG_STRIDE] = seq

    def _wait(self, seq: int) -> None:
        if self.desc is not None:
            self.raise_for(kernels.shm_wait(ctypes.byref(self.desc), seq))
            return
        flags, spins, deadline = self._flags, 0, None
        for r in range(self.size):
            if r == self.rank:
                continue
            i = r * FLAG_STRIDE
            while flags[i] < seq:
                spins += 1
                if spins > SPINS_BEFORE_YIELD:
                    os.sched_yield()
                if spins % CHECK_EVERY == 0:
                    why = self.alive() if self.alive is not None else None
                    if why is not None:
                        raise RuntimeError(why)
                    deadline = deadline or time.monotonic() + self.timeout_s
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"shared-memory all-reduce: rank {r} did not arrive in {self.timeout_s} s")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (t contiguous, on the CPU); returns t."""
        assert t.is_contiguous() and t.device.type == "cpu", "shared-memory all-reduce: a contiguous CPU tensor"
        if self.desc is not None and t.dtype == torch.float32:
            self.raise_for(kernels.shm_all_reduce(ctypes.byref(self.desc), t))
            return t
        flat = t.view(-1)
        per = self.slot_bytes // t.element_size()
        for start in range(0, flat.numel(), per):
            self._reduce_chunk(flat[start : start + per])
        return t

    def _reduce_chunk(self, x: torch.Tensor) -> None:
        seq = self._next_seq()
        parity = seq % 2
        self._wait(seq - 1)  # every peer is done with this parity's buffer (its call seq - 2)
        self._slot(parity, self.rank, x.dtype, x.numel()).copy_(x)
        self._post(seq)
        self._wait(seq)
        torch.add(self._slot(parity, 0, x.dtype, x.numel()), self._slot(parity, 1, x.dtype, x.numel()), out=x)
        for r in range(2, self.size):
            x.add_(self._slot(parity, r, x.dtype, x.numel()))

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's t (same shape and dtype on all, contiguous) on rank 0, in rank order (its own is t);
        None on the others."""
        assert t.is_contiguous() and t.device.type == "cpu", "shared-memory gather: a contiguous CPU tensor"
        flat = t.view(-1)
        out = None if self.rank else [t] + [torch.empty_like(t) for _ in range(1, self.size)]
        per = self.slot_bytes // t.element_size()
        for start in range(0, flat.numel(), per):
            x = flat[start : start + per]
            seq = self._next_seq()
            parity = seq % 2
            self._wait(seq - 1)
            if self.rank:
                self._slot(parity, self.rank, x.dtype, x.numel()).copy_(x)
            self._post(seq)
            if out is not None:
                self._wait(seq)
                for r in range(1, self.size):
                    out[r].view(-1)[start : start + x.numel()].copy_(self._slot(parity, r, x.dtype, x.numel()))
        return out

    def close(self) -> None:
        self._closed.set()
        self.desc = None
        self._flags = self._data = None  # (views of the map: released before it closes)
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere: the map goes with the process
            pass
        if self._created:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
