"""model/mxfp4.py: the int8w form (8-bit codes and float16 group scales hold exactly the weights transformers'
dequantization gives; the int8w Linear multiplies as the MXFP4 one; a scale float16 cannot hold is refused) and
Mxfp4Linear's paths (the MXFP4 x int8 C kernel for few rows, float32 tiles for more or under "weight-only")."""

from __future__ import annotations

import pytest
import torch

from lmserve import kernels
from lmserve.model.layers import Linear
from lmserve.model.mxfp4 import MXFP4_COMPUTE_ENV, Mxfp4Linear, dequantize_mxfp4, mxfp4_a8_reference, mxfp4_to_int8w
from lmserve.model.quantization import dequantize_int8w


def _random_mxfp4(out: int, inp: int, seed: int, low: int = 112, high: int = 135) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (out, inp // 32, 16), dtype=torch.uint8, generator=g)
    return blocks, torch.randint(low, high, (out, inp // 32), dtype=torch.uint8, generator=g)


def test_int8w_form_is_exact() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4(48, 96, 0)
    codes, s = mxfp4_to_int8w(blocks, scales)
    assert codes.dtype == torch.int8 and s.dtype == torch.float16 and codes.shape == (48, 96)
    want = convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)[0].t()
    assert torch.equal(dequantize_int8w(codes, s), want)
    assert torch.equal(dequantize_mxfp4(blocks, scales), want)


@torch.inference_mode()
def test_int8w_linear_matches_the_mxfp4_one() -> None:
    blocks, scales = _random_mxfp4(64, 128, 1, 118, 126)
    mx = Mxfp4Linear(128, 64, bias=True)
    mx.set_mxfp4(blocks, scales)
    mx.bias.copy_(torch.randn(64))
    mx.compute = "weight-only"  # (float activations, as the int8w kernel's)
    lin = mx.to_int8w()
    assert isinstance(lin, Linear) and lin.quant_method == "int8w"
    for rows in (1, 3, 20):  # the few-row C kernel and the dequantized tiles
        x = torch.randn(rows, 128)
        torch.testing.assert_close(lin(x), mx(x), rtol=1e-5, atol=1e-4)


def test_scale_outside_float16_is_refused() -> None:
    blocks, scales = _random_mxfp4(4, 32, 2)
    scales[1, 0] = 100  # 2^-28: below float16's smallest subnormal
    assert mxfp4_to_int8w(blocks, scales) is None


def _layer(out: int, inp: int, seed: int) -> Mxfp4Linear:
    mx = Mxfp4Linear(inp, out, bias=True)
    mx.set_mxfp4(*_random_mxfp4(out, inp, seed, 118, 126))
    with torch.no_grad():
        mx.bias.copy_(torch.randn(out, generator=torch.Generator().manual_seed(seed)))
    return mx


@pytest.mark.skipif(not kernels.available(), reason="no C compiler: kernels not built")
@torch.inference_mode()
def test_few_rows_run_the_int8_kernel_more_the_float_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    mx = _layer(48, 96, 3)
    mx.DEQUANT_ROWS = 20  # (several tiles)
    w = dequantize_mxfp4(mx.blocks, mx.scales)
    for rows in (1, 8, 9, 30):
        x = torch.randn(rows, 96)
        if rows <= kernels.MXFP4_MAX_ROWS:
            assert mx.fast_path(x) == "mxfp4_kernel"
            want = mxfp4_a8_reference(x, mx.blocks, mx.scales, mx.bias)
        else:
            assert mx.fast_path(x) == "dequant"
            want = x @ w.t() + mx.bias
        torch.testing.assert_close(mx(x), want, rtol=1e-5, atol=1e-4)
    x3 = torch.randn(2, 3, 96)  # leading dimensions kept
    torch.testing.assert_close(mx(x3), mx(x3.reshape(6, 96)).view(2, 3, 48))
    mx.compute = "weight-only"
    x = torch.randn(1, 96)
    assert mx.fast_path(x) == "dequant"
    torch.testing.assert_close(mx(x), x @ w.t() + mx.bias, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv(MXFP4_COMPUTE_ENV, "weight-only")
    assert _layer(16, 32, 4).compute == "weight-only"
    monkeypatch.setenv(MXFP4_COMPUTE_ENV, "fp8")
    with pytest.raises(ValueError, match="LMSERVE_MXFP4_COMPUTE must be one of"):
        Mxfp4Linear(32, 16, bias=False)
