"""The KV transfer's cost (issue 33): µs per block and GB/s for a pull of N blocks, ZeroMQ over ipc (inside one
`lmserve serve --disaggregation`) and tcp loopback (two servers), against a shared-memory copy (the producer's
blocks copied into a shared segment and out of it into the consumer's: what a shared-memory transport would pay at
least, without any signalling). No model: KV caches of SmolLM2-135M's geometry (30 layers, 3 KV heads, head_dim 64,
block 16) in float32 and int8 (+ scales).

    python benchmarks/bench_kv_transfer.py [--quick] [--repeats 20] [--out benchmarks/results]

The lead runs it on a quiet machine; the JSON goes to benchmarks/results/kv-transfer-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from multiprocessing import shared_memory
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from benchmark_model import add_size_args, resolve_size_args  # noqa: E402
from machine import write_result  # noqa: E402

from lmserve.engine.kv_transfer import block_nbytes, cache_tensors  # noqa: E402
from lmserve.model.kv_cache import KVCache  # noqa: E402
from lmserve.sim.kv_transfer_timing import time_kv_pulls  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
FULL = {"num_blocks": 1024, "repeats": 20}
QUICK = {"num_blocks": 256, "repeats": 5}
SIZES = (1, 16, 64, 256)


def caches(num_blocks: int, dtype: str) -> list[KVCache]:
    out = [KVCache.allocate(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype, torch.device("cpu")) for _ in range(LAYERS)]
    for c in out:
        for t in cache_tensors([c]):
            t.copy_(torch.randint(-100, 100, t.shape).to(t.dtype))
    return out


def shm_copy(src: list[KVCache], dst: list[KVCache], n: int, repeats: int) -> list[float]:
    nbytes = n * block_nbytes(src)
    seg = shared_memory.SharedMemory(create=True, size=nbytes)
    try:
        buf = torch.frombuffer(seg.buf, dtype=torch.uint8)
        idx_src, idx_dst = torch.arange(n), torch.arange(n, 2 * n)
        times = []
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            off = 0
            for t in cache_tensors(src):  # producer side: blocks → the segment
                b = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
                size = n * b[0].numel() * b.element_size()
                view = buf[off : off + size].view(b.dtype).view(n, *b.shape[1:])
                torch.index_select(b, 0, idx_src, out=view)
                off += size
            off = 0
            for t in cache_tensors(dst):  # consumer side: the segment → its blocks
                size = n * t[0].numel() * t.element_size()
                t.index_copy_(0, idx_dst, buf[off : off + size].view(t.dtype).view(n, *t.shape[1:]))
                off += size
            if r:
                times.append(time.perf_counter() - t0)
        del buf, view
    finally:
        seg.close()
        seg.unlink()
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_args(ap, FULL, QUICK)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    resolve_size_args(ap, args, FULL, QUICK)
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("float32", "int8"):
            src, dst = caches(args.num_blocks, dtype), caches(args.num_blocks, dtype)
            per_block = block_nbytes(src)
            for n in (s for s in SIZES if 2 * s <= args.num_blocks):
                for name in ("zmq ipc", "zmq tcp", "shared memory copy"):
                    if name == "shared memory copy":
                        times = shm_copy(src, dst, n, args.repeats)
                    else:
                        where = f"ipc://{tmp}/kv-{dtype}-{n}" if name == "zmq ipc" else "tcp://127.0.0.1:*"
                        times = time_kv_pulls(src, dst, where, n, args.repeats)
                    t = statistics.median(times)
                    rows.append({"transport": name, "kv_dtype": dtype, "blocks": n, "block_bytes": per_block,
                                 "median_s": t, "us_per_block": 1e6 * t / n,
                                 "gb_per_s": n * per_block / t / 1e9})  # fmt: skip
                    r = rows[-1]
                    print(f"{dtype:8s} {name:20s} {n:4d} blocks ({per_block / 1024:.0f} KiB each): "
                          f"{r['us_per_block']:8.1f} µs/block {r['gb_per_s']:6.2f} GB/s", flush=True)  # fmt: skip
    write_result(Path(args.out), "kv-transfer", args, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
