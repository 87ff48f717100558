"""The machine description every benchmarks/ JSON carries: CPU model, cores, memory, the instruction sets that
pick lmserve's (and peers') kernels, versions, git commit and load average. Machines differ between sessions:
a figure means nothing without this."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from lmserve import kernels
from lmserve.kernels import cpu_flags

REPO = Path(__file__).resolve().parent.parent
# the /proc/cpuinfo flags that decide which kernels run (vector width, int8 / bf16 dot products, AMX tiles)
ISA_FLAGS = {
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
    "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16", "asimd", "sve",
}  # fmt: skip



def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def cpu_model_name() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith(("model name", "Model Name", "Processor")) and ":" in line:
            return line.split(":", 1)[1].strip()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def physical_cores() -> int | None:
    """Distinct (physical id, core id) pairs of /proc/cpuinfo; None where it does not say."""
    cores: set[tuple[str, str]] = set()
    phys = core = None
    for line in _read("/proc/cpuinfo").splitlines() + [""]:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "physical id":
            phys = value.strip()
        elif key == "core id":
            core = value.strip()
        elif not line.strip():
            if core is not None:
                cores.add((phys or "0", core))
            phys = core = None
    return len(cores) or None


def meminfo_gib(field: str) -> float | None:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith(field + ":"):
            return round(int(line.split()[1]) * 1024 / 2**30, 2)
    return None


def git_commit() -> dict[str, Any]:
    def git(*a: str) -> str | None:
        try:
            r = subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def lmserve_kernels() -> dict[str, str]:
    """The instructions lmserve's quantized kernels run on here, as the runner logs them (int8, int4 weight-only,
    int8w, and the W4A8 path $LMSERVE_W4A8_ISA or cpuid picks); empty without the C kernels."""
    if not kernels.available():
        return {}
    try:
        return kernels.quantized_kernel_names()
    except ValueError as e:  # a forced W4A8 path this CPU lacks
        return {"error": str(e)}


def machine_info() -> dict[str, Any]:
    import transformers

    return {
        "cpu_model": cpu_model_name(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "physical_cores": physical_cores(),
        "mem_total_gib": meminfo_gib("MemTotal"),
        "mem_available_gib": meminfo_gib("MemAvailable"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_isa_flags": sorted(cpu_flags() & ISA_FLAGS),
        "lmserve_kernels": lmserve_kernels(),
        "git": git_commit(),
        "load_avg_1m_start": os.getloadavg()[0],
    }


def write_result(out_dir: Path, name: str, args: Any, payload: dict[str, Any], suffix: str = "") -> Path:
    """benchmarks/results-style JSON: {benchmark, args, machine, time, **payload} as `<name>-<timestamp><suffix>.json`
    under out_dir; prints and returns the path."""
    import json
    import time

    out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": name,
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine": machine_info(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **payload,
    }
    path = out_dir / f"{name.replace('_', '-')}-{time.strftime('%Y%m%d-%H%M%S')}{suffix}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return path
