"""The C kernels of lmserve.kernels against PyTorch references, the engine's use of them, and the
fallback to PyTorch ops when they cannot be built."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from lmserve import LLM, SamplingParams, kernels
from lmserve.model.decode_stack import DecodeStack
from tests.hf.test_model_vs_hf import PROMPTS, assert_greedy_matches_hf

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: kernels not built")


@pytest.mark.parametrize("m", [1, 3, 4, 5, 17, 64])
@pytest.mark.parametrize("o,i", [(5, 7), (8, 64), (13, 576), (1027, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_torch(m: int, o: int, i: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(m * 1000 + o + i)
    x, w = torch.randn(m, i, generator=g), torch.randn(o, i, generator=g)
    b = torch.randn(o, generator=g) if bias else None
    torch.testing.assert_close(kernels.linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_linear_takes_non_contiguous_input() -> None:
    x = torch.randn(8, 3, 32)[:, 1]  # strided rows
    w = torch.randn(16, 32)
    torch.testing.assert_close(kernels.linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_linear_refuses_wrong_dtype() -> None:
    with pytest.raises(AssertionError, match="float32"):
        kernels.linear(torch.randn(2, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64))


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_layer_paths_match_torch(rows: int, bias: bool) -> None:
    """lmserve's Linear: the C kernel up to kernels.f32_max_rows() rows, the oneDNN-packed weight beyond, the
    same result as nn.Linear."""
    from lmserve.model.layers import Linear, onednn_packing_available

    torch.manual_seed(rows)
    layer = Linear(48, 70, bias=bias)
    x = torch.randn(rows, 48)
    expected = F.linear(x, layer.weight, layer.bias)
    if onednn_packing_available():
        layer.pack_for_onednn()
        assert layer._packed is not None
    elif rows > kernels.f32_max_rows():
        pytest.skip("no oneDNN in this torch build")
    assert layer.fast_path(x) == ("kernel" if rows <= kernels.f32_max_rows() else "onednn" if layer._packed is not None
                                  else None)  # fmt: skip
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [32, 48, 70, 576])  # whole 32-input steps, a masked last step of 16 / 6 / 22 inputs
def test_linear_rows_are_bit_identical_whatever_the_row_count(weight_dtype: torch.dtype, k: int) -> None:
    """Each row of x is computed the same way alone, in a pair or in a run of up to 19 (the kernel takes 8 at a
    time): a speculative verification run scores each position exactly as a plain decode step would."""
    g = torch.Generator().manual_seed(k)
    x, w = torch.randn(19, k, generator=g), torch.randn(37, k, generator=g).to(weight_dtype)
    b = torch.randn(37, generator=g)
    alone = torch.cat([kernels.linear(x[i : i + 1], w, b) for i in range(19)])
    for m in (2, 5, 8, 19):
        assert torch.equal(kernels.linear(x[:m], w, b), alone[:m]), f"{m} rows differ from one row at a time"
    torch.testing.assert_close(alone, F.linear(x, w.float(), b), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 7])
def test_rmsnorm_and_residual_add_match_torch(rows: int) -> None:
    from lmserve.model.layers import RMSNorm

    torch.manual_seed(rows)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data.uniform_(0.5, 1.5)
    x, res = torch.randn(rows, 96), torch.randn(rows, 96)
    with torch.inference_mode():
        kernels.set_enabled(False)
        try:
            expected, expected_res = norm.add_forward(x, res.clone())
            expected_plain = norm(x)
        finally:
            kernels.set_enabled(True)
        got_res = res.clone()
        got, got_res_out = norm.add_forward(x, got_res)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert got_res_out is got_res, "the kernel path updates the residual in place"
        torch.testing.assert_close(got_res, expected_res, atol=0, rtol=0)
        torch.testing.assert_close(norm(x), expected_plain, atol=1e-5, rtol=1e-5)


def test_silu_mul_matches_torch() -> None:
    gu = torch.randn(5, 2 * 37) * 4
    gate, up = gu.split(37, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gu), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 9])
def test_rope_write_kv_matches_torch(tokens: int) -> None:
    from lmserve.config.engine import RopeConfig
    from lmserve.model.attention import write_kv
    from lmserve.model.kv_cache import KVCache
    from lmserve.model.layers import RotaryEmbedding, apply_rotary

    heads, kv_heads, d, block_size = 6, 2, 16, 4
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), d, 64)
    positions = torch.randperm(64)[:tokens]
    cos, sin = rotary(positions, torch.float32)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d)
    q, k, v = (t.view(tokens, -1, d) for t in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
    slots = torch.randperm(8 * block_size)[:tokens]
    caches = [torch.zeros(8, block_size, kv_heads, d) for _ in range(4)]
    write_kv(KVCache(caches[0], caches[1]), apply_rotary(k, cos, sin), v, slots)
    q_expected = apply_rotary(q, cos, sin)
    kernels.rope_write_kv(q, k, v, cos.squeeze(1), sin.squeeze(1), caches[2], caches[3], slots)
    torch.testing.assert_close(q, q_expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(caches[2], caches[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(caches[3], caches[1], atol=0, rtol=0)


def _reference_decode_attention(q, k_cache, v_cache, tables, lens, window=None, sinks=None):
    """Per sequence: gather its first lens[b] tokens through the block table (the last `window` of them with a
    sliding window), plain softmax attention (with sinks (H,): HF gpt-oss's, a softmax over [scores, sink] whose
    sink column is dropped)."""
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    outs = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        first = max(0, n - window) if window else 0
        k = k_cache[tables[b]].reshape(-1, *k_cache.shape[2:])[first:n].repeat_interleave(group, dim=1)  # (n, H, D)
        v = v_cache[tables[b]].reshape(-1, *v_cache.shape[2:])[first:n].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b], k) / q.shape[-1] ** 0.5
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            probs = torch.cat([scores, sinks[:, None]], dim=-1).softmax(-1)[:, :-1]
        outs.append(torch.einsum("hn,nhd->hd", probs, v))
        assert tables.shape[1] * block_size >= n
    return torch.stack(outs)


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (4, 1), (9, 3)])
@pytest.mark.parametrize("batch", [1, 2, 11])  # few sequences split by kv head; many: one item per sequence
def test_paged_decode_attention_matches_reference(heads: int, kv_heads: int, batch: int) -> None:
    g = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + batch)
    block_size, head_dim, num_blocks = 4, 16, 128
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    lens = torch.tensor([1, 4, 5, 37, 2, 16, 9, 30, 3, 8, 21][:batch], dtype=torch.long)
    max_blocks = -(-int(lens.max()) // block_size)
    tables = torch.randperm(num_blocks, generator=g)[: batch * max_blocks].view(batch, max_blocks).contiguous()
    q = torch.randn(batch, heads, head_dim, generator=g)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    expected = _reference_decode_attention(q, k_cache, v_cache, tables, lens)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def _paged(rows: torch.Tensor, tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """rows (B, L, KVH, D) of K or V laid out in a paged cache of block_size through tables (B, blocks a sequence)."""
    batch, per_seq = tables.shape
    padded = torch.zeros(batch, per_seq * block_size, *rows.shape[2:])
    padded[:, : rows.shape[1]] = rows
    cache = torch.zeros(batch * per_seq, block_size, *rows.shape[2:])
    cache[tables.flatten()] = padded.view(batch * per_seq, block_size, *rows.shape[2:])
    return cache


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 1, 32), (4, 4, 128), (6, 2, 80)])
def test_paged_decode_attention_same_bits_in_every_layout(heads: int, kv_heads: int, head_dim: int) -> None:
    """Blocks of 16 and 32 tokens take the 16-token vectorized scores (AVX-512, head_dim a multiple of 16), blocks
    of 8 only the one-token path; thread counts split the heads differently (by kv head, or a single stream's query
    heads in runs): every output must be the same bits, and agree with plain softmax attention."""
    g = torch.Generator().manual_seed(heads * 1000 + head_dim)
    lens = torch.tensor([230, 17, 16, 1, 64], dtype=torch.long)
    length = int(lens.max())
    k_rows = torch.randn(len(lens), length, kv_heads, head_dim, generator=g)
    v_rows = torch.randn(len(lens), length, kv_heads, head_dim, generator=g)
    q = torch.randn(len(lens), heads, head_dim, generator=g) * 2
    threads = torch.get_num_threads()
    outs = []
    try:
        for block_size, nthreads, batch in [(16, 2, 5), (32, 2, 5), (8, 2, 5), (16, 1, 5), (16, 2, 1), (8, 1, 1)]:
            torch.set_num_threads(nthreads)
            per_seq = -(-length // block_size)
            tables = torch.randperm(batch * per_seq, generator=g).view(batch, per_seq).contiguous()
            k_cache = _paged(k_rows[:batch], tables, block_size)
            v_cache = _paged(v_rows[:batch], tables, block_size)
            out = kernels.paged_decode_attention(q[:batch], k_cache, v_cache, tables, lens[:batch], head_dim**-0.5)
            expected = _reference_decode_attention(q[:batch], k_cache, v_cache, tables, lens[:batch])
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    for out in outs[1:]:
        assert torch.equal(out, outs[0][: out.shape[0]]), "attention bits depend on the cache layout or threads"


def _filled_cache(num_blocks: int, kv_dtype: str, g: torch.Generator) -> tuple:
    """A KV cache of num_blocks blocks of 4 tokens (2 KV heads of 16) every slot written with random rows, and its
    keys and values dequantized: (cache, k_ref, v_ref)."""
    from lmserve.model.kv_cache import KVCache, dequantize

    cache = KVCache.allocate(num_blocks, 4, 2, 16, kv_dtype, torch.device("cpu"))
    rows = torch.randn(2, num_blocks * 4, 2, 16, generator=g)
    cache.write(rows[0], rows[1], torch.arange(num_blocks * 4))
    return cache, dequantize(cache.k, cache.k_scale, torch.float32), dequantize(cache.v, cache.v_scale, torch.float32)


@pytest.mark.parametrize("window", [1, 3, 4, 9, 64])
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_paged_decode_attention_reads_only_the_window(window: int, kv_dtype: str) -> None:
    """With a sliding window the kernel starts at the first block inside it: table entries before that block are
    -1 here (a freed block's sentinel), which would crash or corrupt a kernel that read them."""
    g = torch.Generator().manual_seed(window)
    block_size, heads, head_dim, num_blocks = 4, 8, 16, 128
    cache, k_ref, v_ref = _filled_cache(num_blocks, kv_dtype, g)
    lens = torch.tensor([1, 4, 5, 37, 2, 16, 9, 30, 3, 8, 21], dtype=torch.long)
    batch, max_blocks = len(lens), -(-int(lens.max()) // block_size)
    tables = torch.randperm(num_blocks, generator=g)[: batch * max_blocks].view(batch, max_blocks).contiguous()
    q = torch.randn(batch, heads, head_dim, generator=g)
    expected = _reference_decode_attention(q, k_ref, v_ref, tables, lens, window)
    for b, n in enumerate(lens.tolist()):
        tables[b, : max(0, n - window) // block_size] = -1  # blocks wholly before the window
    out = kernels.paged_decode_attention(
        q, cache.k, cache.v, tables, lens, head_dim**-0.5, cache.k_scale, cache.v_scale, sliding_window=window
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_paged_decode_attention_with_sinks(window: int | None, kv_dtype: str) -> None:
    """gpt-oss's attention sinks: each head's logit joins its softmax's maximum and denominator and reads no value;
    one sink far above every score (nearly all the weight goes to it), one far below (plain attention)."""
    g = torch.Generator().manual_seed(11)
    block_size, heads, head_dim, num_blocks = 4, 8, 16, 64
    cache, k_ref, v_ref = _filled_cache(num_blocks, kv_dtype, g)
    lens = torch.tensor([1, 6, 37, 13], dtype=torch.long)
    batch, max_blocks = len(lens), -(-int(lens.max()) // block_size)
    tables = torch.randperm(num_blocks, generator=g)[: batch * max_blocks].view(batch, max_blocks).contiguous()
    q = torch.randn(batch, heads, head_dim, generator=g)
    sinks = torch.randn(heads, generator=g)
    sinks[0], sinks[1] = 40.0, -40.0
    out = kernels.paged_decode_attention(
        q, cache.k, cache.v, tables, lens, head_dim**-0.5, cache.k_scale, cache.v_scale, window, sinks
    )
    expected = _reference_decode_attention(q, k_ref, v_ref, tables, lens, window, sinks)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    plain = kernels.paged_decode_attention(
        q, cache.k, cache.v, tables, lens, head_dim**-0.5, cache.k_scale, cache.v_scale, window
    )
    assert not torch.allclose(out, plain) and out[:, 0].abs().max() < 1e-6


@pytest.mark.parametrize("stack", [True, False], ids=["decode-stack", "module-path"])
def test_engine_uses_kernels_and_matches_hf(llama_dir: Path, monkeypatch: pytest.MonkeyPatch, stack: bool) -> None:
    """Decode steps run the whole stack in one C call (model/decode_stack.py), or with it refused, layer by
    layer through the kernels; both give HF's greedy tokens."""
    calls = {"linear": 0, "paged_decode_attention": 0, "decode_stack": 0}
    for name in calls:
        real = getattr(kernels, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(kernels, name, counted)
    if not stack:
        monkeypatch.setattr(DecodeStack, "supports", staticmethod(lambda model, kv_caches: False))
    llm = LLM(str(llama_dir), num_kv_blocks=64)
    assert llm.engine.runner.packed_weight_bytes > 0, "CPU fp32 weights should get oneDNN-packed copies"
    # two sequences: decode steps of 2 rows take the C kernels, prefill steps the packed oneDNN weights
    assert_greedy_matches_hf(llm, llama_dir, PROMPTS[:2], max_tokens=8)
    assert calls["linear"] > 0, calls  # the LM head of decode steps
    if stack:
        assert calls["decode_stack"] > 0 and calls["paged_decode_attention"] == 0, calls
    else:
        assert calls["decode_stack"] == 0 and calls["paged_decode_attention"] > 0, calls


def test_torch_path_matches_hf_with_kernels_off(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a, **kw):
        raise AssertionError("kernel called while disabled")

    kernels.set_enabled(False)
    try:
        monkeypatch.setattr(kernels, "linear", refuse)
        monkeypatch.setattr(kernels, "paged_decode_attention", refuse)
        assert not kernels.usable(torch.zeros(1))
        assert_greedy_matches_hf(LLM(str(llama_dir), num_kv_blocks=64), llama_dir, PROMPTS[:3], max_tokens=8)
    finally:
        kernels.set_enabled(True)
    assert kernels.available()


def test_failed_compile_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.setenv("LMSERVE_KERNEL_CACHE", str(tmp_path))
    kernels.set_enabled(False)
    try:
        with caplog.at_level(logging.WARNING, logger="lmserve.kernels"):
            kernels.set_enabled(True)
        assert not kernels.available()
        assert "using PyTorch ops" in caplog.text
        assert list(tmp_path.iterdir()) == [], "no partial library left behind"
    finally:
        monkeypatch.delenv("CC")
        monkeypatch.delenv("LMSERVE_KERNEL_CACHE")
        kernels.set_enabled(True)
    assert kernels.available()


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMSERVE_CPU_KERNELS", "0")
    kernels.set_enabled(True)
    try:
        assert not kernels.available()
    finally:
        monkeypatch.delenv("LMSERVE_CPU_KERNELS")
        kernels.set_enabled(True)
    assert kernels.available()


def test_generate_runs_with_bfloat16_model_through_torch_path(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=64, dtype="bfloat16")
    out = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_bf16_weights_match_hf_with_the_same_rounded_weights(llama_dir: Path) -> None:
    """weight_dtype="bfloat16": the engine computes (in fp32) the model whose linear weights are rounded to
    bf16; HF with the same rounding applied must produce the same greedy tokens and close logits."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(llama_dir), num_kv_blocks=64, weight_dtype="bfloat16")
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for module in hf.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(module.weight.to(torch.bfloat16).float())
        hf.get_input_embeddings().weight.copy_(hf.get_input_embeddings().weight.to(torch.bfloat16).float())
    rounded = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert rounded._weight_bf16 is not None and rounded._weight_bf16.dtype == torch.bfloat16
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS[:2], outs, strict=True):
        ids = tok.encode(prompt)
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(ids) :].tolist(), prompt


def test_weight_dtype_validation(llama_dir: Path) -> None:
    from lmserve.config.engine import EngineArgs

    with pytest.raises(ValueError, match="weight_dtype"):
        EngineArgs.from_kwargs(str(llama_dir), weight_dtype="float16").create_engine_config()
    with pytest.raises(ValueError, match="weight_dtype='bfloat16' is the CPU float32 path"):
        EngineArgs.from_kwargs(str(llama_dir), dtype="float16", weight_dtype="bfloat16").create_engine_config()
    same = EngineArgs.from_kwargs(str(llama_dir), dtype="bfloat16", weight_dtype="bfloat16").create_engine_config()
    assert same.weight_dtype is None, "weights already in the model dtype: nothing to do"


def test_unloadable_cached_library_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """A corrupt library in the cache (say, from another system) must not crash the engine."""
    monkeypatch.setenv("LMSERVE_KERNEL_CACHE", str(tmp_path))
    path = kernels.library_path(kernels._compiler())
    path.write_bytes(b"not an ELF file")  # where the loader looks first: it must not compile over it
    kernels.set_enabled(False)
    try:
        with caplog.at_level(logging.WARNING, logger="lmserve.kernels"):
            kernels.set_enabled(True)
        assert not kernels.available()
        assert "loading" in caplog.text and "using PyTorch ops" in caplog.text
    finally:
        monkeypatch.delenv("LMSERVE_KERNEL_CACHE")
        kernels.set_enabled(True)
    assert kernels.available()
