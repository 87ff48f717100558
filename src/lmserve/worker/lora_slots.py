"""The model runner's adapters (LoRASlotPool): loaded ones in RAM (LRU, max_cpu_loras) and the compute slots' weights.

The scheduler assigns `request.lora_slot` (core/lora_slots.py); this pool copies the adapter into its slot (from RAM,
or from disk if dropped) on the first step that needs it, and builds the step's row groups for lora/layers.py.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from lmserve.config.engine import EngineConfig
from lmserve.core.outputs import ScheduledRequest
from lmserve.lora.adapter import LORA_MODULES, LoRAAdapter, load_adapter, module_parts
from lmserve.lora.layers import LoRAHooks, LoRALinear
from lmserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)

NO_SLOT = -1


class LoRASlotPool:
    def __init__(self, model: torch.nn.Module, config: EngineConfig) -> None:
        """model: the runner's CausalLM."""
        assert config.lora is not None, "LoRA is disabled"
        self.config, self.lora = config, config.lora
        mc = config.model
        dtype = next(p for p in model.model.norm.parameters()).dtype
        parts = module_parts(mc)
        self.linears = {
            (layer, name): LoRALinear(
                parts[name][0], parts[name][1], self.lora.max_loras, self.lora.max_lora_rank, dtype, config.device
            )  # fmt: skip
            for layer in range(mc.num_layers)
            for name in LORA_MODULES
        }
        self.hooks = LoRAHooks(model.model, self.linears)
        assert self.num_bytes == self.lora.slot_bytes or not self.lora.slot_bytes, (
            f"LoRA slots hold {self.num_bytes} bytes, the KV budget set aside {self.lora.slot_bytes} "
            "(memory.lora_slot_bytes)"
        )
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id → adapter, least recently used first
        self.slot_ids: list[int | None] = [None] * self.lora.max_loras  # the adapter each compute slot holds
        self.num_slot_loads_total = 0
        logger.info(
            "LoRA: %d compute slots of rank <= %d (%.1f MiB), up to %d adapters in RAM",
            self.lora.max_loras,
            self.lora.max_lora_rank,
            self.num_bytes / 2**20,
            self.lora.max_cpu_loras,
        )

    @property
    def num_bytes(self) -> int:
        """The compute slots' stacked weights (the memory ledger's LoRA line)."""
        return sum(w.num_bytes for w in self.linears.values())

    @property
    def cpu_bytes(self) -> int:
        return sum(a.num_bytes for a in self.cpu.values())

    def add_adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter loaded (validated against the base model; ValueError naming the field), most recently used."""
        adapter = self.cpu.get(request.lora_int_id)
        if adapter is not None and adapter.request == request:
            self.cpu.move_to_end(request.lora_int_id)
            return adapter
        if adapter is not None:
            raise ValueError(f"lora_int_id {request.lora_int_id} is already {adapter.request.lora_name!r} at "
                             f"{adapter.request.lora_path!r}; every adapter needs its own id")  # fmt: skip
        adapter = load_adapter(request, self.config.model, self.lora.max_lora_rank)
        self.cpu[request.lora_int_id] = adapter
        while len(self.cpu) > self.lora.max_cpu_loras:
            self.cpu.popitem(last=False)  # a slot keeps its own copy; a later load reads the directory again
        return adapter

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget a loaded adapter (its slot, if any, is reused by the next load). Returns whether it was loaded."""
        found = self.cpu.pop(lora_int_id, None) is not None
        for slot, held in enumerate(self.slot_ids):
            if held == lora_int_id:
                self.slot_ids[slot] = None
                found = True
        return found

    def list_adapters(self) -> list[int]:
        return list(self.cpu)

    @staticmethod
    def slot_of(s: ScheduledRequest) -> int:
        return getattr(s.request, "lora_slot", NO_SLOT)

    def sort_rows(self, scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """Each slot's requests next to each other (stable: base rows first, then by slot)."""
        return sorted(scheduled, key=self.slot_of)

    def begin_step(self, ordered: list[ScheduledRequest]) -> bool:
        """Fill the slots the step's requests use and set the hooks' row groups; with no LoRA row the hooks come
        off (the step runs the plain model). Returns whether the step has LoRA rows."""
        groups: list[tuple[int, int, int]] = []
        row = 0
        for s in ordered:
            slot, n = self.slot_of(s), s.num_new_tokens
            if slot != NO_SLOT:
                self._fill(slot, s.request.lora_request)
                if groups and groups[-1][0] == slot and groups[-1][2] == row:
                    groups[-1] = (slot, groups[-1][1], row + n)
                else:
                    groups.append((slot, row, row + n))
            row += n
        if not groups:
            if self.hooks.installed:
                self.hooks.remove()
            return False
        self.hooks.install()
        self.hooks.groups = groups
        return True

    def end_step(self) -> None:
        self.hooks.groups = []

    def _fill(self, slot: int, request: LoRARequest) -> None:
        if self.slot_ids[slot] == request.lora_int_id:
            return
        adapter = self.add_adapter(request)
        for (layer, name), lora in self.linears.items():
            lora.set_slot(slot, adapter.rank, adapter.weights.get((layer, name)))
        self.slot_ids[slot] = request.lora_int_id
        self.num_slot_loads_total += 1
