"""engine/router.choose_core: the server's routing rule as a pure function, choosing as EngineCoreClient._route does
on the same loads (random snapshots, unacknowledged adds, dead cores, shared first blocks), step by step."""

from __future__ import annotations

import random
from collections import OrderedDict
from pathlib import Path

from lmserve.config.engine import EngineArgs
from lmserve.engine import core_client, router
from lmserve.engine.async_engine import Admission, EngineSnapshot
from lmserve.engine.core_client import EngineCoreClient
from lmserve.engine.core_handles import CoreView
from lmserve.engine.router import choose_core, first_block_key

BLOCK = 16


def _snap(running: int, waiting: int, usage: float) -> EngineSnapshot:
    metrics = {"num_requests_running": running, "num_requests_waiting": waiting, "kv_cache_usage": usage}
    return EngineSnapshot(metrics, num_batched_tokens=0, num_aborted_requests_total=0, time=1.0)


def test_constants_are_the_servers() -> None:
    assert router.AFFINITY_SLACK == core_client.AFFINITY_SLACK
    assert router.AFFINITY_ENTRIES == core_client.AFFINITY_ENTRIES


def test_choose_core_matches_engine_core_client_route(llama_dir: Path) -> None:
    num_cores = 4
    config = EngineArgs.from_kwargs(str(llama_dir), num_kv_blocks=64, block_size=BLOCK).create_engine_config()
    client = EngineCoreClient(config, data_parallel_size=num_cores)
    client._cores = [CoreView(i, None, None, Admission(None), 1, snapshot=_snap(0, 0, 0.0)) for i in range(num_cores)]
    affinity: OrderedDict[int, int] = OrderedDict()
    rng = random.Random(0)
    prefixes = [[rng.randrange(1, 500) for _ in range(BLOCK)] for _ in range(6)]
    choices = []
    for step in range(600):
        for core in client._cores:  # loads move as snapshots arrive; ties on load are common (small numbers)
            if rng.random() < 0.5:
                core.snapshot = _snap(rng.randrange(0, 8), rng.randrange(0, 3), rng.choice([0.0, 0.25, 0.5]))
            if rng.random() < 0.2:
                core.pending = {f"p{step}-{j}": (rng.randrange(1, 3), 1) for j in range(rng.randrange(0, 3))}
        if step % 97 == 50:  # a core dies, another comes back (the rule never picks a dead one)
            for core in client._cores:
                core.alive = True
            client._cores[rng.randrange(num_cores)].alive = False
        kind = rng.random()
        if kind < 0.6:
            prompt = rng.choice(prefixes) + [rng.randrange(1, 500) for _ in range(rng.randrange(0, 20))]
        elif kind < 0.8:
            prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(1, BLOCK))]  # shorter than a block
        else:
            prompt = [rng.randrange(1, 500) for _ in range(40)]
        loads = {c.index: c.load() for c in client._cores if c.alive}
        expected = client._route(prompt).index
        assert choose_core(loads, affinity, prompt, BLOCK) == expected, f"step {step}: differs from the server"
        choices.append(expected)
        assert affinity == client._affinity, f"step {step}: the affinity tables diverged"
    assert len(set(choices)) == num_cores  # every core was chosen at some point
    assert len(affinity) > 0


def test_affinity_table_is_bounded_lru() -> None:
    affinity: OrderedDict[int, int] = OrderedDict()
    loads = {0: (0, 0.0), 1: (0, 0.0)}
    for i in range(10):
        choose_core(loads, affinity, [i] * BLOCK, BLOCK, max_entries=4)
    assert len(affinity) == 4
    assert first_block_key([9] * BLOCK + [1], BLOCK) in affinity  # the most recent kept
    assert first_block_key([0] * BLOCK, BLOCK) not in affinity  # the oldest dropped
    assert first_block_key([1] * (BLOCK - 1), BLOCK) is None
