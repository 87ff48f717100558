"""The MXFP4 x int8 kernel (kernels/mxfp4.c) on random bytes: every path this CPU runs (forced with the isa argument
/ LMSERVE_MXFP4_ISA) against the PyTorch reference of the same integer math, all paths and row counts bit-identical,
and the float product of transformers' own dequantization within the bound activation rounding allows."""

from __future__ import annotations

import pytest
import torch

from lmserve import kernels
from lmserve.model import quantization as Q
from lmserve.model.mxfp4 import dequantize_mxfp4, mxfp4_a8_reference

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: kernels not built")

ISAS = list(kernels.MXFP4_ISAS)
ROWS = [1, 2, 5, 8, 9, 17]
# (out, in): one block, blocks not a multiple of 8 (a partial last step of the 8 accumulator lanes), exactly 16,
# gpt-oss-like 90 blocks (2880 inputs, cut to 45 here), odd output counts
SHAPES = [(5, 32), (37, 96), (16, 512), (23, 1440), (64, 288)]


def _isa_or_skip(isa: str) -> str:
    if not kernels.mxfp4_isa_supported(isa):
        pytest.skip(f"this CPU does not run the MXFP4 {isa} path")
    return isa


def _weights(o: int, k: int, seed: int, low: int = 112, high: int = 135) -> tuple[torch.Tensor, torch.Tensor]:
    """Every byte of the codes random; the e8m0 scales in the range real checkpoints use (2^-16 .. 2^7)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (o, k // 32, 16), dtype=torch.uint8, generator=g)
    return blocks, torch.randint(low, high, (o, k // 32), dtype=torch.uint8, generator=g)


def _magnitude(x: torch.Tensor, w: torch.Tensor) -> float:
    return (x.abs() @ w.abs().t()).max().item()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(("o", "k"), SHAPES)
def test_kernel_matches_the_integer_reference(isa: str, m: int, o: int, k: int) -> None:
    _isa_or_skip(isa)
    blocks, scales = _weights(o, k, seed=m * 1000 + o + k)
    x, bias = torch.randn(m, k) * torch.logspace(-2, 1, k), torch.randn(o)
    x[0, :32] = 0  # an all-zero activation block: scale 0, codes 0
    ref = mxfp4_a8_reference(x, blocks, scales, bias)
    # integer block sums exact; only the per-block float products and their sum round (as the W4A8 kernels' test)
    scale = _magnitude(x, dequantize_mxfp4(blocks, scales))
    torch.testing.assert_close(kernels.linear_mxfp4(x, blocks, scales, bias, isa), ref, atol=2e-6 * scale, rtol=1e-5)


@pytest.mark.parametrize(("o", "k"), SHAPES[1:4])
def test_every_path_and_row_count_gives_the_same_bits(o: int, k: int) -> None:
    """Each output is the same float operations in the same order on every path, whatever the other rows: a decode
    row comes out the same alone, in a speculative run of 8, or beside 16 others."""
    blocks, scales = _weights(o, k, seed=7)
    x, bias = torch.randn(17, k), torch.randn(o)
    runs = {isa: kernels.linear_mxfp4(x, blocks, scales, bias, isa) for isa in ISAS if kernels.mxfp4_isa_supported(isa)}
    assert "scalar" in runs and len(runs) >= 2 or not kernels.cpu_flags() & {"avx2"}, "the SIMD path is tested"
    for isa, y in runs.items():
        assert torch.equal(y, runs["scalar"]), isa
    best = kernels.mxfp4_isa()
    for rows in (slice(0, 1), slice(3, 5), slice(8, 16), slice(0, 9)):
        assert torch.equal(kernels.linear_mxfp4(x[rows], blocks, scales, bias, best), runs[best][rows])


@pytest.mark.parametrize("m", [1, 4, 8])
def test_within_the_activation_rounding_of_the_float_product(m: int) -> None:
    """Against x @ W^T in float32 with W transformers' own dequantization: each activation moves at most half its
    block's step d when quantized, so |y - y_float| <= sum_k |W[o, k]| d(m, k / 32) / 2, plus float rounding."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    o, k = 48, 2880 // 10
    blocks, scales = _weights(o, k, seed=m)
    w = convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)[0].t()
    assert torch.equal(w, dequantize_mxfp4(blocks, scales))
    x = torch.randn(m, k) * 3
    _, d = Q.quantize_activation_blocks(x)
    bound = 0.5 * (d.repeat_interleave(32, dim=1) @ w.abs().t()) + 1e-5 * _magnitude(x, w)
    err = (kernels.linear_mxfp4(x, blocks, scales, None) - x @ w.t()).abs()
    assert (err <= bound).all(), (err - bound).max()
    assert err.max() > 0  # (the activations are quantized: the bound is what is being checked, not equality)


@pytest.mark.parametrize("isa", ISAS)
def test_every_e8m0_exponent_decodes(isa: str) -> None:
    """Scales 2^-128 (e = 0) and 2^-127 (subnormal float32) up to 2^126: x scaled so that every product is a normal
    float32; each row of weights one exponent."""
    _isa_or_skip(isa)
    exps = torch.tensor([0, 1, 2, 3, 60, 127, 128, 129, 200, 254], dtype=torch.uint8)
    blocks, _ = _weights(len(exps), 64, seed=3)
    scales = exps[:, None].expand(-1, 2).contiguous()
    for shift in (100, 0, -100):
        x = torch.randn(2, 64) * 2.0**shift
        keep = (exps.long() - 128 + shift).abs() < 100
        b, s = blocks[keep].contiguous(), scales[keep].contiguous()
        ref = mxfp4_a8_reference(x, b, s)
        atol = 2e-6 * _magnitude(x, dequantize_mxfp4(b, s))
        torch.testing.assert_close(kernels.linear_mxfp4(x, b, s, None, isa), ref, rtol=1e-5, atol=atol)


def test_isa_choice_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kernels.mxfp4_isa_supported("scalar") and kernels.mxfp4_isa("scalar") == "scalar"
    monkeypatch.setenv(kernels.MXFP4_ISA_ENV, "scalar")
    assert kernels.mxfp4_isa() == "scalar"
    monkeypatch.setenv(kernels.MXFP4_ISA_ENV, "avx9000")
    with pytest.raises(ValueError, match="LMSERVE_MXFP4_ISA must be auto or one of"):
        kernels.mxfp4_isa()
    for isa in ISAS:
        assert kernels.mxfp4_isa_name(isa).startswith("MXFP4 x int8")
        if not kernels.mxfp4_isa_supported(isa):
            with pytest.raises(ValueError, match="needs instructions this CPU lacks"):
                kernels.mxfp4_isa(isa)


def test_kernel_refuses_mismatched_operands() -> None:
    blocks, scales = _weights(8, 64, seed=1)
    with pytest.raises(AssertionError, match="MXFP4 blocks"):
        kernels.linear_mxfp4(torch.randn(1, 96), blocks, scales, None)
    with pytest.raises(AssertionError, match="MXFP4 scales"):
        kernels.linear_mxfp4(torch.randn(1, 64), blocks, scales[:, :1].contiguous(), None)
    with pytest.raises(AssertionError, match="bias"):
        kernels.linear_mxfp4(torch.randn(1, 64), blocks, scales, torch.zeros(7))
    assert kernels.linear_mxfp4(torch.randn(0, 64), blocks, scales, None).shape == (0, 8)
