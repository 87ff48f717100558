"""DiskKVStore and DiskWriter: verified reads, atomic writes, LRU within the capacity, restarts, a full disk."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from lmserve.worker import kv_disk
from lmserve.worker.kv_disk import HEADER, DiskKVStore, DiskWriter

FP = b"f" * 16
N = 1000  # payload bytes of a block


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _payload(i: int) -> bytes:
    return bytes([i % 251]) * N


def _store(path: Path, num_blocks: int = 100, fp: bytes = FP) -> DiskKVStore:
    return DiskKVStore(path, num_blocks * (HEADER.size + N), fp, N)


def test_round_trip_atomic_and_restart(tmp_path: Path) -> None:
    s = _store(tmp_path)
    assert s.read(_key(1)) is None and s.num_misses_total == 1
    assert s.write(_key(1), _payload(1)) and not s.write(_key(1), _payload(1))  # the second: already there
    assert s.read(_key(1)) == _payload(1)
    assert not list(tmp_path.glob("*/.tmp-*")), "no temporary file is left behind"
    assert s.num_bytes_written_total == s.num_bytes_read_total == s.usage_bytes == HEADER.size + N  # file bytes
    assert sum(s.read_latency_counts) == 1
    again = _store(tmp_path)  # a restart: the index is rebuilt from the directory
    assert again.contains(_key(1)) and again.read(_key(1)) == _payload(1)


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "empty"])
def test_bad_files_are_misses_deleted_and_logged_once(tmp_path: Path, damage: str, caplog) -> None:
    s = _store(tmp_path)
    for i in (1, 2):
        s.write(_key(i), _payload(i))
    for i in (1, 2):
        f = s._file(_key(i))
        data = f.read_bytes()
        if damage == "flip":
            data = data[:-5] + bytes([data[-5] ^ 1]) + data[-4:]
        elif damage == "truncate":
            data = data[: len(data) // 2]
        elif damage == "empty":
            data = b""
        else:  # a file of another fingerprint under this name
            data = data.replace(FP, b"g" * 16, 1)
        f.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger=kv_disk.__name__):
        assert s.read(_key(1)) is None and s.read(_key(2)) is None
    assert s.num_bad_files_total == 2 and not s.contains(_key(1)) and not s._file(_key(1)).exists()
    assert len([r for r in caplog.records if "corrupted" in r.getMessage()]) == 1


def test_other_fingerprint_never_reads_a_block(tmp_path: Path) -> None:
    _store(tmp_path).write(_key(1), _payload(1))
    assert _store(tmp_path, fp=b"g" * 16).read(_key(1)) is None


def test_lru_within_the_capacity(tmp_path: Path) -> None:
    s = _store(tmp_path, num_blocks=3)
    for i in range(3):
        s.write(_key(i), _payload(i))
    assert s.read(_key(0)) == _payload(0)  # block 0 becomes the most recently used
    s.write(_key(3), _payload(3))
    assert [s.contains(_key(i)) for i in range(4)] == [True, False, True, True]
    assert s.num_evicted_total == 1 and s.usage_bytes <= s.capacity_bytes
    assert len(list(tmp_path.glob(f"*/*{kv_disk.SUFFIX}"))) == 3
    os.utime(s._file(_key(2)), (1, 1))  # the oldest mtime: the first to go after a restart
    again = _store(tmp_path, num_blocks=3)
    again.write(_key(4), _payload(4))
    assert not again.contains(_key(2)) and again.contains(_key(0))


def test_full_disk_stops_writing_and_says_so_once(tmp_path: Path, monkeypatch, caplog) -> None:
    s = _store(tmp_path)
    s.write(_key(1), _payload(1))

    def no_space(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kv_disk.os, "replace", no_space)
    with caplog.at_level(logging.WARNING, logger=kv_disk.__name__):
        assert not s.write(_key(2), _payload(2)) and not s.write(_key(3), _payload(3))
    assert s.write_disabled and len([r for r in caplog.records if "full" in r.getMessage()]) == 1
    assert not list(tmp_path.glob("*/.tmp-*")), "the temporary file of the failed write is removed"
    assert s.read(_key(1)) == _payload(1), "reads go on"
    monkeypatch.undo()
    assert s.clear() == 1 and not s.write_disabled and s.num_files == 0


def test_writer_thread_writes_and_bounds_what_waits(tmp_path: Path) -> None:
    s = _store(tmp_path)
    w = DiskWriter(s, max_pending_bytes=10 * N)
    for i in range(5):
        assert w.put(_key(i), _payload(i))
    w.flush()
    assert all(s.read(_key(i)) == _payload(i) for i in range(5))
    w.close()
    tiny = DiskWriter(s, max_pending_bytes=N // 2)
    assert not tiny.put(_key(9), _payload(9)) and tiny.num_dropped_total == 1
    tiny.close()
