"""Tensor parallelism, Megatron-style (vLLM's column / row / vocab-parallel layers): each rank's slice of each
weight, the slicing at load, and the collectives a split decoder needs, attached to an unchanged CausalLM.

The model is built from `local_config(cfg, tp)`, so the C kernels run on the local shard unchanged; `parallelize`
attaches the Collectives. The split: docs/tensor_parallel.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import nn

from lmserve.config.engine import ModelConfig, QuantizationConfig
from lmserve.memory.ledger import kv_heads_per_rank


class Collectives(Protocol):
    """What a split model needs from its group: in-place sum and max over ranks, and a gather on rank 0."""

    rank: int
    size: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor: ...

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None: ...


@dataclass(frozen=True)
class TPShard:
    """One rank's place in a tensor-parallel group and the slices it holds (computed once from the full config)."""

    rank: int
    size: int
    num_heads: int  # local attention heads
    num_kv_heads: int  # local KV heads (1 when replicated)
    kv_head_start: int  # the first global KV head this rank holds
    intermediate: int  # local MLP rows
    vocab_per_rank: int  # ceil(V / tp): local embedding / LM-head rows, the last rank's padded with zeros
    vocab_size: int  # the full V

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int) -> TPShard:
        assert 0 <= rank < size, f"rank {rank} of {size}"
        if cfg.num_heads % size or cfg.intermediate_size % size:
            raise ValueError(
                f"tensor_parallel_size={size} must divide num_attention_heads ({cfg.num_heads}) and "
                f"intermediate_size ({cfg.intermediate_size})"
            )
        moe = cfg.moe
        if moe is not None and (moe.expert_intermediate_size % size or moe.shared_expert_intermediate_size % size):
            raise ValueError(
                f"tensor_parallel_size={size} must divide the experts' width ({moe.expert_intermediate_size}) and "
                f"the shared expert's ({moe.shared_expert_intermediate_size})"
            )
        if moe is not None and moe.mxfp4:
            raise ValueError("tensor_parallel_size > 1 with MXFP4 experts is not supported (load a float checkpoint)")
        kv = kv_heads_per_rank(cfg.num_kv_heads, size)
        kv_start = rank * kv if cfg.num_kv_heads % size == 0 else rank // (size // cfg.num_kv_heads)
        return cls(
            rank, size, cfg.num_heads // size, kv, kv_start, cfg.intermediate_size // size,
            math.ceil(cfg.vocab_size / size), cfg.vocab_size,
        )  # fmt: skip

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_rows(self) -> int:
        """Real (unpadded) vocabulary rows on this rank."""
        return max(0, min(self.vocab_size, self.vocab_start + self.vocab_per_rank) - self.vocab_start)


def local_config(cfg: ModelConfig, shard: TPShard) -> ModelConfig:
    """The config a rank builds its CausalLM from: its own head, KV-head, MLP-row and vocabulary counts (attn_scale
    pinned to the full head_dim's, which is unchanged anyway)."""
    moe = cfg.moe
    if moe is not None:
        moe = replace(
            moe,
            expert_intermediate_size=moe.expert_intermediate_size // shard.size,
            shared_expert_intermediate_size=moe.shared_expert_intermediate_size // shard.size,
            dense_intermediate_size=moe.dense_intermediate_size // shard.size,
        )
    return replace(
        cfg,
        num_heads=shard.num_heads,
        num_kv_heads=shard.num_kv_heads,
        intermediate_size=shard.intermediate,
        vocab_size=shard.vocab_per_rank,
        moe=moe,
    )


# ---- the slicing at load -----------------------------------------------------------------------------------------


