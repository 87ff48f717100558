"""Which adapter holds which of the max_loras compute slots, as the scheduler admits requests (LoRASlotTable).

Running requests hold their adapter's slot; an idle slot keeps its adapter and is the LRU candidate for another.
A request whose adapter finds no slot waits; a slot is never taken from an adapter in use. Imports no torch.
"""

from __future__ import annotations

from collections import OrderedDict

NO_SLOT = -1


class LoRASlotTable:
    def __init__(self, max_loras: int) -> None:
        assert max_loras > 0, "max_loras must be positive"
        self.max_loras = max_loras
        self.holder: list[int | None] = [None] * max_loras  # lora_int_id per slot
        self.users = [0] * max_loras  # running requests per slot
        self._slot_of: dict[int, int] = {}
        # slots without users, least recently released first (empty slots are taken before any of these)
        self._idle: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))
        self.num_evictions_total = 0

    def slot_of(self, lora_int_id: int) -> int:
        return self._slot_of.get(lora_int_id, NO_SLOT)

    def can_acquire(self, lora_int_id: int) -> bool:
        return lora_int_id in self._slot_of or bool(self._idle)

    def acquire(self, lora_int_id: int) -> int:
        """A slot for one more running request of the adapter (its own, an empty one, else the least recently
        used idle one, whose adapter is evicted). Call only when can_acquire."""
        slot = self._slot_of.get(lora_int_id)
        if slot is None:
            assert self._idle, "no idle LoRA slot (check can_acquire first)"
            empty = [s for s in self._idle if self.holder[s] is None]
            slot = empty[0] if empty else next(iter(self._idle))
            old = self.holder[slot]
            if old is not None:
                del self._slot_of[old]
                self.num_evictions_total += 1
            self.holder[slot] = lora_int_id
            self._slot_of[lora_int_id] = slot
        self.users[slot] += 1
        self._idle.pop(slot, None)
        return slot

    def release(self, slot: int) -> None:
        """A running request of the slot's adapter finished or was preempted."""
        assert self.users[slot] > 0, f"LoRA slot {slot} released more often than acquired"
        self.users[slot] -= 1
        if self.users[slot] == 0:
            self._idle[slot] = None  # most recently used idle slot: evicted last

    def forget(self, lora_int_id: int) -> bool:
        """Drop an adapter that no running request uses from its slot (unload). Returns False if one does."""
        slot = self._slot_of.get(lora_int_id)
        if slot is None:
            return True
        if self.users[slot]:
            return False
        del self._slot_of[lora_int_id]
        self.holder[slot] = None
        self._idle.move_to_end(slot, last=False)  # an empty slot: taken first anyway
        return True

    @property
    def num_active(self) -> int:
        return sum(1 for u in self.users if u)
