"""W4A8 int4 (int4_compute="w4a8"): the activation blocks, the packed layout, every kernel path (forced with
LMSERVE_W4A8_ISA / the isa argument, so each one this CPU runs is tested here) against the PyTorch reference of
the same math, the Linear / engine wiring, and greedy output against the engine's own reference path."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from lmserve import LLM, SamplingParams, kernels
from lmserve.model import quantization as Q
from lmserve.model.decode_stack import DecodeStack
from lmserve.model.layers import Linear

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: kernels not built")

ISAS = list(kernels.W4A8_ISAS)
ROWS = [1, 2, 5, 8, 9, 33, 128]
# (out, in, group, mins): odd row counts (a partial last panel), K tails past the last whole 64 / 128, one block,
# group 128 (four activation blocks per weight scale), GGUF Q4_1-style mins
SHAPES = [(37, 96, 32, False), (64, 256, 128, False), (40, 160, 32, True), (17, 384, 128, True), (1, 32, 32, False)]


def _isa_or_skip(isa: str) -> str:
    if not kernels.w4a8_isa_supported(isa):
        pytest.skip(f"this CPU does not run the W4A8 {isa} path")
    return isa


def _weights(
    o: int, k: int, group: int, mins: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    qw, s = Q.quantize_int4(torch.randn(o, k, generator=g), group)
    m = (torch.randn(o, k // group, generator=g) * 0.5).half() if mins else None
    return qw, s, m


def test_activation_blocks_are_bit_identical_to_the_reference() -> None:
    x = torch.randn(5, 160) * torch.logspace(-3, 2, 160)
    x[1, 32:64] = 0  # an all-zero block: scale 0, codes 0
    q, d, corr, ds = kernels.w4a8_quantize_rows(x)
    ref_q, ref_d = Q.quantize_activation_blocks(x)
    assert torch.equal(q, ref_q) and torch.equal(d, ref_d)
    sums = ref_q.reshape(5, 5, 32).sum(-1, dtype=torch.int32)
    assert torch.equal(corr, -8 * sums) and torch.equal(ds, ref_d * sums.float())
    assert d[1, 1] == 0 and not q[1, 32:64].any()
    assert torch.equal(kernels.w4a8_quantize_rows(x, offset=0)[2], torch.zeros_like(corr))


@pytest.mark.parametrize(("o", "k", "group", "mins"), SHAPES)
def test_packing_round_trips(o: int, k: int, group: int, mins: bool) -> None:
    qw, s, m = _weights(o, k, group, mins, seed=o + k)
    packed = Q.pack_w4a8(qw, s, m)
    p = -(-o // Q.W4A8_PANEL)
    assert packed.codes.shape == (p, k // 32, 4, 64) and packed.scales.shape == (p, k // group, 16)
    back = Q.unpack_w4a8(packed)
    assert torch.equal(back[0], qw) and torch.equal(back[1], s)
    assert (back[2] is None) == (m is None) and (m is None or torch.equal(back[2], m))
    # the documented byte order: panel 0, block 0, vector 1, lane 3, byte 2 = inputs 4 + 2 (low), 20 + 2 (high)
    if o > 3:
        codes = Q.unpack_int4(qw)
        assert packed.codes[0, 0, 1, 4 * 3 + 2] == codes[3, 6] | (codes[3, 22] << 4)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(("o", "k", "group", "mins"), SHAPES)
def test_kernel_matches_the_reference(isa: str, m: int, o: int, k: int, group: int, mins: bool) -> None:
    _isa_or_skip(isa)
    qw, s, mn = _weights(o, k, group, mins, seed=m * 1000 + o + k)
    x, bias = torch.randn(m, k), torch.randn(o)
    packed = Q.pack_w4a8(qw, s, mn)
    ref = Q.w4a8_reference(x, qw, s, mn, bias)
    # integer block sums exact; only the per-block float products and their sum round
    scale = (x.abs() @ Q.dequantize_int4(qw, s, mn).abs().t()).max().item()
    torch.testing.assert_close(kernels.linear_w4a8(x, packed, bias, isa), ref, atol=2e-6 * scale, rtol=1e-5)


@pytest.mark.parametrize(("o", "k", "group", "mins"), SHAPES[:3])
def test_every_path_and_row_count_gives_the_same_bits(o: int, k: int, group: int, mins: bool) -> None:
    """Each output is the same float operations in the same order on every path, whatever the other rows: a
    decode row scores the same alone, in a speculative run of 8 or in a batch of 33."""
    qw, s, mn = _weights(o, k, group, mins, seed=7)
    packed = Q.pack_w4a8(qw, s, mn)
    x = torch.randn(33, k)
    runs = {isa: kernels.linear_w4a8(x, packed, None, isa) for isa in ISAS if kernels.w4a8_isa_supported(isa)}
    assert "scalar" in runs
    for isa, y in runs.items():
        assert torch.equal(y, runs["scalar"]), isa
    best = kernels.w4a8_isa()
    for rows in (slice(0, 1), slice(3, 5), slice(8, 16), slice(0, 9)):
        assert torch.equal(kernels.linear_w4a8(x[rows], packed, None, best), runs[best][rows])


@pytest.mark.parametrize("mins", [False, True])
def test_many_products_in_one_call_give_each_ones_bits(mins: bool) -> None:
    """linear_w4a8_many (one region over several products: a layer's input projections, a token's experts) equals
    one linear_w4a8 call each, bit for bit: shared and distinct x, a panel tail, an empty product, groups 32 / 128."""
    k = 256
    shapes = [(40, 32), (8, 128), (17, 32), (64, 128), (5, 32)]
    ws = [Q.pack_w4a8(*_weights(o, k, g, mins, seed=o + g)) for o, g in shapes]
    shared = torch.randn(3, k)
    xs = [shared, shared, torch.randn(9, k), torch.randn(0, k), torch.randn(1, k)]
    biases = [torch.randn(o) if i % 2 else None for i, (o, _) in enumerate(shapes)]
    for isa in [i for i in ISAS if kernels.w4a8_isa_supported(i)]:
        many = kernels.linear_w4a8_many(xs, ws, biases, isa)
        for x, w, b, y in zip(xs, ws, biases, many, strict=True):
            assert torch.equal(y, kernels.linear_w4a8(x, w, b, isa)), isa


def test_isa_choice_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kernels.w4a8_isa_supported("scalar")
    best = kernels.w4a8_isa()
    assert kernels.w4a8_isa_supported(best) and kernels.quantized_kernel_names()["w4a8"] == kernels.w4a8_isa_name(best)
    flags = kernels.cpu_flags()
    if {"avx512_vnni", "avx512bw", "avx2"} <= flags:
        assert best == "vnni512"
    elif "avx2" in flags:
        assert best in ("vnni256", "avx2")
    monkeypatch.setenv(kernels.W4A8_ISA_ENV, "scalar")
    assert kernels.w4a8_isa() == "scalar"
    monkeypatch.setenv(kernels.W4A8_ISA_ENV, "sse9")
    with pytest.raises(ValueError, match=kernels.W4A8_ISA_ENV):
        kernels.w4a8_isa()
    flags = kernels.cpu_flags()
    if flags and "avx2" not in flags:
        with pytest.raises(ValueError, match="lacks"):
            kernels.w4a8_isa("avx2")


def test_kernel_refuses_mismatched_operands() -> None:
    qw, s, _ = _weights(16, 64, 32, False, seed=1)
    packed = Q.pack_w4a8(qw, s)
    with pytest.raises(AssertionError, match="features"):
        kernels.linear_w4a8(torch.randn(1, 96), packed, None)
    with pytest.raises(AssertionError, match="float32"):
        kernels.linear_w4a8(torch.randn(1, 64, dtype=torch.float64), packed, None)
    with pytest.raises(AssertionError, match="multiple of 32"):
        Q.pack_w4a8(qw, torch.zeros(16, 4, dtype=torch.float16))  # groups of 16
    assert kernels.linear_w4a8(torch.randn(0, 64), packed, None).shape == (0, 16)


@pytest.mark.parametrize("rows", [1, 8, 9, 40])
@pytest.mark.parametrize("mins", [False, True])
def test_linear_runs_w4a8_for_every_row_count(rows: int, mins: bool) -> None:
    layer = Linear(96, 40, bias=True)
    layer.quantize("int4", 32)
    if mins:
        layer.mins = (torch.randn(40, 3) * 0.5).half()
    qw, s, mn = layer.qweight.clone(), layer.scales.clone(), layer.mins
    x = torch.randn(rows, 96)
    assert layer.fast_path(x) == ("int4_kernel" if rows <= kernels.I4_MAX_ROWS else "int4_dequant")
    exact = layer.dequantized_weight()
    layer.pack_w4a8()
    assert layer.qweight is None and layer.scales is None and layer.mins is None, "one copy of the codes"
    assert torch.equal(layer.dequantized_weight(), exact)
    assert layer.fast_path(x) == "w4a8"
    with torch.inference_mode():
        y = layer(x)
    torch.testing.assert_close(y, Q.w4a8_reference(x, qw, s, mn, layer.bias), atol=1e-4, rtol=1e-5)


# ---- the engine --------------------------------------------------------------------------------------------

PROMPTS = ["The capital of France is", "def fib(n):", "import json\nimport os\n\nclass Decoder(object):"]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def _reference_linear_w4a8(x: torch.Tensor, w: Q.W4A8Weights, bias: torch.Tensor | None, isa=None) -> torch.Tensor:
    if w.bits == 8:
        return Q.w8a8_blocks_reference(x, *Q.unpack_w4a8(w)[:2], bias)
    return Q.w4a8_reference(x, *Q.unpack_w4a8(w), bias)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2"])
def test_w4a8_engine_matches_its_own_reference(
    model_dirs: dict[str, Path], name: str, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """The engine on the W4A8 kernels (the decode stack included) generates exactly what the same engine does
    with every W4A8 projection computed by the PyTorch reference (quantization.w4a8_reference)."""
    with caplog.at_level(logging.INFO, logger="lmserve.worker.model_runner"):
        llm = LLM(str(model_dirs[name]), num_kv_blocks=64, quantization="int4")
    assert llm.engine.config.quantization.int4_compute == "w4a8"
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "W4A8 in 9 Linear layers" in logged and kernels.w4a8_isa_name(kernels.w4a8_isa()) in logged, logged
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    model = llm.engine.runner.model.model
    assert model.decode_stack(llm.engine.runner.kv_caches) is not None, "the decode stack ran the W4A8 kernels"
    monkeypatch.setattr(kernels, "linear_w4a8", _reference_linear_w4a8)
    monkeypatch.setattr(DecodeStack, "supports", staticmethod(lambda *_: False))
    model.reset_decode_stack()
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == ref


@pytest.mark.parametrize("isa", ["scalar", "avx2", "vnni256"])
def test_every_path_generates_the_same_tokens(llama_dir: Path, isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _isa_or_skip(isa)
    best = LLM(str(llama_dir), num_kv_blocks=64, quantization="int4").generate(PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.setenv(kernels.W4A8_ISA_ENV, isa)
    forced = LLM(str(llama_dir), num_kv_blocks=64, quantization="int4").generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in forced] == [o.outputs[0].token_ids for o in best]


def test_the_int4_methods_8_bit_head_runs_w8a8_blocks(llama_dir: Path) -> None:
    """With W4A8 the int4 method's int8w head is repacked into the kernels' 8-bit panels (codes + 128): the same
    weights, int8 activations per block of 32, the exact integer math of quantization.w8a8_blocks_reference."""
    exact_llm = LLM(
        str(llama_dir), num_kv_blocks=16, quantization="int4", int4_compute="weight-only"
    )  # kept alive: collecting an LLM closes its engine
    exact = exact_llm.engine.runner.model
    model_llm = LLM(
        str(llama_dir), num_kv_blocks=16, quantization="int4"
    )  # kept alive: collecting an LLM closes its engine
    model = model_llm.engine.runner.model
    head = model.lm_head
    assert head.quant_method == "int8w" and head.qweight is None and head._w4a8.bits == 8
    assert torch.equal(head.dequantized_weight(), exact.lm_head.dequantized_weight())
    hidden = torch.randn(11, model.config.hidden_size)
    assert head.fast_path(hidden) == "w4a8"
    ref = Q.w8a8_blocks_reference(hidden, exact.lm_head.qweight, exact.lm_head.scales)
    torch.testing.assert_close(model.compute_logits(hidden), ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 9, 33])
def test_8_bit_panels_match_the_reference(isa: str, m: int) -> None:
    _isa_or_skip(isa)
    g = torch.Generator().manual_seed(m)
    qw, s = Q.quantize_int8w(torch.randn(37, 160, generator=g))
    qw[0, :32] = -128  # outside Q8_0's range, but a file could hold it: the sign trick's edge (|-128| = 128)
    packed = Q.pack_w8a8(qw, s)
    assert packed.codes.shape == (3, 5, 8, 64) and packed.bits == 8
    back = Q.unpack_w4a8(packed)
    assert torch.equal(back[0], qw) and torch.equal(back[1], s) and back[2] is None
    x, bias = torch.randn(m, 160, generator=g), torch.randn(37, generator=g)
    y = kernels.linear_w4a8(x, packed, bias, isa)
    torch.testing.assert_close(y, Q.w8a8_blocks_reference(x, qw, s, bias), atol=1e-4, rtol=1e-5)
    assert torch.equal(y, kernels.linear_w4a8(x, packed, bias, "scalar"))


def test_weight_only_stays_available(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=64, quantization="int4", int4_compute="weight-only")
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear) and m.quant_method == "int4"]
    assert layers and all(m._w4a8 is None and m.qweight is not None for m in layers)
    assert layers[0].fast_path(torch.randn(1, layers[0].in_features)) == "int4_kernel"
    with pytest.raises(ValueError, match="int4_compute must be one of"):
        LLM(str(llama_dir), num_kv_blocks=64, quantization="int4", int4_compute="w4a16")


def test_bench_machine_records_the_kernels() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from machine import machine_info

    info = machine_info()
    assert info["lmserve_kernels"]["w4a8"] == kernels.w4a8_isa_name(kernels.w4a8_isa())
