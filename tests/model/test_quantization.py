"""Quantized weights: the C kernels against the PyTorch reference of the same math, the engine's greedy
tokens against a plain PyTorch model with dequantized weights (and fake-quantized activations for int8),
every scheduling path, and the checkpoint format."""

from __future__ import annotations

import ctypes
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmserve import LLM, SamplingParams, kernels
from lmserve.config.engine import EngineArgs
from lmserve.model import gguf_blocks
from lmserve.model import quantization as Q
from lmserve.model.layers import Linear

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="no C compiler: CPU kernels off")
PROMPTS = [
    "The capital of France is",
    "def fib(n):",
    "import json\nimport os\n\nclass Decoder(object):\n    def __init__(self, strict=True):",
    "床前明月光，疑是地上霜。",
]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
# W4A8 rounds every projection input to an int8 grid: HF's float32 model and ours differ by ~1e-6 before that
# rounding, enough to move a value across a rounding boundary now and then (a 1-step change of one activation),
# which shifts logits by ~1e-2 on these tiny random models and can swap near-tied tokens. Against the HF reference,
# W4A8 greedy tokens must be within this much of the best logit; test_w4a8_engine_matches_its_own_reference holds
# the engine to exact greedy equality with the PyTorch W4A8 math on the same inputs.
W4A8_MARGIN = 0.05
SHAPES = [(1, 256, 96), (2, 768, 64), (2, 100, 37), (1, 64, 5)]  # K: multiples of 64, a 100 tail, one vector


