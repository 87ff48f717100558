"""GGUF Q5_0 / Q5_1 kept as they are in the file (the "int5" layout): the blocks against gguf's own dequantizer on
random bytes, the W4A8 kernels' 5-bit panels (every path this CPU runs) against the PyTorch reference of the same
integer math, the Linear wiring (weight-only: dequantized tiles; W4A8: the panels), and whole Q4_K_M / Q5_K_M
files of a model whose rows are not whole super-blocks (llama-quantize's Q5_0 / Q5_1 / Q8_0 fallbacks, a qkv of
Q5_0 and Q8_0 parts held as Q8_0) against HF transformers reading the same file."""

from __future__ import annotations

import json
import logging
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
from lmserve.model.decode_stack import DecodeStack
from lmserve.model.layers import Linear
from tests.gguf_helpers import q4_k_m_types, with_kquant_fallbacks, write_gguf
from tests.helpers import build_model

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: kernels not built")

TYPES = ("Q5_0", "Q5_1")
ISAS = list(kernels.W4A8_ISAS)
PROMPTS = ["The capital of France is", "def fib(n):", "床前明月光，疑是地上霜。"]


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """(rows, cols / 32 * block bytes) random blocks: random bytes are valid Q5_0 / Q5_1 blocks once the float16
    d (and m) fields are finite."""
    rng = np.random.default_rng(seed)
    size = gguf_blocks.GGUF_BLOCK_BYTES[type_name]
    blocks = rng.integers(0, 256, size=(rows, cols // 32, size), dtype=np.uint8)
    n = 2 if type_name == "Q5_1" else 1
    values = rng.uniform(0.5, 2.0, (rows, cols // 32, n)) * 1e-2 * rng.choice([-1, 1], (rows, cols // 32, n))
    blocks[..., : 2 * n] = values.astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def reference(type_name: str, blocks: np.ndarray, cols: int) -> torch.Tensor:
    return torch.from_numpy(gguf.dequantize(blocks, gguf.GGMLQuantizationType[type_name]).reshape(-1, cols))


def int5(type_name: str, rows: int, cols: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The int5 layout's buffers of random blocks, and gguf's weights for them."""
    blocks = random_blocks(type_name, rows, cols, seed)
    return gguf_blocks.gguf_block32_tensors(type_name, blocks), reference(type_name, blocks, cols)


def _isa_or_skip(isa: str) -> str:
    if not kernels.w4a8_isa_supported(isa):
        pytest.skip(f"this CPU does not run the W4A8 {isa} path")
    return isa


# ---- the blocks ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize(("rows", "cols"), [(1, 32), (7, 96), (33, 576)])
def test_blocks_dequantize_like_gguf_bit_for_bit(type_name: str, rows: int, cols: int) -> None:
    buffers, expected = int5(type_name, rows, cols, seed=rows + cols)
    qw, s, m = buffers["qweight"], buffers["scales"], buffers.get("mins")
    assert qw.shape == (rows, cols // 32 * 20) and qw.dtype == torch.uint8 and (m is not None) == (type_name == "Q5_1")
    assert torch.equal(Q.dequantize_int5(qw, s, m), expected), "every Q5 weight is gguf's float32 value"
    assert torch.equal(Q.pack_int5(Q.unpack_int5(qw)), qw)
    packed = Q.pack_w5a8(qw, s, m)  # the W4A8 kernels' 5-bit panels hold the same weights
    assert packed.bits == 5 and packed.codes.shape == (-(-rows // 16), cols // 32, 5, 64)
    assert torch.equal(Q.dequantize_w4a8(packed), expected)
    back = Q.unpack_w4a8(packed)
    assert torch.equal(back[0], qw) and torch.equal(back[1], s) and (m is None or torch.equal(back[2], m))
    blocks = random_blocks(type_name, rows, cols, seed=rows + cols)
    tensor = lm_gguf.GGUFTensor("t", "t", type_name, (rows, cols), blocks, None)
    scales, mins, values = lm_gguf.unpack_block32(tensor)  # the torch-free reader's split, same values
    rebuilt = scales[..., None].astype(np.float32) * values.astype(np.float32)
    if mins is not None:
        rebuilt += mins[..., None].astype(np.float32)
    np.testing.assert_array_equal(rebuilt.reshape(rows, cols), expected.numpy())
    if type_name == "Q5_0":  # a Q5_0 part of a projection held as Q8_0: code - 16 as int8, exactly
        as8 = gguf_blocks.gguf_block32_tensors(type_name, blocks, "int8w")
        assert as8["qweight"].dtype == torch.int8 and torch.equal(Q.dequantize_int8w(as8["qweight"], s), expected)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 33])
def test_5_bit_panels_match_the_reference(isa: str, type_name: str, m: int) -> None:
    """Each path: the exact integer block sums of quantization.w5a8_reference (to float32 rounding), the same
    bits as the portable path for every row count; and the product of the float weights with the activations
    rounded to their int8 blocks."""
    _isa_or_skip(isa)
    o, k = 37, 160  # a partial last panel, a K tail past the last 128
    buffers, w = int5(type_name, o, k, seed=m)
    qw, s, mins = buffers["qweight"], buffers["scales"], buffers.get("mins")
    packed = Q.pack_w5a8(qw, s, mins)
    g = torch.Generator().manual_seed(m)
    x, bias = torch.randn(m, k, generator=g), torch.randn(o, generator=g)
    x[0, 32:64] = 0  # an all-zero activation block
    y = kernels.linear_w4a8(x, packed, bias, isa)
    torch.testing.assert_close(y, Q.w5a8_reference(x, qw, s, mins, bias), atol=1e-5, rtol=1e-5)
    assert torch.equal(y, kernels.linear_w4a8(x, packed, bias, "scalar"))
    assert torch.equal(y[:1], kernels.linear_w4a8(x[:1], packed, bias, isa)), "a row's result ignores the others"
    xq = Q.fake_quantize_activation_blocks(x)
    torch.testing.assert_close(y, F.linear(xq, w, bias), atol=1e-4, rtol=1e-4)


# ---- the Linear layer ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("kernels_on", [True, False])
@pytest.mark.parametrize("rows", [1, 9, 40])
def test_linear_layer_paths(type_name: str, rows: int, kernels_on: bool) -> None:
    """Weight-only (not packed): float32 tiles of exactly gguf's weights, then the GEMM, for every row count;
    packed (int4_compute="w4a8"): the 5-bit panels, every row count; without kernels: the dequantized weight."""
    from lmserve.model.layers import DEQUANT_TILE_BYTES

    o, k = 1800, 320  # float32 rows of 1280 B: the tiles cut the weight
    assert DEQUANT_TILE_BYTES // (4 * k) < o
    layer = Linear(k, o, bias=True)
    layer.prepare_quantized("int5", 32, mins=type_name == "Q5_1")
    buffers, w = int5(type_name, o, k, seed=rows)
    for name, t in buffers.items():
        getattr(layer, name).copy_(t)
    assert layer.weight is None and torch.equal(layer.dequantized_weight(), w)
    x = torch.randn(rows, k)
    try:
        if not kernels_on:
            kernels.set_enabled(False)
        assert layer.fast_path(x) == "int5_dequant"
        with torch.inference_mode():
            got = layer(x)
    finally:
        kernels.set_enabled(True)
    torch.testing.assert_close(got, F.linear(x, w, layer.bias), atol=1e-4, rtol=1e-4)
    layer.pack_w4a8()
    assert layer.qweight is None and layer._w4a8.bits == 5 and torch.equal(layer.dequantized_weight(), w)
    assert layer.fast_path(x) == "w4a8"
    with torch.inference_mode():
        got = layer(x)
    mins = buffers.get("mins")
    expected = Q.w5a8_reference(x, buffers["qweight"], buffers["scales"], mins, layer.bias.detach())
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


# ---- whole files: llama-quantize's Q4_K_M / Q5_K_M of rows that are not whole super-blocks -------------------------


@pytest.fixture(scope="module")
def q5_models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    """Tiny random models shaped like the benchmark model: 64-wide rows (not whole super-blocks: Q5_0 / Q5_1 /
    Q8_0 fallbacks) beside a 256-wide down_proj (K-quants)."""
    root = tmp_path_factory.mktemp("q5-models")
    shape = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4)
    return {
        "llama": build_model(root / "llama", "llama", tokenizer_dir, tie_word_embeddings=False, **shape),
        "llama-tied": build_model(root / "llama-tied", "llama", tokenizer_dir, seed=1, **shape),
        "qwen2": build_model(root / "qwen2", "qwen2", tokenizer_dir, seed=2, tie_word_embeddings=False, **shape),
    }


def _file(models: dict[str, Path], name: str, base: str, out: Path) -> tuple[Path, dict[str, str]]:
    model_dir = models[name]
    cfg = json.loads((model_dir / "config.json").read_text())
    types = with_kquant_fallbacks(model_dir, q4_k_m_types(cfg["num_hidden_layers"], base, cfg["tie_word_embeddings"]))
    return write_gguf(model_dir, out / f"{name}-{base}_M.gguf", base, types), types


def _weight_bytes(llm: LLM) -> int:
    model = llm.engine.runner.model
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(
        b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith((".qweight", ".scales", ".mins"))
    )
    return params + buffers


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
def test_q5_fallbacks_match_transformers_reading_the_same_file(
    q5_models: dict[str, Path], tmp_path: Path, name: str, base: str, caplog
) -> None:
    """Weight-only, the file's weights exactly: the last prompt logits within float32 rounding of transformers'
    GGUF loader, the same greedy tokens; every Q5 tensor kept (int5, or int8w in a qkv with Q8_0 parts)."""
    from transformers import AutoModelForCausalLM

    file, types = _file(q5_models, name, base, tmp_path)
    q5 = "Q5_0" if base == "Q4_K" else "Q5_1"
    stored = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(file)).tensors}
    assert {q5, "Q8_0", base, "Q6_K"} <= set(stored.values()), stored
    with caplog.at_level(logging.INFO, logger="lmserve.checkpoint.gguf"):
        llm = LLM(str(file), tokenizer=str(q5_models[name]), num_kv_blocks=64, int4_compute="weight-only")
    logged = [r.getMessage() for r in caplog.records if r.name == "lmserve.checkpoint.gguf"]
    assert any(f"{q5} tensors kept as they are in the file" in line for line in logged), logged
    model = llm.engine.runner.model
    dequantized = LLM(str(file), tokenizer=str(q5_models[name]), num_kv_blocks=64, quantization="none")
    plain = dict(dequantized.engine.runner.model.named_modules())
    layers = model.model.layers
    for i, layer in enumerate(layers):
        qkv, v_type = layer.self_attn.qkv_proj, types[f"model.layers.{i}.self_attn.v_proj.weight"]
        if v_type == "Q8_0" and q5 == "Q5_0":
            assert qkv.quant_method == "int8w", "Q5_0 q / k with a Q8_0 v: held as Q8_0"
        elif v_type == "Q8_0":
            assert qkv.quant_method is None, "Q5_1 with Q8_0 parts: dequantized (no layout holds both)"
        else:
            assert qkv.quant_method == "int5" and (qkv.mins is not None) == (q5 == "Q5_1")
        assert layer.self_attn.o_proj.quant_method == layer.mlp.gate_up_proj.quant_method == "int5"
        assert layer.mlp.down_proj.quant_method == "kquant"
    for mod_name, m in model.named_modules():
        if isinstance(m, Linear) and m.quant_method is not None:
            assert torch.equal(m.dequantized_weight(), plain[mod_name].weight), f"{mod_name}: the file's weights"
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
    # the memory ledger: the file's bytes (a Q5_0 part held as Q8_0: 34 bytes a block), the rest float32
    ckpt = lm_gguf.GGUFCheckpoint(file)
    assert lm_gguf.resident_weight_bytes(ckpt, 4, True)[0] == _weight_bytes(llm)


def _reference_linear_w4a8(x: torch.Tensor, w: Q.W4A8Weights, bias: torch.Tensor | None, isa=None) -> torch.Tensor:
    if w.bits == 8:
        return Q.w8a8_blocks_reference(x, *Q.unpack_w4a8(w)[:2], bias)
    if w.bits == 5:
        return Q.w5a8_reference(x, *Q.unpack_w4a8(w), bias)
    return Q.w4a8_reference(x, *Q.unpack_w4a8(w), bias)


@pytest.mark.parametrize(("name", "base"), [("llama", "Q4_K"), ("qwen2", "Q5_K")])
def test_w4a8_runs_q5_and_q8_0_blocks_on_the_integer_path(
    q5_models: dict[str, Path], tmp_path: Path, name: str, base: str, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """int4_compute="w4a8" (the default): Q5_0 / Q5_1 on the 5-bit panels, Q8_0 (the head, a Q5_0 + Q8_0 qkv) on
    the 8-bit ones, int8 activations per block of 32 (llama.cpp's q5_0 / q8_0 x q8_0); the engine (the one-call
    decode stack included) generates exactly what it does with every panel product computed by the PyTorch
    reference."""
    file, _ = _file(q5_models, name, base, tmp_path)
    with caplog.at_level(logging.INFO, logger="lmserve.worker.model_runner"):
        llm = LLM(str(file), tokenizer=str(q5_models[name]), num_kv_blocks=64)
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks and Q4_K / Q5_K projections: W4A8 in" in logged
    model = llm.engine.runner.model
    bits = {n: m._w4a8.bits for n, m in model.named_modules() if isinstance(m, Linear) and m._w4a8 is not None}
    assert bits["lm_head"] == 8 and bits["model.layers.1.self_attn.o_proj"] == 5
    if base == "Q4_K":
        assert bits["model.layers.2.self_attn.qkv_proj"] == 8, "Q5_0 + Q8_0 held as Q8_0: 8-bit panels"
        assert bits["model.layers.0.self_attn.qkv_proj"] == 5
    assert all(m.qweight is None for n, m in model.named_modules() if n in bits), "the panels are the only copy"
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    assert model.model.decode_stack(llm.engine.runner.kv_caches) is not None, "the decode stack ran the panels"
    monkeypatch.setattr(kernels, "linear_w4a8", _reference_linear_w4a8)
    monkeypatch.setattr(DecodeStack, "supports", staticmethod(lambda *_: False))
    model.model.reset_decode_stack()
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    assert got == ref
