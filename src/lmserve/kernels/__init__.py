"""Optional C kernels for the CPU decode path (see cpu_kernels.c for what they replace and why).

The source is compiled on first use with the system C compiler (`$CC`, else `cc`/`gcc`) into a cache
directory (`$LMSERVE_KERNEL_CACHE`, else `~/.cache/lmserve/kernels`), keyed by a hash of the source, the
flags and this CPU's feature list, and loaded with ctypes. Without a compiler, or with
`LMSERVE_CPU_KERNELS=0`, `available()` is False and callers use their PyTorch path: results agree to
float32 rounding (tests/kernels/test_kernels.py compares both).

This module builds and loads the library and binds the float32 kernels; `quantized.py`, `w4a8.py`, `stack.py` and
`gated_deltanet.py` bind the other families, re-exported here (callers use `kernels.<name>`).
"""

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
        _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _I, ctypes.c_int,
    ]  # fmt: skip
    lib.paged_decode_attention.restype = None
    lib.rmsnorm_f32.argtypes = [_P, _P, _P, _P, _I, _I, ctypes.c_float, ctypes.c_int]
    lib.rmsnorm_f32.restype = None
    lib.silu_mul_f32.argtypes = [_P, _P, _I, _I, ctypes.c_int]
    lib.silu_mul_f32.restype = None
    lib.rope_write_kv_f32.argtypes = [_P, _I, _P, _I, _P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_int]
    lib.rope_write_kv_f32.restype = None
    lib.paged_decode_attention_q.argtypes = [
        _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _I, ctypes.c_int, ctypes.c_int,
    ]  # fmt: skip
    lib.paged_decode_attention_q.restype = None
    lib.rope_write_kv_q.argtypes = [
        _P, _I, _P, _I, _P, _I, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_int, ctypes.c_int,
    ]  # fmt: skip
    lib.rope_write_kv_q.restype = None
    _declare_quantized(lib)
    _declare_kquant(lib)
    lib.decode_stack.argtypes = [_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _P, ctypes.c_int]
    lib.decode_stack.restype = ctypes.c_int
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


