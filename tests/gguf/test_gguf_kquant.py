"""GGUF K-quants (Q4_K, Q5_K, Q6_K) kept as they are in the file: the C kernels against gguf's own dequantizer
on random super-blocks (both the AVX-512 path and the portable one, chosen at run time), the kquant Linear and
Embedding layouts, whole K-quant models (llama-quantize's Q4_K_M / Q5_K_M mixes) against HF transformers reading
the same file, and the memory they take (the ledger exactly; the resident set of a fresh process)."""

from __future__ import annotations

import ctypes
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import gguf
from lmserve import LLM, SamplingParams, kernels
from lmserve.checkpoint import gguf as lm_gguf
from lmserve.model import gguf_blocks
from lmserve.model import quantization as Q
from tests.gguf_helpers import dequantized_hf_model, q4_k_m_types, write_gguf
from tests.helpers import build_model

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: kernels not built")

TYPES = gguf_blocks.KQUANT_TYPES
PROMPTS = ["The capital of France is", "def fib(n):", "床前明月光，疑是地上霜。"]


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """(rows, cols / 256 * block bytes) random super-blocks: random bytes are valid K-quant blocks, except that
    the float16 d / dmin fields are set to finite, sane values (so every weight is finite)."""
    rng = np.random.default_rng(seed)
    size = kernels.KQ_BLOCK_BYTES[type_name]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)

    def f16(n: int) -> np.ndarray:
        values = rng.uniform(0.5, 2.0, size=(rows, cols // 256, n)) * 2e-3 * rng.choice([-1, 1], (rows, cols // 256, n))
        return values.astype(np.float16).view(np.uint8)

    if type_name == "Q6_K":
        blocks[..., 208:210] = f16(1)
    else:
        blocks[..., 0:4] = f16(2)  # d and dmin (a negative dmin is valid too: ggml only multiplies by it)
    return blocks.reshape(rows, -1)


def reference(type_name: str, blocks: np.ndarray, cols: int) -> torch.Tensor:
    return torch.from_numpy(gguf.dequantize(blocks, gguf.GGMLQuantizationType[type_name]).reshape(-1, cols))


@pytest.fixture(params=["avx512", "portable"])
def kernel_path(request: pytest.FixtureRequest):
    """Each test once per path: the CPU's (AVX-512 where it has it) and the portable C one, forced."""
    if request.param == "avx512" and not kernels.library._lib.kq_kernel_isa():
        pytest.skip("this CPU has no AVX-512: the portable path is the only one")
    kernels.force_kquant_portable(request.param == "portable")
    expected = "portable C" if request.param == "portable" else "AVX-512 (chosen at run time)"
    assert kernels.kquant_kernel_name() == expected
    yield request.param
    kernels.force_kquant_portable(False)


# ---- the kernels against gguf's dequantizer -------------------------------------------------------------------


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize(("rows", "cols"), [(1, 256), (7, 512), (33, 768)])
def test_dequant_is_gguf_bit_for_bit(type_name: str, rows: int, cols: int, kernel_path: str) -> None:
    blocks = random_blocks(type_name, rows, cols, seed=rows + cols)
    got = kernels.dequant_kq(type_name, torch.from_numpy(blocks), cols)
    assert torch.equal(got, reference(type_name, blocks, cols)), "every K-quant weight is exact in float32"
    assert torch.equal(gguf_blocks.dequantize_kquant(type_name, torch.from_numpy(blocks), cols), got)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 33])
