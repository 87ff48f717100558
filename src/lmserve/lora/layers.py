"""The batched LoRA delta of one lmserve Linear: slot-stacked weights and a forward hook that adds them.

Per LoRA'd Linear (qkv_proj, o_proj, gate_up_proj, down_proj of every layer), for max_loras compute slots:

    A: (max_loras, num_parts · max_rank, in_features)   slot s's adapter of rank r packs its parts' A rows
                                                         densely: part j at rows [j·r, (j + 1)·r)
    B: (max_loras, out_features, max_rank)              part j's B (· scaling) at its output rows, columns [0, r)

A step's rows are ordered so that each slot's rows are contiguous runs (model_runner sorts decodes and prefills
by slot), and `groups` lists (slot, first row, end row). The delta of a run is one shrink (x · A_sᵀ over the
slot's r · parts rows: its actual rank, not max_rank) and one expand per part into that part's output columns
(SGMV's grouping, a loop over the few slots present). Rows of no adapter (-1) are in no group. The hook adds in
place to the Linear's output, so any kernel path of the base (float, quantized, packed) is unchanged.
"""

from __future__ import annotations

import torch


class LoRALinear:
    """The compute slots' weights for one Linear with the given output parts (row ranges)."""

    def __init__(
        self, in_features: int, parts: list[tuple[int, int]], max_loras: int, max_rank: int, dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:  # fmt: skip
        self.parts = parts
        self.max_rank = max_rank
        out_features = parts[-1][1]
        self.A = torch.zeros(max_loras, len(parts) * max_rank, in_features, dtype=dtype, device=device)
        self.B = torch.zeros(max_loras, out_features, max_rank, dtype=dtype, device=device)
        # per slot: (rank, [(rank block j, first output row, end row)]); rank 0: the slot's adapter skips this Linear
        self.slot_parts: list[tuple[int, list[tuple[int, int, int]]]] = [(0, []) for _ in range(max_loras)]

    @property
    def num_bytes(self) -> int:
        return self.A.numel() * self.A.element_size() + self.B.numel() * self.B.element_size()

    def set_slot(self, slot: int, rank: int, weights: dict[int, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Put one adapter's parts (part index → (A (r, in), B·scaling (rows, r)); part -1: every row) in the slot;
        None or {} clears it (the adapter does not target this Linear)."""
        if not weights:
            self.slot_parts[slot] = (0, [])
            return
        assert rank <= self.max_rank, f"rank {rank} > max_rank {self.max_rank}"
        self.A[slot].zero_()
        self.B[slot].zero_()
        present = []
        for j, (part, (a, b)) in enumerate(sorted(weights.items())):
            r0, r1 = (0, self.parts[-1][1]) if part == -1 else self.parts[part]
            self.A[slot, j * rank : (j + 1) * rank].copy_(a)
            self.B[slot, r0:r1, :rank].copy_(b)
            present.append((j, r0, r1))
        self.slot_parts[slot] = (rank, present)

    def add_delta(self, x: torch.Tensor, out: torch.Tensor, groups: list[tuple[int, int, int]]) -> None:
        """out[rows] += the slot's delta for x[rows], per (slot, start, end) group; x (T, in), out (T, out)."""
        for slot, start, end in groups:
            rank, present = self.slot_parts[slot]
            if not rank:
                continue
            xa = x[start:end] @ self.A[slot, : len(present) * rank].t()  # shrink: (n, parts · r)
            o = out[start:end]
            for j, r0, r1 in present:  # expand each part into its output columns
                o[:, r0:r1].addmm_(xa[:, j * rank : (j + 1) * rank], self.B[slot, r0:r1, :rank].t())


class LoRAHooks:
    """Forward hooks on the LoRA'd Linears, installed only while steps have LoRA rows (a step without any runs the
    plain modules, and the one-call decode stack, which would bypass the hooks, only then)."""

    def __init__(self, decoder: torch.nn.Module, linears: dict[tuple[int, str], LoRALinear]) -> None:
        self.decoder = decoder  # a DecoderModel
        self.linears = linears
        self.groups: list[tuple[int, int, int]] = []
        self._handles: list = []

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self) -> None:
        if self._handles:
            return
        for (layer, name), lora in self.linears.items():
            module = self.decoder.layers[layer].get_submodule(name)
            self._handles.append(module.register_forward_hook(self._hook(lora)))
        self.decoder.lora_active = True

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.decoder.lora_active = False

    def _hook(self, lora: LoRALinear):
        def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
            if self.groups:
                lora.add_delta(args[0], out, self.groups)

        return hook
