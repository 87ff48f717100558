"""The one kernel library: built from the sources on first use, cached, loaded with ctypes, its functions'
signatures declared; `available()` says whether it loaded. The bindings (float32.py, quantized.py, w4a8.py,
mxfp4.py, stack.py, gated_deltanet.py) read `_lib` from here at call time."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")  # the unity file: it #includes one source per kernel family
SOURCES = sorted([*SOURCE.parent.glob("*.c"), *SOURCE.parent.glob("*.h")])
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=gnu11"]
MAX_HEADS = 256  # query heads the attention kernel's stack arrays hold (MAX_GROUP_HEADS in the C source)
# KV cache storage dtypes the attention and RoPE+KV-write kernels read and write (the `kind` of the *_q variants;
# float32 takes the original kernels). int8 and fp8 come with a float32 scale per (slot, KV head).
KV_CACHE_DTYPES = {torch.float32: -1, torch.bfloat16: 0, torch.int8: 1, torch.float8_e4m3fn: 2}

_lib: ctypes.CDLL | None = None
_tried = False

_P = ctypes.c_void_p
_I = ctypes.c_int64


def _cpu_fingerprint() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() + platform.machine()


def _cache_dir() -> Path:
    env = os.environ.get("LMSERVE_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lmserve" / "kernels"


def _compile(cc: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, out)  # atomic: concurrent processes never load a half-written library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library_path(cc: str) -> Path:
    """Where the library built by `cc` for this source, these flags and this CPU is cached."""
    key = hashlib.sha256(
        b"".join(s.name.encode() + s.read_bytes() for s in SOURCES)
        + " ".join([cc, *CFLAGS]).encode()
        + _cpu_fingerprint().encode()
    ).hexdigest()[:16]
    return _cache_dir() / f"cpu_kernels-{key}.so"


def _load() -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None:
        logger.info("no C compiler found: CPU kernels off, using PyTorch ops")
        return None
    path = library_path(cc)
    if not path.exists():
        try:
            _compile(cc, path)
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            logger.warning("compiling %s failed, using PyTorch ops instead: %s", SOURCE.name, detail.strip()[-2000:])
            return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:  # e.g. a cached library this system cannot load
        logger.warning("loading %s failed, using PyTorch ops instead: %s", path, e)
        return None
    lib.linear_f32.argtypes = [_P, _P, _P, _P, _I, _I, _I, ctypes.c_int]
    lib.linear_f32.restype = None
    lib.linear_bf16w_f32.argtypes = [_P, _P, _P, _P, _I, _I, _I, ctypes.c_int]
    lib.linear_bf16w_f32.restype = None
    lib.f32_kernel_max_rows.argtypes, lib.f32_kernel_max_rows.restype = [], ctypes.c_int
    lib.paged_decode_attention.argtypes = [
        _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _I, _P, ctypes.c_int,
    ]  # fmt: skip
    lib.paged_decode_attention.restype = None
    lib.rmsnorm_f32.argtypes = [_P, _P, _P, _P, _I, _I, ctypes.c_float, ctypes.c_int]
    lib.rmsnorm_f32.restype = None
    lib.silu_mul_f32.argtypes = [_P, _P, _I, _I, ctypes.c_int]
    lib.silu_mul_f32.restype = None
    lib.swiglu_clamped_f32.argtypes = [_P, _P, _I, _I, ctypes.c_float, ctypes.c_float, ctypes.c_int]
    lib.swiglu_clamped_f32.restype = None
    lib.rope_write_kv_f32.argtypes = [_P, _I, _P, _I, _P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_int]
    lib.rope_write_kv_f32.restype = None
    lib.paged_decode_attention_q.argtypes = [
        _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _I, _P, ctypes.c_int, ctypes.c_int,
    ]  # fmt: skip
    lib.paged_decode_attention_q.restype = None
    lib.rope_write_kv_q.argtypes = [
        _P, _I, _P, _I, _P, _I, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_int, ctypes.c_int,
    ]  # fmt: skip
    lib.rope_write_kv_q.restype = None
    lib.rope_partial_write_kv.argtypes = [
        _P, _I, _P, _I, _P, _I, _P, _P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_int, ctypes.c_int,
    ]  # fmt: skip
    lib.rope_partial_write_kv.restype = None
    _declare_quantized(lib)
    _declare_kquant(lib)
    _declare_mxfp4(lib)
    lib.decode_stack.argtypes = [_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _P, ctypes.c_int]
    lib.decode_stack.restype = ctypes.c_int
    lib.moe_route_f32.argtypes = [_P, _I, _I, _I, ctypes.c_int, ctypes.c_int, _P, _P]
    lib.moe_route_f32.restype = ctypes.c_int
    lib.sigmoid_f32.argtypes, lib.sigmoid_f32.restype = [_P, _P, _I], None
    lib.moe_block_f32.argtypes = [_P, _P, _P, _I, _I, ctypes.c_int]
    lib.moe_block_f32.restype = ctypes.c_int
    lib.shm_all_reduce_f32.argtypes, lib.shm_all_reduce_f32.restype = [_P, _P, _I], ctypes.c_int
    lib.shm_wait.argtypes, lib.shm_wait.restype = [_P, _I], ctypes.c_int
    lib.shm_post.argtypes, lib.shm_post.restype = [_P, _I], None
    lib.lora_delta_f32.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_int]
    lib.lora_delta_f32.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the kernels are compiled and enabled (compiles on the first call)."""
    global _lib, _tried
    if not _tried:
        _tried = True
        _lib = _load() if os.environ.get("LMSERVE_CPU_KERNELS", "1") not in ("0", "false", "no") else None
    return _lib is not None