@pytest.mark.parametrize(("o", "k"), [(7, 256), (33, 768), (1, 1024)])
def test_linear_matches_the_dequantized_matmul(type_name: str, m: int, o: int, k: int, kernel_path: str) -> None:
    """Weight-only: x float32 times exactly gguf's weights; only the order of the float32 sums differs."""
    blocks = random_blocks(type_name, o, k, seed=m * 100 + o + k)
    w = reference(type_name, blocks, k).double()
    g = torch.Generator().manual_seed(m + o + k)
    x, bias = torch.randn(m, k, generator=g), torch.randn(o, generator=g)
    segments = gguf_blocks.kquant_segment_table(gguf_blocks.kquant_segments([(type_name, o)], k))
    qweight = torch.from_numpy(blocks.reshape(-1))
    for b in (None, bias):
        got = kernels.linear_kq(x, qweight, segments, o, b)
        expected = x.double() @ w.t() + (0 if b is None else b.double())
        scale = (x.double().abs() @ w.abs().t()).max()  # the size of the sums' rounding
        torch.testing.assert_close(got.double(), expected, atol=float(scale) * 2e-6, rtol=0)


def test_segments_of_different_types_make_one_output(kernel_path: str) -> None:
    """A fused qkv whose parts are Q4_K, Q5_K and Q6_K (rows 5, 3, 9): one call, each segment its own type."""
    k, parts = 512, [("Q4_K", 5), ("Q5_K", 3), ("Q6_K", 9), ("Q6_K", 2)]
    blocks = [random_blocks(t, rows, k, seed=i) for i, (t, rows) in enumerate(parts)]
    segments = gguf_blocks.kquant_segments(parts, k)
    assert [(s.type_name, s.start, s.rows) for s in segments] == [("Q4_K", 0, 5), ("Q5_K", 5, 3), ("Q6_K", 8, 11)]
    qweight = torch.from_numpy(np.concatenate([b.reshape(-1) for b in blocks]))
    w = torch.cat([reference(t, b, k) for (t, _), b in zip(parts, blocks, strict=True)])
    x, bias = torch.randn(3, k), torch.randn(19)
    got = kernels.linear_kq(x, qweight, gguf_blocks.kquant_segment_table(segments), 19, bias)
    torch.testing.assert_close(got, x @ w.t() + bias, atol=1e-4, rtol=1e-4)


def test_the_path_is_chosen_at_run_time_whatever_the_build(tmp_path: Path) -> None:
    """The source compiled for a baseline x86-64 (no AVX-512 at build time) still runs the AVX-512 path on a CPU
    that has it, and its portable path on request; both give gguf's weights."""
    cc = kernels._compiler()
    if cc is None or "avx512f" not in kernels.cpu_flags():
        pytest.skip("needs a C compiler and an AVX-512 CPU")
    out = tmp_path / "baseline.so"
    flags = [f for f in kernels.CFLAGS if not f.startswith("-march")] + ["-march=x86-64-v2"]
    try:
        subprocess.run([cc, *flags, str(kernels.SOURCE), "-o", str(out), "-lm"], check=True, capture_output=True)
    except subprocess.CalledProcessError:
        pytest.skip("this compiler cannot target x86-64-v2")
    lib = ctypes.CDLL(str(out))
    kernels._declare_kquant(lib)
    saved = kernels.library._lib
    kernels.library._lib = lib
    try:
        for portable in (False, True):
            lib.kq_force_portable(int(portable))
            assert lib.kq_kernel_isa() == (0 if portable else 1)
            for type_name in TYPES:
                blocks = random_blocks(type_name, 9, 512, seed=3)
                w = reference(type_name, blocks, 512)
                assert torch.equal(kernels.dequant_kq(type_name, torch.from_numpy(blocks), 512), w)
                x = torch.randn(2, 512)
                table = gguf_blocks.kquant_segment_table(gguf_blocks.kquant_segments([(type_name, 9)], 512))
                got = kernels.linear_kq(x, torch.from_numpy(blocks.reshape(-1)), table, 9, None)
                torch.testing.assert_close(got, x @ w.t(), atol=1e-4, rtol=1e-4)
    finally:
        lib.kq_force_portable(0)
        kernels.library._lib = saved