def f32_max_rows() -> int:
    """The most rows `linear` serves at about the cost of one pass over the weights: 8 where it was compiled
    with AVX-512 (each row computed bit-identically whatever the row count), else 2; 0 without the kernels."""
    return int(_lib.f32_kernel_max_rows()) if available() else 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, in) @ weight (out, in)^T + bias on the CPU, x float32; weight float32 or bfloat16 (converted
    exactly to float32 as it is read). For few rows (bandwidth-bound). Returns (M, out) float32."""
    assert _lib is not None, "kernels not loaded: call available() first"
    x = x.contiguous()
    _check(x, "x")
    if bias is not None:
        _check(bias, "bias")
    bf16 = weight.dtype == torch.bfloat16
    _check(weight, "weight", torch.bfloat16 if bf16 else torch.float32)
    m, k = x.shape
    o = weight.shape[0]
    assert weight.shape[1] == k, f"x has {k} features, weight expects {weight.shape[1]}"
    y = torch.empty(m, o, dtype=torch.float32)
    fn = _lib.linear_bf16w_f32 if bf16 else _lib.linear_f32
    fn(
        x.data_ptr(),
        weight.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        y.data_ptr(),
        m,
        o,
        k,
        torch.get_num_threads(),
    )
    return y


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q (B, H, D) against K/V caches (num_blocks, block_size, KVH, D) through block_tables (B, max_blocks)
    int64, each row attending to its first context_lens[b] tokens (with a sliding_window W, to the last
    min(W, context_lens[b]) of them: blocks before those are never read, so their table entries may be freed
    blocks or the -1 sentinel). Returns (B, H, D) float32.
    The caches are float32, bfloat16, or int8 / float8_e4m3fn with k_scale, v_scale (num_blocks, block_size,
    KVH) float32 (lmserve/model/kv_cache.py); values are converted in registers, never copied."""
    assert _lib is not None, "kernels not loaded: call available() first"
    q = q.contiguous()
    kind = _kv_kind(k_cache, v_cache, k_scale, v_scale)
    _check(q, "q")
    _check(block_tables, "block_tables", torch.int64)
    _check(context_lens, "context_lens", torch.int64)
    b, h, d = q.shape
    _, block_size, kvh, dk = k_cache.shape
    assert dk == d and h % kvh == 0 and h <= MAX_HEADS, f"q {tuple(q.shape)} vs cache {tuple(k_cache.shape)}"
    assert block_tables.shape[0] == b and context_lens.shape == (b,), "one block table and length per query"
    assert sliding_window is None or sliding_window > 0, f"sliding_window {sliding_window} must be positive"
    out = torch.empty_like(q)
    args = (block_tables.data_ptr(), context_lens.data_ptr(), out.data_ptr(), b, h, kvh, d, block_size)
    window = sliding_window or 0
    if kind < 0:
        _lib.paged_decode_attention(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), *args, block_tables.shape[1], scale, window,
            torch.get_num_threads(),
        )  # fmt: skip
    else:
        _lib.paged_decode_attention_q(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _ptr(k_scale), _ptr(v_scale), *args,
            block_tables.shape[1], scale, window, kind, torch.get_num_threads(),
        )  # fmt: skip
    return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _kv_kind(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> int:
    """The C `kind` of a cache (-1: float32), after checking values and scales agree in dtype and layout."""
    assert k_cache.dtype in KV_CACHE_DTYPES, f"no kernel reads a {k_cache.dtype} KV cache"
    for t, n in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        _check(t, n, k_cache.dtype)
    assert v_cache.shape == k_cache.shape, f"k_cache {tuple(k_cache.shape)} vs v_cache {tuple(v_cache.shape)}"
    scaled = k_cache.dtype in (torch.int8, torch.float8_e4m3fn)
    for t, n in ((k_scale, "k_scale"), (v_scale, "v_scale")):
        assert (t is not None) == scaled, f"{n}: needed exactly for int8 / fp8 caches ({k_cache.dtype})"
        if t is not None:
            _check(t, n)
            assert t.shape == k_cache.shape[:3], f"{n} {tuple(t.shape)}: one scale per (slot, KV head)"
    return KV_CACHE_DTYPES[k_cache.dtype]


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x (M, N). With residual (M, N), first residual += x in place (the
    decoder's skip connection) and normalise the sum. Returns a new (M, N) tensor."""
    assert _lib is not None, "kernels not loaded: call available() first"
    x = x.contiguous()
    _check(x, "x")
    _check(weight, "weight")
    if residual is not None:
        _check(residual, "residual")
        assert residual.shape == x.shape, f"residual {tuple(residual.shape)} vs x {tuple(x.shape)}"
    m, n = x.shape
    assert weight.shape == (n,), f"weight {tuple(weight.shape)} for rows of {n}"
    out = torch.empty_like(x)
    _lib.rmsnorm_f32(
        x.data_ptr(),
        residual.data_ptr() if residual is not None else None,
        weight.data_ptr(),
        out.data_ptr(),
        m,
        n,
        eps,
        torch.get_num_threads(),
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(M, 2I) [gate | up] → (M, I) silu(gate) * up."""
    assert _lib is not None, "kernels not loaded: call available() first"
    gate_up = gate_up.contiguous()
    _check(gate_up, "gate_up")
    m, two_i = gate_up.shape
    assert two_i % 2 == 0, "gate_up must hold gate and up halves"
    out = torch.empty(m, two_i // 2, dtype=torch.float32)
    _lib.silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), m, two_i // 2, torch.get_num_threads())
    return out


def _token_rows(t: torch.Tensor, name: str) -> int:
    """(T, heads, D) view whose heads and elements are contiguous within a token; returns the token stride."""
    assert t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 3, f"{name}: cpu float32 (T, heads, D)"
    assert t.stride(2) == 1 and t.stride(1) == t.shape[2], f"{name}: heads must be contiguous within a token"
    return t.stride(0)


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Rotate q (T, H, D) and k (T, KVH, D) in place (rotate-half RoPE with cos/sin (T, D)), then write
    k and v rows into the caches (num_blocks, block_size, KVH, D) at slot_mapping (T,) int64: float32 as is,
    bfloat16 rounded to nearest even, int8 / float8_e4m3fn quantized per row with its scale written to
    k_scale / v_scale (the bytes model/kv_cache.quantize produces)."""
    assert _lib is not None, "kernels not loaded: call available() first"
    qs, ks, vs = _token_rows(q, "q"), _token_rows(k, "k"), _token_rows(v, "v")
    t, h, d = q.shape
    kvh = k.shape[1]
    assert k.shape == v.shape == (t, kvh, d) and d % 2 == 0, f"q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}"
    kind = _kv_kind(k_cache, v_cache, k_scale, v_scale)
    for c, n in ((cos, "cos"), (sin, "sin")):
        _check(c, n)
    assert cos.shape == sin.shape == (t, d), f"cos/sin must be ({t}, {d}), got {tuple(cos.shape)}"
    assert k_cache.shape[2:] == (kvh, d), "cache layout (blocks, size, KVH, D)"
    _check(slot_mapping, "slot_mapping", torch.int64)
    assert slot_mapping.shape == (t,), "one slot per token"
    rows = (q.data_ptr(), qs, k.data_ptr(), ks, v.data_ptr(), vs, cos.data_ptr(), sin.data_ptr())
    if kind < 0:
        _lib.rope_write_kv_f32(
            *rows, k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), t, h, kvh, d,
            torch.get_num_threads(),
        )  # fmt: skip
    else:
        _lib.rope_write_kv_q(
            *rows, k_cache.data_ptr(), v_cache.data_ptr(), _ptr(k_scale), _ptr(v_scale), slot_mapping.data_ptr(),
            t, h, kvh, d, kind, torch.get_num_threads(),
        )  # fmt: skip


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


def _declare_kquant(lib: ctypes.CDLL) -> None:
    lib.kq_kernel_isa.argtypes, lib.kq_kernel_isa.restype = [], ctypes.c_int
    lib.kq_force_portable.argtypes, lib.kq_force_portable.restype = [ctypes.c_int], None
    lib.linear_kq_f32.argtypes = [_P, _P, _P, _I, _P, _P, _I, _I, _I, ctypes.c_int]
    lib.linear_kq_f32.restype = None
    lib.dequant_kq_f32.argtypes = [ctypes.c_int, _P, _P, _I, _I, ctypes.c_int]
    lib.dequant_kq_f32.restype = None


def cpu_flags() -> set[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# the bindings by kernel family, re-exported: callers use kernels.<name>
from lmserve.kernels.quantized import *  # noqa: E402, F403
from lmserve.kernels.stack import *  # noqa: E402, F403
from lmserve.kernels.w4a8 import *  # noqa: E402, F403
