"""Tiny random HF models and a locally trained byte-level BPE tokenizer, built from configs (no downloads)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

CORPUS_FILES = ("collections/__init__.py", "argparse.py", "textwrap.py", "json/decoder.py")

EXTRA_TEXT = [
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "床前明月光，疑是地上霜。举头望明月，低头思故乡。",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "emoji 🙂🚀 and accents: café, naïve, Zürich.",
]


def train_tokenizer(out_dir: Path, vocab_size: int = 512) -> None:
    """Byte-level BPE trained on Python's own stdlib sources, saved so AutoTokenizer loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sys.modules["os"].__file__).parent
    texts = [(stdlib / f).read_text(encoding="utf-8") for f in CORPUS_FILES] + EXTRA_TEXT * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(out_dir)


def build_model(out_dir: Path, family: str, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A tiny randomly initialised HF model of the given family, saved with its tokenizer."""
    import shutil

    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        Gemma4ForCausalLM,
        Gemma4TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Olmo2Config,
        Olmo2ForCausalLM,
        Olmo3Config,
        Olmo3ForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        SmolLM3Config,
        SmolLM3ForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "gemma2": (Gemma2Config, Gemma2ForCausalLM),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
        "phi3": (Phi3Config, Phi3ForCausalLM),
        "olmo2": (Olmo2Config, Olmo2ForCausalLM),
        "smollm3": (SmolLM3Config, SmolLM3ForCausalLM),
        "olmo3": (Olmo3Config, Olmo3ForCausalLM),
        "gemma4": (Gemma4TextConfig, Gemma4ForCausalLM),
    }
    config_cls, model_cls = classes[family]
    kwargs = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=0,
        bos_token_id=None,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out_dir / f.name)
    return out_dir


def require_extra(extra: str, *modules: str) -> None:
    """Skip the calling test module when an optional extra (`pip install 'lmserve[EXTRA]'`) is not installed, or
    fail it when LMSERVE_REQUIRE_EXTRAS=1 (as CI sets: there a missing extra is an install bug, not a skip)."""
    import importlib.util
    import os

    import pytest

    def absent(module: str) -> bool:
        # find_spec("a.b") imports "a" first, and raises ModuleNotFoundError when "a" itself is absent
        try:
            return importlib.util.find_spec(module) is None
        except ImportError:  # ModuleNotFoundError, or a parent set to None in sys.modules
            return True

    missing = [m for m in modules if absent(m)]
    if not missing:
        return
    message = f"the {extra!r} extra is not installed (missing {', '.join(missing)}): pip install 'lmserve[{extra}]'"
    if os.environ.get("LMSERVE_REQUIRE_EXTRAS") == "1":
        pytest.fail(f"LMSERVE_REQUIRE_EXTRAS=1 but {message}", pytrace=False)
    pytest.skip(message, allow_module_level=True)


@contextmanager
def steps_held_after_first(engine: Any) -> Iterator[threading.Event]:
    """`engine.step` (an LLMEngine's): the first call runs, every later one waits until the yielded event is set.
    A request is then mid-generation by construction while the test acts (cancels, disconnects, adds a duplicate),
    however fast the machine: at most the step under way when it is released runs before the engine sees the act.
    The real step is restored on exit."""
    release, real_step, num_calls = threading.Event(), engine.step, [0]

    def held_step() -> Any:
        num_calls[0] += 1
        if num_calls[0] > 1:
            assert release.wait(60), "the test never released the held steps"
        return real_step()

    engine.step = held_step
    try:
        yield release
    finally:
        release.set()
        engine.step = real_step