def test_bad_k_quant_input_is_named() -> None:
    with pytest.raises(ValueError, match=r"up_proj: Q4_K rows hold whole super-blocks of 256, got 320 inputs"):
        gguf_blocks.kquant_row_bytes("Q4_K", 320, "up_proj")
    with pytest.raises(ValueError, match=r"token embedding: Q3_K is not a K-quant type \(Q4_K, Q5_K, Q6_K\)"):
        gguf_blocks.kquant_row_bytes("Q3_K", 256, "token embedding")


# ---- the Linear and Embedding layouts ------------------------------------------------------------------------


@pytest.mark.parametrize("kernels_on", [True, False])
@pytest.mark.parametrize("rows", [1, 8, 9, 40])
def test_linear_layer_paths_agree(rows: int, kernels_on: bool) -> None:
    """Few rows: the kernel; more: float32 tiles dequantized within each segment, then the GEMM; without the
    kernels: gguf's dequantized weight. All the same product."""
    from lmserve.model.layers import DEQUANT_TILE_BYTES, Linear

    k, parts = 512, [("Q4_K", 300), ("Q6_K", 1500)]  # float32 rows of 2 KiB: tiles of 1024 rows, within a segment
    layer = Linear(k, 1800, bias=True)
    blocks = np.concatenate([random_blocks(t, r, k, seed=r).reshape(-1) for t, r in parts])
    layer.set_kquant(torch.from_numpy(blocks), gguf_blocks.kquant_segments(parts, k))
    assert layer.weight is None and layer.scales is None and layer.qweight.dtype == torch.uint8
    w = layer.dequantized_weight()
    assert DEQUANT_TILE_BYTES // (4 * k) < 1500, "the tiles must cut a segment for this test"
    x = torch.randn(rows, k)
    try:
        if not kernels_on:
            kernels.set_enabled(False)
        path = layer.fast_path(x)
        expected_path = "kquant_kernel" if rows <= kernels.KQ_MAX_ROWS and kernels_on else "kquant_dequant"
        assert path == expected_path
        with torch.inference_mode():
            got = layer(x)
    finally:
        kernels.set_enabled(True)
    torch.testing.assert_close(got, F.linear(x, w, layer.bias), atol=1e-4, rtol=1e-4)


def test_embedding_looks_up_exactly_gguf_rows() -> None:
    from lmserve.model.layers import Embedding

    emb = Embedding(50, 512)
    emb.prepare_kquant("Q6_K")
    blocks = random_blocks("Q6_K", 50, 512, seed=1)
    emb.qweight.copy_(torch.from_numpy(blocks.reshape(-1)))
    ids = torch.tensor([[3, 49, 0], [3, 7, 7]])
    table = reference("Q6_K", blocks, 512)
    assert torch.equal(emb(ids), table[ids])
    kernels.set_enabled(False)  # gguf's dequantizer when there are no kernels
    try:
        assert torch.equal(emb(ids), table[ids])
    finally:
        kernels.set_enabled(True)


# ---- whole models: llama-quantize's mixes, against transformers reading the same file ---------------------------


@pytest.fixture(scope="module")
def kquant_models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    """Tiny random models with widths that are multiples of 256 (K-quant rows hold whole super-blocks)."""
    root = tmp_path_factory.mktemp("kquant-models")
    shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4)
    return {
        "llama": build_model(root / "llama", "llama", tokenizer_dir, tie_word_embeddings=False, **shape),
        "llama-tied": build_model(root / "llama-tied", "llama", tokenizer_dir, seed=1, **shape),
        "qwen2": build_model(root / "qwen2", "qwen2", tokenizer_dir, seed=2, tie_word_embeddings=False, **shape),
    }


def _mix(model_dir: Path, base: str) -> dict[str, str]:
    cfg = json.loads((model_dir / "config.json").read_text())
    return q4_k_m_types(cfg["num_hidden_layers"], base, cfg["tie_word_embeddings"])


