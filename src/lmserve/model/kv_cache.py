"""One layer's paged KV cache in its storage dtype (EngineArgs.kv_cache_dtype), and the quantize / dequantize
steps between it and the model's activations (KVCache, quantize, dequantize).

int8 and fp8 add a float32 scale per (slot, KV head) from the row's own absolute maximum (x ≈ scale * value), so
scales follow their blocks; the C kernels read and write the same bytes. See docs/kv_cache.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmserve.model.kv_pool import lazy_zeros

STORAGE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
}
QUANT_MAX = {"int8": 127.0, "fp8_e4m3": 448.0}  # largest stored magnitude: a row's amax maps onto it
_NAMES = {dtype: name for name, dtype in STORAGE_DTYPES.items()}


def quantize(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(..., D) rows → (values in the storage dtype, float32 scale per row or None for the float dtypes)."""
    if kv_dtype not in QUANT_MAX:
        return x.to(STORAGE_DTYPES[kv_dtype]), None
    qmax = QUANT_MAX[kv_dtype]
    xf = x.float()
    scale = xf.abs().amax(-1) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stores zeros, scale 1
    y = (xf / scale.unsqueeze(-1)).clamp_(-qmax, qmax)
    if kv_dtype == "int8":
        return y.round_().to(torch.int8), scale
    return y.to(torch.float8_e4m3fn), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize, into `dtype` (the model's activation dtype)."""
    if scale is None:
        return values.to(dtype)
    return (values.float() * scale.unsqueeze(-1)).to(dtype)


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    # index_copy_ / index_select have no float8 kernels on every backend: move fp8 values as bytes
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@dataclass
class KVCache:
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @staticmethod
    def allocate(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, kv_dtype: str, device: torch.device
    ) -> KVCache:
        assert kv_dtype in STORAGE_DTYPES, f"kv dtype {kv_dtype!r} is not one of {list(STORAGE_DTYPES)}"
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        dtype = STORAGE_DTYPES[kv_dtype]
        # zeros committed as written (worker/kv_pool.py); an unwritten row reads value 0 x scale 0 = 0
        k, v = (lazy_zeros(shape, dtype, device) for _ in range(2))
        if kv_dtype not in QUANT_MAX:
            return KVCache(k, v)
        k_scale, v_scale = (lazy_zeros(shape[:3], torch.float32, device) for _ in range(2))
        return KVCache(k, v, k_scale, v_scale)

    @property
    def kv_dtype(self) -> str:
        return _NAMES[self.k.dtype]

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        tensors = [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v: (T, KVH, D) rows of the step's tokens → their slots, quantized."""
        kvh, d = self.k.shape[-2:]
        for x, values, scales in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            q, s = quantize(x, self.kv_dtype)
            _bytes_view(values).view(-1, kvh, d).index_copy_(0, slot_mapping, _bytes_view(q))
            if scales is not None:
                scales.view(-1, kvh).index_copy_(0, slot_mapping, s)

    def gather(self, block_tables: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(..., num_blocks) block ids → K and V (..., num_blocks * block_size, KVH, D) in `dtype`, in table
        order. index_select on whole blocks copies contiguous rows (advanced indexing is several times slower)."""
        ids = block_tables.reshape(-1)
        out = []
        for values, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            raw = _bytes_view(values).index_select(0, ids).view(values.dtype)
            s = None if scales is None else scales.index_select(0, ids)
            x = dequantize(raw, s, dtype)
            out.append(x.view(*block_tables.shape[:-1], -1, *values.shape[-2:]))
        return out[0], out[1]
