"""ResponseStore: the Responses API's stored responses (`store: true`), in memory: each response object with the
conversation it ended (for `previous_response_id`) and, while a background response runs, how to cancel it.
Bounded in entries (the oldest goes first) and in age (an entry older than the TTL is gone); lost on restart."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_ENTRIES = 1000
DEFAULT_TTL_S = 3600.0


@dataclass
class StoredResponse:
    response: Any  # protocol_responses.ResponseObject
    messages: list[Any]  # the conversation up to and including this response's output (ChatMessages)
    stored_at: float = field(default_factory=time.monotonic)
    cancel: Callable[[], None] | None = None  # a running background response's abort


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, ttl_s: float = DEFAULT_TTL_S) -> None:
        if max_entries < 0 or ttl_s <= 0:
            raise ValueError(f"responses store: max_entries must be >= 0 and ttl_s > 0, got {max_entries}, {ttl_s}")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        """Store (or replace) the entry of its response's id; the oldest entries go beyond max_entries."""
        self._expire()
        rid = entry.response.id
        self._entries.pop(rid, None)
        if self.max_entries == 0:
            return
        self._entries[rid] = entry
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        while self._entries:
            rid, oldest = next(iter(self._entries.items()))
            if oldest.stored_at > cutoff:
                break
            del self._entries[rid]