def _weight_bytes(llm: LLM) -> int:
    """What the loaded model's weights take: parameters, quantized buffers (each tensor once) and W4A8 panels."""
    from lmserve.model.layers import Linear

    model = llm.engine.runner.model
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(
        b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith((".qweight", ".scales", ".mins"))
    )
    panels = sum(m._w4a8.nbytes for m in model.modules() if isinstance(m, Linear) and m._w4a8 is not None)
    return params + buffers + panels


def _last_logits(llm: LLM, prompts: list[str]) -> tuple[list[list[int]], torch.Tensor]:
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=1, temperature=0.0))
    sched = engine.scheduler.schedule()
    out = engine.runner.execute(sched)
    for i in range(len(prompts)):
        engine.abort_request(str(i))
    return [s.request.prompt_token_ids for s in sched.scheduled], out.logits


@pytest.mark.parametrize(("name", "base"), [("llama", "Q4_K"), ("llama-tied", "Q4_K"), ("qwen2", "Q5_K")])
def test_k_quant_model_matches_transformers_reading_the_same_file(
    kquant_models: dict[str, Path], tmp_path: Path, name: str, base: str, caplog
) -> None:
    from transformers import AutoModelForCausalLM

    from lmserve.config.engine import QuantizationConfig
    from lmserve.model.layers import Embedding, Linear

    model_dir = kquant_models[name]
    types = _mix(model_dir, base)
    file = write_gguf(model_dir, tmp_path / f"{name}-{base}_M.gguf", base, types)
    stored = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(file)).tensors}
    assert {"Q6_K", base} <= set(stored.values()), stored
    with caplog.at_level(logging.INFO, logger="lmserve.checkpoint.gguf"):  # (the blocks' own kernels: exact)
        llm = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64, int4_compute="weight-only")
    assert llm.engine.config.quantization == QuantizationConfig(
        "gguf", 32, prequantized=True, int4_compute="weight-only"
    )
    logged = [r.getMessage() for r in caplog.records if r.name == "lmserve.checkpoint.gguf"]
    assert not any("dequantized" in line for line in logged), f"every K-quant tensor is kept: {logged}"
    assert any("Q6_K tensors kept as they are in the file (their K-quant kernels run them)" in x for x in logged)
    model = llm.engine.runner.model
    dequantized = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64, quantization="none")
    plain = dict(dequantized.engine.runner.model.named_modules())
    for mod_name, m in model.named_modules():
        if isinstance(m, Linear):
            assert m.quant_method == "kquant" and m.weight is None, mod_name
            assert torch.equal(m.dequantized_weight(), plain[mod_name].weight), f"{mod_name}: the file's weights"
    embed = model.model.embed_tokens
    assert isinstance(embed, Embedding) and embed.kq_type == types["model.embed_tokens.weight"]
    if name == "llama-tied":
        assert model.lm_head.qweight is embed.qweight, "a K-quant tied head shares the embedding's bytes"
    # layer 2 (the last) is a use_more_bits layer: its qkv is two segments, q/k of the base type and v Q6_K
    qkv = model.model.layers[2].self_attn.qkv_proj
    assert [s.type_name for s in qkv.kq_segments] == [base, "Q6_K"]
    assert model.model.layers[0].mlp.down_proj.kq_segments[0].type_name == base
    assert model.model.layers[2].mlp.down_proj.kq_segments[0].type_name == "Q6_K"
    # the one-call decode stack takes K-quant projections
    assert model.model.decode_stack(llm.engine.runner.kv_caches) is not None
    # transformers' own GGUF loader (its names, permutation and dequantization) is the reference
    hf = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32).eval()
    ids, logits = _last_logits(llm, PROMPTS)
    with torch.inference_mode():
        for row, prompt_ids in enumerate(ids):
            expected = hf(torch.tensor([prompt_ids])).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, atol=2e-4, rtol=1e-4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        ids = list(out.prompt_token_ids)
        with torch.inference_mode():
            for _ in range(8):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        assert out.outputs[0].token_ids == ids[len(out.prompt_token_ids) :], out.prompt
    # the memory ledger is the loaded model's own figure: the file's bytes, the tied head once
    ckpt = lm_gguf.GGUFCheckpoint(file)
    resident, kept = lm_gguf.resident_weight_bytes(ckpt, 4, True)
    assert resident == _weight_bytes(llm)
    norms = sum(int(np.prod(t.shape)) for t in ckpt.tensors() if t.type_name == "F32")
    assert kept == sum(b for t, (_, b, _) in ckpt.bytes_by_type().items() if t != "F32")
    assert resident == kept + 4 * norms
    assert lm_gguf.resident_weight_bytes(ckpt, 4, False)[0] == _weight_bytes(dequantized)


