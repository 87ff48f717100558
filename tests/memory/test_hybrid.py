"""The hybrid ledger from configs alone: Qwen3.5-9B and Qwen3-Next-80B-A3B's published shapes (layers, linear /
full split, KV per token), the state per sequence, parameter counts against HF, and the pool split the engine
sizes its KV blocks and state slots with (agreeing with the state tensors to the byte)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf35

from lmserve.checkpoint.shape import linear_attention_layers, model_shape_from_hf_config
from lmserve.memory import ledger as memory
from lmserve.memory.report import memory_report
from lmserve.worker.state_cache import StateCache

# Qwen/Qwen3.5-9B's config.json (text part): a multimodal checkpoint, the decoder under text_config
QWEN3_5_9B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 248320,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8,
    },
}  # fmt: skip
# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json: no layer_types, a full-attention layer every 4th
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "num_experts": 512, "num_experts_per_tok": 10, "vocab_size": 151936, "intermediate_size": 5120,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "norm_topk_prob": True,
}  # fmt: skip


def test_qwen3_5_9b_split_kv_and_state() -> None:
    shape = model_shape_from_hf_config(QWEN3_5_9B)
    assert (shape.num_layers, shape.num_linear_layers, shape.num_kv_layers) == (32, 24, 8)
    # 8 full-attention layers x K and V x 4 KV heads x 256 x 2 bytes: 32 KiB a token (a dense 32-layer model: 128)
    assert memory.kv_cache_bytes_per_token(shape.num_kv_layers, shape.num_kv_heads, shape.head_dim, "bf16") == 32768
    report = memory_report(shape, seq_len=4096, kv_dtype="bf16")
    assert report.kv_bytes_per_token == 32768
    # 24 layers x (conv window 8192 x 3 + 32 heads x 128 x 128) x 4 bytes
    assert report.state_bytes_per_sequence == 24 * (8192 * 3 + 32 * 128 * 128) * 4 == 52_690_944


def test_qwen3_next_80b_split_kv_and_parameters() -> None:
    linear, is_linear = linear_attention_layers(QWEN3_NEXT_80B, 48)
    assert [i for i, x in enumerate(is_linear) if not x] == list(range(3, 48, 4)), "every 4th layer: full attention"
    shape = model_shape_from_hf_config(QWEN3_NEXT_80B)
    assert (shape.num_layers, shape.num_linear_layers, shape.num_kv_layers) == (48, 36, 12)
    report = memory_report(shape, kv_dtype="bf16")
    assert report.kv_bytes_per_token == 24576  # 12 layers x K, V x 2 KV heads x 256 x 2 bytes: 24 KiB a token
    assert report.state_bytes_per_sequence == 36 * (8192 * 3 + 32 * 128 * 128) * 4
    # published: 80B total, 3B activated (here with the 0.3B LM head a step streams)
    assert 79e9 < memory.num_parameters(shape) < 82e9
    assert 3.0e9 < memory.num_active_parameters(shape, embeddings=False) < 3.7e9


def test_a_dense_config_has_no_linear_layers() -> None:
    cfg = dict(QWEN3_5_9B["text_config"])
    for key in [k for k in cfg if k.startswith("linear_") or k == "layer_types"]:
        del cfg[key]
    shape = model_shape_from_hf_config(cfg)
    assert shape.linear is None and shape.num_kv_layers == 32
    assert memory.linear_state_bytes_per_sequence(shape) == 0


def test_bad_linear_fields_are_value_errors() -> None:
    bad = dict(QWEN3_5_9B["text_config"], linear_num_value_heads=24)  # not a multiple of 16 key heads
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        model_shape_from_hf_config(bad)
    with pytest.raises(ValueError, match="layer_types"):
        model_shape_from_hf_config(dict(QWEN3_5_9B["text_config"], layer_types=["mamba"] * 32))


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_matches_hf(tied: bool) -> None:
    cfg = hf35.Qwen3_5TextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=6, linear_conv_kernel_dim=3, tie_word_embeddings=tied,
    )  # fmt: skip
    with torch.device("meta"):
        model = hf35.Qwen3_5ForCausalLM(cfg)
    expected = sum(p.numel() for p in model.parameters())  # a tied head is one parameter
    shape = model_shape_from_hf_config(cfg.to_dict())
    assert memory.num_parameters(shape) == expected


def test_pool_split_fits_the_budget_and_agrees_with_the_state_tensors() -> None:
    shape = model_shape_from_hf_config(dict(QWEN3_5_9B["text_config"], num_hidden_layers=4,
                                            layer_types=["linear_attention"] * 3 + ["full_attention"]))  # fmt: skip
    state = memory.linear_state_bytes_per_sequence(shape)
    kv = memory.kv_cache_bytes_per_token(shape.num_kv_layers, shape.num_kv_heads, shape.head_dim, "float32")
    budget = 10 * state + 1000 * 16 * kv + 123
    blocks, slots = memory.hybrid_pool_split(budget, 16, kv, state, max_num_seqs=256)
    assert blocks * 16 * kv + slots * state <= budget < (blocks + 1) * 16 * kv + slots * state
    assert slots <= 256 and slots * (state + 16 * kv) <= budget < (slots + 1) * (state + 16 * kv) + 16 * kv
    assert memory.hybrid_pool_split(budget, 16, kv, state, max_num_seqs=4)[1] == 4, "max_num_seqs caps the slots"
    cache = StateCache(shape.linear, shape.num_linear_layers, num_slots=3)
    assert cache.nbytes == 3 * state  # the worker's tensors hold the ledger's bytes exactly
    report = memory_report(shape, seq_len=1000, kv_dtype="float32", weight_dtype="float32",
                           memory_bytes=budget + 10**9, reserve_bytes=10**9 - 0)  # fmt: skip
    snapshots, left = memory.state_snapshot_split(report.kv_budget_bytes_per_rank, state)
    assert report.num_state_snapshots == snapshots == report.kv_budget_bytes_per_rank // 8 // state
    assert (report.num_kv_blocks, report.num_state_slots) == memory.hybrid_pool_split(left, 16, kv, state, 256)
    assert report.max_concurrent_requests == min(report.num_state_slots, report.num_kv_blocks // 63)


def test_concurrent_sequences_at_a_context_length() -> None:
    per_seq = 4 * 16 * 100 + 5000  # 50 tokens -> 4 blocks of 16 at 100 B a token, plus the state
    assert memory.max_concurrent_sequences(7 * per_seq + per_seq - 1, 50, 100, 5000, 16) == 7
    assert memory.max_concurrent_sequences(7 * per_seq, 50, 100, 5000, 16) == 7
    assert memory.max_concurrent_sequences(per_seq - 1, 50, 100, 5000, 16) == 0
