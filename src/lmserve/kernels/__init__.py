"""Optional C kernels for the CPU decode path (see cpu_kernels.c for what they replace and why).

The source is compiled on first use with the system C compiler (`$CC`, else `cc`/`gcc`) into a cache
directory (`$LMSERVE_KERNEL_CACHE`, else `~/.cache/lmserve/kernels`), keyed by a hash of the source, the
flags and this CPU's feature list, and loaded with ctypes. Without a compiler, or with
`LMSERVE_CPU_KERNELS=0`, `available()` is False and callers use their PyTorch path: results agree to
float32 rounding (tests/kernels/test_kernels.py compares both).

Past 500 lines because it is one thing: the ctypes binding of the one C library, its build and load, and one thin
wrapper per kernel (shapes and dtypes asserted, tensors passed as pointers).
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
from typing import Any

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
        x.data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else None, y.data_ptr(),
        m, o, k, torch.get_num_threads(),
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
        x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(), out.data_ptr(),
        m, n, eps, torch.get_num_threads(),
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


# ---- quantized linear kernels (int8 W8A8, int4 weight-only); the C side is the section at the end of
# ---- cpu_kernels.c. Tensor layouts are lmserve.model.quantization's.

I4_MAX_ROWS = 8  # rows linear_i4 takes in one pass over the weights (I4_MAX_ROWS in the C source)
I8_MAX_ROWS = 8  # rows linear_i8 serves in one pass over the weights (I8_MAX_ROWS in the C source)
I8_KERNEL_NAMES = {2: "AVX512-VNNI (vpdpbusd, 512-bit)", 1: "AVX-VNNI (vpdpbusd, 256-bit)", 0: "portable C (no VNNI)"}


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


def cpu_flags() -> set[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def quantized_kernel_names() -> dict[str, str]:
    """Which instructions the loaded int8 / int4 kernels use (what the runner logs)."""
    assert _lib is not None, "kernels not loaded: call available() first"
    return {
        "int8": I8_KERNEL_NAMES[_lib.i8_kernel_isa()],
        "int4": "AVX-512" if _lib.i4_kernel_isa() else "portable C",
        "int8w": "AVX-512" if _lib.i4_kernel_isa() else "portable C",  # compiled with the int4 kernel's paths
        "w4a8": w4a8_isa_name(w4a8_isa()),
    }


def quantize_rows_i8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of x (M, K) float32: (q (M, K) int8, scales (M,) float32), bit-identical to
    lmserve.model.quantization.quantize_activations."""
    assert _lib is not None, "kernels not loaded: call available() first"
    x = x.contiguous()
    _check(x, "x")
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    s = torch.empty(m, dtype=torch.float32)
    _lib.quantize_rows_i8(x.data_ptr(), q.data_ptr(), s.data_ptr(), m, k, torch.get_num_threads())
    return q, s


