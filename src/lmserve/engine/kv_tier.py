"""The prefix cache's disk tier on the engine's side: the fingerprint of what makes a block's bytes, and the moves
between the KV pool and the store (worker/kv_disk.py) before each step. A block's payload is its slice of every
cache tensor (engine/kv_transfer.cache_tensors' order: per layer K, V, then int8 / fp8 scales; a draft model's after),
as raw bytes. Saves copy an evicted block out on the engine thread (a memcpy) and queue the file write on the writer
thread; loads (prefix hits the scheduler read from disk) are written into their fresh blocks before the step runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import warnings
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch

from lmserve.engine.kv_transfer import cache_tensors
from lmserve.request import RequestStatus
from lmserve.worker.kv_disk import READ_LATENCY_BUCKETS_S, DiskKVStore, DiskWriter

logger = logging.getLogger(__name__)

MAX_PREFETCHING = 8  # waiting requests holding prefetched payloads at once (past that: read at admission)
FORMAT_VERSION = 1  # raised when the payload layout changes: older files then never match
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def weight_files(model_dir: str) -> list[tuple[str, int, int]]:
    """(name, bytes, mtime) of a checkpoint's weight files: a changed checkpoint at the same path is another model."""
    path = Path(model_dir)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    return [(p.name, (st := p.stat()).st_size, int(st.st_mtime)) for p in files]


def fingerprint(config: Any, tensors: list[torch.Tensor]) -> bytes:
    """16 bytes naming everything that makes a block's bytes: the checkpoint (resolved path: a Hub revision's snapshot
    directory; its weight files), dtypes, weight quantization, KV cache dtype, block size, the layout of a block
    (shapes and dtypes: layers, KV heads, head dim, scales), the tensor-parallel rank and size, a draft model, the
    device. Salts the root of the disk keys' chain (a LoRA adapter salts it further per request)."""
    mc, cc = config.model, config.cache
    spec = config.speculative
    fields = {
        "format": FORMAT_VERSION,
        "model": os.path.realpath(mc.path),
        "weights": weight_files(mc.path),
        "architecture": mc.architecture,
        "dtype": mc.dtype,
        "weight_dtype": config.weight_dtype,
        "quantization": repr(config.quantization),
        "kv_cache_dtype": cc.kv_cache_dtype,
        "block_size": cc.block_size,
        "layout": [(list(t.shape[1:]), str(t.dtype)) for t in tensors],
        "tensor_parallel": [0, config.tensor_parallel_size],
        "draft": None if spec is None or spec.draft is None else os.path.realpath(spec.draft.path),
        "device": torch.device(config.device).type,
    }
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


