"""A shared-memory all-reduce for the ranks of one tensor-parallel group on one host (vLLM's CPU backend has one
beside gloo): a /dev/shm file mapped by every rank, spin-waited sequence flags, no sockets.

    header   one int64 flag per rank, 64 bytes apart (no false sharing): the last call the rank has posted
    data     2 buffers (call parity) x ranks x slot_bytes

Call k (per rank, in the same order on all ranks, as every collective): wait until every peer posted call k - 1
(so it has finished reading call k - 2, the last user of this parity's buffer), copy the input into this rank's
slot of buffer k % 2, post k, wait until every peer posted k, then sum the slots in rank order into the input. Every
rank adds the same numbers in the same order: the results are identical on all ranks (as gloo's). Inputs larger
than a slot go through in slot-sized chunks, one call each.

Ordering relies on x86's total store order (the data is stored before the flag, and read after it): the group uses
this only on x86-64 (worker/distributed.py), else gloo.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable

import numpy as np
import torch

FLAG_STRIDE = 8  # int64s between two ranks' flags: 64 bytes, one cache line each
DEFAULT_SLOT_BYTES = 4 * 2**20  # a 1,024-token prefill's hidden states (576 floats) in two chunks
SPINS_BEFORE_YIELD = 2000  # then the waiting rank yields its CPU between checks (a crowded machine)
CHECK_EVERY = 4096  # spins between liveness checks


class ShmAllReduce:
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
        self._seq = 0
        self._created = create

    def _slot(self, parity: int, rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        start = (parity * self.size + rank) * self.slot_bytes
        return self._data[start : start + numel * dtype.itemsize].view(dtype)

    def _wait(self, seq: int) -> None:
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
        flat = t.view(-1)
        per = self.slot_bytes // t.element_size()
        for start in range(0, flat.numel(), per):
            self._reduce_chunk(flat[start : start + per])
        return t

    def _reduce_chunk(self, x: torch.Tensor) -> None:
        self._seq += 1
        seq, parity = self._seq, self._seq % 2
        self._wait(seq - 1)  # every peer is done with this parity's buffer (its call seq - 2)
        self._slot(parity, self.rank, x.dtype, x.numel()).copy_(x)
        self._flags[self.rank * FLAG_STRIDE] = seq
        self._wait(seq)
        torch.add(self._slot(parity, 0, x.dtype, x.numel()), self._slot(parity, 1, x.dtype, x.numel()), out=x)
        for r in range(2, self.size):
            x.add_(self._slot(parity, r, x.dtype, x.numel()))

    def close(self) -> None:
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
