"""Per-request block tables over the BlockPool: prefix lookup, slot allocation, caching, freeing."""

from __future__ import annotations

from lmserve.core.block_pool import BlockPool, KVCacheBlock, block_key, hash_blocks
from lmserve.core.outputs import BlockMap
from lmserve.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks that prefixes the request's tokens, and how many tokens it
        covers. Never the whole sequence: at least one token must be computed to produce logits."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed
        request.block_hashes = hash_blocks(request.all_token_ids, self.block_size, request.block_hashes)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        parent: int | None = None
        for i in range(max_hit_blocks):
            tokens = request.all_token_ids[i * self.block_size : (i + 1) * self.block_size]
            block = self.pool.lookup(block_key(parent, tokens))
            if block is None:
                break
            hits.append(block)
            parent = request.block_hashes[i]
        return hits, len(hits) * self.block_size

    def can_allocate(self, num_tokens: int, computed_blocks: list[KVCacheBlock]) -> bool:
        """Whether a new request whose prefix hits are computed_blocks could get blocks for num_tokens
        tokens now (hits on the free list count against it, as in allocate_slots)."""
        num_fresh = max(0, self.num_blocks_for(num_tokens) - len(computed_blocks))
        return num_fresh + sum(1 for b in computed_blocks if b.ref_cnt == 0) <= self.pool.num_free_blocks

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVCacheBlock] | None = None
    ) -> list[KVCacheBlock] | None:
        """Make room for num_new_tokens more tokens after the request's computed ones. Returns the
        request's whole block table, or None (nothing changed) if the pool has too few free blocks.

            |<-- computed (incl. prefix hits) -->|<-- new -->|
            [ b0 ][ b1 ][ b2 ][ b3 ]              ...  [ bN ]   ← blocks, block_size tokens each
            existing + computed_blocks  ────────  + fresh blocks from the pool
        """
        computed_blocks = computed_blocks or []
        table = self.req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = self.num_blocks_for(num_computed + num_new_tokens)
        num_fresh = max(0, num_needed - len(table) - len(computed_blocks))
        # Hits sitting on the free list stop being free once touched.
        num_free_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_fresh + num_free_hits > self.pool.num_free_blocks:
            return None
        self.pool.touch(computed_blocks)
        table = table + computed_blocks + self.pool.get_new_blocks(num_fresh)
        self.req_to_blocks[request.request_id] = table
        if computed_blocks:
            self._num_cached_blocks[request.request_id] = len(table) - num_fresh
        return table

    def cache_blocks(self, request: Request, num_tokens: int | None = None) -> None:
        """Register the request's full blocks among its first num_tokens tokens (default: its computed ones)
        in the prefix index. The scheduler passes computed + scheduled tokens to share blocks within a step:
        their K/V are written (every layer writes the whole step's K/V before any attention reads) before a
        later request of the same step reads them as cached context."""
        if not self.enable_prefix_caching:
            return
        table = self.req_to_blocks[request.request_id]
        num_tokens = request.num_computed_tokens if num_tokens is None else num_tokens
        num_full = min(num_tokens // self.block_size, len(table))
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        request.block_hashes = hash_blocks(request.all_token_ids, self.block_size, request.block_hashes)
        for i in range(start, num_full):
            parent = request.block_hashes[i - 1] if i else None
            tokens = request.all_token_ids[i * self.block_size : (i + 1) * self.block_size]
            self.pool.cache_block(table[i], block_key(parent, tokens))
        self._num_cached_blocks[request.request_id] = num_full

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's tail blocks past those num_tokens tokens need (slots of rejected proposals or
        unused lookahead); they hold no computed, cached token."""
        table = self.req_to_blocks.get(request.request_id)
        if table is None:
            return
        keep = self.num_blocks_for(num_tokens)
        assert keep >= self._num_cached_blocks.get(request.request_id, 0), "trim would drop a cached block"
        if len(table) > keep:
            self.pool.free_blocks(list(reversed(table[keep:])))
            self.req_to_blocks[request.request_id] = table[:keep]

    def free(self, request: Request) -> None:
        table = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(list(reversed(table)))

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
