"""Optional C kernels for the CPU (the sources: cpu_kernels.c includes one file per kernel family).

Compiled on first use with the system C compiler into a cache keyed by sources, flags and CPU features, loaded with
ctypes (library.py). Without a compiler, or with LMSERVE_CPU_KERNELS=0, `available()` is False and callers use
their PyTorch path. Bindings are re-exported here (`kernels.<name>`). See docs/cpu_kernels.md.
"""

from lmserve.kernels.float32 import (
    _kv_kind as _kv_kind,
)
from lmserve.kernels.float32 import (
    _token_rows as _token_rows,
)
from lmserve.kernels.float32 import (
    f32_max_rows as f32_max_rows,
)
from lmserve.kernels.float32 import (
    linear as linear,
)
from lmserve.kernels.float32 import (
    paged_decode_attention as paged_decode_attention,
)
from lmserve.kernels.float32 import (
    rmsnorm as rmsnorm,
)
from lmserve.kernels.float32 import (
    rope_write_kv as rope_write_kv,
)
from lmserve.kernels.float32 import (
    silu_mul as silu_mul,
)
from lmserve.kernels.float32 import (
    swiglu_clamped as swiglu_clamped,
)
from lmserve.kernels.library import (
    _I as _I,
)
from lmserve.kernels.library import (
    _P as _P,
)
from lmserve.kernels.library import (
    CFLAGS as CFLAGS,
)
from lmserve.kernels.library import (
    KV_CACHE_DTYPES as KV_CACHE_DTYPES,
)
from lmserve.kernels.library import (
    MAX_HEADS as MAX_HEADS,
)
from lmserve.kernels.library import (
    SOURCE as SOURCE,
)
from lmserve.kernels.library import (
    SOURCES as SOURCES,
)
from lmserve.kernels.library import (
    _cache_dir as _cache_dir,
)
from lmserve.kernels.library import (
    _check as _check,
)
from lmserve.kernels.library import (
    _compile as _compile,
)
from lmserve.kernels.library import (
    _compiler as _compiler,
)
from lmserve.kernels.library import (
    _cpu_fingerprint as _cpu_fingerprint,
)
from lmserve.kernels.library import (
    _declare_kquant as _declare_kquant,
)
from lmserve.kernels.library import (
    _declare_quantized as _declare_quantized,
)
from lmserve.kernels.library import (
    _load as _load,
)
from lmserve.kernels.library import (
    _ptr as _ptr,
)
from lmserve.kernels.library import (
    available as available,
)
from lmserve.kernels.library import (
    cpu_flags as cpu_flags,
)
from lmserve.kernels.library import (
    library_path as library_path,
)
from lmserve.kernels.library import (
    set_enabled as set_enabled,
)
from lmserve.kernels.library import (
    usable as usable,
)
from lmserve.kernels.mxfp4 import (
    MXFP4_ISA_ENV as MXFP4_ISA_ENV,
)
from lmserve.kernels.mxfp4 import (
    MXFP4_ISAS as MXFP4_ISAS,
)
from lmserve.kernels.mxfp4 import (
    MXFP4_MAX_ROWS as MXFP4_MAX_ROWS,
)
from lmserve.kernels.mxfp4 import (
    linear_mxfp4 as linear_mxfp4,
)
from lmserve.kernels.mxfp4 import (
    mxfp4_isa as mxfp4_isa,
)
from lmserve.kernels.mxfp4 import (
    mxfp4_isa_name as mxfp4_isa_name,
)
from lmserve.kernels.mxfp4 import (
    mxfp4_isa_supported as mxfp4_isa_supported,
)
from lmserve.kernels.quantized import (
    I4_MAX_ROWS as I4_MAX_ROWS,
)
from lmserve.kernels.quantized import (
    I8_KERNEL_NAMES as I8_KERNEL_NAMES,
)
from lmserve.kernels.quantized import (
    I8_MAX_ROWS as I8_MAX_ROWS,
)
from lmserve.kernels.quantized import (
    KQ_BLOCK as KQ_BLOCK,
)
from lmserve.kernels.quantized import (
    KQ_BLOCK_BYTES as KQ_BLOCK_BYTES,
)
from lmserve.kernels.quantized import (
    KQ_MAX_ROWS as KQ_MAX_ROWS,
)
from lmserve.kernels.quantized import (
    KQ_TYPES as KQ_TYPES,
)
from lmserve.kernels.quantized import (
    _check_groups as _check_groups,
)
from lmserve.kernels.quantized import (
    _check_i4 as _check_i4,
)
from lmserve.kernels.quantized import (
    _check_i8w as _check_i8w,
)
from lmserve.kernels.quantized import (
    dequant_i4 as dequant_i4,
)
from lmserve.kernels.quantized import (
    dequant_i8w as dequant_i8w,
)
from lmserve.kernels.quantized import (
    dequant_kq as dequant_kq,
)
from lmserve.kernels.quantized import (
    force_kquant_portable as force_kquant_portable,
)
from lmserve.kernels.quantized import (
    i8_kernel_rows as i8_kernel_rows,
)
from lmserve.kernels.quantized import (
    int8_dot_instructions as int8_dot_instructions,
)
from lmserve.kernels.quantized import (
    kquant_kernel_name as kquant_kernel_name,
)
from lmserve.kernels.quantized import (
    linear_i4 as linear_i4,
)
from lmserve.kernels.quantized import (
    linear_i8 as linear_i8,
)
from lmserve.kernels.quantized import (
    linear_i8w as linear_i8w,
)
from lmserve.kernels.quantized import (
    linear_kq as linear_kq,
)
from lmserve.kernels.quantized import (
    quantize_rows_i8 as quantize_rows_i8,
)
from lmserve.kernels.quantized import (
    quantized_kernel_names as quantized_kernel_names,
)
from lmserve.kernels.stack import (
    LORA_MAX_ROWS as LORA_MAX_ROWS,
)
from lmserve.kernels.stack import (
    MOE_MAX_TOP_K as MOE_MAX_TOP_K,
)
from lmserve.kernels.stack import (
    MOE_SCORINGS as MOE_SCORINGS,
)
from lmserve.kernels.stack import (
    SHM_ABORTED as SHM_ABORTED,
)
from lmserve.kernels.stack import (
    SHM_TIMEOUT as SHM_TIMEOUT,
)
from lmserve.kernels.stack import (
    decode_stack as decode_stack,
)
from lmserve.kernels.stack import (
    lora_delta as lora_delta,
)
from lmserve.kernels.stack import (
    moe_block as moe_block,
)
from lmserve.kernels.stack import (
    moe_route as moe_route,
)
from lmserve.kernels.stack import (
    shm_all_reduce as shm_all_reduce,
)
from lmserve.kernels.stack import (
    shm_post as shm_post,
)
from lmserve.kernels.stack import (
    shm_wait as shm_wait,
)
from lmserve.kernels.stack import (
    sigmoid as sigmoid,
)
from lmserve.kernels.w4a8 import (
    W4A8_ISA_ENV as W4A8_ISA_ENV,
)
from lmserve.kernels.w4a8 import (
    W4A8_ISAS as W4A8_ISAS,
)
from lmserve.kernels.w4a8 import (
    linear_w4a8 as linear_w4a8,
)
from lmserve.kernels.w4a8 import (
    linear_w4a8_many as linear_w4a8_many,
)
from lmserve.kernels.w4a8 import (
    w4a8_isa as w4a8_isa,
)
from lmserve.kernels.w4a8 import (
    w4a8_isa_name as w4a8_isa_name,
)
from lmserve.kernels.w4a8 import (
    w4a8_isa_supported as w4a8_isa_supported,
)
from lmserve.kernels.w4a8 import (
    w4a8_quantize_rows as w4a8_quantize_rows,
)
