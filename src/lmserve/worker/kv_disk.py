"""DiskKVStore: KV blocks as files in a directory, the prefix cache's tier below RAM, and DiskWriter, the thread
that writes them. Files are named by the block's chain digest (core/block_pool.disk_hash_blocks), written under a
temporary name and renamed, with a header a read verifies (a bad file is a miss, deleted); the LRU index is rebuilt
from the directory at start and every RESCAN_EVERY writes. Format and policy: docs/kv_disk_tier.md.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path

from lmserve.memory.ledger import KV_DISK_HEADER_BYTES

logger = logging.getLogger(__name__)

MAGIC = b"LMKVBLK1"
HEADER = struct.Struct("<8s16s16sQI")  # magic, fingerprint digest, key, payload bytes, CRC-32 of the payload
assert HEADER.size == KV_DISK_HEADER_BYTES, "the ledger's disk-tier header size (memory/ledger.py) is this header's"
SUFFIX = ".kv"
RESCAN_EVERY = 256  # writes between rescans of the directory (its usage as every writer sees it)
STALE_TMP_S = 600.0  # temporary files older than this at start are a crashed writer's: removed
READ_LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}


class DiskKVStore:
    """Block payloads (bytes) by key (a 16-byte digest) in `path`, at most capacity_bytes of files (LRU). Thread-safe:
    the engine thread reads, the writer thread writes."""

    def __init__(self, path: str | os.PathLike, capacity_bytes: int, fingerprint: bytes, payload_bytes: int) -> None:
        assert capacity_bytes > 0 and len(fingerprint) == 16, "a positive capacity and a 16-byte fingerprint"
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.payload_bytes = payload_bytes  # every block's payload has this length (the engine's block layout)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key → file bytes, least recently used first
        self.usage_bytes = 0
        self._tmp_ids = itertools.count()
        self._writes_since_scan = 0
        self._warned: set[str] = set()
        self.write_disabled = False  # the disk filled up: no more writes (reads go on)
        self.num_blocks_written_total = self.num_blocks_read_total = 0
        self.num_bytes_written_total = self.num_bytes_read_total = 0
        self.num_misses_total = 0  # keys looked up and not found (or found unusable)
        self.num_bad_files_total = 0  # truncated, corrupted or foreign files (deleted)
        self.num_evicted_total = 0  # files removed for the capacity
        self.num_write_errors_total = 0
        self.read_latency_counts = [0] * (len(READ_LATENCY_BUCKETS_S) + 1)  # per bucket (+Inf last), not cumulative
        self.read_latency_sum_s = 0.0
        self._remove_stale_tmp()
        self.rescan()

    # ---- files ---------------------------------------------------------------------------------------

    def _file(self, key: bytes) -> Path:
        name = key.hex()
        return self.path / name[:2] / (name + SUFFIX)

    def _remove_stale_tmp(self) -> None:
        now = time.time()
        for tmp in self.path.glob("*/.tmp-*"):
            try:
                if now - tmp.stat().st_mtime > STALE_TMP_S:
                    tmp.unlink()
            except OSError:
                pass

    def rescan(self) -> None:
        """Rebuild the index from the directory (oldest mtime first): what a restart, or another writer, left."""
        found: list[tuple[float, bytes, int]] = []
        for sub in self.path.iterdir() if self.path.is_dir() else ():
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            with os.scandir(sub) as entries:
                for e in entries:
                    if not e.name.endswith(SUFFIX):
                        continue
                    try:
                        key = bytes.fromhex(e.name[: -len(SUFFIX)])
                        st = e.stat()
                    except (ValueError, OSError):
                        continue
                    if len(key) == 16:
                        found.append((st.st_mtime, key, st.st_size))
        found.sort()
        with self._lock:
            self._index = OrderedDict((key, size) for _, key, size in found)
            self.usage_bytes = sum(self._index.values())
            self._writes_since_scan = 0

    # ---- reads ---------------------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def read(self, key: bytes) -> bytes | None:
        """The block's payload, verified; None (a miss) if absent, truncated, corrupted or foreign."""
        with self._lock:
            known = key in self._index
            if known:
                self._index.move_to_end(key)
        path = self._file(key)
        start = time.perf_counter()
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self._forget(key)  # (another writer's eviction, or never written)
            self.num_misses_total += 1
            return None
        except OSError as e:
            self._warn_once("read", "KV disk tier: reading %s failed (%s); treated as a miss", path, e)
            self.num_misses_total += 1
            return None
        payload = self._verify(key, data)
        if payload is None:
            self.num_bad_files_total += 1
            self.num_misses_total += 1
            self._warn_once("bad", "KV disk tier: %s is truncated, corrupted or another engine's; deleted, its "
                            "tokens recomputed (further bad files are counted, not logged)", path)  # fmt: skip
            self._remove(key)
            return None
        elapsed = time.perf_counter() - start
        self._observe_read(elapsed, len(data))
        if not known:
            with self._lock:
                if key not in self._index:
                    self._index[key] = len(data)
                    self.usage_bytes += len(data)
        try:
            os.utime(path)  # mtime is the LRU order a restart (or another process's rescan) sees
        except OSError:
            pass
        return payload

    def _verify(self, key: bytes, data: bytes) -> bytes | None:
        if len(data) < HEADER.size:
            return None
        magic, fp, file_key, n, crc = HEADER.unpack_from(data)
        payload = data[HEADER.size :]
        if magic != MAGIC or fp != self.fingerprint or file_key != key or n != len(payload):
            return None
        if n != self.payload_bytes or zlib.crc32(payload) != crc:
            return None
        return payload

    def _observe_read(self, elapsed_s: float, nbytes: int) -> None:
        i = next((i for i, b in enumerate(READ_LATENCY_BUCKETS_S) if elapsed_s <= b), len(READ_LATENCY_BUCKETS_S))
        self.read_latency_counts[i] += 1
        self.read_latency_sum_s += elapsed_s
        self.num_blocks_read_total += 1
        self.num_bytes_read_total += nbytes

    # ---- writes --------------------------------------------------------------------------------------

    def write(self, key: bytes, payload: bytes) -> bool:
        """Store a block (a no-op when present or the disk is full); returns whether a file was written."""
        assert len(payload) == self.payload_bytes, f"a block payload of {len(payload)} B, expected {self.payload_bytes}"
        if self.write_disabled or self.contains(key):
            return False
        size = HEADER.size + len(payload)
        if size > self.capacity_bytes:
            return False
        self._writes_since_scan += 1
        if self._writes_since_scan >= RESCAN_EVERY:
            self.rescan()
        self._make_room(size)
        path = self._file(key)
        tmp = path.parent / f".tmp-{os.getpid()}-{threading.get_ident()}-{next(self._tmp_ids)}"
        header = HEADER.pack(MAGIC, self.fingerprint, key, len(payload), zlib.crc32(payload))
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)  # atomic: a reader sees the old file, no file, or the whole new one
        except OSError as e:
            _unlink(tmp)
            if e.errno in _NO_SPACE:
                self.write_disabled = True
                logger.warning("KV disk tier: %s is full (%s); no more blocks are written, reads and serving go "
                               "on", self.path, e)  # fmt: skip
            else:
                self.num_write_errors_total += 1
                self._warn_once("write", "KV disk tier: writing %s failed (%s); the block stays uncached", path, e)
            return False
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self.usage_bytes += size
        self.num_blocks_written_total += 1
        self.num_bytes_written_total += size
        return True

    def _make_room(self, size: int) -> None:
        while True:
            with self._lock:
                if self.usage_bytes + size <= self.capacity_bytes or not self._index:
                    return
                key, _ = next(iter(self._index.items()))
            self._remove(key)
            self.num_evicted_total += 1

    # ---- removal -------------------------------------------------------------------------------------

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.usage_bytes -= size

    def _remove(self, key: bytes) -> None:
        self._forget(key)
        _unlink(self._file(key))

    def clear(self) -> int:
        """Delete every block file in the directory (every writer's); returns how many."""
        self.rescan()
        with self._lock:
            keys = list(self._index)
        for key in keys:
            self._remove(key)
        self.write_disabled = False  # (space was freed)
        return len(keys)

    @property
    def num_files(self) -> int:
        return len(self._index)

    def _warn_once(self, what: str, msg: str, *args: object) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(msg, *args)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


