"""The KV transfer's cost for PD simulation: block pulls between two engines on one host, timed."""

from __future__ import annotations

import time
from typing import Any


def time_kv_pulls(src: list[Any], dst: list[Any], address: str, n: int, repeats: int) -> list[float]:
    """Seconds of each of `repeats` pulls of blocks 0..n-1 from `src` into `dst`'s blocks n..2n-1 (`dst` holds at
    least 2n), through the disaggregated engines' own KVServer (bound at `address`: ipc://... or tcp://host:*) and
    KVPuller, the blocks written by import_blocks as a decode engine writes them. A first pull sets the connection
    up and is not counted."""
    from types import SimpleNamespace

    from lmserve.engine.kv_transfer import KVLeases, KVPuller, KVServer, import_blocks

    leases = KVLeases(60.0)
    server = KVServer(address, leases, src, {})
    bound = server.start()
    puller = KVPuller(30.0)
    times = []
    try:
        for r in range(repeats + 1):
            req = SimpleNamespace(request_id=f"timed-{n}-{r}")
            leases.grant(req, list(range(n)))
            t0 = time.perf_counter()
            ticket = puller.pull(bound, req.request_id, list(range(n)))
            results = []
            while not results:
                results = puller.poll(100)
            assert results[0].ticket == ticket and results[0].frames is not None, results[0].error
            import_blocks(dst, list(range(n, 2 * n)), results[0].frames)
            if r:
                times.append(time.perf_counter() - t0)
            leases.collect(lambda _: None)
    finally:
        puller.close()
        server.stop()
    return times


def measure_kv_transfer(config: Any, repeats: int = 5, sizes: tuple[int, int] = (1, 32)) -> tuple[float, float]:
    """(seconds per pull, seconds per block) of a KV pull between two engines on this machine (time_kv_pulls over
    ZeroMQ ipc, on KV caches of the config's geometry and dtype): the median of `repeats` pulls at two sizes, fitted
    as a line (what the simulator's disaggregation charges per pull)."""
    import statistics
    import tempfile

    import torch

    from lmserve.model.kv_cache import KVCache

    m, cc = config.model, config.cache
    n_max = max(sizes)
    src, dst = ([KVCache.allocate(2 * n_max, cc.block_size, m.num_kv_heads, m.head_dim, cc.kv_cache_dtype,
                                  torch.device("cpu")) for _ in range(m.num_layers)] for _ in range(2))  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        t0_s, t1_s = (statistics.median(time_kv_pulls(src, dst, f"ipc://{tmp}/kv-{n}", n, repeats)) for n in sizes)
    n0, n1 = sizes
    block_s = max(0.0, (t1_s - t0_s) / (n1 - n0))
    return max(0.0, t0_s - n0 * block_s), block_s