def _int8_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The int32 product computed in int64 (no overflow, no rounding), then the same single scaling."""
    xq, xs = Q.quantize_activations(x)
    acc = xq.long() @ qweight.long().t()
    assert acc.abs().max() < 2**31
    return acc.to(torch.int32).float() * (xs[:, None] * scales[None, :])


# ---- kernels vs the PyTorch reference ------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("m,k,o", SHAPES)
def test_int8_kernel_exact_in_int32(m: int, k: int, o: int) -> None:
    torch.manual_seed(k)
    x, w = torch.randn(m, k) * 3, torch.randn(o, k)
    x[0, :7] = 0.0  # zeros and an all-zero row must not divide by zero
    if m > 1:
        x[1] = 0.0
    qw, s = Q.quantize_int8(w)
    xq, xs = kernels.quantize_rows_i8(x)
    ref_q, ref_s = Q.quantize_activations(x)
    assert torch.equal(xq, ref_q) and torch.equal(xs, ref_s), "activation quantization differs from torch"
    expected = _int8_reference(x, qw, s)
    assert torch.equal(kernels.linear_i8(x, qw, s, Q.int8_row_sums(qw), None), expected)
    # the batched paths (torch._int_mm; float32 GEMMs of the codes where the CPU has no VNNI) are the same arithmetic
    assert torch.equal(Q.int8_linear(xq, xs, qw, s, None), expected)
    assert torch.equal(Q.int8_linear(xq, xs, qw, s, None, use_int_mm=False), expected)
    bias = torch.randn(o)
    torch.testing.assert_close(kernels.linear_i8(x, qw, s, Q.int8_row_sums(qw), bias), expected + bias)


@pytest.mark.parametrize("k", [1, 1000, Q.INT8_FLOAT_K, Q.INT8_FLOAT_K + 1, 2500])
def test_int8_mm_in_float32_is_exact(k: int) -> None:
    """The float32 GEMMs of int8 codes equal torch._int_mm to the bit, at the extreme codes too (sums up to
    128 * 127 * K: past 2**24 once K > 1,032, where the chunks must add in int32)."""
    torch.manual_seed(k)
    xq = torch.randint(-127, 128, (17, k), dtype=torch.int8)
    w = torch.randint(-128, 128, (1200, k), dtype=torch.int8)
    assert torch.equal(Q.int8_mm(xq, w, use_int_mm=False), Q.int8_mm(xq, w, use_int_mm=True))
    xq[:4], w[:3] = -127, -128  # the largest sums: every product 16,256
    w[3:6] = 127
    assert torch.equal(Q.int8_mm(xq, w, use_int_mm=False), Q.int8_mm(xq, w, use_int_mm=True))


@needs_kernels
@pytest.mark.parametrize("k", [64, 100, 576, 1536])
def test_int8_kernel_batches_rows_bit_identically(k: int) -> None:
    """1-17 rows of x (runs of I8_MAX_ROWS, a short last run; the 64-byte chunks interleaved, a tail past them):
    every row's output is the reference's bits, the same as that row alone."""
    torch.manual_seed(k)
    x, w = torch.randn(2 * kernels.I8_MAX_ROWS + 1, k) * 2, torch.randn(40, k)
    x[3] = 0.0
    qw, s = Q.quantize_int8(w)
    sums, bias = Q.int8_row_sums(qw), torch.randn(40)
    expected = _int8_reference(x, qw, s)
    for m in range(1, x.shape[0] + 1):
        assert torch.equal(kernels.linear_i8(x[:m], qw, s, sums, None), expected[:m]), f"{m} rows"
    torch.testing.assert_close(kernels.linear_i8(x, qw, s, sums, bias), expected + bias)  # (one fused rounding)
    assert kernels.I8_MAX_ROWS == kernels.library._lib.i8_kernel_max_rows()


def test_int8_weight_quantization_is_symmetric_per_channel() -> None:
    torch.manual_seed(0)
    w = torch.randn(16, 64)
    w[3] = 0.0
    q, s = Q.quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (16,) and int(q.abs().max()) == 127
    assert torch.equal(q.abs().amax(dim=1)[torch.arange(16) != 3], torch.full((15,), 127, dtype=torch.int8))
    assert float(s[3]) == 1.0 and not q[3].any()
    assert (Q.dequantize_int8(q, s) - w).abs().le(s[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_quantization_packs_and_rounds_to_nearest(group: int) -> None:
    torch.manual_seed(group)
    w = torch.randn(8, 256)
    qw, scales = Q.quantize_int4(w, group)
    assert qw.shape == (8, 128) and qw.dtype == torch.uint8
    assert scales.shape == (8, 256 // group) and scales.dtype == torch.float16
    codes = Q.unpack_int4(qw)
    assert torch.equal(Q.pack_int4(codes), qw)
    assert int(codes.max()) <= 15
    # byte i of a 32-run: input i in the low nibble, input i + 16 in the high one
    assert int(qw[0, 0]) == int(codes[0, 0]) | int(codes[0, 16]) << 4
    d = scales.float().repeat_interleave(group, dim=1)
    err = (Q.dequantize_int4(qw, scales) - w).abs()
    # nearest code, except the group's positive extreme which clamps at +7 (up to one step)
    assert (err <= d.abs() / 2 + 1e-6).float().mean() > 0.95
    assert (err <= d.abs() + 1e-6).all()


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("group", [32, 64])
def test_int4_kernel_matches_dequantized_matmul(m: int, group: int) -> None:
    torch.manual_seed(m * group)
    x, w, bias = torch.randn(m, 192), torch.randn(40, 192), torch.randn(40)
    qw, scales = Q.quantize_int4(w, group)
    ref_w = Q.dequantize_int4(qw, scales)
    assert torch.equal(kernels.dequant_i4(qw, scales), ref_w), "dequantization must be exact"
    torch.testing.assert_close(kernels.linear_i4(x, qw, scales, bias), x @ ref_w.t() + bias, atol=1e-4, rtol=1e-5)


@pytest.fixture
def portable_kernels(tmp_path: Path) -> Iterator[ctypes.CDLL]:
    """The kernel source compiled for a baseline x86-64 (no AVX-512, no VNNI) and swapped in."""
    cc = kernels._compiler()
    if cc is None or not kernels.available():
        pytest.skip("no C compiler")
    out = tmp_path / "portable.so"
    flags = [f for f in kernels.CFLAGS if not f.startswith("-march")] + ["-march=x86-64-v2"]
    try:
        subprocess.run([cc, *flags, str(kernels.SOURCE), "-o", str(out), "-lm"], check=True, capture_output=True)
    except subprocess.CalledProcessError:
        pytest.skip("this compiler cannot target x86-64-v2")
    lib = ctypes.CDLL(str(out))
    kernels._declare_quantized(lib)
    saved = kernels.library._lib
    kernels.library._lib = lib
    yield lib
    kernels.library._lib = saved


@pytest.mark.slow
def test_portable_fallback_without_vnni_is_exact(portable_kernels: ctypes.CDLL) -> None:
    # the W4A8 kernels pick their path by cpuid at run time, whatever the build targeted
    best = kernels.w4a8_isa_name(kernels.w4a8_isa("auto"))
    names = {"int8": "portable C (no VNNI)", "int4": "portable C", "int8w": "portable C", "w4a8": best}
    assert kernels.quantized_kernel_names() == names
    for m, k, o in SHAPES:
        torch.manual_seed(o)
        x, w = torch.randn(m, k), torch.randn(o, k)
        qw, s = Q.quantize_int8(w)
        assert torch.equal(kernels.linear_i8(x, qw, s, Q.int8_row_sums(qw), None), _int8_reference(x, qw, s))
    x, w = torch.randn(3, 128), torch.randn(24, 128)
    qw, scales = Q.quantize_int4(w, 32)
    assert torch.equal(kernels.dequant_i4(qw, scales), Q.dequantize_int4(qw, scales))
    ref = x @ Q.dequantize_int4(qw, scales).t()
    torch.testing.assert_close(kernels.linear_i4(x, qw, scales, None), ref, atol=1e-4, rtol=1e-5)
    for type_name in ("Q8_0", "Q4_0", "Q4_1"):  # (int5 has no weight-only kernel: tests/gguf/test_gguf_q5.py)
        layout, blocks = _gguf_layout(type_name, 24, 128)
        ref_w = Q.dequantize_layout(layout, blocks["qweight"], blocks["scales"], blocks.get("mins"))
        if layout == "int8w":
            assert torch.equal(kernels.dequant_i8w(blocks["qweight"], blocks["scales"]), ref_w)
            got = kernels.linear_i8w(x, blocks["qweight"], blocks["scales"], None)
        else:
            assert torch.equal(kernels.dequant_i4(blocks["qweight"], blocks["scales"], blocks.get("mins")), ref_w)
            got = kernels.linear_i4(x, blocks["qweight"], blocks["scales"], None, blocks.get("mins"))
        torch.testing.assert_close(got, x @ ref_w.t(), atol=1e-4, rtol=1e-5)


# ---- GGUF's block-32 tensors as they are in the file: Q8_0 → int8w, Q4_0 → int4, Q4_1 → int4 with mins -----


def _gguf_layout(type_name: str, rows: int, cols: int, seed: int = 0) -> tuple[str, dict[str, torch.Tensor]]:
    """Random weights quantized by gguf's own quantizer, regrouped into our layout."""
    import numpy as np

    import gguf

    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    return gguf_blocks.GGUF_LAYOUTS[type_name][0], gguf_blocks.gguf_block32_tensors(type_name, raw.reshape(rows, -1))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_dequantize_exactly_like_gguf(type_name: str) -> None:
    """The layout holds the file's bytes: its reference dequantization is gguf's, bit for bit."""
    import numpy as np

    import gguf

    w = np.random.default_rng(1).standard_normal((16, 256)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[type_name]
    raw = gguf.quants.quantize(w, qtype)
    blocks = gguf_blocks.gguf_block32_tensors(type_name, raw.reshape(16, -1))
    layout, has_mins = gguf_blocks.GGUF_LAYOUTS[type_name]
    assert ("mins" in blocks) == has_mins and blocks["scales"].shape == (16, 8)
    assert sum(t.numel() * t.element_size() for t in blocks.values()) == raw.nbytes, "the same bytes, regrouped"
    ours = Q.dequantize_layout(layout, blocks["qweight"], blocks["scales"], blocks.get("mins"))
    np.testing.assert_array_equal(ours.numpy(), gguf.dequantize(raw, qtype).reshape(16, 256))
    if type_name == "Q4_0":  # llama.cpp's Q4_0 block is our int4 layout: same nibbles, same (code - 8) * d
        codes = Q.unpack_int4(blocks["qweight"])
        assert torch.equal(Q.pack_int4(codes), blocks["qweight"])


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_block_kernels_match_the_dequantized_matmul(m: int, type_name: str) -> None:
    layout, blocks = _gguf_layout(type_name, 40, 192, seed=m)
    q, s, mins = blocks["qweight"], blocks["scales"], blocks.get("mins")
    ref_w = Q.dequantize_layout(layout, q, s, mins)
    dequant = kernels.dequant_i8w(q, s) if layout == "int8w" else kernels.dequant_i4(q, s, mins)
    assert torch.equal(dequant, ref_w), "dequantization must be exact"
    torch.manual_seed(m)
    x, bias = torch.randn(m, 192), torch.randn(40)
    got = kernels.linear_i8w(x, q, s, bias) if layout == "int8w" else kernels.linear_i4(x, q, s, bias, mins)
    torch.testing.assert_close(got, x @ ref_w.t() + bias, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kernels_on", [True, False])
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_1"])
def test_gguf_block_linear_paths_agree(type_name: str, kernels_on: bool) -> None:
    """A Linear holding GGUF blocks: the few-row kernel and the batched dequantize + GEMM path (and the
    PyTorch ops without kernels) compute the dequantized weight's product."""
    if kernels_on and not kernels.available():
        pytest.skip("no C compiler")
    layout, blocks = _gguf_layout(type_name, 48, 128, seed=3)
    lin = Linear(128, 48, bias=True)
    lin.prepare_quantized(layout, 32, "mins" in blocks)
    for name, t in blocks.items():
        getattr(lin, name).copy_(t)
    x = torch.randn(12, 128)
    expected = x @ lin.dequantized_weight().t() + lin.bias
    try:
        kernels.set_enabled(kernels_on)
        assert lin.fast_path(x[:1]) == (f"{layout}_kernel" if kernels_on else f"{layout}_dequant")
        assert lin.fast_path(x) == f"{layout}_dequant"
        rows = torch.cat([lin(x[i : i + 1]) for i in range(12)])
        batched = lin(x)
    finally:
        kernels.set_enabled(True)
    torch.testing.assert_close(batched, expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(rows, expected, atol=1e-4, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_linear_paths_agree(method: str) -> None:
    """The few-row kernel (1-8 rows; int8: kernels.i8_kernel_rows()) and the batched path of one quantized Linear
    compute the same model."""
    torch.manual_seed(1)
    lin = Linear(128, 48, bias=True)
    lin.quantize(method, 32)
    assert lin.weight is None and lin.qweight.dtype == (torch.int8 if method == "int8" else torch.uint8)
    n = kernels.i8_kernel_rows() + 4 if method == "int8" else 12
    x = torch.randn(n, 128)
    assert lin.fast_path(x[:1]) == f"{method}_kernel"
    assert lin.fast_path(x) == ("int8_gemm" if method == "int8" else "int4_dequant")
    batched = lin(x)
    rows = torch.cat([lin(x[i : i + 1]) for i in range(n)])
    torch.testing.assert_close(rows, batched, atol=1e-5, rtol=1e-5)
    xr = Q.fake_quantize_activations(x) if method == "int8" else x
    torch.testing.assert_close(batched, xr @ lin.dequantized_weight().t() + lin.bias, atol=1e-4, rtol=1e-5)


# ---- the engine against a plain PyTorch model of the same quantized math -----------------------------------

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantized_reference(
    model_dir: Path, method: str, group: int = 32, float_head: bool = False, int4_compute: str = "w4a8"
):
    """HF's model with every projection's weight replaced by its dequantized form, and (int8) each
    projection's input rounded to its per-token int8 grid first, (int4 W4A8) to its per-block-of-32 int8 grid.
    The LM head: int8 the same way; int4 its 8-bit group-32 weight-only form (float_head: kept float32, as int4
    checkpoints written before it was quantized); a tied head gets its own weight first, so the token lookup keeps
    the float32 embedding table."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if not float_head:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    for name, mod in model.named_modules():
        if not (name.endswith(PROJECTIONS) or (not float_head and name == "lm_head")):
            continue
        w = mod.weight.data
        if method == "int8":
            mod.weight.data = Q.dequantize_int8(*Q.quantize_int8(w))
            mod.register_forward_pre_hook(lambda _m, args: (Q.fake_quantize_activations(args[0]),))
        elif name == "lm_head":
            mod.weight.data = Q.dequantize_int8w(*Q.quantize_int8w(w))
            if int4_compute == "w4a8":  # the 8-bit head runs with int8 activations per block of 32 too
                mod.register_forward_pre_hook(lambda _m, args: (Q.fake_quantize_activation_blocks(args[0]),))
        else:
            mod.weight.data = Q.dequantize_int4(*Q.quantize_int4(w, group))
            if int4_compute == "w4a8":
                mod.register_forward_pre_hook(lambda _m, args: (Q.fake_quantize_activation_blocks(args[0]),))
                model.greedy_margin = W4A8_MARGIN
    return model


@torch.inference_mode()
def reference_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


def assert_matches_reference(llm: LLM, ref, prompts: list[str], params: SamplingParams = GREEDY) -> None:
    """The engine's greedy tokens are the reference's; a reference with a `greedy_margin` (W4A8) accepts, at each
    position of the engine's own output, a token whose reference logit is within that margin of the best."""
    margin = getattr(ref, "greedy_margin", 0.0)
    for out in llm.generate(prompts, params, use_tqdm=False):
        got = out.outputs[0].token_ids
        if not margin:
            expected = reference_greedy(ref, out.prompt_token_ids, params.max_tokens)
            assert got == expected, f"greedy mismatch for {out.prompt!r}"
            continue
        n = len(out.prompt_token_ids)
        with torch.inference_mode():
            logits = ref(torch.tensor([out.prompt_token_ids + got])).logits[0, n - 1 : n - 1 + len(got)]
        gap = logits.max(dim=-1).values - logits.gather(1, torch.tensor(got)[:, None])[:, 0]
        assert (gap <= margin).all(), (
            f"{out.prompt!r}: tokens {gap.gt(margin).nonzero().flatten().tolist()} of {got} "
            f"are {gap.max().item():.4f} below the reference's best logit (margin {margin})"
        )


@pytest.mark.parametrize("method", ["int8", "int4", "int4-weight-only"])
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2", "qwen3", "llama3-rope-untied"])
def test_greedy_matches_quantized_reference(model_dirs: dict[str, Path], name: str, method: str) -> None:
    """int4: W4A8 by default (the reference rounds each projection's input per block of 32), weight-only when
    asked (float32 inputs)."""
    compute = "weight-only" if method.endswith("weight-only") else "w4a8"
    method = method.removesuffix("-weight-only")
    llm = LLM(str(model_dirs[name]), num_kv_blocks=64, quantization=method, int4_compute=compute)
    if method == "int4":  # the projections and the 8-bit head
        w4a8 = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear) and m._w4a8 is not None]
        assert len(w4a8) == (4 * llm.engine.config.model.num_layers + 1 if compute == "w4a8" else 0)
    assert_matches_reference(llm, quantized_reference(model_dirs[name], method, int4_compute=compute), PROMPTS)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_engine_features_keep_the_quantized_model(llama_dir: Path, method: str) -> None:
    ref = quantized_reference(llama_dir, method)
    # chunked prefill + prefix-cache hits (the prompts share a long prefix)
    llm = LLM(str(llama_dir), num_kv_blocks=64, block_size=4, max_num_batched_tokens=8, quantization=method)
    shared = PROMPTS[2]
    assert_matches_reference(llm, ref, [shared, shared + " x", shared + " y"])
    assert llm.get_metrics()["prefix_cache_hits_total"] > 0
    # preemption (recompute) under a small pool
    llm = LLM(str(llama_dir), num_kv_blocks=12, block_size=16, quantization=method)
    prompts = [f"Request number {i}: import json, os, sys" for i in range(6)]
    assert_matches_reference(llm, ref, prompts, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    assert llm.get_metrics()["num_preemptions_total"] > 0


def test_kernels_off_compute_the_same_quantized_model(llama_dir: Path) -> None:
    kernels.set_enabled(False)
    try:
        llm = LLM(str(llama_dir), num_kv_blocks=64, quantization="int8")
        assert_matches_reference(llm, quantized_reference(llama_dir, "int8"), PROMPTS[:2])
    finally:
        kernels.set_enabled(True)


# ---- configuration ---------------------------------------------------------------------------------------


def test_bad_quantization_arguments_name_the_field(llama_dir: Path) -> None:
    def make(**kw):
        return EngineArgs(str(llama_dir), num_kv_blocks=8, **kw).create_engine_config()

    with pytest.raises(ValueError, match="quantization must be one of"):
        make(quantization="int3")
    with pytest.raises(ValueError, match="quantization_group_size"):
        make(quantization="int4", quantization_group_size=48)
    with pytest.raises(ValueError, match="quantization_group_size"):
        make(quantization="int4", quantization_group_size=256)  # does not divide hidden_size 64
    with pytest.raises(ValueError, match="CPU float32 path"):
        make(quantization="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="CPU float32 path"):
        make(quantization="int8", weight_dtype="bfloat16")
    cfg = make(quantization="int4", quantization_group_size=64)
    assert (cfg.quantization.method, cfg.quantization.group_size, cfg.quantization.prequantized) == ("int4", 64, False)
    assert make().quantization is None


# ---- checkpoint format -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def int4_checkpoint(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lmserve.entrypoints.cli import main

    out = tmp_path_factory.mktemp("q4")
    src = model_dirs["qwen2"]  # qkv biases ride along in float32
    assert main(["quantize", "--model", str(src), "--out", str(out), "--method", "int4"]) == 0
    return out


def test_quantized_checkpoint_loads_without_a_flag(model_dirs: dict[str, Path], int4_checkpoint: Path) -> None:
    saved = json.loads((int4_checkpoint / "config.json").read_text())["quantization_config"]
    assert saved == {"quant_method": "lmserve", "format": "lmserve-v1", "method": "int4", "group_size": 32,
                     "lm_head": "int8w"}  # fmt: skip
    size = (int4_checkpoint / "model.safetensors").stat().st_size
    assert size < 0.5 * (model_dirs["qwen2"] / "model.safetensors").stat().st_size
    llm = LLM(str(int4_checkpoint), num_kv_blocks=64)
    assert llm.engine.config.quantization.prequantized
    on_the_fly = LLM(str(model_dirs["qwen2"]), num_kv_blocks=64, quantization="int4")
    a = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    b = on_the_fly.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    with pytest.raises(ValueError, match="is an int4 checkpoint"):
        LLM(str(int4_checkpoint), num_kv_blocks=64, quantization="int8")


def test_int8_quantizes_the_lm_head_and_keeps_a_tied_embedding_float32(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=16, quantization="int8")
    model = llm.engine.runner.model
    assert model.config.tie_word_embeddings
    head, embed = model.lm_head, model.model.embed_tokens.weight
    assert head.quant_method == "int8" and head.weight is None and head.qweight.dtype == torch.int8
    assert embed.dtype == torch.float32
    torch.testing.assert_close(head.dequantized_weight(), embed, atol=float(head.scales.max()) / 2 + 1e-7, rtol=0)
    rows = kernels.i8_kernel_rows() + 1
    hidden = torch.randn(rows, model.config.hidden_size)
    assert head.fast_path(hidden[:1]) == "int8_kernel" or not kernels.available()
    assert head.fast_path(hidden[: rows - 1]) == "int8_kernel" or not kernels.available()
    assert head.fast_path(hidden) == "int8_gemm"
    ref = Q.fake_quantize_activations(hidden) @ head.dequantized_weight().t()
    torch.testing.assert_close(model.compute_logits(hidden), ref, atol=1e-4, rtol=1e-5)


def test_int4_gives_the_lm_head_8_bits_weight_only(llama_dir: Path) -> None:
    """int4's head: llama.cpp's Q8_0 block rule (int8w, group 32), the tied embedding kept; float32 activations
    with int4_compute="weight-only" (W4A8: tests/kernels/test_w4a8.py)."""
    llm = LLM(str(llama_dir), num_kv_blocks=16, quantization="int4", int4_compute="weight-only")
    model = llm.engine.runner.model
    head, embed = model.lm_head, model.model.embed_tokens.weight
    assert head.quant_method == "int8w" and head.weight is None and head.qweight.dtype == torch.int8
    assert head.scales.dtype == torch.float16 and head.scales.shape == (embed.shape[0], embed.shape[1] // 32)
    assert embed.dtype == torch.float32
    step = head.scales.float().repeat_interleave(32, dim=1)
    # rounded to nearest against the float32 scale, then the scale rounded to float16 (2^-11 relative, times up
    # to 127 codes): within 0.5 + 127 / 2048 of a step
    assert bool(((head.dequantized_weight() - embed).abs() <= step * (0.5 + 127 / 2048) + 1e-6).all())
    hidden = torch.randn(3, model.config.hidden_size)
    assert head.fast_path(hidden) == ("int8w_kernel" if kernels.available() else "int8w_dequant")
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ head.dequantized_weight().t(), atol=1e-4,
                               rtol=1e-5)  # fmt: skip


def test_quantize_int8w_is_q8_0() -> None:
    """Against gguf's own Q8_0 quantizer: the same scales and the same codes."""
    gguf = pytest.importorskip("gguf")
    torch.manual_seed(3)
    w = torch.randn(16, 128)
    q, d = Q.quantize_int8w(w)
    raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
    blocks = gguf_blocks.gguf_block32_tensors("Q8_0", raw)
    assert torch.equal(d, blocks["scales"]) and torch.equal(q, blocks["qweight"])


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("name", ["llama-gqa", "llama3-rope-untied"])
def test_checkpoint_round_trip_carries_the_lm_head(
    model_dirs: dict[str, Path], name: str, method: str, tmp_path: Path
) -> None:
    from safetensors import safe_open

    from lmserve.entrypoints.cli import main

    out = tmp_path / "q"
    assert main(["quantize", "--model", str(model_dirs[name]), "--out", str(out), "--method", method]) == 0
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"lm_head.qweight", "lm_head.scales", "model.embed_tokens.weight"} <= names
    assert "lm_head.weight" not in names
    llm = LLM(str(out), num_kv_blocks=64)
    model = llm.engine.runner.model
    head = {"int8": "int8", "int4": "int8w"}[method]
    assert llm.engine.config.quantization.prequantized and model.lm_head.quant_method == head
    on_the_fly = LLM(str(model_dirs[name]), num_kv_blocks=64, quantization=method)
    fresh = on_the_fly.engine.runner.model
    assert torch.equal(model.lm_head.dequantized_weight(), fresh.lm_head.dequantized_weight())
    assert torch.equal(model.model.embed_tokens.weight, fresh.model.embed_tokens.weight)
    a = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    b = on_the_fly.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def _rewrite(src: Path, dst: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_int4_checkpoint_without_a_head_layout_keeps_a_float_head(
    model_dirs: dict[str, Path], int4_checkpoint: Path, tmp_path: Path
) -> None:
    """An int4 checkpoint written before int4 quantized its head (no `lm_head` key, a float32 head) still loads
    as it was written; an lm_head layout that does not go with the method is refused."""
    from safetensors.torch import load_file

    src = model_dirs["qwen2"]

    def float_head(t: dict) -> None:
        del t["lm_head.qweight"], t["lm_head.scales"]
        if "lm_head.weight" in load_file(str(src / "model.safetensors")):
            t["lm_head.weight"] = load_file(str(src / "model.safetensors"))["lm_head.weight"]

    old = _rewrite(int4_checkpoint, tmp_path / "v1", float_head)
    cfg = json.loads((old / "config.json").read_text())
    del cfg["quantization_config"]["lm_head"]
    (old / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(old), num_kv_blocks=64)
    assert llm.engine.config.quantization.lm_head is None and llm.engine.runner.model.lm_head.quant_method is None
    assert_matches_reference(llm, quantized_reference(src, "int4", float_head=True), PROMPTS[:2])
    cfg["quantization_config"]["lm_head"] = "int4"
    (old / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="lm_head 'int4' with int4"):
        LLM(str(old), num_kv_blocks=64)


def test_mismatched_or_corrupt_checkpoint_is_refused(int4_checkpoint: Path, tmp_path: Path) -> None:
    name = "model.layers.1.mlp.down_proj"

    def wrong_dtype(t: dict) -> None:
        t[f"{name}.qweight"] = t[f"{name}.qweight"].to(torch.int8)

    def wrong_shape(t: dict) -> None:
        t[f"{name}.scales"] = t[f"{name}.scales"][:, :1].contiguous()

    def nan_scales(t: dict) -> None:
        t[f"{name}.scales"][0, 0] = float("nan")

    def missing(t: dict) -> None:
        del t[f"{name}.scales"]

    for edit, pattern in (
        (wrong_dtype, "qweight"),
        (wrong_shape, "scales"),
        (nan_scales, "scales"),
        (missing, "scales"),
    ):
        bad = _rewrite(int4_checkpoint, tmp_path / edit.__name__, edit)
        with pytest.raises(ValueError, match=rf"{name}\.{pattern}"):
            LLM(str(bad), num_kv_blocks=8)
    truncated = _rewrite(int4_checkpoint, tmp_path / "truncated", lambda t: None)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        LLM(str(truncated), num_kv_blocks=8)


# ---- memory ledger ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("name", ["llama-gqa", "llama3-rope-untied"])  # tied (int8 head: an extra copy), untied
def test_memory_ledger_counts_quantized_bytes_exactly(model_dirs: dict[str, Path], name: str, method: str) -> None:
    from lmserve.memory.ledger import load_model_shape
    from lmserve.memory.report import memory_report

    llama_dir = model_dirs[name]
    llm = LLM(str(llama_dir), num_kv_blocks=16, quantization=method)
    llm.generate(["a"], SamplingParams(max_tokens=2), use_tqdm=False)  # decode steps build the int8 row sums
    model = llm.engine.runner.model
    held = sum(p.nbytes for p in model.parameters())  # embeddings, norms (int4: the LM head): float32
    held += sum(b.nbytes for n, b in model.named_buffers() if n.endswith((".qweight", ".scales")))
    held += sum(m._w4a8.nbytes for m in model.modules() if isinstance(m, Linear) and m._w4a8 is not None)
    row_sums = [m._row_sums for m in model.modules() if isinstance(m, Linear) and m._row_sums is not None]
    assert len(row_sums) == (2 * 4 + 1 if method == "int8" else 0)  # 2 layers x qkv, o, gate_up, down; head
    held += sum(r.nbytes for r in row_sums)
    report = memory_report(load_model_shape(llama_dir), weight_dtype="fp32", quantization=method)
    assert report.weight_bytes == held
    assert "projections" in report.format_table()


def test_memory_cli_reads_a_quantized_checkpoint(int4_checkpoint: Path, capsys: pytest.CaptureFixture) -> None:
    from lmserve.entrypoints.cli import main

    assert main(["memory", "--model", str(int4_checkpoint), "--weight-dtype", "fp32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["quantization"], report["quantization_group_size"]) == ("int4", 32)
    full = json.loads((int4_checkpoint / "config.json").read_text())
    assert report["weight_bytes"] < full["hidden_size"] * full["vocab_size"] * 4 * 2


# ---- server ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_server_serves_the_quantized_model(llama_dir: Path, tmp_path: Path) -> None:
    import httpx

    from tests.server.test_server import MODEL_NAME, LiveServer

    srv = LiveServer(llama_dir, tmp_path / "server.log", "--quantization", "int8")
    try:
        srv.wait_healthy()
        body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        served = r.json()["choices"][0]["text"]
    finally:
        srv.stop()
    kernels.available()  # (loads the library: the row count follows its ISA, 8 VNNI / 64 AVX2 / 16 portable)
    rows = kernels.i8_kernel_rows()
    assert f"int8 weights: 1-{rows} row kernel" in srv.log(), "the server logs which int8 kernel runs"
    offline = LLM(str(llama_dir), num_kv_blocks=64, quantization="int8")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert served == offline.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].text


# ---- bfloat16 compute on the CPU ---------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [{"amx_bf16", "avx512_bf16"}, {"avx2"}])
def test_bf16_compute_says_whether_the_cpu_has_bf16_instructions(
    llama_dir: Path, flags: set[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(kernels, "cpu_flags", lambda: flags)
    with caplog.at_level("INFO", logger="lmserve.worker.model_runner"):
        llm = LLM(str(llama_dir), num_kv_blocks=16, dtype="bfloat16")
    text = caplog.text
    if "amx_bf16" in flags:
        assert "oneDNN bf16 GEMMs on this CPU's amx_bf16 and avx512_bf16" in text
    else:
        assert "neither avx512_bf16 nor amx_bf16" in text and "WARNING" in text
    out = llm.generate(["a"], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
