"""The KV pool's default memory budget: a quarter of the RAM available now (half the free GPU memory on CUDA),
capped at 4 GiB; and the RAM available, which weight packing also reads."""

from __future__ import annotations

DEFAULT_KV_FRACTION = 0.25
DEFAULT_KV_CAP_BYTES = 4 * 2**30


def default_kv_budget_bytes(device: str) -> int:
    """A quarter of the free memory of the device, capped at 4 GiB: enough to serve, safe to share."""
    if device.startswith("cuda"):
        import torch

        free_bytes, _ = torch.cuda.mem_get_info()
        return int(free_bytes * 0.5)  # weights are already loaded elsewhere; leave room for activations
    free_bytes = available_ram_bytes()
    return int(min(free_bytes * DEFAULT_KV_FRACTION, DEFAULT_KV_CAP_BYTES))


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30