def _rows(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return t.narrow(0, start, n)


def _qkv_part(t: torch.Tensor, part: int, cfg: ModelConfig, shard: TPShard) -> torch.Tensor:
    d = cfg.head_dim
    if part == 0:
        return _rows(t, shard.rank * shard.num_heads * d, shard.num_heads * d)
    return _rows(t, shard.kv_head_start * d, shard.num_kv_heads * d)


def _vocab_rows(t: torch.Tensor, shard: TPShard) -> torch.Tensor:
    local = _rows(t, shard.vocab_start, shard.vocab_rows)
    if shard.vocab_rows == shard.vocab_per_rank:
        return local
    pad = t.new_zeros((shard.vocab_per_rank - shard.vocab_rows, *t.shape[1:]))
    return torch.cat([local, pad])


def shard_tensor(target: str, tensor: torch.Tensor, part: int | None, cfg: ModelConfig, shard: TPShard) -> torch.Tensor:
    """The slice of checkpoint tensor `target` (our parameter name, loader._map_name's) that `shard` holds; part:
    its index within a fused qkv / gate_up (None: the tensor is the whole parameter, fused already for Phi-3)."""
    if ".qkv_proj." in target:
        if part is None:  # a fused checkpoint tensor: slice each part, keep the fused order
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            pieces = tensor.split([q, kv, kv])
            return torch.cat([_qkv_part(p, i, cfg, shard) for i, p in enumerate(pieces)])
        return _qkv_part(tensor, part, cfg, shard)
    if ".gate_up_proj." in target:
        n = shard.intermediate
        if part is None:
            gate, up = tensor.split(cfg.intermediate_size)
            return torch.cat([_rows(gate, shard.rank * n, n), _rows(up, shard.rank * n, n)])
        return _rows(tensor, shard.rank * n, n)
    if target.endswith(".o_proj.weight"):
        n = shard.num_heads * cfg.head_dim
        return tensor.narrow(1, shard.rank * n, n)
    if target.endswith(".down_proj.weight"):
        return tensor.narrow(1, shard.rank * shard.intermediate, shard.intermediate)
    if target in ("model.embed_tokens.weight", "lm_head.weight"):
        return _vocab_rows(tensor, shard)
    if target.endswith(".self_attn.sinks"):
        return _rows(tensor, shard.rank * shard.num_heads, shard.num_heads)
    if target.endswith((".o_proj.bias", ".down_proj.bias")):  # added once: the all-reduce sums the ranks' outputs
        return tensor if shard.rank == 0 else torch.zeros_like(tensor)
    return tensor  # norms (Qwen3's per-head q/k norms too): replicated


# ---- quantizing the local shard ----------------------------------------------------------------------------------


def row_parallel(name: str) -> bool:
    return name.endswith((".o_proj", ".down_proj"))


def quantize_linear_weights(model: nn.Module, config: QuantizationConfig, comm: Collectives) -> None:
    """layers.quantize_linear_weights on a rank's shard, the same codes and scales as tp = 1: int4 / int8w groups
    lie within a shard (config checks the alignment); int8's per-output-channel scale of a row-parallel layer is
    the maximum over all ranks' columns (one all-reduce at load)."""
    from lmserve.model.layers import quantizable_linears

    names = {id(m): n for n, m in model.named_modules()}
    for m, layout, group in quantizable_linears(model, config):
        if layout != "int8" or not row_parallel(names[id(m)]):
            m.quantize(layout, group)
            continue
        w = m.weight.detach().float()
        s = comm.all_reduce_max(w.abs().amax(dim=1).contiguous()) / 127
        s = torch.where(s == 0, torch.ones_like(s), s)
        q = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
        assert q.shape == w.shape, f"int8 codes {tuple(q.shape)} for {tuple(w.shape)}"
        m._set_quantized("int8", None, q, s)


# ---- the collectives attached to a model -------------------------------------------------------------------------


def parallelize(model: nn.Module, shard: TPShard, comm: Collectives) -> None:
    """Attach the split's collectives to a CausalLM built from local_config: an all-reduce after every o_proj and
    down_proj, the vocab-parallel embedding, and a compute_logits that gathers the vocabulary slices on rank 0
    (the other ranks get None). The decode stack is on only with comm's shared-memory all-reduce (`comm.shm`, a
    worker/shm_allreduce.ShmAllReduce with its C description), which it calls from C at the same two points."""
    assert comm.size == shard.size and comm.rank == shard.rank, f"group {comm.rank}/{comm.size} vs shard {shard}"

    state = model._tp_state = {"local": False}  # local_only(): projections timed alone, no all-reduce

    def reduce_output(_m: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        return out if state["local"] else comm.all_reduce(out.contiguous())

    from lmserve.model.layers.moe import SparseMoE

    decoder = model.model
    for layer in decoder.layers:
        layer.self_attn.o_proj.register_forward_hook(reduce_output)
        moe = isinstance(layer.mlp, SparseMoE)  # (its experts' and shared expert's partial sums: one all-reduce)
        (layer.mlp if moe else layer.mlp.down_proj).register_forward_hook(reduce_output)
    decoder.tensor_parallel_size = shard.size
    decoder.tp_all_reduce = getattr(comm, "shm", None)
    decoder.reset_decode_stack()
    start, rows = shard.vocab_start, shard.vocab_rows
    masks: list[torch.Tensor] = []

    def local_ids(_m: nn.Module, args: tuple) -> tuple:
        ids = args[0]
        outside = (ids < start) | (ids >= start + rows)
        masks.append(outside)
        return ((ids - start).masked_fill(outside, 0),)

    def embed_reduce(_m: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        outside = masks.pop()
        return comm.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0).contiguous())

    decoder.embed_tokens.register_forward_pre_hook(local_ids)
    decoder.embed_tokens.register_forward_hook(embed_reduce)
    local_logits = model.compute_logits  # soft-capping is elementwise: applied per slice

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor | None:
        parts = comm.gather(local_logits(hidden).contiguous())
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, : shard.vocab_size]

    model.compute_logits = compute_logits
    model.tensor_parallel = shard


@contextmanager
def local_only(model: nn.Module) -> Iterator[None]:
    """Within: the row-parallel projections of a parallelized model skip their all-reduce (choose_small_m_paths
    times single projections on each rank alone). A no-op for a model that is not split."""
    state = getattr(model, "_tp_state", None)
    if state is None:
        yield
        return
    state["local"] = True
    try:
        yield
    finally:
        state["local"] = False
