"""The memory ledger on mixture-of-experts configs (model_shape.MoEShape, memory.py): total and active parameters
against the published figures, from config.json fields alone written into a model directory (no weights), expert
bytes per precision, KV per token, `lmserve memory` on them, and bad configs (ValueError naming the field)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmserve.checkpoint.shape import load_model_shape, model_shape_from_hf_config
from lmserve.memory.ledger import (
    expert_bytes,
    num_active_parameters,
    num_parameters,
    quantized_projection_bytes,
    weight_bytes_per_rank,
)
from lmserve.memory.report import memory_report

# The fields of the published config.json files that decide the counts (Hugging Face Hub, as downloaded).
CONFIGS = {
    "Qwen3-30B-A3B": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, max_position_embeddings=40960,
    ),
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088, intermediate_size=2880,
        num_local_experts=32, num_experts_per_tok=4, experts_per_token=4, attention_bias=True, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12, swiglu_limit=7.0, tie_word_embeddings=False,
        quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
    ),
    "Mixtral-8x7B": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, intermediate_size=14336,
        num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False, sliding_window=None,
    ),
    "OLMoE-1B-7B": dict(
        architectures=["OlmoeForCausalLM"], model_type="olmoe", hidden_size=2048, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, vocab_size=50304, intermediate_size=1024, num_experts=64,
        num_experts_per_tok=8, norm_topk_prob=False, tie_word_embeddings=False,
    ),
}  # fmt: skip

# (total, active) as published: Qwen's model card, OpenAI's gpt-oss model card (20.91B; 3.61B active, which leaves
# out the input embedding table: a token reads one row of it), Mistral's release, the OLMoE paper.
PUBLISHED = {
    "Qwen3-30B-A3B": (30.5e9, 3.3e9, True),
    "gpt-oss-20b": (20.91e9, 3.61e9, False),
    "Mixtral-8x7B": (46.7e9, 12.9e9, True),
    "OLMoE-1B-7B": (6.9e9, 1.3e9, True),
}


def _model_dir(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIGS[name]))
    return d


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_parameter_counts(tmp_path: Path, name: str) -> None:
    shape = load_model_shape(_model_dir(tmp_path, name))
    total, active, with_embeddings = PUBLISHED[name]
    assert shape.moe is not None
    assert num_parameters(shape) == pytest.approx(total, rel=0.02)
    assert num_active_parameters(shape, embeddings=with_embeddings) == pytest.approx(active, rel=0.02)


def test_qwen3_moe_count_by_hand() -> None:
    """Qwen3-30B-A3B's count from its parts, written out here (not through the ledger's helpers)."""
    shape = model_shape_from_hf_config(CONFIGS["Qwen3-30B-A3B"])
    h, layers, e, k, i = 2048, 48, 128, 8, 768
    attn = h * 4096 + 2 * h * 512 + 4096 * h + 2 * 128 + 2 * h  # q, k, v, o, q/k norms, the two layer norms
    expert = 3 * h * i
    embed = 2 * 151936 * h + h
    assert num_parameters(shape) == layers * (attn + e * expert + e * h) + embed
    assert num_active_parameters(shape) == layers * (attn + k * expert + e * h) + embed
    assert shape.moe.router.renormalize and shape.moe.router.scoring == "softmax_topk"


def test_expert_bytes_per_precision() -> None:
    shape = model_shape_from_hf_config(CONFIGS["Mixtral-8x7B"])
    h, i, n = 4096, 14336, 32 * 8  # experts in all layers
    assert expert_bytes(shape, "float32") == n * 3 * h * i * 4
    assert expert_bytes(shape, "bfloat16") == n * 3 * h * i * 2
    assert expert_bytes(shape, "int8") == n * (3 * h * i + 8 * (2 * i + h))  # + a scale and a row sum per row
    assert expert_bytes(shape, "int4") == n * (3 * h * i // 2 + 2 * (2 * i * h // 32 + h * i // 32))
    assert expert_bytes(shape, "mxfp4") == n * (3 * h * i // 2 + 3 * h * i // 32)
    with pytest.raises(ValueError, match="expert precision must be one of"):
        expert_bytes(shape, "fp8")


def test_quantized_weights_quantize_experts_not_the_router() -> None:
    shape = model_shape_from_hf_config(CONFIGS["OLMoE-1B-7B"])
    h, e, i, layers, v = 2048, 64, 1024, 16, 50304
    attn = [(h, h)] * 4
    q = sum(quantized_projection_bytes(o, kk, "int8") for o, kk in attn) + e * (
        2 * quantized_projection_bytes(i, h, "int8") + quantized_projection_bytes(h, i, "int8")
    )
    float_params = 2 * h + h + h + e * h  # layer norms, q norm (h), k norm (h), router
    head = quantized_projection_bytes(v, h, "int8")
    want = layers * (q + float_params * 2) + (v * h + h) * 2 + head  # bf16 rest: embeddings, final norm
    assert weight_bytes_per_rank(shape, 2, 1, "int8") == want


def test_gpt_oss_mxfp4_experts_stay_4_bit_in_the_ledger() -> None:
    shape = model_shape_from_hf_config(CONFIGS["gpt-oss-20b"])
    assert shape.moe.mxfp4 and shape.moe.expert_bias and shape.attention_sinks
    bf16 = num_parameters(shape) * 2
    mx = weight_bytes_per_rank(shape, 2)
    assert mx == bf16 - expert_bytes(shape, "bfloat16") + expert_bytes(shape, "mxfp4")
    assert 12e9 < mx < 14e9  # the ~13 GB the checkpoint takes


def test_report_and_kv_per_token(tmp_path: Path) -> None:
    shape = load_model_shape(_model_dir(tmp_path, "Qwen3-30B-A3B"))
    r = memory_report(shape, seq_len=1024, kv_dtype="bf16", name="Qwen3-30B-A3B")
    assert r.kv_bytes_per_token == 2 * 48 * 4 * 128 * 2
    assert r.num_active_parameters == num_active_parameters(shape)
    assert r.expert_bytes["int4"] == expert_bytes(shape, "int4")
    text = r.format_table()
    assert "active parameters" in text and "top-8 of 128 experts in 48 of 48 layers" in text


def test_memory_cli_on_a_moe_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.entrypoints.test_memory_cli import _run

    rc, out, err = _run(["--model", str(_model_dir(tmp_path, "Mixtral-8x7B")), "--json"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert d["num_parameters"] == pytest.approx(46.7e9, rel=0.02)
    assert d["num_active_parameters"] == pytest.approx(12.9e9, rel=0.02)


def test_dense_and_sparse_layers() -> None:
    cfg = dict(CONFIGS["Qwen3-30B-A3B"], mlp_only_layers=[0, 5], decoder_sparse_step=2)
    moe = model_shape_from_hf_config(cfg).moe
    assert moe.sparse_layers[:6] == (False, True, False, True, False, False)
    assert moe.num_sparse_layers == 23 and moe.dense_intermediate_size == 6144


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(model_type="deepseek_v3", n_routed_experts=8), "model_type='deepseek_v3'.*no router variant"),
        (dict(num_experts_per_tok=200), r"num_experts_per_tok \(200\) exceeds the 128 experts"),
        (dict(num_experts=0), "mixture-of-experts families|num_experts"),
        (dict(moe_intermediate_size=None), "moe_intermediate_size must be a positive integer"),
        (dict(norm_topk_prob="yes"), "norm_topk_prob must be true or false"),
        (dict(mlp_only_layers="0"), "mlp_only_layers must be a list"),
    ],
)
def test_bad_moe_configs_name_the_field(change: dict, match: str) -> None:
    cfg = dict(CONFIGS["Qwen3-30B-A3B"], **change)
    if change.get("num_experts") == 0:  # no expert field left: a dense config, which is fine
        assert model_shape_from_hf_config(cfg).moe is None
        return
    with pytest.raises(ValueError, match=match):
        model_shape_from_hf_config(cfg)


def test_memory_cli_answers_for_gpt_oss_from_its_config(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`lmserve memory --model` on a directory holding only gpt-oss-20b's config.json (its mxfp4 quantization_config
    included): the published 20.9 B total / 3.61 B active (without the embedding table), within 2 %."""
    from lmserve.entrypoints.cli import main

    assert main(["memory", "--model", str(_model_dir(tmp_path, "gpt-oss-20b")), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_parameters"] == pytest.approx(20.91e9, rel=0.02)
    shape = model_shape_from_hf_config(CONFIGS["gpt-oss-20b"])
    assert num_active_parameters(shape, embeddings=False) == pytest.approx(3.61e9, rel=0.02)