class DiskWriter:
    """A thread writing (key, payload) pairs into a store, so the engine's step never waits for the disk. At most
    max_pending_bytes wait: past that a block is dropped (counted), not written."""

    def __init__(self, store: DiskKVStore, max_pending_bytes: int = 256 * 2**20) -> None:
        self.store = store
        self.max_pending_bytes = max_pending_bytes
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue()
        self._pending_bytes = 0
        self._pending: dict[bytes, bytes] = {}  # key → payload queued, not yet written
        self._lock = threading.Lock()
        self.num_dropped_total = 0
        self._thread = threading.Thread(target=self._run, name="lmserve-kv-disk-writer", daemon=True)
        self._thread.start()

    def pending(self, key: bytes) -> bool:
        with self._lock:
            return key in self._pending

    def get(self, key: bytes) -> bytes | None:
        """A queued block's payload (not on disk yet), or None."""
        with self._lock:
            return self._pending.get(key)

    def put(self, key: bytes, payload: bytes) -> bool:
        with self._lock:
            if key in self._pending:
                return False
            if self._pending_bytes + len(payload) > self.max_pending_bytes:
                self.num_dropped_total += 1
                return False
            self._pending_bytes += len(payload)
            self._pending[key] = payload
        self._queue.put((key, payload))
        return True

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            key, payload = item
            try:
                self.store.write(key, payload)
            except Exception:  # noqa: BLE001 (the thread must live on: one block is lost)
                logger.exception("KV disk tier: writing a block failed")
            finally:
                with self._lock:
                    self._pending_bytes -= len(payload)
                    self._pending.pop(key, None)
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued block is written."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join(10)
