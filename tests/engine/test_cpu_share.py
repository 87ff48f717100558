"""engine/cpu_share.py: others' CPU use from /proc counters, and the thread back-off with its hysteresis."""

from __future__ import annotations

import os

import pytest

from lmserve.engine.cpu_share import BACK_OFF_AT, CHECK_INTERVAL_S, RESTORE_BELOW, CpuShare, ThreadBackoff


class FakeProc:
    """/proc/stat for CPUs 0-2 and /proc/<pid>/stat for two pids, advanced by hand (clock ticks)."""

    def __init__(self) -> None:
        self.busy = {0: 0, 1: 0, 2: 0}  # user ticks per CPU
        self.ours = {10: 0, 20: 0}

    def read(self, path: str) -> str:
        if path == "/proc/stat":
            lines = ["cpu  1 2 3 4 5 6 7 8"]
            lines += [f"cpu{c} {b} 0 0 1000 0 0 0 0 0 0" for c, b in self.busy.items()]
            return "\n".join(lines + ["intr 1 2 3", "ctxt 5"])
        pid = int(path.split("/")[2])
        if pid not in self.ours:
            raise FileNotFoundError(path)
        # comm with a space and a parenthesis, as stat(5) allows; utime = ours, stime = 0
        return f"{pid} (py thon) ) R 1 1 1 0 -1 0 0 0 0 0 {self.ours[pid]} 0 0 0 20 0 3 0"


def test_others_are_busy_time_minus_ours_on_our_cpus_only(monkeypatch: pytest.MonkeyPatch) -> None:
    proc = FakeProc()
    clock = iter([100.0, 101.0, 102.0])
    monkeypatch.setattr("lmserve.engine.cpu_share.time.monotonic", lambda: next(clock))
    share = CpuShare({0, 1}, (10, 20), read=proc.read)
    ticks = os.sysconf("SC_CLK_TCK")
    proc.busy[0] += ticks  # CPU 0 fully busy for the 1 s interval
    proc.busy[1] += ticks // 2
    proc.busy[2] += 5 * ticks  # not one of ours: ignored
    proc.ours[10] += ticks // 2  # the engine core
    proc.ours[20] += ticks // 4  # the API process
    assert share.sample() == pytest.approx((ticks + ticks // 2 - ticks // 2 - ticks // 4) / ticks)
    proc.ours[10] += 2 * ticks  # more than the CPUs' busy time (rounding between files): never negative
    assert share.sample() == 0.0


def test_unreadable_proc_reports_nothing() -> None:
    def read(path: str) -> str:
        raise PermissionError(path)

    share = CpuShare({0}, (1,), read=read)
    assert share.sample() is None


class FakeShare:
    cpus = {0, 1}

    def __init__(self) -> None:
        self.others: float | None = 0.0

    def sample(self) -> float | None:
        return self.others


def test_backoff_to_one_thread_and_back_with_hysteresis() -> None:
    share = FakeShare()
    now = [0.0]
    b = ThreadBackoff(2, share, clock=lambda: now[0])  # type: ignore[arg-type]

    def tick(others: float | None) -> int | None:
        share.others = others
        now[0] += CHECK_INTERVAL_S
        return b.poll()

    assert tick(0.2) is None and b.current == 2
    assert b.poll() is None  # not due yet: no sample taken
    assert tick(BACK_OFF_AT * 2) == 1  # others hold half the CPUs: one thread
    assert tick(BACK_OFF_AT * 2 - 0.01) is None and b.current == 1  # between the thresholds: stay
    assert tick(None) is None and b.current == 1  # unreadable: no change
    assert tick(RESTORE_BELOW * 2 - 0.01) == 2  # they left: every thread again
    assert tick(0.0) is None


def test_real_proc_sample_is_a_number_on_linux() -> None:
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc")
    share = CpuShare(os.sched_getaffinity(0), (os.getpid(),))
    sum(i * i for i in range(200_000))  # some time passes
    others = share.sample()
    assert others is not None and 0.0 <= others <= len(os.sched_getaffinity(0)) + 0.5
