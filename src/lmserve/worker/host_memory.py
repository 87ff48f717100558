"""glibc malloc settings for a process that allocates and frees many large activation tensors per step.

By default glibc serves large allocations with mmap and returns them with munmap, so every step's activations
are page-faulted in and zeroed again; tune_malloc_for_tensors keeps allocations up to 32 MiB on the heap and never
trims it, so the memory is reused; release_freed_memory gives freed pages back once (malloc_trim).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's maximum; larger tensors (weights, KV pool) still get mmap
TRIM_THRESHOLD_BYTES = 2**31 - 1  # keep freed heap memory for the next step instead of trimming it
TOP_PAD_BYTES = 64 * 2**20

_applied = False


def tune_malloc_for_tensors() -> bool:
    """Apply the settings once per process; returns whether they are in effect (glibc only)."""
    global _applied
    if _applied:
        return True
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): leave the allocator alone
        return False
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
            (M_TOP_PAD, TOP_PAD_BYTES),
        )
    )
    if not ok:
        logger.debug("mallopt refused a setting; allocator left partly at its defaults")
    _applied = ok
    return ok


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the OS once (glibc malloc_trim(0)): after a quantized load and its
    repacking, whose temporary copies the untrimmed heap would otherwise keep resident; the steps' activations
    regrow it as they need. Returns whether it ran (glibc only)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True
