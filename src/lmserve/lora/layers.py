"""The batched LoRA delta of one lmserve Linear: slot-stacked weights and a forward hook that adds them.

LoRALinear holds every compute slot's A and block-diagonal B and adds a step's delta per contiguous run of rows of
one slot (shrink, then expand in place); LoRAHooks installs it on the decoder's Linears, leaving the base's
kernel path unchanged. The layout is in docs/lora.md.
"""

from __future__ import annotations

import torch

from lmserve import kernels


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
        self.B = torch.zeros(max_loras, out_features, len(parts) * max_rank, dtype=dtype, device=device)
        # per slot: the columns of A's rows / B's columns in use (present parts · rank); 0: the slot's adapter skips
        # this Linear. `cols` mirrors it for the decode stack's C side (which reads it each step)
        self.slot_cols = [0] * max_loras
        self.cols = torch.zeros(max_loras, dtype=torch.int64)
        # float32 CPU slots: runs of up to LORA_MAX_ROWS rows take the C kernel the decode stack calls (same bits)
        self.kernel = dtype == torch.float32 and self.A.device.type == "cpu" and kernels.available()

    @property
    def num_bytes(self) -> int:
        return self.A.numel() * self.A.element_size() + self.B.numel() * self.B.element_size()

    def set_slot(self, slot: int, rank: int, weights: dict[int, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Put one adapter's parts (part index → (A (r, in), B·scaling (rows, r)); part -1: every row) in the slot;
        None or {} clears it (the adapter does not target this Linear)."""
        if not weights:
            self.slot_cols[slot] = 0
            self.cols[slot] = 0
            return
        assert rank <= self.max_rank, f"rank {rank} > max_rank {self.max_rank}"
        self.A[slot].zero_()
        self.B[slot].zero_()
        for j, (part, (a, b)) in enumerate(sorted(weights.items())):
            r0, r1 = (0, self.parts[-1][1]) if part == -1 else self.parts[part]
            self.A[slot, j * rank : (j + 1) * rank].copy_(a)
            self.B[slot, r0:r1, j * rank : (j + 1) * rank].copy_(b)
        self.slot_cols[slot] = len(weights) * rank
        self.cols[slot] = self.slot_cols[slot]

    def add_delta(self, x: torch.Tensor, out: torch.Tensor, groups: list[tuple[int, int, int]]) -> None:
        """out[rows] += the slot's delta for x[rows], per (slot, start, end) group; x (T, in), out (T, out). A run
        of at most LORA_MAX_ROWS rows of float32 CPU tensors takes kernels.lora_delta (the decode stack's own
        arithmetic, so a decode computes the same bits on either path); longer runs two BLAS products."""
        for slot, start, end in groups:
            cols = self.slot_cols[slot]
            if not cols:
                continue
            rows = out[start:end]
            if (self.kernel and end - start <= kernels.LORA_MAX_ROWS and x.dtype == torch.float32
                    and rows.is_contiguous() and rows.dtype == torch.float32):  # fmt: skip
                kernels.lora_delta(x[start:end].contiguous(), self.A[slot], self.B[slot], rows, cols)
            else:
                xa = torch.mm(x[start:end], self.A[slot, :cols].t())  # shrink: (n, parts · r)
                rows.addmm_(xa, self.B[slot, :, :cols].t())  # expand, every part at once


class LoRAHooks:
    """Forward hooks on the LoRA'd Linears, installed only while steps have LoRA rows (a step without any runs the
    plain modules). The one-call decode stack bypasses the hooks: with LoRA rows it adds the same deltas in C from
    these linears and groups (DecodeStack.run's lora), else it stands aside."""

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
        self.decoder.lora_hooks = self  # the decode stack adds the same deltas itself (model/decode_stack.py)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.decoder.lora_active = False
        self.decoder.lora_hooks = None

    def _hook(self, lora: LoRALinear):
        def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
            if self.groups:
                lora.add_delta(args[0], out, self.groups)

        return hook