def test_kquant_as_block32_is_the_file_up_to_float16_scales() -> None:
    """Q4_K / Q5_K super-blocks as the int4 / int5 layout with mins (what the W4A8 panels are packed from): every
    weight within the float16 rounding of its sub-block's scale and min, on random bytes (valid blocks)."""
    rng = np.random.default_rng(5)
    for type_name in ("Q4_K", "Q5_K"):
        k = 512
        blocks = rng.integers(0, 256, (9, gguf_blocks.kquant_row_bytes(type_name, k)), dtype=np.uint8)
        view = blocks.reshape(-1, gguf_blocks.KQ_BLOCK_BYTES[type_name])
        view[:, 0:4] = np.array(rng.uniform(1e-3, 1e-1, (view.shape[0], 2)), np.float16).view(np.uint8)  # finite
        ref = gguf_blocks.dequantize_kquant(type_name, torch.from_numpy(blocks), k)
        lay = gguf_blocks.kquant_as_block32(type_name, torch.from_numpy(blocks), k)
        assert lay["scales"].shape == lay["mins"].shape == (9, k // 32)
        unpack = Q.dequantize_int4 if type_name == "Q4_K" else Q.dequantize_int5
        got = unpack(lay["qweight"], lay["scales"], lay["mins"])
        levels = 15 if type_name == "Q4_K" else 31
        scale = lay["scales"].float().abs().repeat_interleave(32, dim=1)
        bound = 2.0**-11 * (levels * scale + lay["mins"].float().abs().repeat_interleave(32, dim=1)) + 1e-7
        assert ((got - ref).abs() <= bound).all(), f"{type_name}: {(got - ref).abs().max()}"
        assert (got - ref).abs().max() > 0, "float16 scales: not bit for bit (the weight-only path is)"
    with pytest.raises(AssertionError, match="no W4A8 panels"):
        gguf_blocks.kquant_as_block32("Q6_K", torch.zeros(1, 210, dtype=torch.uint8), 256)


@pytest.mark.parametrize(("name", "base"), [("llama", "Q4_K"), ("qwen2", "Q5_K")])
def test_q4_k_and_q5_k_projections_run_w4a8_by_default(
    kquant_models: dict[str, Path], tmp_path: Path, name: str, base: str
) -> None:
    """int4_compute="w4a8" (the default) repacks every projection that is all Q4_K or all Q5_K into the W4A8
    panels (its weights the file's up to float16 sub-block scales); Q6_K and mixed ones stay K-quant blocks; the
    memory ledger counts the panels; logits stay within the int8 activations' rounding of the exact engine's and
    greedy tokens are HF's up to near-ties."""
    from lmserve.model.layers import Linear
    from tests.hf_reference import assert_greedy_matches_hf_up_to_margin

    if not kernels.available():
        pytest.skip("no C compiler: K-quants run on their own kernels")
    model_dir = kquant_models[name]
    file = write_gguf(model_dir, tmp_path / f"{name}-{base}_M.gguf", base, _mix(model_dir, base))
    llm = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64)
    exact = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64, int4_compute="weight-only")
    plain = dict(exact.engine.runner.model.named_modules())
    packed = kept = 0
    for mod_name, m in llm.engine.runner.model.named_modules():
        if not isinstance(m, Linear):
            continue
        ref = plain[mod_name]
        if ref.kquant_panel_bits() is not None:
            assert m._w4a8 is not None and m._w4a8.bits == ref.kquant_panel_bits() and m.qweight is None, mod_name
            w, r = m.dequantized_weight(), ref.dequantized_weight()
            assert (w - r).abs().max() <= 1e-3 * r.abs().max(), mod_name
            packed += 1
        else:
            assert m.quant_method == "kquant" and m._w4a8 is None, mod_name
            assert any(s.type_name == "Q6_K" for s in m.kq_segments), mod_name
            kept += 1
    assert packed >= 4 and kept >= 2, (packed, kept)
    ckpt = lm_gguf.GGUFCheckpoint(file)
    resident = lm_gguf.resident_weight_bytes(ckpt, 4, True, kquant_panels=True)[0]
    assert resident == _weight_bytes(llm) > lm_gguf.resident_weight_bytes(ckpt, 4, True)[0] == _weight_bytes(exact)
    assert llm.engine.runner.model.model.decode_stack(llm.engine.runner.kv_caches) is not None
    _, logits = _last_logits(llm, PROMPTS)
    _, expected = _last_logits(exact, PROMPTS)
    rel = ((logits - expected).norm() / expected.norm()).item()
    # measured 0.079 (Q4_K) and 0.092 (Q5_K) on these random models: each projection's own error is the W4A8
    # rounding of plain int4 (0.5-0.6 %), which their layers amplify
    assert rel < 0.15, f"W4A8 logits {rel:.4f} (relative) from the exact engine's"
    # a greedy token may differ only where HF's top two are closer than twice the largest logit error measured
    margin = 2 * float((logits - expected).abs().max())
    ref_dir = dequantized_hf_model(model_dir, file, tmp_path / "ref")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        ids = out.outputs[0].token_ids
        assert_greedy_matches_hf_up_to_margin(ref_dir, out.prompt_token_ids, ids, margin, out.prompt)


