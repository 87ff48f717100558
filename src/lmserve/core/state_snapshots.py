"""Snapshots of a hybrid model's recurrent state at cached block boundaries (StateSnapshotPool), so a prefix-cache hit
can restore the state its KV blocks need. Keyed by the BlockKey of the last block a snapshot covers (the key the KV
prefix index uses); an LRU of their own over num_slots slots of the worker's snapshot tensors. Imports no torch.
A save is reserved when the scheduler plans it and registered once the step that writes it has run (commit).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from lmserve.core.block_pool import BlockKey, KVCacheBlock, block_key, hash_blocks, root_hash
from lmserve.request import Request

NO_SNAPSHOT = -1


@dataclass(frozen=True)
class StateSave:
    """Copy the request's state after `position` tokens (a block boundary inside the step's chunk) to `slot`."""

    position: int
    slot: int


class StateSnapshotPool:
    def __init__(self, num_slots: int) -> None:
        assert num_slots > 0, f"num_slots must be positive, got {num_slots}"
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 handed out first
        self._index: OrderedDict[BlockKey, int] = OrderedDict()  # registered snapshots, least recently used first
        self._pending: dict[BlockKey, int] = {}  # reserved by the step being run; registered by commit
        self.num_saves_total = 0
        self.num_restores_total = 0  # counted by the scheduler as a request restoring one is admitted
        self.num_evictions_total = 0

    @property
    def num_cached(self) -> int:
        return len(self._index)

    def longest_hit(self, hits: list[KVCacheBlock]) -> tuple[int, int]:
        """(blocks, snapshot slot): the longest run of the KV prefix hits whose last block has a registered snapshot,
        marked recently used; (0, NO_SNAPSHOT) when none has. Blocks past it are computed again."""
        for n in range(len(hits), 0, -1):
            key = hits[n - 1].key
            slot = self._index.get(key) if key is not None else None
            if slot is not None:
                self._index.move_to_end(key)
                return n, slot
        return 0, NO_SNAPSHOT

    def reserve(self, key: BlockKey) -> int:
        """A slot for a new snapshot under key (the least recently used one evicted if none is free), or NO_SNAPSHOT
        when key is already kept or pending, or every slot is pending."""
        if key in self._index or key in self._pending:
            if key in self._index:
                self._index.move_to_end(key)
            return NO_SNAPSHOT
        if self._free:
            slot = self._free.pop()
        elif self._index:
            _, slot = self._index.popitem(last=False)
            self.num_evictions_total += 1
        else:
            return NO_SNAPSHOT
        self._pending[key] = slot
        return slot

    def release(self, key: BlockKey) -> None:
        """Forget the registered snapshot under key, if it is still kept (its slot becomes free)."""
        slot = self._index.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def commit(self) -> None:
        """The step that wrote the reserved snapshots has run: they become findable."""
        for key, slot in self._pending.items():
            self._index[key] = slot
            self.num_saves_total += 1
        self._pending.clear()

    def reset(self) -> None:
        """Forget every registered snapshot (reset_prefix_cache); pending ones are still written and registered."""
        self._free.extend(self._index.values())
        self._index.clear()

    def check_invariants(self) -> None:
        """For tests: every slot is free, registered or pending, exactly once."""
        held = list(self._index.values()) + list(self._pending.values())
        assert len(set(held)) == len(held), f"a snapshot slot is held twice: {self._index} {self._pending}"
        assert not set(held) & set(self._free), "a snapshot slot is both free and held"
        assert sorted(held + self._free) == list(range(self.num_slots)), "snapshot slots lost or duplicated"


def plan_save(pool: StateSnapshotPool, request: Request, num_new: int, block_size: int) -> StateSave | None:
    """The snapshot a prefill chunk of num_new tokens takes: its state at the last block boundary inside the chunk
    that a later prompt's prefix hit could end at (never the request's last known token), if not kept already."""
    start = request.num_computed_tokens
    tokens = request.all_token_ids
    num_blocks = min(start + num_new, len(tokens) - 1) // block_size
    if num_new < 2 or num_blocks * block_size <= start:
        return None
    slot = pool.reserve(_boundary_key(request, num_blocks, block_size))
    return None if slot == NO_SNAPSHOT else StateSave(num_blocks * block_size, slot)


def plan_decode_save(pool: StateSnapshotPool, request: Request, block_size: int) -> StateSave | None:
    """The snapshot a decode token takes when it completes a block: the state after it, so a follow-up turn whose
    prompt holds this output hits that far. A request keeps only its latest one (the one before is released), so
    long generations do not push the prompts' snapshots out of the LRU."""
    end = request.num_computed_tokens + 1
    if end % block_size or end > len(request.all_token_ids):
        return None
    key = _boundary_key(request, end // block_size, block_size)
    slot = pool.reserve(key)
    if slot == NO_SNAPSHOT:
        return None
    if request.decode_snapshot is not None:
        pool.release(request.decode_snapshot)
    request.decode_snapshot = key
    return StateSave(end, slot)


def _boundary_key(request: Request, num_blocks: int, block_size: int) -> BlockKey:
    """The prefix-cache key of the request's block num_blocks - 1 (its chained parent hash and its tokens): the
    key a snapshot of the state after its first num_blocks blocks is kept under."""
    tokens = request.all_token_ids
    root = root_hash(request.lora_int_id)
    request.block_hashes = hash_blocks(tokens, block_size, request.block_hashes, root)
    i = num_blocks - 1
    return block_key(request.block_hashes[i - 1] if i else root, tokens[i * block_size : num_blocks * block_size])
