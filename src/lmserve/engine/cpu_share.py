"""CPU sharing: how much of this engine core's CPUs other processes take (CpuShare), and the thread back-off it
drives (ThreadBackoff): one torch thread while others use the core's CPUs, all of them again when they stop.

"Others" excludes this process and its parent (the API process), read from /proc; Linux only (elsewhere the thread
count never changes). See docs/processes.md, "Threads and CPUs".
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

CHECK_INTERVAL_S = 0.5
BACK_OFF_AT = 0.5  # others use at least this fraction of the core's CPUs → one thread
RESTORE_BELOW = 0.25  # ... and back to all threads once they use less than this (hysteresis)


class CpuShare:
    """Others' CPU use on `cpus`, in cores, averaged over the last interval (`sample()`)."""

    def __init__(self, cpus: set[int], pids: tuple[int, ...], read: Callable[[str], str] | None = None) -> None:
        self.cpus = set(cpus)
        self.pids = pids  # processes whose time is ours (this one and the API process)
        self._read = read or _read_text
        self._ticks_per_s = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._counters()

    def sample(self) -> float | None:
        """Cores' worth of CPU time others used since the previous sample (None: /proc unreadable)."""
        now = self._counters()
        if now is None or self._last is None:
            self._last = now
            return None
        (t0, busy0, ours0), (t1, busy1, ours1) = self._last, now
        self._last = now
        elapsed = t1 - t0
        if elapsed <= 0:
            return None
        return max(0.0, (busy1 - busy0) - (ours1 - ours0)) / self._ticks_per_s / elapsed

    def _counters(self) -> tuple[float, int, int] | None:
        try:
            busy = 0
            for line in self._read("/proc/stat").splitlines():
                name, _, rest = line.partition(" ")
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in self.cpus:
                    f = [int(x) for x in rest.split()]
                    busy += f[0] + f[1] + f[2] + f[5] + f[6] + (f[7] if len(f) > 7 else 0)
            ours = 0
            for pid in self.pids:
                fields = self._read(f"/proc/{pid}/stat").rpartition(")")[2].split()
                ours += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat(5))
        except (OSError, ValueError, IndexError):
            return None
        return time.monotonic(), busy, ours


class ThreadBackoff:
    """The torch thread count an engine core should run with now: `num_threads`, or 1 while others use at least
    BACK_OFF_AT of its CPUs (until they use less than RESTORE_BELOW)."""

    def __init__(self, num_threads: int, share: CpuShare, clock: Callable[[], float] = time.monotonic) -> None:
        self.num_threads = num_threads
        self.current = num_threads
        self._share = share
        self._clock = clock
        self._next_check = clock() + CHECK_INTERVAL_S

    def poll(self) -> int | None:
        """The new thread count when it changes, else None (cheap when not due)."""
        now = self._clock()
        if now < self._next_check:
            return None
        self._next_check = now + CHECK_INTERVAL_S
        others = self._share.sample()
        if others is None:
            return None
        ncpus = max(1, len(self._share.cpus))
        if self.current > 1 and others >= BACK_OFF_AT * ncpus:
            self.current = 1
        elif self.current == 1 and self.num_threads > 1 and others < RESTORE_BELOW * ncpus:
            self.current = self.num_threads
        else:
            return None
        logger.info("other processes use %.2f of %d CPU(s): %d torch thread(s)", others, ncpus, self.current)
        return self.current


def _read_text(path: str) -> str:
    with open(path) as f:
        return f.read()
