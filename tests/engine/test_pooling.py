"""The pooling runner (LLM.embed) against HF's pooling of the same tiny random Qwen3 models to 1e-5: last-token
+ L2 (sentence-transformers files), mean pooling across prefill chunks, a headless Qwen3Model picked by
--runner auto, Matryoshka dimensions, prefix-cache hits; and the runner refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmserve import LLM, SamplingParams
from lmserve.config.engine import EngineArgs
from tests.pooling_helpers import build_embedding_model, build_headless_model, hf_embeddings

TEXTS = ["The capital of France is Paris.", "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 2,
         "emoji 🙂🚀 and accents: café", "x"]  # fmt: skip
KW = {"num_kv_blocks": 64, "max_num_batched_tokens": 24}  # the long prompt is computed in chunks


def close(ours: list[list[float]], ref: list[torch.Tensor]) -> None:
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(torch.tensor(a), b, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def last_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_embedding_model(tmp_path_factory.mktemp("emb-last"), tokenizer_dir, "last", normalize=True)


def test_last_token_normalized_equals_hf_with_chunks_batches_and_cache_hits(last_dir: Path) -> None:
    llm = LLM(str(last_dir), **KW)
    assert llm.engine.config.runner == "pooling"
    ids = [llm.get_tokenizer().encode(t) for t in TEXTS]
    assert max(map(len, ids)) > KW["max_num_batched_tokens"]
    close(llm.embed(TEXTS), hf_embeddings(last_dir, ids, "last", True))
    again = llm.embed([TEXTS[1], ids[0]])  # the long prompt's blocks are cached now; token ids as a prompt
    assert llm.engine.get_metrics()["prefix_cache_hits_total"] > 0
    close(again, hf_embeddings(last_dir, [ids[1], ids[0]], "last", True))
    close(llm.embed(TEXTS[:2], dimensions=16), hf_embeddings(last_dir, ids[:2], "last", True, dimensions=16))
    with pytest.raises(ValueError, match="runner"):
        llm.generate("hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed("x", dimensions=65)


def test_mean_pooling_over_chunks_equals_hf(tmp_path: Path, tokenizer_dir: Path) -> None:
    model_dir = build_embedding_model(tmp_path / "m", tokenizer_dir, "mean", normalize=False, seed=2)
    llm = LLM(str(model_dir), **KW)
    ids = [llm.get_tokenizer().encode(t) for t in TEXTS]
    close(llm.embed(TEXTS), hf_embeddings(model_dir, ids, "mean", False))
    close(llm.embed(TEXTS[1]), hf_embeddings(model_dir, ids[1:2], "mean", False))  # no cache hit may skip rows


def test_headless_checkpoint_runs_pooling_under_auto(tmp_path: Path, tokenizer_dir: Path) -> None:
    model_dir = build_headless_model(tmp_path / "h", tokenizer_dir)
    llm = LLM(str(model_dir), **KW)
    assert llm.engine.config.runner == "pooling" and llm.engine.config.model.architecture == "Qwen3Model"
    ids = [llm.get_tokenizer().encode(t) for t in TEXTS]
    close(llm.embed(TEXTS), hf_embeddings(model_dir, ids, "last", True))
    with pytest.raises(ValueError, match="no LM head"):
        EngineArgs.from_kwargs(str(model_dir), runner="generate", num_kv_blocks=8).create_engine_config()


def test_generate_runner_refuses_embed(llama_dir: Path, last_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=16)
    assert llm.engine.config.runner == "generate"
    with pytest.raises(ValueError, match="runner"):
        llm.embed("hello")
    cfg = EngineArgs.from_kwargs(str(last_dir), runner="generate", num_kv_blocks=8).create_engine_config()
    assert cfg.runner == "generate" and cfg.pooler is None
    with pytest.raises(ValueError, match="pooler_config"):
        EngineArgs.from_kwargs(str(last_dir), pooler_config={"pooling": "x"}, num_kv_blocks=8).create_engine_config()