def linear_i8(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, row_sums: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """W8A8 for few rows: x (M, K) float32 quantized per row inside, qweight (O, K) int8, scales (O,) float32,
    row_sums (O,) int32 (sum of each qweight row). Returns (M, O) float32."""
    assert _lib is not None, "kernels not loaded: call available() first"
    x = x.contiguous()
    _check(x, "x")
    _check(qweight, "qweight", torch.int8)
    _check(scales, "scales")
    _check(row_sums, "row_sums", torch.int32)
    if bias is not None:
        _check(bias, "bias")
    m, k = x.shape
    o = qweight.shape[0]
    assert qweight.shape[1] == k, f"x has {k} features, weight expects {qweight.shape[1]}"
    y = torch.empty(m, o, dtype=torch.float32)
    _lib.linear_i8_f32(
        x.data_ptr(), qweight.data_ptr(), scales.data_ptr(), row_sums.data_ptr(),
        bias.data_ptr() if bias is not None else None, y.data_ptr(), m, o, k, torch.get_num_threads(),
    )
    return y


def _check_groups(scales: torch.Tensor, o: int, k: int, name: str = "scales") -> int:
    _check(scales, name, torch.float16)
    assert scales.shape[0] == o and k % scales.shape[1] == 0, f"{name} {tuple(scales.shape)} for ({o}, {k})"
    group = k // scales.shape[1]
    assert group % 32 == 0, f"group size {group} must be a multiple of 32"
    return group


def _check_i4(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, k: int) -> int:
    _check(qweight, "qweight", torch.uint8)
    o = qweight.shape[0]
    assert qweight.shape == (o, k // 2) and k % 32 == 0, f"int4 codes {tuple(qweight.shape)} for {k} inputs"
    group = _check_groups(scales, o, k)
    if mins is not None:
        _check(mins, "mins", torch.float16)
        assert mins.shape == scales.shape, f"mins {tuple(mins.shape)} vs scales {tuple(scales.shape)}"
    return group


def linear_i4(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weight-only int4 for up to I4_MAX_ROWS rows: x (M, K) float32, qweight (O, K/2) uint8 codes, scales
    (O, K/G) float16, mins (O, K/G) float16 or None (asymmetric: w = code * scale + min). Returns (M, O) float32."""
    assert _lib is not None, "kernels not loaded: call available() first"
    x = x.contiguous()
    _check(x, "x")
    m, k = x.shape
    assert m <= I4_MAX_ROWS, f"linear_i4 takes at most {I4_MAX_ROWS} rows, got {m}"
    group = _check_i4(qweight, scales, mins, k)
    if bias is not None:
        _check(bias, "bias")
    o = qweight.shape[0]
    y = torch.empty(m, o, dtype=torch.float32)
    _lib.linear_i4_f32(
        x.data_ptr(), qweight.data_ptr(), scales.data_ptr(), _ptr(mins), _ptr(bias), y.data_ptr(), m, o, k, group,
        torch.get_num_threads(),
    )  # fmt: skip
    return y


def dequant_i4(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 (O, K) matrix of int4 codes, group scales and mins (exactly lmserve.model.quantization's)."""
    assert _lib is not None, "kernels not loaded: call available() first"
    o, k = qweight.shape[0], qweight.shape[1] * 2
    group = _check_i4(qweight, scales, mins, k)
    out = torch.empty(o, k, dtype=torch.float32)
    _lib.dequant_i4_f32(
        qweight.data_ptr(), scales.data_ptr(), _ptr(mins), out.data_ptr(), o, k, group, torch.get_num_threads()
    )
    return out


def _check_i8w(qweight: torch.Tensor, scales: torch.Tensor) -> int:
    _check(qweight, "qweight", torch.int8)
    o, k = qweight.shape
    return _check_groups(scales, o, k)


def linear_i8w(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Weight-only int8 with group scales (GGUF Q8_0) for up to I4_MAX_ROWS rows: x (M, K) float32, qweight
    (O, K) int8, scales (O, K/G) float16. Returns (M, O) float32."""
    assert _lib is not None, "kernels not loaded: call available() first"
    x = x.contiguous()
    _check(x, "x")
    m, k = x.shape
    assert m <= I4_MAX_ROWS, f"linear_i8w takes at most {I4_MAX_ROWS} rows, got {m}"
    assert qweight.dim() == 2 and qweight.shape[1] == k, f"x has {k} features, weight {tuple(qweight.shape)}"
    group = _check_i8w(qweight, scales)
    if bias is not None:
        _check(bias, "bias")
    o = qweight.shape[0]
    y = torch.empty(m, o, dtype=torch.float32)
    _lib.linear_i8w_f32(
        x.data_ptr(), qweight.data_ptr(), scales.data_ptr(), _ptr(bias), y.data_ptr(), m, o, k, group,
        torch.get_num_threads(),
    )  # fmt: skip
    return y


def dequant_i8w(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 (O, K) matrix of group-scaled int8 weights (exactly lmserve.model.quantization's)."""
    assert _lib is not None, "kernels not loaded: call available() first"
    group = _check_i8w(qweight, scales)
    o, k = qweight.shape
    out = torch.empty(o, k, dtype=torch.float32)
    _lib.dequant_i8w_f32(qweight.data_ptr(), scales.data_ptr(), out.data_ptr(), o, k, group, torch.get_num_threads())
    return out


# ---- GGUF K-quant kernels (Q4_K / Q5_K / Q6_K super-blocks as they are in the file); the C side is the K-quant
# ---- section of cpu_kernels.c, the layout lmserve.model.quantization's "kquant".

KQ_MAX_ROWS = 8  # rows linear_kq takes in one pass over the weights (KQ_MAX_ROWS in the C source)
KQ_BLOCK = 256  # weights a super-block (ggml's QK_K)
KQ_TYPES = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}  # GGML type -> the C kernels' type code (KQ_Q4_K ...)
KQ_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _declare_kquant(lib: ctypes.CDLL) -> None:
    lib.kq_kernel_isa.argtypes, lib.kq_kernel_isa.restype = [], ctypes.c_int
    lib.kq_force_portable.argtypes, lib.kq_force_portable.restype = [ctypes.c_int], None
    lib.linear_kq_f32.argtypes = [_P, _P, _P, _I, _P, _P, _I, _I, _I, ctypes.c_int]
    lib.linear_kq_f32.restype = None
    lib.dequant_kq_f32.argtypes = [ctypes.c_int, _P, _P, _I, _I, ctypes.c_int]
    lib.dequant_kq_f32.restype = None


def kquant_kernel_name() -> str:
    """Which path the K-quant kernels take on this CPU now (chosen at run time by its features)."""
    assert _lib is not None, "kernels not loaded: call available() first"
    return "AVX-512 (chosen at run time)" if _lib.kq_kernel_isa() else "portable C"


def force_kquant_portable(on: bool) -> None:
    """Make the K-quant kernels take their portable C path whatever the CPU has (on=False: back to the CPU's)."""
    assert _lib is not None, "kernels not loaded: call available() first"
    _lib.kq_force_portable(int(on))


def linear_kq(
    x: torch.Tensor, qweight: torch.Tensor, segments: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """K-quant weight-only linear: x (M, K) float32; qweight uint8, the row segments' super-block bytes one after
    the other; segments (S, 3) int64 rows (type code, rows, byte offset in qweight) covering the out_features
    output rows in order (lmserve.model.quantization.kquant_segment_table). Returns (M, out_features) float32.
    Up to KQ_MAX_ROWS rows cost about one pass over the weights; more are served in runs of it (Linear
    dequantizes tiles for the float32 GEMM then)."""
    assert _lib is not None, "kernels not loaded: call available() first"
    x = x.contiguous()
    _check(x, "x")
    m, k = x.shape
    assert k % KQ_BLOCK == 0, f"K-quant rows hold whole super-blocks of {KQ_BLOCK}, got {k} inputs"
    _check(qweight, "qweight", torch.uint8)
    _check(segments, "segments", torch.int64)
    assert segments.dim() == 2 and segments.shape[1] == 3, f"segments {tuple(segments.shape)}: (S, 3) rows"
    if bias is not None:
        _check(bias, "bias")
        assert bias.shape == (out_features,), f"bias {tuple(bias.shape)} for {out_features} outputs"
    y = torch.empty(m, out_features, dtype=torch.float32)
    _lib.linear_kq_f32(
        x.data_ptr(), qweight.data_ptr(), segments.data_ptr(), segments.shape[0], _ptr(bias), y.data_ptr(), m,
        out_features, k, torch.get_num_threads(),
    )  # fmt: skip
    return y


def dequant_kq(type_name: str, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows of one K-quant type, blocks (rows, in_features / 256 * block bytes) uint8, as float32 (rows,
    in_features): exactly gguf's dequantized values."""
    assert _lib is not None, "kernels not loaded: call available() first"
    assert type_name in KQ_TYPES, f"{type_name} is not a K-quant type ({', '.join(KQ_TYPES)})"
    _check(blocks, "blocks", torch.uint8)
    assert in_features % KQ_BLOCK == 0, f"K-quant rows hold whole super-blocks of {KQ_BLOCK}, got {in_features}"
    rows = blocks.shape[0]
    row_bytes = in_features // KQ_BLOCK * KQ_BLOCK_BYTES[type_name]
    assert blocks.numel() == rows * row_bytes, f"{type_name} blocks {tuple(blocks.shape)} for {in_features} inputs"
    out = torch.empty(rows, in_features, dtype=torch.float32)
    _lib.dequant_kq_f32(
        KQ_TYPES[type_name], blocks.data_ptr(), out.data_ptr(), rows, in_features, torch.get_num_threads()
    )
    return out


def decode_stack(
    model: ctypes._Pointer | ctypes._CArgObject,
    h: torch.Tensor,
    out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    logits: torch.Tensor | None = None,
) -> int:
    """Every layer of a decoder and its final norm for B decode tokens (cpu_kernels.c: decode_stack): model
    points at the C description lmserve.model.decode_stack builds; h (B, hidden) embeddings in, out (B, hidden)
    written; cos, sin (B, head_dim); slot_mapping (B,), block_tables (B, max_blocks), context_lens (B,) int64.
    logits (B, vocab) float32: also the LM head model.head describes, on out (the model's head must be set).
    Returns 0, -1 if the kernel's scratch memory could not be allocated, or (a tensor-parallel rank's stack,
    model.allreduce set) SHM_ABORTED / SHM_TIMEOUT from its all-reduce."""
    assert _lib is not None, "kernels not loaded: call available() first"
    b, hidden = h.shape
    for t, n in ((h, "h"), (out, "out"), (cos, "cos"), (sin, "sin")):
        _check(t, n)
    for t, n in ((slot_mapping, "slot_mapping"), (block_tables, "block_tables"), (context_lens, "context_lens")):
        _check(t, n, torch.int64)
    assert out.shape == h.shape and cos.shape == sin.shape and cos.shape[0] == b, "one row per token"
    assert slot_mapping.shape == (b,) and context_lens.shape == (b,) and block_tables.shape[0] == b, "per token"
    if logits is not None:
        _check(logits, "logits")
        assert logits.dim() == 2 and logits.shape[0] == b, "one logits row per token"
    return _lib.decode_stack(
        model, h.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(),
        block_tables.data_ptr(), context_lens.data_ptr(), b, block_tables.shape[1], _ptr(logits),
        torch.get_num_threads(),
    )  # fmt: skip


SHM_ABORTED, SHM_TIMEOUT = -2, -3  # cpu_kernels.c's LS_AR_ABORTED / LS_AR_TIMEOUT


def shm_all_reduce(desc: ctypes._Pointer | ctypes._CArgObject, x: torch.Tensor) -> int:
    """x (contiguous float32, CPU) summed in place over a shared-memory group (cpu_kernels.c: shm_all_reduce_f32,
    worker/shm_allreduce.py's protocol); desc points at the group's ls_allreduce. Returns 0, SHM_ABORTED or
    SHM_TIMEOUT."""
    assert _lib is not None, "kernels not loaded: call available() first"
    _check(x, "x")
    return _lib.shm_all_reduce_f32(desc, x.data_ptr(), x.numel())


def shm_wait(desc: ctypes._Pointer | ctypes._CArgObject, seq: int) -> int:
    """Wait (spin, then sleep) until every peer of the group desc points at posted call seq (cpu_kernels.c:
    shm_wait). Returns 0, SHM_ABORTED or SHM_TIMEOUT."""
    assert _lib is not None, "kernels not loaded: call available() first"
    return _lib.shm_wait(desc, seq)


def shm_post(desc: ctypes._Pointer | ctypes._CArgObject, seq: int) -> None:
    """Post this rank's call seq and wake peers sleeping on it (cpu_kernels.c: shm_post)."""
    assert _lib is not None, "kernels not loaded: call available() first"
    _lib.shm_post(desc, seq)


# runs of at most this many rows take lora_delta, on the hooks' path and in the decode stack alike (its most rows:
# model/decode_stack.W4A8_STACK_MAX_ROWS); longer runs (prefills) the hooks' BLAS products
LORA_MAX_ROWS = 64


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, y: torch.Tensor, cols: int) -> None:
    """y (M, O) += (x (M, K) · a[:cols]ᵀ) · b[:, :cols]ᵀ (cpu_kernels.c: lora_delta_f32, what the decode stack adds
    for a LoRA run): a (≥ cols, K), b (O, ≥ cols) one slot's stacked LoRA weights, rows contiguous."""
    assert _lib is not None, "kernels not loaded: call available() first"
    for t, n in ((x, "x"), (a, "A"), (b, "B"), (y, "y")):
        _check(t, n)
    m, k = x.shape
    o, stride = b.shape
    assert y.shape == (m, o) and a.shape[1] == k and 0 < cols <= min(a.shape[0], stride), "LoRA delta shapes"
    rc = _lib.lora_delta_f32(x.data_ptr(), a.data_ptr(), b.data_ptr(), y.data_ptr(), m, k, o, cols, stride,
                             torch.get_num_threads())  # fmt: skip
    assert rc == 0, "lora_delta: out of memory for its scratch"


# ---- W4A8 int4 (int8 activations per block of 32, integer dot products); the C side is cpu_kernels.c's
# ---- "W4A8 int4 kernels" section, the packed layout lmserve.model.quantization.pack_w4a8.

W4A8_ISA_ENV = "LMSERVE_W4A8_ISA"  # auto (the fastest this CPU runs) | vnni512 | vnni256 | avx2 | scalar
W4A8_ISAS = {"scalar": 0, "avx2": 1, "vnni256": 2, "vnni512": 3}  # W4A8_* in the C source


def w4a8_isa_supported(isa: str) -> bool:
    """Whether this CPU (and OS) runs the W4A8 path isa, by cpuid at run time."""
    assert isa in W4A8_ISAS, f"W4A8 path {isa!r}: one of {list(W4A8_ISAS)}"
    return available() and bool(_lib.w4a8_isa_supported(W4A8_ISAS[isa]))


def w4a8_isa(isa: str | None = None) -> str:
    """The W4A8 path the kernels run: isa, else $LMSERVE_W4A8_ISA, else ("auto") the fastest this CPU supports.
    A forced path the CPU lacks is a ValueError."""
    assert _lib is not None, "kernels not loaded: call available() first"
    want = (isa or os.environ.get(W4A8_ISA_ENV, "auto")).strip().lower() or "auto"
    if want == "auto":
        best = _lib.w4a8_isa_best()
        return next(n for n, v in W4A8_ISAS.items() if v == best)
    if want not in W4A8_ISAS:
        raise ValueError(f"{W4A8_ISA_ENV} must be auto or one of {list(W4A8_ISAS)}, got {want!r}")
    if not w4a8_isa_supported(want):
        raise ValueError(f"W4A8 path {want!r} needs instructions this CPU lacks (flags: {sorted(cpu_flags())[:8]}...)")
    return want


def w4a8_isa_name(isa: str) -> str:
    """What path isa runs, in words (the runner logs it, bench JSONs record it)."""
    assert _lib is not None, "kernels not loaded: call available() first"
    vex = bool(_lib.w4a8_vnni256_vex())
    return {
        "vnni512": "W4A8 AVX512-VNNI (vpdpbusd zmm, 16-row panels)",
        "vnni256": f"W4A8 {'AVX-VNNI (vpdpbusd ymm, VEX)' if vex else 'AVX512-VNNI/VL (vpdpbusd ymm, EVEX)'}, 8 rows",
        "avx2": "W4A8 AVX2 (vpmaddubsw + vpmaddwd), 8 rows",
        "scalar": "W4A8 portable C",
    }[isa]


def w4a8_quantize_rows(x: torch.Tensor, offset: int = 8) -> tuple[torch.Tensor, ...]:
    """The activation blocks the W4A8 kernels compute with, for x (M, K) float32: q (M, K) int8, d (M, K/32)
    float32, corr (M, K/32) int32 = -offset * (sum of the block's q), ds (M, K/32) float32 = d * sum q."""
    assert _lib is not None, "kernels not loaded: call available() first"
    x = x.contiguous()
    _check(x, "x")
    m, k = x.shape
    assert k % 32 == 0, f"{k} inputs: not a multiple of 32"
    q = torch.empty(m, k, dtype=torch.int8)
    d, ds = torch.empty(m, k // 32), torch.empty(m, k // 32)
    corr = torch.empty(m, k // 32, dtype=torch.int32)
    _lib.w4a8_quantize_rows(
        x.data_ptr(), q.data_ptr(), d.data_ptr(), corr.data_ptr(), ds.data_ptr(), m, k, offset,
        torch.get_num_threads(),
    )  # fmt: skip
    return q, d, corr, ds


def linear_w4a8(x: torch.Tensor, w: Any, bias: torch.Tensor | None, isa: str | None = None) -> torch.Tensor:
    """W4A8 for any number of rows: x (M, K) float32 quantized inside per row per block of 32; w a
    lmserve.model.quantization.W4A8Weights (the packed int4 panels, 5-bit ones (GGUF Q5_0 / Q5_1), or 8-bit ones:
    W8A8 blocks); bias (O,) or None;
    isa as w4a8_isa. Returns (M, O) float32."""
    assert _lib is not None, "kernels not loaded: call available() first"
    x = x.contiguous()
    _check(x, "x")
    m, k = x.shape
    assert k == w.in_features, f"x has {k} features, weight expects {w.in_features}"
    o = w.out_features
    _check(w.codes, "codes", torch.uint8)
    _check(w.scales, "scales", torch.float16)
    assert w.codes.shape == (-(-o // 16), k // 32, w.bits, 64), f"codes {tuple(w.codes.shape)} for ({o}, {k})"
    assert w.bits in (4, 5, 8) and (w.bits != 8 or w.mins is None), f"{w.bits}-bit panels (4, 5, or 8 without mins)"
    assert w.scales.shape == (w.codes.shape[0], k // w.group_size, 16), f"scales {tuple(w.scales.shape)}"
    if w.mins is not None:
        _check(w.mins, "mins", torch.float16)
        assert w.mins.shape == w.scales.shape, f"mins {tuple(w.mins.shape)} vs scales {tuple(w.scales.shape)}"
    if bias is not None:
        _check(bias, "bias")
    y = torch.empty(m, o, dtype=torch.float32)
    if m == 0:
        return y
    rc = _lib.linear_w4a8_f32(
        x.data_ptr(), w.codes.data_ptr(), w.scales.data_ptr(), _ptr(w.mins), _ptr(bias), y.data_ptr(), m, o, k,
        w.group_size, w.bits, W4A8_ISAS[w4a8_isa(isa)], torch.get_num_threads(),
    )  # fmt: skip
    assert rc == 0, "linear_w4a8_f32: out of memory for the activation scratch"
    return y