def test_the_hf_reference_also_agrees_on_dequantized_weights(kquant_models: dict[str, Path], tmp_path: Path) -> None:
    """The same file against an HF directory holding gguf's dequantized weights (no transformers GGUF loader), on
    the blocks' own kernels (int4_compute="weight-only": exact)."""
    from tests.hf_reference import hf_greedy

    model_dir = kquant_models["llama"]
    file = write_gguf(model_dir, tmp_path / "llama-Q4_K_M.gguf", "Q4_K", _mix(model_dir, "Q4_K"))
    ref_dir = dequantized_hf_model(model_dir, file, tmp_path / "ref")
    llm = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64, int4_compute="weight-only")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        assert out.outputs[0].token_ids == hf_greedy(ref_dir, out.prompt_token_ids, 8), out.prompt


def test_a_k_quant_fused_with_another_kind_is_dequantized(kquant_models: dict[str, Path], tmp_path: Path) -> None:
    """q / k Q4_K with v Q8_0 cannot share one kernel: that qkv is dequantized (logged), the rest stays K-quant."""
    model_dir = kquant_models["llama"]
    types = {**_mix(model_dir, "Q4_K"), "model.layers.0.self_attn.v_proj.weight": "Q8_0"}
    file = write_gguf(model_dir, tmp_path / "mixed.gguf", "Q4_K", types)
    llm = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64, int4_compute="weight-only")  # (no panels)
    layers = llm.engine.runner.model.model.layers
    assert layers[0].self_attn.qkv_proj.quant_method is None and layers[1].self_attn.qkv_proj.quant_method == "kquant"
    ckpt = lm_gguf.GGUFCheckpoint(file)
    assert lm_gguf.resident_weight_bytes(ckpt, 4, True)[0] == _weight_bytes(llm)


