from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import build_model, train_tokenizer

# Tests that count kernel calls need the C kernel on the few-row path, not a choice timed on a busy machine;
# tests/model/test_small_m_linear.py sets the other modes itself.
os.environ.setdefault("LMSERVE_SMALL_M_LINEAR", "kernel")

MODEL_SPECS = {
    "llama-gqa": ("llama", {}),
    "llama3-rope-untied": (
        "llama",
        {
            "tie_word_embeddings": False,
            "num_key_value_heads": 1,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "mistral": ("mistral", {"sliding_window": None, "num_key_value_heads": 4}),
    # sliding windows shorter than the prompts and generations, so positions fall out of the window
    "mistral-swa": ("mistral", {"sliding_window": 12}),
    "qwen2-swa": ("qwen2", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1}),
    "gemma2": (
        "gemma2",
        {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 12, "attn_logit_softcapping": 5.0,
         "final_logit_softcapping": 8.0},
    ),  # fmt: skip
    "gemma3": (
        "gemma3",
        {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 12,
         "layer_types": ["sliding_attention", "full_attention"],
         "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}},
    ),  # fmt: skip
    "phi3-longrope-partial": (
        "phi3",
        {"partial_rotary_factor": 0.75, "pad_token_id": 0,
         "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 512,
                             "factor": 4.0, "short_factor": [1.0 + 0.1 * i for i in range(6)],
                             "long_factor": [2.0 + 0.5 * i for i in range(6)]}},
    ),  # fmt: skip
    "olmo2": ("olmo2", {"pad_token_id": 0}),
    # the dense families of 2026: NoPE layers; sliding layers by layer_types with their own rotary; Gemma 4's
    # wider global heads with keys as values (one KV head), proportional rotary, KV shared by the last two layers,
    # double-wide MLPs there, per-layer inputs
    "smollm3": ("smollm3", {"num_hidden_layers": 4, "pad_token_id": 0}),
    "olmo3": (
        "olmo3",
        {"num_hidden_layers": 4, "sliding_window": 12, "pad_token_id": 0,
         "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}}},
    ),  # fmt: skip
    "gemma4": (
        "gemma4",
        {"num_hidden_layers": 4, "head_dim": 16, "global_head_dim": 32, "sliding_window": 12, "pad_token_id": 0,
         "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
         "attention_k_eq_v": True, "num_global_key_value_heads": 1, "num_kv_shared_layers": 2,
         "use_double_wide_mlp": True, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 512,
         "final_logit_softcapping": 8.0},
    ),  # fmt: skip
}


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        name: build_model(root / name, family, tokenizer_dir, **overrides)
        for name, (family, overrides) in MODEL_SPECS.items()
    }


@pytest.fixture(scope="session")
def llama_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama-gqa"]


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """For modules whose engine runs beside HTTP/test threads: two intra-op threads on a busy 2-core
    machine spin against them (~20x slower steps). Use with pytest.mark.usefixtures("one_torch_thread")."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def hybrid_dirs(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    """Tiny hybrid checkpoints by family (tests/hybrid_helpers.py), each built on first use."""
    from tests.hybrid_helpers import HybridDirs

    return HybridDirs(tmp_path_factory.mktemp("hybrid"), tokenizer_dir)


@pytest.fixture(scope="session")
def moe_dir_of(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path):  # noqa: ANN201
    """family → its tiny MoE checkpoint (tests/hf/test_moe_models.py's families and gpt_oss), built on first use."""
    from tests.hf.test_gpt_oss import build_gpt_oss
    from tests.hf.test_moe_models import build_moe_model

    root, built = tmp_path_factory.mktemp("moe"), {}

    def get(family: str) -> Path:
        if family not in built:
            out = root / family
            built[family] = (build_gpt_oss(out, tokenizer_dir) if family == "gpt_oss"
                             else build_moe_model(out, family, tokenizer_dir))  # fmt: skip
        return built[family]

    return get