class KVDiskTier:
    """One engine's disk tier: its store, writer thread and the block moves."""

    def __init__(self, config: Any, runner: Any) -> None:
        if config.kv_transfer is not None or config.tensor_parallel_size > 1:  # (configs built past EngineArgs' check)
            raise ValueError("kv_cache_disk_dir: the disk tier is not supported with prefill/decode disaggregation "
                             "or tensor_parallel_size > 1")  # fmt: skip
        caches = list(runner.kv_caches)
        if runner.proposer is not None and hasattr(runner.proposer, "kv_caches"):
            caches += list(runner.proposer.kv_caches)  # a draft model's KV lives in the same blocks
        tensors = cache_tensors(caches)
        self._raw = [t.view(torch.uint8) for t in tensors]  # (fp8, bf16: moved as bytes)
        self.block_bytes = sum(r[0].numel() for r in self._raw)
        self.kv_pool = runner.kv_pool
        self.fingerprint = fingerprint(config, tensors)
        cc = config.cache
        self.store = DiskKVStore(cc.kv_disk_dir, cc.kv_disk_bytes, self.fingerprint, self.block_bytes)
        self.writer = DiskWriter(self.store)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="lmserve-kv-disk-reader")
        self._prefetching: list[Any] = []  # requests whose payloads are read (or held) in the background
        self.num_prefetches_total = 0
        self.num_loads_total = 0
        self.load_time_s_total = 0.0
        logger.info("KV disk tier: %s, %.1f GiB, %d blocks of %.0f KiB there now (%.1f GiB)", cc.kv_disk_dir,
                    cc.kv_disk_bytes / 2**30, self.store.num_files, self.block_bytes / 1024,
                    self.store.usage_bytes / 2**30)  # fmt: skip

    def export_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Each block's payload (one index_select per cache tensor, whatever the number of blocks)."""
        idx = torch.tensor(block_ids, dtype=torch.long)
        idx = idx.to(self._raw[0].device)
        rows = torch.cat([r.index_select(0, idx).reshape(len(block_ids), -1) for r in self._raw], dim=1).cpu()
        return [row.numpy().tobytes() for row in rows]

    def import_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        """Write payloads (export_blocks' layout) into blocks (one index_copy_ per cache tensor)."""
        assert all(len(p) == self.block_bytes for p in payloads), f"a payload is not a block of {self.block_bytes} B"
        with warnings.catch_warnings():  # bytes are read-only; they are only read
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(b"".join(payloads), dtype=torch.uint8).view(len(payloads), self.block_bytes)
        device = self._raw[0].device
        src = src.to(device)  # (a CUDA pool: one host-to-device copy)
        idx = torch.tensor(block_ids, dtype=torch.long, device=device)
        offset = 0
        for r in self._raw:
            n = r[0].numel()
            r.index_copy_(0, idx, src[:, offset : offset + n].reshape(len(payloads), *r.shape[1:]))
            offset += n

    def apply(self, saves: list[tuple[int, bytes]], loads: list[tuple[int, bytes]]) -> None:
        """Before a step: copy out the evicted blocks (queued for writing), then write the disk hits into theirs."""
        saves = [(b, k) for b, k in saves if not self.store.contains(k) and not self.writer.pending(k)]
        if saves:
            for (_, key), payload in zip(saves, self.export_blocks([b for b, _ in saves]), strict=True):
                self.writer.put(key, payload)
        if loads:
            start = time.perf_counter()
            self.kv_pool.ensure(max(block_id for block_id, _ in loads))  # committed before written (model/kv_pool)
            self.import_blocks([b for b, _ in loads], [p for _, p in loads])
            self.num_loads_total += len(loads)
            self.load_time_s_total += time.perf_counter() - start

    def prefetch(self, requests: list[Any], kv: Any) -> None:
        """A new request (its n sequences share the prompt): read in the background the blocks its prefix lookup will
        find on disk past those in RAM now. Until the read ends it is not admitted (Request.is_kv_ready) and the other
        requests' steps go on; blocks evicted from RAM meanwhile are read at admission."""
        first = requests[0]
        params = first.sampling_params
        if params.prompt_logprobs is not None or params.pooling is not None:
            return  # (they compute every prompt position, or may: no lookup)
        self._prefetching = [r for r in self._prefetching if r.status == RequestStatus.WAITING]
        if len(self._prefetching) >= MAX_PREFETCHING:
            return
        keys = kv.disk_keys(first)[kv.num_ram_hit_blocks(first) : (first.num_tokens - 1) // kv.block_size]
        n = 0
        while n < len(keys) and (self.store.contains(keys[n]) or self.writer.pending(keys[n])):
            n += 1
        if not n:
            return
        future = self._reader.submit(self._read_into, keys[:n], first.disk_payloads)
        for r in requests:
            r.disk_payloads, r.kv_prefetch = first.disk_payloads, future
        self._prefetching.append(first)
        self.num_prefetches_total += 1

    def read(self, key: bytes) -> bytes | None:
        """A block's payload: still queued for writing, or read from disk (the KVCacheManager's DiskTier)."""
        payload = self.writer.get(key)
        return payload if payload is not None else self.store.read(key)

    def _read_into(self, keys: list[bytes], payloads: dict[bytes, bytes]) -> None:
        for key in keys:
            payload = self.read(key)
            if payload is None:
                return
            payloads[key] = payload

    def wait_prefetch(self, timeout_s: float = 0.05) -> bool:
        """Wait (at most timeout_s) for a background read when nothing else can run; False if none is pending."""
        pending = [r.kv_prefetch for r in self._prefetching if r.kv_prefetch is not None and not r.kv_prefetch.done()]
        if pending:
            wait(pending, timeout_s, FIRST_COMPLETED)
        return bool(pending)

    def save_cached(self, pool: Any) -> int:
        """Write every block the RAM prefix cache holds that the disk has not (at close: a restart finds them)."""
        self.writer.flush()
        num = 0
        todo = [b for b in pool.blocks if b.disk_key is not None and not self.store.contains(b.disk_key)]
        for i in range(0, len(todo), 64):
            chunk = todo[i : i + 64]
            for block, payload in zip(chunk, self.export_blocks([b.block_id for b in chunk]), strict=True):
                num += self.store.write(block.disk_key, payload)
        return num

    def clear(self) -> int:
        """Delete every block on disk (POST /reset_prefix_cache?include_disk=true)."""
        self.writer.flush()
        return self.store.clear()

    def close(self, pool: Any) -> None:
        self._reader.shutdown(wait=True)
        saved = self.save_cached(pool)
        self.writer.close()
        logger.info("KV disk tier: %d cached blocks saved at close (%d on disk)", saved, self.store.num_files)

    def metrics(self) -> dict[str, Any]:
        s = self.store
        buckets = [*(str(b) for b in READ_LATENCY_BUCKETS_S), "+Inf"]
        return {
            "kv_disk_usage_bytes": s.usage_bytes,
            "kv_disk_capacity_bytes": s.capacity_bytes,
            "kv_disk_num_blocks": s.num_files,
            "kv_disk_blocks_written_total": s.num_blocks_written_total,
            "kv_disk_blocks_read_total": s.num_blocks_read_total,
            "kv_disk_bytes_written_total": s.num_bytes_written_total,
            "kv_disk_bytes_read_total": s.num_bytes_read_total,
            "kv_disk_misses_total": s.num_misses_total,
            "kv_disk_bad_files_total": s.num_bad_files_total,
            "kv_disk_evicted_total": s.num_evicted_total,
            "kv_disk_write_errors_total": s.num_write_errors_total,
            "kv_disk_writes_dropped_total": self.writer.num_dropped_total,
            "kv_disk_write_disabled": int(s.write_disabled),
            "kv_disk_read_latency_seconds_buckets": dict(zip(buckets, s.read_latency_counts, strict=True)),
            "kv_disk_read_latency_seconds_sum": s.read_latency_sum_s,
            "kv_disk_load_time_s_total": self.load_time_s_total,
            "kv_disk_prefetches_total": self.num_prefetches_total,
        }
