"""How engine cores divide the machine's CPUs: threads per core (default_num_threads), a disjoint CPU set per core
when there are several (cpu_slices; each core pins itself to its own), and the OpenMP environment a core starts
with (CPU_POLICIES, `--cpu-wait-policy`). Decided in the API process before the cores start; the thread back-off a
core does at run time is engine/cpu_share.py.
"""

from __future__ import annotations

import os
from typing import Any

# CPU-sharing policies: the OpenMP environment an engine core starts with (see docs/architecture.md and
# docs/performance.md for the measurements). "adaptive" (default): "bounded", and the core drops to one torch
# thread while other processes use its CPUs (engine/cpu_share.py); "bounded": workers spin briefly between
# parallel regions, then sleep; "spin": libgomp's default (long spins); "passive": workers sleep at once (every
# region pays a futex wake-up).
CPU_POLICIES: dict[str, dict[str, str]] = {
    "adaptive": {"GOMP_SPINCOUNT": "10000"},  # bounded, plus the thread back-off (engine/cpu_share.py)
    "bounded": {"GOMP_SPINCOUNT": "10000"},
    "spin": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
}
DEFAULT_CPU_POLICY = "adaptive"


def default_num_threads(data_parallel_size: int) -> int:
    """Threads per engine core when --num-threads is not given: torch's default ($OMP_NUM_THREADS or the
    usable cores) split evenly over the cores, at least 1."""
    import torch

    return max(1, _torch_default_threads(torch) // data_parallel_size)


def _torch_default_threads(torch: Any) -> int:
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return len(os.sched_getaffinity(0)) or torch.get_num_threads()


def cpu_slices(data_parallel_size: int, num_threads: int) -> list[tuple[int, ...]] | None:
    """Disjoint CPU sets for N > 1 cores: `num_threads` CPUs each when they fit, else the usable CPUs split
    evenly; None (no pinning) for one core or more cores than CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    n = data_parallel_size
    if n <= 1 or n > len(cpus):
        return None
    per = num_threads if n * num_threads <= len(cpus) else len(cpus) // n
    return [tuple(cpus[i * per : (i + 1) * per]) for i in range(n)]
