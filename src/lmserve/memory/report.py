"""`lmserve memory`'s answer: MemoryReport (every figure it prints, as a table or JSON) and memory_report(), which
fills it from a ModelShape with the ledger's arithmetic (memory.py)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from lmserve.checkpoint.shape import ModelShape
from lmserve.memory.ledger import (
    _check_tp,
    _positive,
    dtype_bytes,
    expert_bytes,
    hybrid_pool_split,
    kv_blocks_held,
    kv_cache_bytes_per_token,
    kv_committed_bytes,
    kv_disk_blocks,
    kv_heads_per_rank,
    kv_scale_bytes_per_token,
    linear_state_bytes_per_sequence,
    lora_slot_bytes,
    max_num_kv_blocks,
    num_active_parameters,
    num_parameters,
    num_parameters_per_rank,
    state_snapshot_split,
    weight_bytes_per_rank,
)
from lmserve.memory.units import format_bytes

__all__ = ["MemoryReport", "memory_report"]


@dataclass(frozen=True)
class MemoryReport:
    """Everything `lmserve memory` prints. "per rank" is one tensor-parallel device; "total" is
    summed over all ranks (it counts replicated KV heads once per rank that holds them)."""

    name: str | None
    shape: ModelShape
    seq_len: int
    batch: int
    block_size: int
    tp: int
    kv_dtype: str
    weight_dtype: str
    # weights
    num_parameters: int
    num_parameters_per_rank: int
    weight_bytes: int
    weight_bytes_per_rank: int
    # KV cache, whole model (unsharded); per-token figures include the 8-bit dtypes' scales
    kv_bytes_per_token: int
    kv_scale_bytes_per_token: int
    kv_bytes_per_token_per_layer: int
    mha_kv_bytes_per_token: int
    gqa_factor: float
    kv_bytes_per_request: int
    kv_bytes_batch: int
    # KV cache, sharded
    kv_heads_per_rank: int
    kv_bytes_per_token_per_rank: int
    kv_bytes_per_request_per_rank: int
    kv_bytes_batch_per_rank: int
    kv_bytes_batch_total: int
    blocks_per_request: int
    # budget (per device); None when no memory budget was given
    memory_bytes: int | None = None
    reserve_bytes: int = 0
    weights_fit: bool | None = None
    kv_budget_bytes_per_rank: int | None = None
    num_kv_blocks: int | None = None
    max_kv_tokens: int | None = None
    max_concurrent_requests: int | None = None
    batch_fits: bool | None = None
    kv_committed_bytes_batch_per_rank: int | None = None  # the pool's pages the batch commits (memory.py)
    notes: tuple[str, ...] = field(default=())
    quantization: str | None = None  # "int8" | "int4": projections quantized, the rest at weight_dtype
    quantization_group_size: int | None = None
    # sliding windows: the tokens of KV a request holds (seq_len, or the window + a block when freed)
    kv_tokens_per_request: int | None = None
    kv_freed_outside_window: bool = False
    # LoRA (--enable-lora): the compute slots' stacked weights, per device, taken from the budget before the KV
    max_loras: int | None = None
    max_lora_rank: int | None = None
    lora_dtype: str | None = None
    lora_slot_bytes: int = 0
    # hybrid models: the linear-attention layers' state per sequence (float32) and the slots the budget gives them
    state_bytes_per_sequence: int = 0
    num_state_slots: int | None = None
    num_state_snapshots: int | None = None  # the prefix cache's state snapshots (1/8 of the budget, the default)
    # mixture of experts: parameters a token computes with (embedding table counted, and without it: what a decode
    # step streams per token) and the routed experts' bytes per precision; None for a dense model
    num_active_parameters: int | None = None
    num_active_parameters_streamed: int | None = None
    expert_bytes: dict[str, int] | None = None
    # the prefix cache's disk tier (--kv-cache-disk-gib): its blocks, tokens and seq_len prompts; None without one
    kv_disk_bytes: int | None = None
    kv_disk_blocks: int | None = None
    kv_disk_tokens: int | None = None
    kv_disk_prompts: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict (for ``--json``)."""
        d = asdict(self)
        d["notes"] = list(self.notes)
        return d

    def format_table(self) -> str:
        """Readable two-column report."""
        s = self.shape
        tp = self.tp

        def both(total: int, per_rank: int) -> str:
            text = _fmt(total)
            if tp > 1:
                text += f"   [per rank: {_fmt(per_rank)}]"
            return text

        rows: list[tuple[str, str]] = []
        title = f"lmserve memory: {self.name}" if self.name else "lmserve memory"
        rows.append(
            (
                "model",
                f"{s.num_layers} layers, hidden {s.hidden_size}, {s.num_attention_heads} heads / "
                f"{s.num_kv_heads} KV heads, head_dim {s.head_dim}, vocab {s.vocab_size}",
            )
        )
        params = f"{self.num_parameters:,} ({self.num_parameters / 1e9:.2f} B)"
        if tp > 1:
            params += f"   [per rank: {self.num_parameters_per_rank:,}]"
        rows.append(("parameters", params))
        if s.moe is not None:
            r = s.moe.router
            rows.append(
                (
                    "active parameters",
                    f"{self.num_active_parameters:,} ({self.num_active_parameters / 1e9:.2f} B; "
                    f"{self.num_active_parameters_streamed / 1e9:.2f} B without the embedding table): top-{r.top_k} "
                    f"of {r.num_experts} experts in {s.moe.num_sparse_layers} of {s.num_layers} layers",
                )
            )
            sizes = ", ".join(f"{k} {format_bytes(v)}" for k, v in (self.expert_bytes or {}).items())
            rows.append(("experts' weights", sizes))
        label = f"weights ({self.weight_dtype})"
        if self.quantization == "int8":
            head = "int8 copy of the tied" if s.tie_word_embeddings else "int8"
            label = f"weights (int8 projections + {head} LM head + {self.weight_dtype} embeddings/norms)"
        elif self.quantization == "gguf":
            label = f"weights (GGUF blocks as in the file + {self.weight_dtype} dequantized rest)"
        elif self.quantization == "int4":
            head = "8-bit g32 copy of the tied" if s.tie_word_embeddings else "8-bit g32"
            label = (
                f"weights (int4 g{self.quantization_group_size} projections + {head} LM head + {self.weight_dtype} "
                "embeddings/norms)"
            )
        rows.append((label, both(self.weight_bytes, self.weight_bytes_per_rank)))
        if self.max_loras is not None:
            rows.append(
                (
                    f"LoRA slots ({self.lora_dtype})",
                    f"{_fmt(self.lora_slot_bytes)} ({self.lora_slot_bytes:,} B: {self.max_loras} slot(s) of rank "
                    f"<= {self.max_lora_rank})",
                )
            )
        if tp > 1:
            rows.append(
                (
                    "tensor parallel",
                    f"tp={tp}, {self.kv_heads_per_rank} KV head(s) per rank"
                    + (" (replicated)" if s.num_kv_heads < tp else ""),
                )
            )
        rows.append((f"KV cache ({self.kv_dtype})", ""))
        rows.append(
            (
                "  per token",
                f"{format_bytes(self.kv_bytes_per_token)} ({self.kv_bytes_per_token:,} B)"
                + (f", of which scales {self.kv_scale_bytes_per_token:,} B" if self.kv_scale_bytes_per_token else "")
                + (f"   [per rank: {_fmt(self.kv_bytes_per_token_per_rank)}]" if tp > 1 else ""),
            )
        )
        rows.append(("  per token per layer", format_bytes(self.kv_bytes_per_token_per_layer)))
        rows.append(
            (
                "  MHA equivalent per token",
                f"{format_bytes(self.mha_kv_bytes_per_token)} "
                + (
                    f"(GQA: {self.gqa_factor:g}× smaller with {s.num_kv_heads} KV heads "
                    f"for {s.num_attention_heads} query heads)"
                    if s.num_kv_heads < s.num_attention_heads
                    else "(1× smaller: model is MHA, KV heads = query heads)"
                ),
            )
        )
        held = ""
        if self.kv_freed_outside_window:
            held = f"   [{self.kv_tokens_per_request:,} tokens held: sliding window {s.sliding_window:,} + a block]"
        rows.append(
            (
                f"  per request ({self.seq_len:,} tokens)",
                both(self.kv_bytes_per_request, self.kv_bytes_per_request_per_rank) + held,
            )
        )
        batch_text = _fmt(self.kv_bytes_batch)
        if tp > 1:
            batch_text += (
                f"   [per rank: {_fmt(self.kv_bytes_batch_per_rank)}, "
                f"all ranks: {_fmt(self.kv_bytes_batch_total)}]"
            )
        rows.append((f"  batch ({self.batch} × {self.seq_len:,} tokens)", batch_text))
        if self.state_bytes_per_sequence:
            rows.append(
                (
                    "linear-attention state",
                    f"{_fmt(self.state_bytes_per_sequence)} per sequence (float32, {s.num_linear_layers} of "
                    f"{s.num_layers} layers; the KV above counts the other {s.num_kv_layers})",
                )
            )
        if self.memory_bytes is not None:
            budget = f"{_fmt(self.memory_bytes)} per device"
            if self.reserve_bytes:
                budget += f", reserve {_fmt(self.reserve_bytes)}"
            rows.append(("memory budget", budget))
            rows.append(("  left for KV (per device)", _fmt(self.kv_budget_bytes_per_rank or 0)))
            rows.append((f"  KV blocks ({self.block_size} tokens)", f"{self.num_kv_blocks:,}"))
            rows.append(("  tokens that fit", f"{self.max_kv_tokens:,}"))
            pool = (self.num_kv_blocks or 0) * self.block_size * self.kv_bytes_per_token_per_rank
            rows.append(
                (
                    "  KV committed (per device)",
                    f"{_fmt(self.kv_committed_bytes_batch_per_rank or 0)} for the batch; the pool is committed as "
                    f"blocks are first used, up to {_fmt(pool)}",
                )
            )
            if self.num_state_slots is not None:
                slots = f"{self.num_state_slots:,} (one per running sequence: max_num_seqs is at most this)"
                rows.append(("  state slots", slots))
            if self.num_state_snapshots is not None:
                snaps = (f"{self.num_state_snapshots:,} x {_fmt(self.state_bytes_per_sequence)} = "
                         f"{_fmt(self.num_state_snapshots * self.state_bytes_per_sequence)} (prefix cache; "
                         "--state-snapshot-memory-gib, default 1/8 of the budget)")  # fmt: skip
                rows.append(("  state snapshots", snaps))
            rows.append(
                (
                    "  max concurrent requests",
                    f"{self.max_concurrent_requests:,} × {self.seq_len:,} tokens "
                    f"(batch of {self.batch} {'fits' if self.batch_fits else 'does NOT fit'})",
                )
            )
        if self.kv_disk_bytes is not None:
            rows.append(("KV disk tier (below the pool)", _fmt(self.kv_disk_bytes)))
            rows.append((f"  blocks ({self.block_size} tokens, one file each)", f"{self.kv_disk_blocks:,}"))
            rows.append(("  prefix tokens it keeps", f"{self.kv_disk_tokens:,} = {self.kv_disk_prompts:,} prompts of "
                         f"{self.seq_len:,} tokens, read back instead of recomputed"))  # fmt: skip
        width = max(len(label) for label, _ in rows) + 2
        lines = [title]
        lines += [f"  {label.ljust(width)}{value}".rstrip() for label, value in rows]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _fmt(n: int) -> str:
    """Binary size, plus the decimal one when it reads differently (GiB vs GB)."""
    b, d = format_bytes(n), format_bytes(n, binary=False)
    return b if n < 1000 else f"{b} ({d})"


