"""The data-parallel routing rule as a pure function (choose_core): which engine core a new request goes to.

Least loaded live core (running + waiting + unacknowledged adds; ties to lower KV usage, then index), overridden
by prefix affinity on the prompt's first full KV block (first_block_key) unless that core's load exceeds the
minimum by more than AFFINITY_SLACK. EngineCoreClient and the simulator both apply it. No torch, no sockets.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

AFFINITY_SLACK = 4  # sequences: a prefix-affine core is used unless its load exceeds the minimum by more
AFFINITY_ENTRIES = 4096  # first-block hashes remembered (least recently used dropped)

Load = tuple[int, float]  # (sequences queued or running, KV usage fraction)


def first_block_key(prompt_ids: Sequence[int], block_size: int, lora_int_id: int = 0) -> int | None:
    """The affinity key of a prompt: the hash of its first full KV block (None: shorter than a block), salted with
    its LoRA adapter's id as the prefix cache's chain is (so one prompt under two adapters keys two cores' caches)."""
    if len(prompt_ids) < block_size:
        return None
    block = tuple(prompt_ids[:block_size])
    return hash(block) if not lora_int_id else hash((lora_int_id, block))


def choose_core(
    loads: Mapping[int, Load],
    affinity: OrderedDict[int, int],
    prompt_ids: Sequence[int],
    block_size: int,
    max_entries: int = AFFINITY_ENTRIES,
    slack: int = AFFINITY_SLACK,
    lora_int_id: int = 0,
) -> int:
    """The index of the core for a new request.

    loads: the live cores' loads, in core-index order (a dead core is absent). affinity: first-block hash → core
    index, updated in place (the caller keeps it between calls). Returns a key of `loads`.
    """
    assert loads, "routing with no live core"
    live = list(loads)
    if len(live) == 1:
        return live[0]
    best = min(live, key=loads.__getitem__)
    key = first_block_key(prompt_ids, block_size, lora_int_id)
    if key is None:
        return best
    affine = affinity.get(key)
    chosen = best
    if affine is not None and affine in loads and loads[affine][0] <= loads[best][0] + slack:
        chosen = affine
    affinity[key] = chosen
    affinity.move_to_end(key)
    if len(affinity) > max_entries:
        affinity.popitem(last=False)
    return chosen
