"""The KV cache in 16 and 8 bits (EngineArgs.kv_cache_dtype): storage round trip, the C kernels against the
PyTorch path, attention against float32, the ledger and the engine agreeing on the pool, the scheduling paths
(chunked prefill, prefix caching, preemption, beam search) with a quantized cache, and held-out perplexity."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmserve import LLM, SamplingParams, kernels
from lmserve.config.engine import EngineArgs
from lmserve.engine.beam_search import BeamSearchParams
from lmserve.memory import ledger as memory
from lmserve.model.attention import AttentionMetadata, _decode_attention, _Spec
from lmserve.model.kv_cache import KVCache, dequantize, quantize
from tests.conftest import MODEL_SPECS
from tests.hf.test_model_vs_hf import PROMPTS
from tests.hf_reference import assert_greedy_matches_hf_up_to_margin

QUANTIZED = ["bfloat16", "int8", "fp8_e4m3"]
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="no C compiler: kernels not built")
# Logit perturbation under which a greedy flip counts as a legitimate near-tie (the margin tool). Measured on the
# tiny llama (teacher-forced prompt log-probs, 4-token chunks, 252 positions): bf16 KV moves a log-prob by <= 0.037,
# int8 KV by <= 0.084; the difference of two logits can move by twice that.
FLIP_MARGIN = {"bfloat16": 0.08, "int8": 0.2}
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture
def kernels_on_off(request: pytest.FixtureRequest) -> Iterator[None]:
    """Parametrized with True (C kernels) / False (PyTorch ops); restores the kernels afterwards."""
    if request.param and not kernels.available():
        pytest.skip("no C compiler: kernels not built")
    kernels.set_enabled(request.param)
    yield
    kernels.set_enabled(True)


def _rows(n: int, kvh: int = 3, d: int = 64, seed: int = 0) -> torch.Tensor:
    """Rows with magnitudes over several decades, one all-zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, kvh, d, generator=g) * torch.logspace(-3, 2, n)[:, None, None]
    x[n // 2] = 0
    return x


# ---- storage -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_round_trip_error_bounds(kv_dtype: str) -> None:
    x = _rows(40)
    values, scale = quantize(x, kv_dtype)
    y = dequantize(values, scale, torch.float32)
    err = (y - x).abs()
    if kv_dtype == "bfloat16":
        assert scale is None and values.dtype == torch.bfloat16
        bound = x.abs() * 2**-8  # 8 significant bits, round to nearest: half a unit in the last place
    else:
        amax = x.abs().amax(-1, keepdim=True)
        assert torch.equal(scale[20], torch.ones(3)), "an all-zero row stores zeros with scale 1"
        if kv_dtype == "int8":
            bound = amax / 254  # half a step of amax / 127
        else:
            bound = x.abs() * 2**-4 + amax / 448 * 2**-10  # 3 mantissa bits; subnormal steps of 2^-9 * scale
    assert (err <= bound * (1 + 1e-5)).all(), f"max excess {(err - bound).max().item()}"
    assert err.max() > 0, "8 or 16 bits cannot hold these rows exactly"
    assert torch.equal(y[20], torch.zeros(3, 64))


@pytest.mark.parametrize("kv_dtype", ["float32", *QUANTIZED])
def test_cache_write_then_gather_through_block_tables(kv_dtype: str) -> None:
    num_blocks, block_size = 8, 4
    cache = KVCache.allocate(num_blocks, block_size, 3, 64, kv_dtype, torch.device("cpu"))
    expected_bytes = num_blocks * block_size * memory.kv_cache_bytes_per_token(1, 3, 64, kv_dtype)
    assert cache.nbytes == expected_bytes, "the ledger's bytes per token per layer is what one layer allocates"
    k, v = _rows(10, seed=1), _rows(10, seed=2)
    slots = torch.tensor([5, 6, 7, 8, 9, 20, 21, 22, 23, 0])  # blocks 1, 2, 5 and slot 0 of block 0
    cache.write(k, v, slots)
    table = torch.tensor([[1, 2], [5, 0]])
    gk, gv = cache.gather(table, torch.float32)
    assert gk.shape == (2, 8, 3, 64)
    rk = dequantize(*quantize(k, kv_dtype), torch.float32)
    rv = dequantize(*quantize(v, kv_dtype), torch.float32)
    torch.testing.assert_close(gk[0, 1:6], rk[:5], atol=0, rtol=0)  # slot 5 is block 1 offset 1
    torch.testing.assert_close(gv[1, :4], rv[5:9], atol=0, rtol=0)
    torch.testing.assert_close(gk[1, 4], rk[9], atol=0, rtol=0)
    assert torch.equal(gk[0, 0], torch.zeros(3, 64)), "slots never written stay zero"


# ---- C kernels vs PyTorch ------------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
@pytest.mark.parametrize("tokens", [1, 9])
def test_rope_write_kv_kernel_writes_the_same_bytes(kv_dtype: str, tokens: int) -> None:
    from lmserve.config.engine import RopeConfig
    from lmserve.model.layers import RotaryEmbedding, apply_rotary

    heads, kv_heads, d, block_size = 6, 2, 32, 4
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), d, 64)
    cos, sin = rotary(torch.randperm(64)[:tokens], torch.float32)
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g) * 3
    q, k, v = (t.view(tokens, -1, d) for t in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
    slots = torch.randperm(8 * block_size, generator=g)[:tokens]
    ref = KVCache.allocate(8, block_size, kv_heads, d, kv_dtype, torch.device("cpu"))
    ref.write(apply_rotary(k, cos, sin), v, slots)
    out = KVCache.allocate(8, block_size, kv_heads, d, kv_dtype, torch.device("cpu"))
    q_expected = apply_rotary(q, cos, sin)
    kernels.rope_write_kv(q, k, v, cos.squeeze(1), sin.squeeze(1), out.k, out.v, slots, out.k_scale, out.v_scale)
    torch.testing.assert_close(q, q_expected, atol=1e-6, rtol=1e-6)
    # V is stored as given: identical bytes and scales. K is rotated first, and RoPE in C and in PyTorch may
    # differ in the last bit, which moves a stored value by one step in a rare element.
    assert torch.equal(out.v.view(torch.uint8), ref.v.view(torch.uint8)), "V written differently"
    k_same = (out.k.view(torch.uint8) == ref.k.view(torch.uint8)).float().mean().item()
    assert k_same > 0.99, f"only {k_same:.4f} of K's bytes agree"
    if ref.v_scale is not None:
        assert torch.equal(out.v_scale, ref.v_scale)
        torch.testing.assert_close(out.k_scale, ref.k_scale, atol=0, rtol=1e-6)


@needs_kernels
def test_fp8_encoder_matches_torch_on_every_code_and_every_tie() -> None:
    """Every e4m3 value, every midpoint between neighbours (round half to even) and values just beside them,
    written by the C kernel with scale 1 (a row whose amax is 448), against torch's float8_e4m3fn cast."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[codes.isfinite()].unique()  # sorted, -448 .. 448
    mids = (finite[1:] + finite[:-1]) / 2
    x = torch.cat([finite, mids, mids + 1e-7, mids - 1e-7, torch.tensor([1e-30, -3e-9])])
    d = 64
    n = -(-x.numel() // (d - 1))
    rows = torch.zeros(n * (d - 1))
    rows[: x.numel()] = x
    rows = torch.cat([torch.full((n, 1), 448.0), rows.view(n, d - 1)], dim=1).view(n, 1, d)  # amax 448: scale 1
    cache = KVCache.allocate(-(-n // 4), 4, 1, d, "fp8_e4m3", torch.device("cpu"))
    ones, zeros = torch.ones(n, d), torch.zeros(n, d)
    kernels.rope_write_kv(
        torch.zeros(n, 1, d), rows.clone(), rows, ones, zeros, cache.k, cache.v, torch.arange(n),
        cache.k_scale, cache.v_scale,
    )  # fmt: skip
    assert torch.equal(cache.v_scale.view(-1)[:n], torch.ones(n))
    got = cache.v.view(-1, d)[:n].float()
    expected = rows.view(n, d).to(torch.float8_e4m3fn).float()
    assert torch.equal(got, expected), f"{(got != expected).sum().item()} of {n * d} values differ"


def _decode_case(seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    b, h, kvh, d, block_size, num_blocks = 5, 8, 2, 64, 16, 128
    lens = torch.tensor([1, 17, 100, 255, 64])
    max_blocks = -(-int(lens.max()) // block_size)
    tables = torch.randperm(num_blocks, generator=g)[: b * max_blocks].view(b, max_blocks).contiguous()
    q = torch.randn(b, h, d, generator=g)
    k, v = (torch.randn(num_blocks * block_size, kvh, d, generator=g) for _ in range(2))
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), num_decode_tokens=b, decode_block_tables=tables,
        decode_context_lens=lens,
    )  # fmt: skip
    caches = {}
    for kv_dtype in ["float32", *QUANTIZED]:
        caches[kv_dtype] = KVCache.allocate(num_blocks, block_size, kvh, d, kv_dtype, torch.device("cpu"))
        caches[kv_dtype].write(k, v, torch.arange(num_blocks * block_size))
    return q, caches, meta


def _decode(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
    """Decode attention of plain layers (softmax scale 1/sqrt(head_dim), no window, no soft-capping)."""
    return _decode_attention(q, cache, meta, _Spec(q.shape[-1] ** -0.5))


# max / mean |output - float32 output| allowed on N(0, 1) K, V and q, head_dim 64, 1-255 tokens of history
ATTENTION_TOLERANCE = {"bfloat16": (0.01, 1e-3), "int8": (0.02, 4e-3), "fp8_e4m3": (0.1, 1.5e-2)}


@pytest.mark.parametrize("kernels_on_off", [True, False], indirect=True, ids=["kernel", "torch"])
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_decode_attention_vs_float32(kernels_on_off: None, kv_dtype: str) -> None:
    q, caches, meta = _decode_case()
    expected = _decode(q, caches["float32"], meta)
    out = _decode(q, caches[kv_dtype], meta)
    err = (out - expected).abs()
    max_tol, mean_tol = ATTENTION_TOLERANCE[kv_dtype]
    assert err.max() < max_tol and err.mean() < mean_tol, (err.max().item(), err.mean().item())
    assert err.max() > 0, "the quantized cache cannot be exact"


@needs_kernels
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_decode_kernel_matches_torch_path_on_the_same_cache(kv_dtype: str) -> None:
    q, caches, meta = _decode_case(seed=1)
    out = _decode(q, caches[kv_dtype], meta)
    kernels.set_enabled(False)
    try:
        expected = _decode(q, caches[kv_dtype], meta)
    finally:
        kernels.set_enabled(True)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kernels_on_off", [True, False], indirect=True, ids=["kernel", "torch"])
@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
@pytest.mark.parametrize("window", [1, 15, 16, 40])
def test_sliding_window_decode_reads_only_the_window(kernels_on_off: None, kv_dtype: str, window: int) -> None:
    """A sliding-window layer's decode (C kernel and PyTorch gather) reads from the first block inside the window:
    the table entries before it are -1 (freed blocks), which no gather or kernel could read. Same result as
    masking the whole history."""
    q, caches, _ = _decode_case(seed=2)
    cache, block_size = caches[kv_dtype], caches[kv_dtype].block_size
    lens = [1, 17, 100, 255, 64]
    g = torch.Generator().manual_seed(3)
    tables = [torch.randperm(128, generator=g)[: -(-n // block_size)].tolist() for n in lens]
    freed = [[-1] * (max(0, n - window) // block_size) + t[max(0, n - window) // block_size :]
             for t, n in zip(tables, lens, strict=True)]  # fmt: skip
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long))
    meta.set_decodes(lens, freed, block_size)
    out = _decode_attention(q, cache, meta, _Spec(q.shape[-1] ** -0.5, sliding_window=window))
    k_all = dequantize(cache.k, cache.k_scale, torch.float32).flatten(0, 1)  # (slots, KVH, D)
    v_all = dequantize(cache.v, cache.v_scale, torch.float32).flatten(0, 1)
    for b, n in enumerate(lens):
        slots = torch.tensor([tables[b][p // block_size] * block_size + p % block_size for p in range(n)])
        keep = slots[max(0, n - window) :]
        k, v = (x[keep].repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k_all, v_all))  # (n, H, D)
        scores = torch.einsum("hd,nhd->hn", q[b], k) * q.shape[-1] ** -0.5
        expected = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
        torch.testing.assert_close(out[b], expected, atol=2e-5, rtol=1e-4)


# ---- ledger and engine -----------------------------------------------------------------------------------------


def test_kv_cache_dtype_validation(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .* got 'int4'"):
        EngineArgs(str(llama_dir), kv_cache_dtype="int4").create_engine_config()
    auto = EngineArgs(str(llama_dir), num_kv_blocks=8).create_engine_config().cache
    assert auto.kv_cache_dtype == "float32" and auto.kv_scale_bytes_per_token == 0, "auto: the model dtype"


@pytest.mark.parametrize("kv_dtype,per_token,scales", [
    ("float32", 512, 0), ("bfloat16", 256, 0), ("int8", 160, 32), ("fp8_e4m3", 160, 32),
])  # fmt: skip
def test_pool_sized_by_the_ledger_per_dtype(
    llama_dir: Path, kv_dtype: str, per_token: int, scales: int, capsys: pytest.CaptureFixture[str]
) -> None:
    from lmserve.entrypoints.cli import main as cli_main

    # tiny llama: 2 layers x 2 KV heads x head_dim 16; 8-bit: + 2 (K, V) x 2 layers x 2 heads x 4 B of scales
    gib = 0.001
    llm = LLM(str(llama_dir), kv_cache_memory_gib=gib, block_size=8, kv_cache_dtype=kv_dtype, max_model_len=256)
    cache = llm.engine.config.cache
    assert cache.kv_bytes_per_token == per_token and cache.kv_scale_bytes_per_token == scales
    assert cache.num_blocks == memory.max_num_kv_blocks(int(gib * 2**30), 8, per_token)
    assert sum(c.nbytes for c in llm.engine.runner.kv_caches) == cache.pool_bytes, "ledger == allocation"
    assert all(c.kv_dtype == kv_dtype for c in llm.engine.runner.kv_caches)
    m = llm.get_metrics()
    assert m["kv_cache_dtype"] == kv_dtype and m["kv_cache_capacity_bytes"] == cache.pool_bytes
    assert m["kv_cache_scale_bytes_per_token"] == scales
    assert m["kv_cache_max_concurrent_requests"] == cache.num_blocks // (256 // 8)
    # `lmserve memory --kv-dtype` gives the same bytes per token and the same concurrency for the same budget
    assert cli_main([
        "memory", "--model", str(llama_dir), "--kv-dtype", kv_dtype, "--memory", str(int(gib * 2**30)),
        "--weight-dtype", "fp32", "--reserve", "0", "--seq-len", "256", "--block-size", "8", "--json",
    ]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert report["kv_bytes_per_token"] == per_token and report["kv_scale_bytes_per_token"] == scales
    weights = report["weight_bytes"]
    ledger = memory.max_num_kv_blocks(int(gib * 2**30) - weights, 8, per_token) // (256 // 8)
    assert report["max_concurrent_requests"] == ledger  # the CLI's budget also holds the weights


def test_same_memory_buys_2x_and_about_4x_the_blocks(llama_dir: Path) -> None:
    def num_blocks(kv_dtype: str) -> int:
        args = EngineArgs(str(llama_dir), kv_cache_memory_gib=0.01, kv_cache_dtype=kv_dtype)
        return args.create_engine_config().cache.num_blocks

    blocks = {d: num_blocks(d) for d in ("float32", "bfloat16", "int8")}
    assert blocks["bfloat16"] == 2 * blocks["float32"] or blocks["bfloat16"] == 2 * blocks["float32"] + 1
    # head_dim 16 makes the scales weigh 1/5 of an int8 token (160 B for 128 B of values): 3.2x here; the benchmark
    # model's head_dim 64 gives 46080 / 12240 = 3.76x
    assert 3.19 < blocks["int8"] / blocks["float32"] < 3.21
    fp32, int8 = (memory.kv_cache_bytes_per_token(30, 3, 64, d) for d in ("float32", "int8"))
    assert fp32 / int8 > 3.7


@pytest.mark.parametrize("name", sorted(MODEL_SPECS))
def test_bf16_kv_greedy_matches_hf_fp32_on_every_family(model_dirs: dict[str, Path], name: str) -> None:
    llm = LLM(str(model_dirs[name]), num_kv_blocks=64, kv_cache_dtype="bfloat16")
    matched = 0
    for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False):
        matched += assert_greedy_matches_hf_up_to_margin(
            model_dirs[name], out.prompt_token_ids, out.outputs[0].token_ids, FLIP_MARGIN["bfloat16"], name
        )
    # every flip above was a near-tie; the aggregate keeps flips rare (the tiny Phi-3, whose random weights leave
    # more near-ties, matched 89 of 120 tokens: one early flip)
    assert matched >= 0.7 * len(PROMPTS) * GREEDY.max_tokens, f"{name}: only {matched} tokens matched HF"


@pytest.mark.parametrize("kernels_on_off", [True, False], indirect=True, ids=["kernel", "torch"])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_chunked_prefill_prefix_cache_and_preemption_with_quantized_kv(
    llama_dir: Path, kernels_on_off: None, kv_dtype: str
) -> None:
    margin = FLIP_MARGIN[kv_dtype]

    def check(llm: LLM, prompts: list[str], max_tokens: int = 24) -> list:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        for out in outs:
            assert_greedy_matches_hf_up_to_margin(llama_dir, out.prompt_token_ids, out.outputs[0].token_ids, margin)
        return outs

    # chunked prefill: 8-token chunks read the earlier chunks back from the quantized cache
    chunked = LLM(str(llama_dir), num_kv_blocks=64, max_num_batched_tokens=8, block_size=4, kv_cache_dtype=kv_dtype)
    check(chunked, PROMPTS)
    # prefix caching: the shared blocks (values and scales) are reused
    cached = LLM(str(llama_dir), num_kv_blocks=128, block_size=4, kv_cache_dtype=kv_dtype)
    system = "You are a helpful assistant. Answer in one line.\nimport json\nimport os\n"
    check(cached, [system + "Q: what?"])
    outs = check(cached, [system + "Q: why not?", system + "Q: where"])
    assert all(o.num_cached_tokens >= 16 for o in outs), [o.num_cached_tokens for o in outs]
    # preemption: 6 requests need more than the 12-block pool; the recompute rewrites values and scales
    small = LLM(str(llama_dir), num_kv_blocks=12, block_size=16, kv_cache_dtype=kv_dtype)
    check(small, [f"Request number {i}: import json, os, sys" for i in range(6)], max_tokens=30)
    assert small.get_metrics()["num_preemptions_total"] > 0
    assert small.engine.kv.pool.num_free_blocks == 12


@torch.inference_mode()
def _hf_mean_logprob(model_dir: Path, prompt_ids: list[int], token_ids: list[int]) -> float:
    from tests.hf_reference import hf_model

    logprobs = hf_model(model_dir)(torch.tensor([prompt_ids + token_ids])).logits[0].log_softmax(-1)
    n = len(prompt_ids)
    return sum(logprobs[n - 1 + i, t].item() for i, t in enumerate(token_ids)) / len(token_ids)


def test_beam_search_with_int8_kv_scores_its_beams_right(model_dirs: dict[str, Path]) -> None:
    """With prefix caching every beam-search step reads the beams' history from the int8 cache. Beams are
    near-ties by construction, so the quantized search may keep a different beam than HF's (and end elsewhere);
    what must hold is that every beam it returns carries its true score: HF's float32 length-normalised
    log-prob of that very sequence, within the int8 perturbation."""
    path = model_dirs["llama-gqa"]
    llm = LLM(str(path), num_kv_blocks=256, block_size=4, kv_cache_dtype="int8")
    params = BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=1.0)
    outs = llm.beam_search(["The capital of France is", "def fib(n):", "x = 1"], params)
    for out in outs:
        assert len(out.sequences) == params.beam_width
        scores = [s.score for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        for seq in out.sequences:
            assert seq.score == pytest.approx(_hf_mean_logprob(path, out.prompt_token_ids, seq.token_ids), abs=0.02)
    m = llm.get_metrics()
    assert m["prefix_cache_hits_total"] > 3 * m["num_requests_total"], "beams' history comes from the cache"
    assert llm.engine.kv.pool.num_free_blocks == 256


# ---- held-out accuracy of the bundled model ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_heldout_perplexity_and_agreement_per_kv_dtype() -> None:
    """Teacher-forced scoring of >= 2000 held-out positions in 32-token chunks, so that every chunk after a
    window's first attends to earlier chunks read back from the (quantized) cache."""
    from lmserve.bench.accuracy import heldout_windows, score

    scores = {}
    for kv_dtype in ["float32", *QUANTIZED]:
        llm = LLM(kv_cache_dtype=kv_dtype, max_num_batched_tokens=32, num_kv_blocks=256)
        scores[kv_dtype] = score(llm, heldout_windows(llm, window=256, max_tokens=2100))
    ref = scores["float32"]
    assert ref.num_positions >= 2000
    report = {d: (round(s.perplexity, 3), round(s.agreement(ref), 4)) for d, s in scores.items()}
    print(f"held-out perplexity and greedy agreement with float32 KV over {ref.num_positions} positions: {report}")
    assert scores["bfloat16"].perplexity <= ref.perplexity * 1.002, report
    assert scores["int8"].perplexity <= ref.perplexity * 1.01, report
    assert scores["fp8_e4m3"].perplexity <= ref.perplexity * 1.02, report
    assert scores["bfloat16"].agreement(ref) >= 0.99 and scores["int8"].agreement(ref) >= 0.98, report
    assert scores["fp8_e4m3"].agreement(ref) >= 0.95, report
    assert scores["int8"].logprobs != ref.logprobs, "int8 KV must actually change the computation"