def memory_report(
    shape: ModelShape,
    *,
    seq_len: int = 4096,
    batch: int = 1,
    kv_dtype: str = "bf16",
    weight_dtype: str = "bf16",
    memory_bytes: int | None = None,
    reserve_bytes: int = 0,
    block_size: int = 16,
    tp: int = 1,
    name: str | None = None,
    quantization: str | None = None,
    quantization_group_size: int = 32,
    exact_weight_bytes: int | None = None,
    max_loras: int | None = None,
    max_lora_rank: int = 16,
    lora_dtype: str | None = None,
    max_num_seqs: int = 256,
    kv_disk_bytes: int | None = None,
) -> MemoryReport:
    """Weights, KV per token/request/batch, and (given a per-device ``memory_bytes``) how many
    ``seq_len``-token requests fit after weights and ``reserve_bytes``. ``exact_weight_bytes``: the weights'
    bytes when the checkpoint fixes them (a GGUF file's blocks kept as they are; tp=1). ``max_loras`` (LoRA
    enabled): the compute slots of rank ``max_lora_rank`` at ``lora_dtype`` (default ``weight_dtype``; the engine
    keeps them at the model's compute dtype) are counted per device and taken from the budget before the KV, as
    the engine sizes its pool (config.EngineArgs._num_kv_blocks). A hybrid model's state slots (up to
    ``max_num_seqs``) come from the same budget (memory.hybrid_pool_split). ``kv_disk_bytes``: the prefix cache's
    disk tier, whose full blocks (one file each) hold prefixes evicted from the pool."""
    _positive("seq_len", seq_len)
    _positive("batch", batch)
    _positive("block_size", block_size)
    _check_tp(shape, tp)
    dtype_bytes(kv_dtype)  # an unknown KV dtype name is an error before anything else
    w_b = dtype_bytes(weight_dtype)
    if isinstance(reserve_bytes, bool) or not isinstance(reserve_bytes, int) or reserve_bytes < 0:
        raise ValueError(f"reserve_bytes must be a non-negative integer, got {reserve_bytes!r}")
    if memory_bytes is not None:
        _positive("memory_bytes", memory_bytes)
        if reserve_bytes > memory_bytes:
            raise ValueError(
                f"reserve_bytes ({format_bytes(reserve_bytes)}) exceeds memory_bytes "
                f"({format_bytes(memory_bytes)})"
            )

    lora_bytes = 0
    if max_loras is not None:
        _positive("max_loras", max_loras)
        _positive("max_lora_rank", max_lora_rank)
        lora_dtype = lora_dtype or weight_dtype
        q, kv = shape.num_attention_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        lora_bytes = lora_slot_bytes(shape.num_layers, shape.hidden_size, q, kv, shape.intermediate_size, max_loras,
                                     max_lora_rank, dtype_bytes(lora_dtype))  # fmt: skip
    else:
        lora_dtype = None

    params = num_parameters(shape)
    params_rank = num_parameters_per_rank(shape, tp)
    if exact_weight_bytes is not None:
        if tp != 1:
            raise ValueError("exact weight bytes (a GGUF file's kept blocks) are known for tp=1 only")
        weight_bytes = weight_bytes_rank = exact_weight_bytes
    elif quantization is None and (shape.moe is None or not shape.moe.mxfp4):
        weight_bytes = math.ceil(params * w_b)
        weight_bytes_rank = math.ceil(params_rank * w_b)
    else:
        weight_bytes = weight_bytes_per_rank(shape, w_b, 1, quantization, quantization_group_size)
        weight_bytes_rank = weight_bytes_per_rank(shape, w_b, tp, quantization, quantization_group_size)

    moe: dict[str, Any] = {}
    if shape.moe is not None:
        precisions = ("float32", "bfloat16", "int8", "int4") + (("mxfp4",) if shape.moe.mxfp4 else ())
        moe = dict(
            num_active_parameters=num_active_parameters(shape),
            num_active_parameters_streamed=num_active_parameters(shape, embeddings=False),
            expert_bytes={p: expert_bytes(shape, p, 1, quantization_group_size) for p in precisions},
        )

    # per-token sizes: values plus, for the 8-bit KV dtypes, their scales
    layers, heads_rank = shape.num_kv_layers, kv_heads_per_rank(shape.num_kv_heads, tp)
    state_bytes = linear_state_bytes_per_sequence(shape)
    per_token = kv_cache_bytes_per_token(layers, shape.num_kv_heads, shape.head_dim, kv_dtype)
    scales = kv_scale_bytes_per_token(layers, shape.num_kv_heads, kv_dtype)
    per_layer = kv_cache_bytes_per_token(1, shape.num_kv_heads, shape.head_dim, kv_dtype)
    mha = kv_cache_bytes_per_token(layers, shape.num_attention_heads, shape.head_dim, kv_dtype)
    per_token_rank = kv_cache_bytes_per_token(layers, heads_rank, shape.head_dim, kv_dtype)
    free_window = shape.kv_free_window
    n_blocks_req = kv_blocks_held(seq_len, block_size, free_window)
    tokens = seq_len if free_window is None else min(seq_len, n_blocks_req * block_size)

    notes: list[str] = []
    if free_window is not None:
        notes.append(
            f"every layer slides (window {free_window:,}): the engine frees KV blocks outside the window while a "
            f"request runs, so a request holds at most {n_blocks_req:,} blocks ({tokens:,} tokens) of KV, "
            "counted so here"
        )
    elif shape.num_sliding_layers:
        notes.append(
            f"{shape.num_sliding_layers} of {shape.num_layers} layers slide (window {shape.sliding_window:,}), the "
            "others attend to everything: a block holds every layer's K/V, so the engine keeps all blocks (the sliding "
            "layers only stop reading outside their window); KV counted in full"
        )
    if state_bytes:
        notes.append(
            f"hybrid: {shape.num_linear_layers} of {shape.num_layers} layers are linear attention (a "
            f"{format_bytes(state_bytes)} float32 state per sequence, no KV); KV counts the other {layers}"
        )
    if shape.num_kv_heads < tp:
        notes.append(
            f"{shape.num_kv_heads} KV heads < tp={tp}: each KV head is replicated on "
            f"{tp // shape.num_kv_heads} ranks"
        )
    if lora_bytes and tp > 1:
        notes.append(f"LoRA slots are counted whole on every rank (tp={tp}): they are not sharded (the engine refuses "
                     "enable_lora with tensor_parallel_size > 1 today)")  # fmt: skip
    if shape.max_position_embeddings is not None and seq_len > shape.max_position_embeddings:
        notes.append(
            f"seq_len {seq_len:,} exceeds the model's max_position_embeddings "
            f"({shape.max_position_embeddings:,})"
        )

    budget: dict[str, Any] = {}
    if memory_bytes is not None:
        free = memory_bytes - reserve_bytes - weight_bytes_rank - lora_bytes
        kv_budget = max(0, free)
        if free < 0:
            what = "weights" + (" and LoRA slots" if lora_bytes else "")
            notes.append(
                f"{what} ({format_bytes(weight_bytes_rank + lora_bytes)} per device) do not fit in "
                f"memory minus reserve ({format_bytes(memory_bytes - reserve_bytes)})"
            )
        slots = snapshots = None
        if state_bytes:  # the engine's split (config.EngineArgs), with max_num_seqs and the snapshots at their defaults
            snapshots, left = state_snapshot_split(kv_budget, state_bytes)
            blocks, slots = hybrid_pool_split(left, block_size, per_token_rank, state_bytes, max_num_seqs)
            max_req = min(slots, blocks // n_blocks_req)
        else:
            blocks = max_num_kv_blocks(kv_budget, block_size, per_token_rank)
            max_req = blocks // n_blocks_req
        budget = dict(
            num_state_slots=slots,
            num_state_snapshots=snapshots,
            memory_bytes=memory_bytes,
            reserve_bytes=reserve_bytes,
            weights_fit=free >= 0,
            kv_budget_bytes_per_rank=kv_budget,
            num_kv_blocks=blocks,
            max_kv_tokens=blocks * block_size,
            max_concurrent_requests=max_req,
            batch_fits=max_req >= batch,
            kv_committed_bytes_batch_per_rank=kv_committed_bytes(
                min(blocks, batch * n_blocks_req), blocks, block_size * per_token_rank
            ),
        )
    else:
        budget = dict(reserve_bytes=reserve_bytes)

    return MemoryReport(
        name=name,
        shape=shape,
        seq_len=seq_len,
        batch=batch,
        block_size=block_size,
        tp=tp,
        kv_dtype=kv_dtype,
        weight_dtype=weight_dtype,
        num_parameters=params,
        num_parameters_per_rank=params_rank,
        weight_bytes=weight_bytes,
        weight_bytes_per_rank=weight_bytes_rank,
        kv_bytes_per_token=per_token,
        kv_scale_bytes_per_token=scales,
        kv_bytes_per_token_per_layer=per_layer,
        mha_kv_bytes_per_token=mha,
        gqa_factor=shape.gqa_ratio,
        kv_bytes_per_request=per_token * tokens,
        kv_bytes_batch=per_token * tokens * batch,
        kv_heads_per_rank=heads_rank,
        kv_bytes_per_token_per_rank=per_token_rank,
        kv_bytes_per_request_per_rank=per_token_rank * tokens,
        kv_bytes_batch_per_rank=per_token_rank * tokens * batch,
        kv_bytes_batch_total=per_token_rank * tokens * batch * tp,
        blocks_per_request=n_blocks_req,
        kv_tokens_per_request=tokens,
        kv_freed_outside_window=free_window is not None,
        notes=tuple(notes),
        quantization=quantization,
        quantization_group_size=quantization_group_size if quantization == "int4" else None,
        max_loras=max_loras,
        max_lora_rank=max_lora_rank if max_loras is not None else None,
        lora_dtype=lora_dtype,
        lora_slot_bytes=lora_bytes,
        state_bytes_per_sequence=state_bytes,
        **moe,
        **budget,
        **_disk_tier(kv_disk_bytes, block_size, per_token, seq_len),
    )


def _disk_tier(disk_bytes: int | None, block_size: int, per_token: int, seq_len: int) -> dict[str, int]:
    """The disk tier's capacity in blocks, tokens and whole seq_len-token prompts (full blocks only are kept)."""
    if disk_bytes is None:
        return {}
    _positive("kv_disk_bytes", disk_bytes)
    blocks = kv_disk_blocks(disk_bytes, block_size, per_token)
    return dict(kv_disk_bytes=disk_bytes, kv_disk_blocks=blocks, kv_disk_tokens=blocks * block_size,
                kv_disk_prompts=blocks // max(1, seq_len // block_size))  # fmt: skip
