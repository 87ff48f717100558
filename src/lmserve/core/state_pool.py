"""Per-request recurrent-state slots for hybrid models (Gated DeltaNet layers): which running request owns which
of the num_slots slots of the worker's state tensors (StateSlotPool). Imports no torch.

A slot is taken at admission and returned on finish, abort or preemption (state is recomputed on resume); nothing
is zeroed on free, since a first chunk starts from a zero state by itself. See docs/hybrid_models.md.
"""

from __future__ import annotations

NO_STATE_SLOT = -1


class StateSlotPool:
    def __init__(self, num_slots: int) -> None:
        assert num_slots > 0, f"num_slots must be positive, got {num_slots}"
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 handed out first
        self._owner: dict[str, int] = {}  # request id -> slot
        self.num_allocations_total = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_slots

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self, request_id: str) -> int:
        """A free slot for the request (call only when can_allocate)."""
        assert request_id not in self._owner, f"request {request_id} already holds state slot {self._owner[request_id]}"
        assert self._free, "no free state slot (check can_allocate first)"
        slot = self._free.pop()
        self._owner[request_id] = slot
        self.num_allocations_total += 1
        return slot

    def free(self, request_id: str) -> None:
        """Give the request's slot back (a request that holds none: nothing to do, as KVCacheManager.free)."""
        slot = self._owner.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def slot_of(self, request_id: str) -> int:
        return self._owner.get(request_id, NO_STATE_SLOT)

    def check_invariants(self, holders: set[str] | None = None) -> None:
        """For tests: every slot is free or owned exactly once; given the request ids that should hold a slot
        (the running ones), exactly those do."""
        owned = list(self._owner.values())
        assert len(set(owned)) == len(owned), f"a state slot has two owners: {self._owner}"
        assert not set(owned) & set(self._free), "a state slot is both free and owned"
        assert sorted(owned + self._free) == list(range(self.num_slots)), "state slots lost or duplicated"
        if holders is not None:
            assert set(self._owner) == holders, f"slot owners {sorted(self._owner)} != running {sorted(holders)}"