def test_corrupt_scales_are_named(kquant_models: dict[str, Path], tmp_path: Path) -> None:
    model_dir = kquant_models["llama"]
    file = write_gguf(model_dir, tmp_path / "m.gguf", "Q4_K", _mix(model_dir, "Q4_K"))
    target = next(t for t in gguf.GGUFReader(str(file)).tensors if t.name == "blk.1.ffn_up.weight")
    data = bytearray(file.read_bytes())
    data[target.data_offset : target.data_offset + 2] = np.array([np.inf], np.float16).tobytes()  # block 0's d
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"mlp\.gate_up_proj holds non-finite Q4_K scales"):
        LLM(str(tmp_path / "bad.gguf"), tokenizer=str(model_dir), num_kv_blocks=64)


def test_memory_cli_reports_the_file_bytes(kquant_models: dict[str, Path], tmp_path: Path, capsys) -> None:
    import argparse

    from lmserve.entrypoints.memory_cli import add_memory_parser
    from lmserve.memory.ledger import format_bytes

    model_dir = kquant_models["llama-tied"]
    file = write_gguf(model_dir, tmp_path / "tied-Q4_K_M.gguf", "Q4_K", _mix(model_dir, "Q4_K"))
    parser = argparse.ArgumentParser()
    add_memory_parser(parser.add_subparsers())
    args = parser.parse_args(["memory", "--model", str(file), "--json", "--int4-compute", "weight-only"])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    tensors = gguf.GGUFReader(str(file)).tensors
    quantized = sum(int(t.n_bytes) for t in tensors if t.tensor_type.name != "F32")
    floats = sum(int(t.n_elements) for t in tensors if t.tensor_type.name == "F32")
    assert report["quantization"] == "gguf" and report["weight_bytes"] == quantized + 4 * floats
    assert any(f"keeps {format_bytes(quantized)} of K-quant tensors as they are" in n for n in report["notes"])
    assert not any("W4A8 panels" in n for n in report["notes"])
    # the default (w4a8): the Q4_K projections' panels, 20 bytes per 32 weights against the file's 18
    args = parser.parse_args(["memory", "--model", str(file), "--json"])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    panels = lm_gguf.resident_weight_bytes(lm_gguf.GGUFCheckpoint(file), 4, True, kquant_panels=True)[0]
    assert report["weight_bytes"] == panels > quantized + 4 * floats
    extra = panels - quantized - 4 * floats
    assert any("held as W4A8 panels" in n and format_bytes(extra) in n for n in report["notes"]), report["notes"]


def test_resident_memory_after_load_is_about_the_file(tmp_path: Path) -> None:
    """A fresh process loading a ~37 MiB Q4_K_M file (float32 it would be 236 MiB): the weights' load grows the
    resident set by at most 1.3x the file, and the whole LLM() by 1.3x the file plus its KV pool and ~10 MiB of
    engine set-up; the file is unmapped afterwards."""
    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        import bench_kquant
    finally:
        sys.path.remove(str(bench))
    model_dir, file = bench_kquant.build_gguf("small", "Q4_K")
    for int4_compute in ("weight-only", "w4a8"):  # the blocks as they are; the Q4_K projections as W4A8 panels
        m = bench_kquant.measure_memory(file, model_dir, None, int4_compute)
        file_bytes = m["file_tensor_bytes"]
        # the ledger: the file's bytes, or with the panels 20 bytes per 32 Q4_K weights instead of 18
        assert m["ledger_weight_bytes"] < (1.01 if int4_compute == "weight-only" else 1.12) * file_bytes, m
        assert m["rss_load_model_delta"] <= 1.3 * file_bytes, m
        assert m["rss_delta"] <= 1.3 * file_bytes + m["kv_pool_bytes"] + 12 * 2**20, m
        assert not m["file_still_mapped"], "the file's map is closed after load"
