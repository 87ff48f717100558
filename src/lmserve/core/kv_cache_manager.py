"""Per-request block tables over the BlockPool: prefix lookup, slot allocation, caching, freeing (KVCacheManager).

With `sliding_window` (set only when every layer slides) allocate_slots hands blocks that left every future
query's window back to the pool and puts NULL_BLOCK (-1) in their table entries, so indices stay
position // block_size; prefix lookups stop at the first gap. See docs/kv_cache.md, "Sliding windows".
"""

from __future__ import annotations

from typing import Protocol

from lmserve.core.block_pool import (
    DISK_BLOCK_ID,
    BlockPool,
    DiskHitBlock,
    KVCacheBlock,
    block_key,
    disk_hash_blocks,
    disk_root,
    hash_blocks,
    root_hash,
)
from lmserve.core.outputs import BlockMap
from lmserve.memory.ledger import kv_blocks_held
from lmserve.request import Request

NULL_BLOCK = KVCacheBlock(-1)  # a table entry whose block was freed: outside every future query's window


class DiskTier(Protocol):
    """The disk tier as the manager sees it (engine/kv_tier.KVDiskTier): a block's verified payload by its disk key."""

    def read(self, key: bytes) -> bytes | None: ...


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, sliding_window: int | None = None,
        disk: DiskTier | None = None, disk_fingerprint: bytes = b"",
    ) -> None:  # fmt: skip
        """disk: the prefix cache's tier below RAM. A lookup that misses in RAM reads on from disk; a hit there is a
        DiskHitBlock that allocate_slots gives a fresh block, its payload queued in kv_loads; registered blocks
        evicted from RAM are queued for saving (take_transfers: the engine moves the bytes before the step)."""
        assert sliding_window is None or sliding_window > 0, f"sliding_window {sliding_window} must be positive"
        assert disk is None or (enable_prefix_caching and sliding_window is None), "the disk tier needs full attention"
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # None: every block stays until the request ends
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self._num_skipped_blocks: dict[str, int] = {}  # leading NULL_BLOCK entries per request
        self.disk = disk
        self.disk_fingerprint = disk_fingerprint
        self._disk_roots: dict[tuple[str, str], bytes] = {}
        self.pool.save_on_evict = disk is not None
        self.kv_loads: list[tuple[int, bytes]] = []  # (block id, payload) to write before the next step
        self.num_disk_sync_reads_total = 0  # blocks read in the scheduler (not prefetched): that step waited

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_held(self, num_tokens: int, num_new_tokens: int) -> int:
        """The most blocks a request of num_tokens tokens holds at once when steps compute up to
        num_new_tokens of them (all its blocks unless blocks outside a sliding window are freed)."""
        return kv_blocks_held(num_tokens, self.block_size, self.sliding_window, num_new_tokens)

    def _num_skippable(self, num_computed_tokens: int) -> int:
        """Leading blocks no query at a position >= num_computed_tokens reads (0 without a sliding window)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks that prefixes the request's tokens, and how many tokens it
        covers. Never the whole sequence: at least one token must be computed to produce logits."""
        pooling = request.sampling_params.pooling
        if (not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None
                or (pooling is not None and pooling.needs_every_position)):  # fmt: skip
            return [], 0  # prompt logprobs (and mean / first-token pooling) need every prompt position computed
        root = root_hash(request.lora_int_id)
        request.block_hashes = hash_blocks(request.all_token_ids, self.block_size, request.block_hashes, root)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        parent: int | None = root
        for i in range(max_hit_blocks):
            tokens = request.all_token_ids[i * self.block_size : (i + 1) * self.block_size]
            block = self.pool.lookup(block_key(parent, tokens))
            if block is None and (self.disk is None or (block := self._disk_hit(request, i)) is None):
                break
            hits.append(block)
            parent = request.block_hashes[i]
        return hits, len(hits) * self.block_size

    def disk_keys(self, request: Request) -> list[bytes]:
        lora = request.lora_request
        name = ("", "") if lora is None else (lora.lora_name, lora.lora_path)
        root = self._disk_roots.get(name)
        if root is None:
            root = self._disk_roots[name] = disk_root(self.disk_fingerprint, *name)
        request.disk_block_keys = disk_hash_blocks(request.all_token_ids, self.block_size, request.disk_block_keys,
                                                   root)  # fmt: skip
        return request.disk_block_keys

    def _disk_hit(self, request: Request, i: int) -> DiskHitBlock | None:
        """Block i of the request from the disk tier (its payload verified), or None."""
        assert self.disk is not None
        keys = request.disk_block_keys if len(request.disk_block_keys) > i else self.disk_keys(request)
        payload = request.disk_payloads.get(keys[i])
        if payload is None:
            payload = self.disk.read(keys[i])
            if payload is None:
                return None
            self.num_disk_sync_reads_total += 1
            request.disk_payloads[keys[i]] = payload
        return DiskHitBlock(DISK_BLOCK_ID, disk_key=keys[i], payload=payload)

    def num_ram_hit_blocks(self, request: Request) -> int:
        """Leading blocks of the request the RAM prefix cache holds now (no disk lookup)."""
        root = root_hash(request.lora_int_id)
        request.block_hashes = hash_blocks(request.all_token_ids, self.block_size, request.block_hashes, root)
        parent, n = root, 0
        for i in range((request.num_tokens - 1) // self.block_size):
            tokens = request.all_token_ids[i * self.block_size : (i + 1) * self.block_size]
            if self.pool.lookup(block_key(parent, tokens)) is None:
                break
            parent, n = request.block_hashes[i], n + 1
        return n

    def take_transfers(self) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]]]:
        """(loads: block id and payload to write into the pool, saves: block id and disk key of evicted blocks to
        copy out), both before the next step runs, saves first (a saved block may be a load's target)."""
        loads, self.kv_loads = self.kv_loads, []
        return loads, self.pool.take_evicted()

    def can_allocate(self, num_tokens: int, computed_blocks: list[KVCacheBlock]) -> bool:
        """Whether a new request whose prefix hits are computed_blocks could get blocks for num_tokens
        tokens now (hits on the free list count against it, as in allocate_slots)."""
        num_fresh = max(0, self.num_blocks_for(num_tokens) - len(computed_blocks))
        live = computed_blocks[self._num_skippable(len(computed_blocks) * self.block_size) :]
        # (a disk hit has ref_cnt 0: it takes a free block as a cached free block does)
        return num_fresh + sum(1 for b in live if b.ref_cnt == 0) <= self.pool.num_free_blocks

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVCacheBlock] | None = None
    ) -> list[KVCacheBlock] | None:
        """Make room for num_new_tokens more tokens after the request's computed ones. Returns the
        request's whole block table, or None (nothing changed) if the pool has too few free blocks.

            |<-- computed (incl. prefix hits) -->|<-- new -->|
            [ b0 ][ b1 ][ b2 ][ b3 ]              ...  [ bN ]   ← blocks, block_size tokens each
            existing + computed_blocks  ────────  + fresh blocks from the pool
        """
        rid = request.request_id
        if not computed_blocks and self.sliding_window is None:
            # the common decode step: room left in the table, no hits, nothing to free: the table as it is (what the
            # general path below returns too, rebuilt; every running request takes this path every step)
            table = self.req_to_blocks.get(rid)
            if table and -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) <= len(table):
                return table
        computed_blocks = computed_blocks or []
        table = self.req_to_blocks.get(rid, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        table = self._free_outside_window(rid, table, num_computed)  # before taking new blocks: reusable now
        num_needed = self.num_blocks_for(num_computed + num_new_tokens)
        num_fresh = max(0, num_needed - len(table) - len(computed_blocks))
        # Hits already outside the window are not claimed; the others stop being free once touched.
        num_skipped_hits = max(0, self._num_skippable(num_computed) - len(table))
        live_hits = computed_blocks[num_skipped_hits:]
        num_free_hits = sum(1 for b in live_hits if b.ref_cnt == 0)
        if num_fresh + num_free_hits > self.pool.num_free_blocks:
            return None
        if self.disk is not None and any(b.block_id == DISK_BLOCK_ID for b in live_hits):
            live_hits = self._take_disk_hits(request, live_hits, len(table))
        else:
            self.pool.touch(live_hits)
        table = table + [NULL_BLOCK] * num_skipped_hits + live_hits + self.pool.get_new_blocks(num_fresh)
        self.req_to_blocks[rid] = table
        if num_skipped_hits:
            self._num_skipped_blocks[rid] = num_skipped_hits
        if computed_blocks:
            self._num_cached_blocks[rid] = len(table) - num_fresh
        return table

    def _take_disk_hits(self, request: Request, hits: list[KVCacheBlock], first: int) -> list[KVCacheBlock]:
        """The hits with each disk hit replaced by a fresh block, its payload queued in kv_loads. The fresh blocks are
        registered now: the engine writes them before the step, in which every reader reads them."""
        self.pool.touch([b for b in hits if b.block_id != DISK_BLOCK_ID])  # (first: fresh blocks never evict them)
        fresh = iter(self.pool.get_new_blocks(sum(1 for b in hits if b.block_id == DISK_BLOCK_ID)))
        root, size, out = root_hash(request.lora_int_id), self.block_size, []
        for i, hit in enumerate(hits, first):
            if isinstance(hit, DiskHitBlock):
                block = next(fresh)
                self.kv_loads.append((block.block_id, hit.payload))
                parent = request.block_hashes[i - 1] if i else root
                self.pool.cache_block(block, block_key(parent, request.all_token_ids[i * size : (i + 1) * size]),
                                      hit.disk_key)  # fmt: skip
                hit = block
            out.append(hit)
        request.disk_payloads.clear()
        return out

    def _free_outside_window(self, rid: str, table: list[KVCacheBlock], num_computed: int) -> list[KVCacheBlock]:
        """Return the request's leading blocks that no future query reads to the pool; the new table has
        NULL_BLOCK in their entries. They were registered in the prefix index when computed (if caching), so
        they stay findable until handed out again."""
        start = self._num_skipped_blocks.get(rid, 0)
        end = min(self._num_skippable(num_computed), len(table))
        if end <= start:
            return table
        dead = table[start:end]
        assert NULL_BLOCK not in dead, f"request {rid}: block table has a gap before block {end}"
        self.pool.free_blocks(list(reversed(dead)))
        self._num_skipped_blocks[rid] = end
        table = table[:start] + [NULL_BLOCK] * (end - start) + table[end:]
        self.req_to_blocks[rid] = table
        return table

    def cache_blocks(self, request: Request, num_tokens: int | None = None) -> None:
        """Register the request's full blocks among its first num_tokens tokens (default: its computed ones)
        in the prefix index. The scheduler passes computed + scheduled tokens to share blocks within a step:
        their K/V are written (every layer writes the whole step's K/V before any attention reads) before a
        later request of the same step reads them as cached context."""
        if not self.enable_prefix_caching:
            return
        num_tokens = request.num_computed_tokens if num_tokens is None else num_tokens
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_tokens // self.block_size <= start:
            return  # no new full block (most calls: a decode step fills one block in block_size steps)
        table = self.req_to_blocks[request.request_id]
        num_full = min(num_tokens // self.block_size, len(table))
        if num_full <= start:
            return
        root = root_hash(request.lora_int_id)
        request.block_hashes = hash_blocks(request.all_token_ids, self.block_size, request.block_hashes, root)
        hashes, token_ids, size = request.block_hashes, request.all_token_ids, self.block_size
        cache_block = self.pool.cache_block
        disk_keys = self.disk_keys(request) if self.disk is not None else None
        for i in range(start, num_full):
            # blocks are freed out of the window only after they were computed, hence cached here
            assert table[i] is not NULL_BLOCK, f"request {request.request_id}: block {i} freed before it was cached"
            key = block_key(hashes[i - 1] if i else root, token_ids[i * size : (i + 1) * size])
            cache_block(table[i], key, disk_keys[i] if disk_keys is not None else None)
        self._num_cached_blocks[request.request_id] = num_full

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's tail blocks past those num_tokens tokens need (slots of rejected proposals or
        unused lookahead); they hold no computed, cached token."""
        table = self.req_to_blocks.get(request.request_id)
        if table is None:
            return
        keep = -(-num_tokens // self.block_size)  # num_blocks_for, inlined: every decode step of every request
        if len(table) <= keep:
            return
        assert keep >= self._num_cached_blocks.get(request.request_id, 0), "trim would drop a cached block"
        assert keep >= self._num_skipped_blocks.get(request.request_id, 0), "trim would reach freed blocks"
        self.pool.free_blocks(list(reversed(table[keep:])))
        self.req_to_blocks[request.request_id] = table[:keep]

    def free(self, request: Request) -> None:
        table = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        num_skipped = self._num_skipped_blocks.pop(request.request_id, 0)
        self.pool.free_blocks(list(reversed(table[num_skipped:])))

    def live_tables(self) -> list[list[KVCacheBlock]]:
        """Every request's table without its NULL_BLOCK entries (for BlockPool.check_invariants)."""
        return [[b for b in t if b is not NULL_BLOCK] for t in self.req_to_blocks.values()]

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request.request_id, [])]

    def block_map(self) -> BlockMap:
        """Every block's owner, ref count and prefix-index registration (O(blocks + table entries))."""
        owners = [-1] * self.pool.num_blocks
        request_ids = list(self.req_to_blocks)
        for i, table in enumerate(self.req_to_blocks.values()):
            for b in table:
                if owners[b.block_id] < 0:
                    owners[b.block_id] = i
        blocks = self.pool.blocks
        return BlockMap(owners, [b.ref_cnt for b in blocks], [int(b.key is not None) for b in blocks], request_ids)
