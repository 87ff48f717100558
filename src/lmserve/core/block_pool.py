"""The pool of KV-cache blocks: reference counts, an LRU free list, and the prefix-cache index.

A block is free when no request references it (ref_cnt == 0). A free block that holds a full,
hashed block of tokens stays findable in the index until it is handed out again, so a later request
with the same prefix can take it back (a prefix-cache hit). Eviction order is least recently freed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

# (parent block's hash or None, token ids of the block): equal keys mean equal prefixes.
BlockKey = tuple[int | None, tuple[int, ...]]


def block_key(parent_hash: int | None, token_ids: list[int] | tuple[int, ...]) -> BlockKey:
    return (parent_hash, tuple(token_ids))


def root_hash(lora_int_id: int = 0) -> int | None:
    """The first block's parent: None for the base model; a LoRA adapter's id salts the chain, so no KV computed
    under one adapter (or the base) is found under another, and requests of one adapter share their prefixes."""
    return None if not lora_int_id else hash(("lora", lora_int_id))


def hash_blocks(token_ids: list[int], block_size: int, known: list[int], root: int | None = None) -> list[int]:
    """Extend `known` (chained hashes of the first full blocks) to every full block of token_ids; root: the first
    block's parent (root_hash)."""
    hashes = list(known)
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else root
        hashes.append(hash(block_key(parent, token_ids[i * block_size : (i + 1) * block_size])))
    return hashes


def disk_root(fingerprint: bytes, lora_name: str = "", lora_path: str = "") -> bytes:
    """The first block's parent in the disk tier's chain: the engine's fingerprint (everything that makes a block's
    bytes) and the LoRA adapter by name and path (lora_int_id is per process), stable across processes."""
    return hashlib.blake2b(b"\0".join((fingerprint, lora_name.encode(), lora_path.encode())), digest_size=16).digest()


def disk_hash_blocks(token_ids: list[int], block_size: int, known: list[bytes], root: bytes) -> list[bytes]:
    """hash_blocks' chain with a cryptographic digest instead of Python's hash: the disk tier's file keys."""
    digests = list(known)
    for i in range(len(digests), len(token_ids) // block_size):
        parent = digests[-1] if digests else root
        tokens = array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes()
        digests.append(hashlib.blake2b(parent + tokens, digest_size=16).digest())
    return digests


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    key: BlockKey | None = None  # set while the block is registered in the prefix index
    disk_key: bytes | None = None  # with the disk tier, set with key: the block is saved under it when evicted


DISK_BLOCK_ID = -2  # a prefix hit found on disk: a fresh block takes it, its payload loaded before the step


@dataclass(eq=False)
class DiskHitBlock(KVCacheBlock):
    """A prefix hit from the disk tier (get_computed_blocks), not a pool block: allocate_slots gives it one."""

    payload: bytes = b""


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert num_blocks > 0, "the pool needs at least one block"
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._index: dict[BlockKey, KVCacheBlock] = {}
        # the disk tier: (block id, disk key) of registered blocks evicted since the last take (their bytes are
        # copied out before the step that reuses them runs)
        self.save_on_evict = False
        self.evicted: list[tuple[int, bytes]] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def lookup(self, key: BlockKey) -> KVCacheBlock | None:
        return self._index.get(key) if self.enable_caching else None

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks off the head of the free list (evicting their cached contents)."""
        assert n <= self.num_free_blocks, f"asked for {n} blocks, {self.num_free_blocks} free"
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on cached blocks found by lookup (pulling free ones off the free list)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero go to the tail of the free list, in the given order
        (callers pass a request's blocks tail-first so its last blocks are evicted first)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than referenced"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: KVCacheBlock, key: BlockKey, disk_key: bytes | None = None) -> None:
        """Register a full block under its key. If an identical block is already indexed, keep that one."""
        if not self.enable_caching or block.key is not None:
            return
        # one lookup (the key hashed once): an unkeyed block is in no index entry, so `is block` means it was absent
        if self._index.setdefault(key, block) is block:
            block.key, block.disk_key = key, disk_key

    def reset_prefix_cache(self) -> None:
        for block in list(self._index.values()):
            block.key = block.disk_key = None
        self._index.clear()

    def take_evicted(self) -> list[tuple[int, bytes]]:
        out, self.evicted = self.evicted, []
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.key is not None:
            del self._index[block.key]
            block.key = None
            if block.disk_key is not None:
                if self.save_on_evict:
                    self.evicted.append((block.block_id, block.disk_key))
                block.disk_key = None

    def check_invariants(self, block_tables: list[list[KVCacheBlock]] | None = None) -> None:
        """For tests: free ⇔ ref_cnt == 0; the index points at blocks carrying that key; and, given every
        request's block table, ref counts equal the number of tables holding each block."""
        for block in self.blocks:
            in_free = block.block_id in self._free
            assert in_free == (block.ref_cnt == 0), f"block {block.block_id}: ref_cnt={block.ref_cnt}, free={in_free}"
            assert block.ref_cnt >= 0, f"block {block.block_id} has negative ref_cnt"
            if block.key is not None:
                assert self._index.get(block.key) is block, f"block {block.block_id} keyed but not indexed"
        for key, block in self._index.items():
            assert block.key == key, f"index key of block {block.block_id} does not match its contents"
        if block_tables is not None:
            counts = [0] * self.num_blocks
            for table in block_tables:
                for block in table:
                    if block.block_id >= 0:  # -1: a table entry freed outside a sliding window (holds no block)
                        counts[block.block_id] += 1
            for block in self.blocks:
                assert counts[block.block_id] == block.ref_cnt, (
                    f"block {block.block_id}: ref_cnt={block.ref_cnt} but {counts[block.block_id]} tables hold it"
                )
