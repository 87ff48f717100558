from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import build_model, train_tokenizer

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
