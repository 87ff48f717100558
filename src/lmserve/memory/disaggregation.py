"""The memory ledger of prefill/decode disaggregation (`lmserve memory --disaggregation NPmD`): each role's pool.

disaggregated_memory splits the budget over the P + D cores (each its own weights and KV pool, a RolePool per role)
and counts the transfer buffer of a pull. No torch. See docs/memory.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lmserve.memory.ledger import max_num_kv_blocks
from lmserve.memory.report import MemoryReport
from lmserve.memory.units import format_bytes


@dataclass(frozen=True)
class RolePool:
    role: str  # "prefill" | "decode"
    num_cores: int
    weight_bytes_per_core: int
    kv_budget_bytes_per_core: int | None  # None without a memory budget
    num_kv_blocks_per_core: int | None
    max_concurrent_requests_per_core: int | None


@dataclass(frozen=True)
class DisaggregatedMemory:
    prefill: RolePool
    decode: RolePool
    transfer_buffer_bytes_per_pull: int  # export copy + received frames of one request's KV
    weights_fit: bool | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format_table(self) -> str:
        lines = ["disaggregation (each core: its own weights and KV pool)"]
        for pool in (self.prefill, self.decode):
            text = f"{pool.num_cores} × weights {format_bytes(pool.weight_bytes_per_core)}"
            if pool.kv_budget_bytes_per_core is not None:
                text += (f" + KV pool {format_bytes(pool.kv_budget_bytes_per_core)} ({pool.num_kv_blocks_per_core:,} "
                         f"blocks, {pool.max_concurrent_requests_per_core:,} requests)")  # fmt: skip
            lines.append(f"  {pool.role + ' cores':<16}{text}")
        lines.append(f"  {'transfer buffer':<16}{format_bytes(self.transfer_buffer_bytes_per_pull)} per pull in flight "
                     "(one request's KV, twice while it crosses)")  # fmt: skip
        if self.weights_fit is False:
            lines.append("  note: the weights of every core do not fit the budget")
        return "\n".join(lines)


def disaggregated_memory(report: MemoryReport, num_prefill: int, num_decode: int) -> DisaggregatedMemory:
    """Each role's pool for `report`'s model, budget and request size; ValueError naming the field."""
    if num_prefill < 1 or num_decode < 1:
        raise ValueError(f"disaggregation needs >= 1 prefill and >= 1 decode core, got {num_prefill}P{num_decode}D")
    n = num_prefill + num_decode
    weights = report.weight_bytes_per_rank
    budget = blocks = concurrent = None
    fits = None
    if report.memory_bytes is not None:
        share = (report.memory_bytes - report.reserve_bytes) // n
        fits = share > weights
        budget = max(0, share - weights)
        blocks = max_num_kv_blocks(budget, report.block_size, report.kv_bytes_per_token_per_rank)
        concurrent = blocks // max(1, report.blocks_per_request)
    pools = [RolePool(role, k, weights, budget, blocks, concurrent)
             for role, k in (("prefill", num_prefill), ("decode", num_decode))]  # fmt: skip
    return DisaggregatedMemory(pools[0], pools[1], 2 * report.kv_bytes_per_request_per_rank, fits)
