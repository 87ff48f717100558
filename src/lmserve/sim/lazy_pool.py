"""BlockPool with the real pool's allocation order, its blocks created on first use (LazyBlockPool)."""

from __future__ import annotations

from collections import OrderedDict

from lmserve.core.block_pool import BlockKey, BlockPool, KVCacheBlock


class LazyBlockPool(BlockPool):
    """BlockPool whose blocks exist only once handed out: building every block up front dominated large runs.

    The real free list is always [never-used blocks in id order] + [freed blocks, least recently freed first], so
    handing out never-used ids in order before freed ones gives the same sequence; everything else (reference
    counts, prefix index, eviction) is BlockPool's code. tests/sim/test_simulator.py compares both pools op by op.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:  # noqa: D107 - no super(): nothing eager
        assert num_blocks > 0, "the pool needs at least one block"
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._created: list[KVCacheBlock] = []  # ids 0 .. len - 1, handed out at least once
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict()  # freed blocks, least recently freed first
        self._index: dict[BlockKey, KVCacheBlock] = {}

    @property
    def blocks(self) -> list[KVCacheBlock]:  # type: ignore[override]
        """Every block (never-used ones as fresh free blocks; for reading: block maps, invariant checks)."""
        return self._created + [KVCacheBlock(i) for i in range(len(self._created), self.num_blocks)]

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self.num_blocks - len(self._created)

    @property
    def usage(self) -> float:  # BlockPool.usage's expression on the same count, one call (every step reads it)
        return 1.0 - (len(self._free) + self.num_blocks - len(self._created)) / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        assert n <= self.num_free_blocks, f"asked for {n} blocks, {self.num_free_blocks} free"
        out = []
        created = self._created
        for _ in range(n):
            if len(created) < self.num_blocks:  # the head of the real free list: never-used blocks, in id order
                block = KVCacheBlock(len(created))
                created.append(block)
            else:
                _, block = self._free.popitem(last=False)
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def check_invariants(self, block_tables: list[list[KVCacheBlock]] | None = None) -> None:
        for block in self._created:
            assert (block.block_id in self._free) == (block.ref_cnt == 0), f"block {block.block_id}: free list"
        for key, block in self._index.items():
            assert block.key == key, f"index key of block {block.block_id} does not match its contents"
