"""The KV pool's memory, committed as it is used: every K / V / scale tensor is an anonymous mapping (zero pages
until written, no RSS), and blocks are committed in chunks, in block-id order, before a step first writes them:
the block pool hands never-used blocks out in id order, so the blocks ever used are [0, high-water mark). A chunk
is committed only when the machine (MemAvailable, and the cgroup's limit) can hold it beside a reserve; else the
step raises KVCommitError, a clear error instead of a kernel OOM kill. The pool's size stays the budget's.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterable

import torch

from lmserve.memory.ledger import KV_COMMIT_CHUNK_BYTES as CHUNK_BYTES  # (the ledger's figure: `lmserve memory`)

RESERVE_BYTES = 256 * 2**20  # a chunk is committed only if this much memory stays available after it
_PAGE = mmap.PAGESIZE


class KVCommitError(MemoryError):
    """The machine cannot hold the next chunk of the KV pool (the pool was sized when more memory was free)."""


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros(shape) whose pages are not committed until written (CPU: an anonymous mapping; reads of an
    unwritten page see zeros); other devices: torch.zeros."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)  # (the tensor keeps the mapping alive)


def commitable_bytes() -> int | None:
    """Memory this process may still commit: MemAvailable, lowered to the cgroup's room under its memory.max;
    None when neither can be read."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read().strip())
        if limit != "max":
            found.append(int(limit) - current)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


class KVPoolMemory:
    """Commits the blocks of a pool's KV tensors (block id first in each: (num_blocks, ...)) chunk by chunk."""

    def __init__(
        self,
        num_blocks: int,
        tensors: Iterable[torch.Tensor] = (),
        chunk_bytes: int = CHUNK_BYTES,
        reserve_bytes: int = RESERVE_BYTES,
        available: Callable[[], int | None] | None = None,
    ) -> None:
        """available(): the bytes the machine can still commit (None: unknown); default commitable_bytes."""
        self.num_blocks = num_blocks
        self.chunk_bytes, self.reserve_bytes, self._available = chunk_bytes, reserve_bytes, available
        self._tensors: list[torch.Tensor] = []
        self.committed_blocks = 0  # blocks [0, committed_blocks) are committed
        self.add(tensors)

    def add(self, tensors: Iterable[torch.Tensor]) -> None:
        """More tensors of the same blocks (a speculative draft's KV), committed as far as the others."""
        new = [t for t in tensors if t is not None]
        for t in new:
            assert t.shape[0] == self.num_blocks and t.is_contiguous(), f"KV tensor {tuple(t.shape)} is not a pool's"
            if t.device.type != "cpu":
                self.committed_blocks = self.num_blocks  # (a device's allocator commits it all at once)
        self._tensors += new
        if self.committed_blocks:
            self._touch(new, 0, self.committed_blocks)

    @property
    def block_bytes(self) -> int:
        return sum(t.nbytes for t in self._tensors) // self.num_blocks

    @property
    def pool_bytes(self) -> int:
        return self.block_bytes * self.num_blocks

    @property
    def committed_bytes(self) -> int:
        return self.block_bytes * self.committed_blocks

    def ensure(self, max_block_id: int) -> None:
        """Commit every block up to max_block_id (a step is about to write it), in whole chunks; raises
        KVCommitError, committing nothing more, when the machine cannot hold the chunk beside the reserve."""
        if max_block_id < self.committed_blocks:
            return
        assert max_block_id < self.num_blocks, f"block {max_block_id} is outside the pool of {self.num_blocks}"
        per_chunk = max(1, self.chunk_bytes // max(1, self.block_bytes))
        end = min(self.num_blocks, -(-(max_block_id + 1) // per_chunk) * per_chunk)
        need = (end - self.committed_blocks) * self.block_bytes
        available = (self._available or commitable_bytes)()
        if available is not None and available - need < self.reserve_bytes:
            mib = 2**20
            raise KVCommitError(
                f"KV cache: blocks {self.committed_blocks}..{end - 1} ({need / mib:.0f} MiB) cannot be committed: "
                f"the machine has {max(0, available) / mib:.0f} MiB available and keeps {self.reserve_bytes / mib:.0f} "
                f"MiB in reserve ({self.committed_bytes / mib:.0f} of the pool's {self.pool_bytes / mib:.0f} MiB "
                f"committed so far); give the engine a smaller kv_cache_memory_gib / num_kv_blocks, or free memory"
            )
        self._touch(self._tensors, self.committed_blocks, end)
        self.committed_blocks = end

    @staticmethod
    def _touch(tensors: list[torch.Tensor], start: int, end: int) -> None:
        """Write one byte of every page of blocks [start, end) back onto itself: committed, contents unchanged (a
        block written before it was counted, e.g. one a KV transfer imported, keeps its data)."""
        for t in tensors:
            if t.device.type != "cpu":
                continue
            raw = t.view(-1).view(torch.uint8)
            row = raw.numel() // t.shape[0]
            lo, hi = start * row, end * row
            first = lo + (-(raw.data_ptr() + lo)) % _PAGE  # the first page boundary at or after lo
            pages = raw[first:hi:_PAGE]
            if lo < first:
                raw[lo : lo + 1].add_(0)
            pages.add_(0)


def pool_tensors(caches: Iterable[object]) -> list[torch.Tensor]:
    """The K, V and scale tensors of KVCache objects (model/kv_cache.py); a hybrid's state tensors (no `k`) are
    not the pool's: allocated whole, beside it."""
    kv = [c for c in caches if hasattr(c, "k")]
    return [t for c in kv for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None]  # type: ignore[attr-defined]
