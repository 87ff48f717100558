"""KV-cache memory ledger: textbook figures reproduced exactly, plus properties."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmserve.memory.ledger import (
    DTYPE_BYTES,
    ModelShape,
    dtype_bytes,
    format_bytes,
    kv_blocks_held,
    kv_bytes_per_token,
    kv_bytes_per_token_per_layer,
    kv_cache_bytes_per_token,
    kv_heads_per_rank,
    kv_scale_bytes_per_token,
    load_model_shape,
    max_concurrent_requests,
    max_num_kv_blocks,
    model_shape_from_hf_config,
    num_parameters,
    num_parameters_per_rank,
    parse_bytes,
)
from lmserve.memory.presets import PRESETS, get_preset
from lmserve.memory.report import memory_report

GiB = 2**30
KiB = 2**10


def llama2_7b() -> ModelShape:
    return get_preset("llama-2-7b").shape()


def llama3_8b() -> ModelShape:
    return get_preset("llama-3-8b").shape()


# --- dtypes and byte strings -------------------------------------------------------------------


def test_dtype_bytes_known_names() -> None:
    assert dtype_bytes("fp32") == dtype_bytes("float32") == 4
    assert dtype_bytes("bf16") == dtype_bytes("bfloat16") == 2
    assert dtype_bytes("fp16") == dtype_bytes("float16") == dtype_bytes("half") == 2
    assert dtype_bytes("fp8") == dtype_bytes("int8") == 1
    assert dtype_bytes("BF16") == dtype_bytes("torch.bfloat16") == 2
    for name in ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16", "half", "fp8", "int8"):
        assert name in DTYPE_BYTES


def test_dtype_bytes_unknown_lists_known_names() -> None:
    with pytest.raises(ValueError, match="fp4") as exc:
        dtype_bytes("fp4")
    assert "bf16" in str(exc.value) and "int8" in str(exc.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * 2**30),
        ("80GB", 80 * 10**9),
        ("80G", 80 * 2**30),  # bare G is binary
        ("80g", 80 * 2**30),
        ("80 GiB", 80 * 2**30),
        ("512KiB", 512 * 2**10),
        ("512KB", 512_000),
        ("512K", 512 * 2**10),
        ("1.5GiB", 3 * 2**29),
        ("1.5GB", 1_500_000_000),
        ("2MiB", 2 * 2**20),
        ("2MB", 2_000_000),
        ("1TiB", 2**40),
        ("1TB", 10**12),
        ("100", 100),
        ("100B", 100),
        ("0", 0),
        (".5KiB", 512),
        ("0.0001KB", 0),  # fractions of a byte round down
        (4096, 4096),
    ],
)
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "80XB", "eighty", "-5GiB", "1e9", "80 G iB", "1.2.3MB", "5 GiBs"])
def test_parse_bytes_rejects_bad_text(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid byte quantity") as exc:
        parse_bytes(bad)
    assert repr(bad) in str(exc.value)


@pytest.mark.parametrize("bad", [-1, True, 1.5, None])
def test_parse_bytes_rejects_bad_values(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_bytes(bad)  # type: ignore[arg-type]


def test_format_bytes() -> None:
    assert format_bytes(2 * GiB) == "2.00 GiB"
    assert format_bytes(512 * KiB) == "512.00 KiB"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(0) == "0 B"
    assert format_bytes(16 * GiB, binary=False) == "17.18 GB"
    assert format_bytes(-2 * GiB) == "-2.00 GiB"
    assert format_bytes(3 * 2**40) == "3.00 TiB"


@given(
    st.integers(min_value=0, max_value=2**50), st.sampled_from(["KiB", "MiB", "GiB", "KB", "MB", "GB", ""])
)
def test_parse_bytes_integer_times_unit(n: int, unit: str) -> None:
    factor = {"": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}[unit]
    assert parse_bytes(f"{n}{unit}") == n * factor


# --- model shape --------------------------------------------------------------------------------


def test_shape_from_hf_config_defaults() -> None:
    cfg = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 100,
    }
    s = model_shape_from_hf_config(cfg)
    assert s.num_kv_heads == 4  # defaults to num_attention_heads
    assert s.head_dim == 16  # hidden / heads
    assert s.tie_word_embeddings is False
    assert s.qkv_bias is False and s.qk_norm is False


def test_shape_from_hf_config_explicit_head_dim_and_null_head_dim() -> None:
    base = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 100,
    }
    assert model_shape_from_hf_config({**base, "head_dim": 32}).head_dim == 32
    assert model_shape_from_hf_config({**base, "head_dim": None}).head_dim == 16
    assert model_shape_from_hf_config({**base, "num_key_value_heads": None}).num_kv_heads == 4


def test_shape_from_hf_config_missing_fields_named() -> None:
    with pytest.raises(ValueError, match="num_hidden_layers") as exc:
        model_shape_from_hf_config({"hidden_size": 64, "num_attention_heads": 4})
    msg = str(exc.value)
    assert "intermediate_size" in msg and "vocab_size" in msg and "hidden_size" not in msg


TINY_CONFIG = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 100,
}


def test_shape_from_hf_config_bad_values() -> None:
    base = dict(TINY_CONFIG)
    with pytest.raises(ValueError, match="num_kv_heads"):
        model_shape_from_hf_config({**base, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="hidden_size"):
        model_shape_from_hf_config({**base, "hidden_size": 65})
    with pytest.raises(ValueError, match="num_hidden_layers"):
        model_shape_from_hf_config({**base, "num_hidden_layers": "32"})
    with pytest.raises(ValueError, match="num_local_experts"):
        model_shape_from_hf_config({**base, "num_local_experts": 8})
    with pytest.raises(ValueError, match="JSON object"):
        model_shape_from_hf_config([1, 2])  # type: ignore[arg-type]


def test_shape_from_hf_config_model_specific_flags() -> None:
    base = dict(TINY_CONFIG)
    qwen2 = model_shape_from_hf_config({**base, "model_type": "qwen2"})
    assert qwen2.qkv_bias and not qwen2.o_bias
    qwen3 = model_shape_from_hf_config({**base, "model_type": "qwen3"})
    assert qwen3.qk_norm and not qwen3.qkv_bias
    llama_bias = model_shape_from_hf_config({**base, "attention_bias": True, "mlp_bias": True})
    assert llama_bias.qkv_bias and llama_bias.o_bias and llama_bias.mlp_bias
    nested = model_shape_from_hf_config({"model_type": "llava", "text_config": base})
    assert nested.num_layers == 2


def test_load_model_shape_from_dir_and_file(tmp_path) -> None:
    cfg = dict(get_preset("llama-3-8b").config)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_model_shape(tmp_path) == llama3_8b()
    assert load_model_shape(tmp_path / "config.json") == llama3_8b()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        load_model_shape(tmp_path / "empty")
    with pytest.raises(ValueError, match="not found"):
        load_model_shape(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model_shape(tmp_path / "bad.json")
    (tmp_path / "partial.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        load_model_shape(tmp_path / "partial.json")


# --- parameter counts (public figures, exact) ---------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("llama-2-7b", 6_738_415_616),
        ("llama-3-8b", 8_030_261_248),
        ("llama-3.1-8b", 8_030_261_248),
        ("llama-3.1-70b", 70_553_706_496),
        ("mistral-7b", 7_241_732_096),
        ("qwen2.5-7b", 7_615_616_512),  # q/k/v bias
        ("qwen2.5-0.5b", 494_032_768),  # q/k/v bias, tied embeddings
        ("qwen3-0.6b", 596_049_920),  # q/k norm, tied embeddings, head_dim 128 != 1024/16
    ],
)
def test_num_parameters_matches_public_counts(preset: str, expected: int) -> None:
    assert num_parameters(get_preset(preset).shape()) == expected


def test_num_parameters_per_rank() -> None:
    s = llama2_7b()
    assert num_parameters_per_rank(s, 1) == num_parameters(s)
    # Everything but the norms (2 per layer + final) splits evenly across 2 ranks.
    norms = (2 * s.num_layers + 1) * s.hidden_size
    assert num_parameters_per_rank(s, 2) == (num_parameters(s) - norms) // 2 + norms
    with pytest.raises(ValueError, match="num_attention_heads"):
        num_parameters_per_rank(get_preset("qwen2.5-7b").shape(), 8)


# --- KV bytes (textbook figures, exact) ---------------------------------------------------------


def test_llama2_7b_kv_per_token_is_512_kib() -> None:
    s = llama2_7b()
    assert kv_bytes_per_token(s.num_layers, s.num_kv_heads, s.head_dim, 2) == 524_288 == 512 * KiB
    assert kv_bytes_per_token_per_layer(s.num_kv_heads, s.head_dim, 2) == 16 * KiB


def test_llama2_7b_request_and_batch() -> None:
    r = memory_report(llama2_7b(), seq_len=4096, batch=16)
    assert r.kv_bytes_per_token == 524_288
    assert r.kv_bytes_per_request == 2 * GiB
    assert r.kv_bytes_batch == 32 * GiB
    r8 = memory_report(llama2_7b(), seq_len=2048, batch=8)
    assert r8.kv_bytes_batch == 8 * GiB
    assert r.gqa_factor == 1.0 and r.mha_kv_bytes_per_token == r.kv_bytes_per_token


def test_llama2_7b_concurrency_on_80gb_with_5gb_reserve() -> None:
    r = memory_report(
        llama2_7b(),
        seq_len=4096,
        batch=16,
        memory_bytes=parse_bytes("80GB"),
        reserve_bytes=parse_bytes("5GB"),
    )
    assert r.weight_bytes == 13_476_831_232  # 6,738,415,616 params * 2 bytes (~13.5 GB)
    assert r.kv_budget_bytes_per_rank == 80 * 10**9 - 5 * 10**9 - 13_476_831_232 == 61_523_168_768
    assert r.num_kv_blocks == 61_523_168_768 // (16 * 524_288) == 7334
    assert r.max_kv_tokens == 7334 * 16 == 117_344
    print(f"Llama-2-7B, 80 GB - 5 GB reserve - bf16 weights: {r.max_concurrent_requests} x 4096 tokens")
    assert r.max_concurrent_requests == 28
    assert 28 <= r.max_concurrent_requests <= 31
    assert r.weights_fit and r.batch_fits


def test_llama3_8b_128k_context_is_16_gib_and_4x_smaller_than_mha() -> None:
    r = memory_report(llama3_8b(), seq_len=131072)
    assert r.kv_bytes_per_token == 128 * KiB
    assert r.kv_bytes_per_request == 16 * GiB == 17_179_869_184
    assert format_bytes(r.kv_bytes_per_request, binary=False) == "17.18 GB"
    assert r.mha_kv_bytes_per_token == 4 * r.kv_bytes_per_token
    assert r.gqa_factor == 4.0
    assert any("max_position_embeddings" in n for n in r.notes)  # Llama-3 (not 3.1) is 8k


def test_kv_dtypes_scale_linearly_and_8_bit_ones_pay_for_scales() -> None:
    s = llama3_8b()
    per = {
        d: memory_report(s, kv_dtype=d).kv_bytes_per_token for d in ("fp32", "bf16", "fp16", "fp8", "int8")
    }
    # int8 / fp8: one float32 scale per (token, KV head) for K and V: 2 * 32 layers * 8 KV heads * 4 B = 2 KiB
    scales = 2 * 32 * 8 * 4
    assert per == {
        "fp32": 256 * KiB, "bf16": 128 * KiB, "fp16": 128 * KiB, "fp8": 64 * KiB + scales, "int8": 64 * KiB + scales
    }  # fmt: skip
    r = memory_report(s, kv_dtype="int8")
    assert r.kv_scale_bytes_per_token == scales and memory_report(s, kv_dtype="bf16").kv_scale_bytes_per_token == 0
    assert "of which scales 2,048 B" in r.format_table()


def test_kv_cache_bytes_per_token_per_dtype() -> None:
    # the benchmark model's shape: 30 layers, 3 KV heads, head_dim 64
    assert kv_cache_bytes_per_token(30, 3, 64, "float32") == 2 * 30 * 3 * 64 * 4 == 46_080
    assert kv_cache_bytes_per_token(30, 3, 64, "bfloat16") == 23_040
    assert kv_cache_bytes_per_token(30, 3, 64, "int8") == 11_520 + 720
    assert kv_cache_bytes_per_token(30, 3, 64, "fp8_e4m3") == 11_520 + 720
    assert kv_scale_bytes_per_token(30, 3, "int8") == 720 and kv_scale_bytes_per_token(30, 3, "bfloat16") == 0
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        kv_cache_bytes_per_token(30, 3, 64, "int4")


def test_kv_bytes_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="num_layers"):
        kv_bytes_per_token(0, 8, 128, 2)
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv_bytes_per_token(32, -1, 128, 2)
    with pytest.raises(ValueError, match="dtype_bytes"):
        kv_bytes_per_token(32, 8, 128, 0)


# --- blocks and concurrency ---------------------------------------------------------------------


def test_blocks_round_up_per_request() -> None:
    per_token = 1000
    # 17 tokens hold 2 blocks of 16 = 32 tokens of KV.
    assert max_concurrent_requests(32_000 * 3, 17, per_token, 16) == 3
    assert max_concurrent_requests(32_000 * 3 - 1, 17, per_token, 16) == 2
    assert max_num_kv_blocks(16_000 * 5 + 15_999, 16, per_token) == 5
    assert max_num_kv_blocks(0, 16, per_token) == 0
    with pytest.raises(ValueError, match="budget_bytes"):
        max_num_kv_blocks(-1, 16, per_token)
    with pytest.raises(ValueError, match="block_size"):
        max_num_kv_blocks(100, 0, per_token)
    with pytest.raises(ValueError, match="seq_len"):
        max_concurrent_requests(100, 0, per_token)


@given(
    budget=st.integers(min_value=0, max_value=2**44),
    seq_len=st.integers(min_value=1, max_value=300_000),
    per_token=st.integers(min_value=1, max_value=2**21),
    block_size=st.sampled_from([1, 8, 16, 32, 128, 256]),
)
def test_max_concurrent_requests_is_tight(budget: int, seq_len: int, per_token: int, block_size: int) -> None:
    n = max_concurrent_requests(budget, seq_len, per_token, block_size)
    per_request = -(-seq_len // block_size) * block_size * per_token  # whole blocks
    assert n >= 0
    assert n * per_request <= budget < (n + 1) * per_request


@given(
    budget=st.integers(min_value=0, max_value=2**44),
    per_token=st.integers(min_value=1, max_value=2**21),
    block_size=st.integers(min_value=1, max_value=512),
)
def test_max_num_kv_blocks_is_tight(budget: int, per_token: int, block_size: int) -> None:
    n = max_num_kv_blocks(budget, block_size, per_token)
    assert n * block_size * per_token <= budget < (n + 1) * block_size * per_token


@given(
    preset=st.sampled_from(sorted(PRESETS)),
    seq_len=st.integers(min_value=1, max_value=200_000),
    batch=st.integers(min_value=1, max_value=512),
    memory_gib=st.integers(min_value=1, max_value=200),
)
def test_report_is_consistent(preset: str, seq_len: int, batch: int, memory_gib: int) -> None:
    s = get_preset(preset).shape()
    r = memory_report(s, seq_len=seq_len, batch=batch, memory_bytes=memory_gib * GiB)
    tokens = r.kv_tokens_per_request  # seq_len, or (all layers sliding) at most the window + a block
    assert tokens == seq_len or (r.kv_freed_outside_window and tokens < seq_len)
    assert r.kv_bytes_batch == r.kv_bytes_per_token * tokens * batch
    assert r.kv_bytes_per_token == s.num_layers * r.kv_bytes_per_token_per_layer
    assert r.mha_kv_bytes_per_token * s.num_kv_heads == r.kv_bytes_per_token * s.num_attention_heads
    assert r.max_concurrent_requests is not None and r.max_kv_tokens is not None
    assert r.max_kv_tokens >= r.max_concurrent_requests * tokens
    assert r.weights_fit == (r.weight_bytes <= memory_gib * GiB)
    assert r.batch_fits == (r.max_concurrent_requests >= batch)
    json.dumps(r.to_dict())


# --- tensor parallel ----------------------------------------------------------------------------


def test_kv_heads_per_rank() -> None:
    assert kv_heads_per_rank(8, 1) == 8
    assert kv_heads_per_rank(8, 2) == 4
    assert kv_heads_per_rank(8, 8) == 1
    assert kv_heads_per_rank(8, 16) == 1  # replicated: two ranks per KV head
    assert kv_heads_per_rank(2, 4) == 1
    with pytest.raises(ValueError, match="tp"):
        kv_heads_per_rank(8, 3)
    with pytest.raises(ValueError, match="tp"):
        kv_heads_per_rank(8, 0)


def test_tp_splits_kv_and_weights() -> None:
    s = llama3_8b()
    r1 = memory_report(s, seq_len=4096, batch=4, tp=1)
    r2 = memory_report(s, seq_len=4096, batch=4, tp=2)
    assert r2.kv_bytes_per_token == r1.kv_bytes_per_token  # model-level figure unchanged
    assert r2.kv_bytes_per_token_per_rank * 2 == r1.kv_bytes_per_token
    assert r2.kv_bytes_batch_per_rank * 2 == r1.kv_bytes_batch == r2.kv_bytes_batch_total
    assert r2.weight_bytes == r1.weight_bytes
    assert r1.weight_bytes / 2 < r2.weight_bytes_per_rank < r1.weight_bytes / 2 * 1.001


def test_tp_beyond_kv_heads_replicates() -> None:
    s = get_preset("llama-3.1-70b").shape()
    r = memory_report(s, seq_len=1024, tp=16)
    assert r.kv_heads_per_rank == 1
    assert r.kv_bytes_per_token_per_rank == r.kv_bytes_per_token // 8  # not // 16
    assert r.kv_bytes_batch_total == 2 * r.kv_bytes_batch  # each head held twice
    assert any("replicated" in n for n in r.notes)


def test_tp_raises_more_requests_per_device() -> None:
    s = get_preset("llama-3.1-70b").shape()
    one = memory_report(s, seq_len=8192, memory_bytes=80 * GiB, reserve_bytes=2 * GiB, tp=1)
    four = memory_report(s, seq_len=8192, memory_bytes=80 * GiB, reserve_bytes=2 * GiB, tp=4)
    assert not one.weights_fit and one.max_concurrent_requests == 0
    assert any("do not fit" in n for n in one.notes)
    assert four.weights_fit and four.max_concurrent_requests and four.max_concurrent_requests > 0


def test_report_validation() -> None:
    s = llama2_7b()
    with pytest.raises(ValueError, match="seq_len"):
        memory_report(s, seq_len=0)
    with pytest.raises(ValueError, match="batch"):
        memory_report(s, batch=0)
    with pytest.raises(ValueError, match="block_size"):
        memory_report(s, block_size=0)
    with pytest.raises(ValueError, match="reserve_bytes"):
        memory_report(s, memory_bytes=GiB, reserve_bytes=2 * GiB)
    with pytest.raises(ValueError, match="reserve_bytes"):
        memory_report(s, reserve_bytes=-1)
    with pytest.raises(ValueError, match="fp4"):
        memory_report(s, kv_dtype="fp4")
    with pytest.raises(ValueError, match="tp"):
        memory_report(s, tp=3)


def test_report_without_budget_has_no_budget_fields() -> None:
    r = memory_report(llama2_7b())
    assert r.memory_bytes is None and r.max_concurrent_requests is None and r.num_kv_blocks is None
    assert "memory budget" not in r.format_table()


def test_format_table_mentions_key_figures() -> None:
    r = memory_report(llama3_8b(), seq_len=131072, memory_bytes=80 * GiB)
    table = r.format_table()
    assert "8,030,261,248" in table
    assert "128.00 KiB" in table
    assert "16.00 GiB (17.18 GB)" in table
    assert "4× smaller" in table
    assert "max concurrent requests" in table


# --- presets --------------------------------------------------------------------------------------


def test_required_presets_exist() -> None:
    for name in ("llama-2-7b", "llama-3-8b", "llama-3.1-70b", "mistral-7b", "qwen2.5-7b", "qwen2.5-0.5b"):
        assert name in PRESETS
    q = get_preset("Qwen2.5-0.5B").shape()
    assert (q.num_layers, q.hidden_size, q.num_attention_heads, q.num_kv_heads) == (24, 896, 14, 2)
    assert q.tie_word_embeddings and q.qkv_bias and q.head_dim == 64


def test_unknown_preset_lists_known() -> None:
    with pytest.raises(ValueError, match="unknown preset 'gpt-5'") as exc:
        get_preset("gpt-5")
    assert "llama-2-7b" in str(exc.value) and "qwen2.5-0.5b" in str(exc.value)


# --- sliding windows ----------------------------------------------------------------------------


def _cfg(**overrides) -> dict:
    base = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=100)  # fmt: skip
    return {**base, **overrides}


def test_sliding_layers_read_as_the_engine_reads_them() -> None:
    mistral = model_shape_from_hf_config(_cfg(architectures=["MistralForCausalLM"], sliding_window=64))
    assert (mistral.sliding_window, mistral.num_sliding_layers, mistral.kv_free_window) == (64, 4, 64)
    q_all = _cfg(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=32, max_window_layers=0)
    assert model_shape_from_hf_config(q_all).kv_free_window == 32
    q_some = {**q_all, "max_window_layers": 2}  # layers 2, 3 slide: hybrid
    some = model_shape_from_hf_config(q_some)
    assert (some.num_sliding_layers, some.kv_free_window) == (2, None)
    q_off = {**q_all, "use_sliding_window": False}
    assert model_shape_from_hf_config(q_off).num_sliding_layers == 0
    gemma2 = model_shape_from_hf_config(_cfg(architectures=["Gemma2ForCausalLM"], sliding_window=16, head_dim=16))
    assert (gemma2.num_sliding_layers, gemma2.kv_free_window) == (2, None), "every 2nd layer is global"
    unknown = model_shape_from_hf_config(_cfg(sliding_window=64))  # no architectures: counted in full
    assert unknown.num_sliding_layers == 0


def test_all_sliding_model_counts_the_window_plus_a_block() -> None:
    s = get_preset("mistral-7b-v0.1").shape()
    assert s.kv_free_window == 4096
    r = memory_report(s, seq_len=32768, batch=4, block_size=16, kv_dtype="bf16", memory_bytes=24 * GiB)
    assert r.kv_freed_outside_window and r.blocks_per_request == 257 == kv_blocks_held(32768, 16, 4096)
    assert r.kv_tokens_per_request == 257 * 16
    assert r.kv_bytes_per_request == 128 * KiB * 257 * 16  # 32 layers x 8 KV heads x 128 x 2 B x 2 (K, V)
    assert r.max_concurrent_requests == r.num_kv_blocks // 257
    short = memory_report(s, seq_len=1000, block_size=16)  # shorter than the window: all of it
    assert short.kv_tokens_per_request == 1000 and short.blocks_per_request == 63
    text = r.format_table()
    assert "4,112 tokens held: sliding window 4,096 + a block" in text and "frees KV blocks outside" in text
    full = memory_report(get_preset("mistral-7b").shape(), seq_len=32768, block_size=16)  # v0.2: no window
    assert not full.kv_freed_outside_window and full.kv_tokens_per_request == 32768


def test_hybrid_model_counts_in_full_and_says_why() -> None:
    s = model_shape_from_hf_config(_cfg(architectures=["Gemma2ForCausalLM"], sliding_window=16, head_dim=16))
    r = memory_report(s, seq_len=1000, block_size=16)
    assert not r.kv_freed_outside_window and r.kv_tokens_per_request == 1000
    assert r.kv_bytes_per_request == r.kv_bytes_per_token * 1000
    assert any("2 of 4 layers slide" in n and "counted in full" in n for n in r.notes)


@given(
    window=st.integers(1, 40),
    block_size=st.sampled_from([1, 2, 4, 16]),
    seq_len=st.integers(1, 160),
    chunk=st.integers(1, 24),
)
def test_blocks_held_is_what_the_engine_holds(window: int, block_size: int, seq_len: int, chunk: int) -> None:
    """kv_blocks_held against KVCacheManager itself: a prefill in chunks of `chunk` tokens, then decode to seq_len
    tokens; the most blocks the request ever holds is at most the ledger's bound for that chunk, and exactly the
    decode figure once the decode phase is long enough to see every offset within a block."""
    from lmserve.core.kv_cache_manager import NULL_BLOCK, KVCacheManager
    from lmserve.request import Request
    from lmserve.sampling_params import SamplingParams

    kv = KVCacheManager(num_blocks=1000, block_size=block_size, sliding_window=window)
    prompt_len = max(1, seq_len // 2)
    req = Request("r", list(range(prompt_len)), SamplingParams(max_tokens=seq_len), max_tokens=seq_len)
    held_prefill = held_decode = 0
    while req.num_computed_tokens < seq_len:
        if req.num_computed_tokens >= prompt_len:
            req.append_output_token(1)
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        table = kv.allocate_slots(req, num_new)
        assert table is not None
        held = sum(b is not NULL_BLOCK for b in table)
        if num_new > 1 or req.num_computed_tokens < prompt_len:
            held_prefill = max(held_prefill, held)
        else:
            held_decode = max(held_decode, held)
        req.num_computed_tokens += num_new
    assert max(held_prefill, held_decode) <= kv_blocks_held(seq_len, block_size, window, chunk)
    assert held_decode <= kv_blocks_held(seq_len, block_size, window)
    if seq_len - prompt_len >= window + 2 * block_size:
        assert held_decode == kv_blocks_held(seq_len, block_size, window), "the decode bound is reached"


def test_report_takes_the_lora_slots_from_the_budget() -> None:
    """--enable-lora: the slots' bytes (memory.lora_slot_bytes, per layer and slot: A's parts · rank rows of each
    projection's input, the block-diagonal B's columns of its output) come out of the budget before the KV."""
    from lmserve.memory.ledger import lora_slot_bytes

    shape = get_preset("llama-3-8b").shape()
    h, q, kv, inter = 4096, 4096, 1024, 14336
    per_layer_slot = (3 * 64 * h + (q + 2 * kv) * 3 * 64) + (64 * q + h * 64) + (2 * 64 * h + 2 * inter * 2 * 64) + (
        64 * inter + h * 64)  # fmt: skip
    slots = lora_slot_bytes(32, h, q, kv, inter, 4, 64, 2)
    assert slots == 32 * 4 * per_layer_slot * 2
    base = memory_report(shape, memory_bytes=80 * 2**30)
    lora = memory_report(shape, memory_bytes=80 * 2**30, max_loras=4, max_lora_rank=64)
    assert lora.lora_slot_bytes == slots and base.lora_slot_bytes == 0
    assert lora.kv_budget_bytes_per_rank == base.kv_budget_bytes_per_rank - slots
    assert lora.num_kv_blocks == max_num_kv_blocks(base.kv_budget_bytes_per_rank - slots, 16, lora.kv_bytes_per_token)
    assert "LoRA slots (bf16)" in lora.format_table() and "LoRA slots" not in base.format_table()
    assert json.loads(json.dumps(lora.to_dict()))["max_lora_rank"] == 64
    fp32 = memory_report(shape, max_loras=4, max_lora_rank=64, lora_dtype="fp32")
    assert fp32.lora_slot_bytes == 2 * slots
    assert any("not sharded" in n for n in memory_report(shape, tp=2, max_loras=1).notes)
    with pytest.raises(ValueError, match="max_lora_rank"):
        memory_report(shape, max_loras=1, max_lora_rank=0)
