"""SharedPrefixCounter: how many prompt tokens an earlier prompt already had, whether or not the prefix cache
kept (or could keep) their blocks, so a diagnosis can tell prompts sharing a prefix the cache misses from prompts
that share nothing. It keeps recent prompts' chained block hashes only (LRU-bounded, independent of the KV pool).
"""

from __future__ import annotations

from collections import OrderedDict

from lmserve.core.block_pool import hash_blocks


class SharedPrefixCounter:
    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        assert block_size > 0 and capacity_blocks > 0, "block_size and capacity_blocks must be positive"
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._seen: OrderedDict[int, None] = OrderedDict()

    def observe(self, prompt_token_ids: list[int]) -> int:
        """Record a prompt; returns how many of its leading tokens (whole blocks) an earlier prompt had. As
        for a cache hit, never the whole prompt: its last token is always computed."""
        hashes = hash_blocks(prompt_token_ids, self.block_size, [])
        num_shared, run = 0, True
        for h in hashes[: (len(prompt_token_ids) - 1) // self.block_size]:
            if run and h in self._seen:
                num_shared += 1
                self._seen.move_to_end(h)
            else:
                run = False
                self._seen[h] = None
        while len(self._seen) > self.capacity_blocks:
            self._seen.popitem(last=False)
        return num_shared * self.block_size
