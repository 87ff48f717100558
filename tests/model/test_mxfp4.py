"""MXFP4 → int8w (model/mxfp4.py): the 8-bit codes and float16 group scales hold exactly the weights transformers'
dequantization gives; the int8w Linear multiplies as the MXFP4 one; a scale float16 cannot hold is refused."""

from __future__ import annotations

import torch

from lmserve.model.layers import Linear
from lmserve.model.mxfp4 import Mxfp4Linear, dequantize_mxfp4, mxfp4_to_int8w
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
    lin = mx.to_int8w()
    assert isinstance(lin, Linear) and lin.quant_method == "int8w"
    for rows in (1, 3, 20):  # the few-row C kernel and the dequantized tiles
        x = torch.randn(rows, 128)
        torch.testing.assert_close(lin(x), mx(x), rtol=1e-5, atol=1e-4)


def test_scale_outside_float16_is_refused() -> None:
    blocks, scales = _random_mxfp4(4, 32, 2)
    scales[1, 0] = 100  # 2^-28: below float16's smallest subnormal
    assert mxfp4_to_int8w(blocks, scales) is None