def set_enabled(enabled: bool) -> None:
    """Turn the kernels off (PyTorch ops everywhere) or back on; used by tests and benchmarks."""
    global _lib, _tried
    if enabled:
        _tried = False
        available()
    else:
        _lib, _tried = None, True


def usable(x: torch.Tensor) -> bool:
    """Whether a float32 CPU operand can take the kernel path (kernels loaded and enabled)."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and (_lib is not None or (not _tried and available()))


def _check(t: torch.Tensor, name: str, dtype: torch.dtype = torch.float32) -> None:
    assert t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous(), (
        f"{name}: need a contiguous cpu {dtype} tensor, got {t.device} {t.dtype} contiguous={t.is_contiguous()}"
    )


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _declare_quantized(lib: ctypes.CDLL) -> None:
    lib.i8_kernel_isa.argtypes, lib.i8_kernel_isa.restype = [], ctypes.c_int
    lib.i8_kernel_max_rows.argtypes, lib.i8_kernel_max_rows.restype = [], ctypes.c_int
    lib.i4_kernel_isa.argtypes, lib.i4_kernel_isa.restype = [], ctypes.c_int
    lib.quantize_rows_i8.argtypes = [_P, _P, _P, _I, _I, ctypes.c_int]
    lib.quantize_rows_i8.restype = None
    lib.linear_i8_f32.argtypes = [_P, _P, _P, _P, _P, _P, _I, _I, _I, ctypes.c_int]
    lib.linear_i8_f32.restype = None
    lib.linear_i4_f32.argtypes = [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_int]
    lib.linear_i4_f32.restype = None
    lib.dequant_i4_f32.argtypes = [_P, _P, _P, _P, _I, _I, _I, ctypes.c_int]
    lib.dequant_i4_f32.restype = None
    lib.linear_i8w_f32.argtypes = [_P, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_int]
    lib.linear_i8w_f32.restype = None
    lib.dequant_i8w_f32.argtypes = [_P, _P, _P, _I, _I, _I, ctypes.c_int]
    lib.dequant_i8w_f32.restype = None
    lib.w4a8_isa_supported.argtypes, lib.w4a8_isa_supported.restype = [ctypes.c_int], ctypes.c_int
    lib.w4a8_isa_best.argtypes, lib.w4a8_isa_best.restype = [], ctypes.c_int
    lib.w4a8_vnni256_vex.argtypes, lib.w4a8_vnni256_vex.restype = [], ctypes.c_int
    lib.w4a8_quantize_rows.argtypes = [_P, _P, _P, _P, _P, _I, _I, ctypes.c_int32, ctypes.c_int]
    lib.w4a8_quantize_rows.restype = None
    lib.linear_w4a8_f32.argtypes = [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.linear_w4a8_f32.restype = ctypes.c_int
    lib.linear_w4a8_multi_f32.argtypes = [_P, _I, _I, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.linear_w4a8_multi_f32.restype = ctypes.c_int


def _declare_kquant(lib: ctypes.CDLL) -> None:
    lib.kq_kernel_isa.argtypes, lib.kq_kernel_isa.restype = [], ctypes.c_int
    lib.kq_force_portable.argtypes, lib.kq_force_portable.restype = [ctypes.c_int], None
    lib.linear_kq_f32.argtypes = [_P, _P, _P, _I, _P, _P, _I, _I, _I, ctypes.c_int]
    lib.linear_kq_f32.restype = None
    lib.dequant_kq_f32.argtypes = [ctypes.c_int, _P, _P, _I, _I, ctypes.c_int]
    lib.dequant_kq_f32.restype = None


def _declare_mxfp4(lib: ctypes.CDLL) -> None:
    lib.mxfp4_isa_supported.argtypes, lib.mxfp4_isa_supported.restype = [ctypes.c_int], ctypes.c_int
    lib.mxfp4_isa_best.argtypes, lib.mxfp4_isa_best.restype = [], ctypes.c_int
    lib.linear_mxfp4_f32.argtypes = [_P, _P, _P, _P, _P, _I, _I, _I, ctypes.c_int, ctypes.c_int]
    lib.linear_mxfp4_f32.restype = ctypes.c_int


def cpu_flags() -> set[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
