"""The pooling endpoints against HF on tiny random Qwen3 models, with real clients: `openai`'s embeddings (base64 by
default, floats, token ids, dimensions), LangChain's OpenAIEmbeddings, `ollama`'s embed; /rerank and /score equal to
HF's cosine similarities (an embedding model) and to HF's p(yes) at the last position (a yes/no scorer); and the
400s that name the runner, both ways."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from fastapi import FastAPI

from lmserve.config.engine import EngineArgs
from lmserve.engine.async_engine import AsyncEngine
from lmserve.engine.llm_engine import LLMEngine
from lmserve.entrypoints.openai.server import build_app
from tests.helpers import build_model, require_extra
from tests.pooling_helpers import build_embedding_model, hf_embeddings

require_extra("test", "ollama", "langchain_openai")
import ollama  # noqa: E402
from langchain_openai import OpenAIEmbeddings  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAME = "emb"
DOCS = ["Paris is the capital of France.", "The quick brown fox.", "def fib(n): return n", "café"]
QUERY = "capital of France"


def serve(model_dir: Path, **kw: Any) -> Iterator[tuple[FastAPI, AsyncEngine]]:
    engine = AsyncEngine(LLMEngine.from_engine_args(EngineArgs.from_kwargs(str(model_dir), num_kv_blocks=64, **kw)))
    yield build_app(engine, served_model_name=NAME), engine
    engine.shutdown()


@pytest.fixture(scope="module")
def emb_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_embedding_model(tmp_path_factory.mktemp("emb"), tokenizer_dir, "last", normalize=True)


@pytest.fixture(scope="module")
def emb(emb_dir: Path) -> Iterator[tuple[FastAPI, AsyncEngine]]:
    yield from serve(emb_dir)


def run(app: FastAPI, fn) -> Any:
    async def main() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await fn(http, transport)

    return asyncio.run(main())


def post(app: FastAPI, path: str, body: dict[str, Any]) -> httpx.Response:
    return run(app, lambda http, _: http.post(path, json=body))


def ids_of(engine: AsyncEngine, texts: list[str]) -> list[list[int]]:
    return [engine.tokenizer.encode(t) for t in texts]


def close(ours: list[list[float]], ref: list[torch.Tensor]) -> None:
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(torch.tensor(a, dtype=torch.float32), b, atol=1e-5, rtol=1e-5)


def test_openai_client_embeddings_equal_hf(emb: tuple[FastAPI, AsyncEngine], emb_dir: Path) -> None:
    app, engine = emb
    ids = ids_of(engine, DOCS)

    async def go(http: httpx.AsyncClient, _: Any) -> tuple[Any, ...]:
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
        default = await client.embeddings.create(model=NAME, input=DOCS)  # the client asks for base64
        floats = await client.embeddings.create(model=NAME, input=ids[0], encoding_format="float", dimensions=16)
        return default, floats

    default, floats = run(app, go)
    close([d.embedding for d in default.data], hf_embeddings(emb_dir, ids, "last", True))
    assert [d.index for d in default.data] == [0, 1, 2, 3]
    assert default.usage.prompt_tokens == default.usage.total_tokens == sum(map(len, ids))
    close([floats.data[0].embedding], hf_embeddings(emb_dir, ids[:1], "last", True, dimensions=16))


def test_langchain_and_ollama_clients(emb: tuple[FastAPI, AsyncEngine], emb_dir: Path) -> None:
    app, engine = emb
    ref = hf_embeddings(emb_dir, ids_of(engine, DOCS), "last", True)

    async def go(http: httpx.AsyncClient, transport: Any) -> tuple[Any, Any]:
        lc = OpenAIEmbeddings(model=NAME, base_url="http://test/v1", api_key="x", check_embedding_ctx_length=False,
                              http_async_client=http, max_retries=0)  # fmt: skip
        docs = await lc.aembed_documents(DOCS)
        client = ollama.AsyncClient(host="http://test", transport=transport)
        return docs, await client.embed(model=NAME, input=DOCS)

    docs, ollama_out = run(app, go)
    close(docs, ref)
    close([list(e) for e in ollama_out.embeddings], ref)
    assert ollama_out.prompt_eval_count == sum(map(len, ids_of(engine, DOCS)))


def test_rerank_and_score_are_hf_cosines(emb: tuple[FastAPI, AsyncEngine], emb_dir: Path) -> None:
    app, engine = emb
    vecs = hf_embeddings(emb_dir, ids_of(engine, [QUERY, *DOCS]), "last", True)
    cos = [float(vecs[0] @ v) for v in vecs[1:]]
    want = sorted(range(len(DOCS)), key=lambda i: -cos[i])
    for path in ("/rerank", "/v1/rerank"):
        r = post(app, path, {"model": NAME, "query": QUERY, "documents": DOCS, "top_n": 3})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == want[:3]
        assert [x["document"]["text"] for x in results] == [DOCS[i] for i in want[:3]]
        assert [x["relevance_score"] for x in results] == pytest.approx([cos[i] for i in want[:3]], abs=1e-5)
    r = post(app, "/rerank", {"query": QUERY, "documents": [{"text": d} for d in DOCS], "return_documents": False})
    assert [x["index"] for x in r.json()["results"]] == want and "document" not in r.json()["results"][0]
    r = post(app, "/score", {"model": NAME, "text_1": QUERY, "text_2": DOCS})
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(cos, abs=1e-5)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": "x", "dimensions": 65}, "dimensions"),
        ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ("/v1/embeddings", {"input": "x", "model": "other"}, "model"),
        ("/rerank", {"query": "x", "documents": []}, "documents"),
        ("/rerank", {"query": "x", "documents": ["a"], "top_n": 0}, "top_n"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ],
)
def test_pooling_refusals(emb: tuple[FastAPI, AsyncEngine], path: str, body: dict, param: str) -> None:
    r = post(emb[0], path, body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_generation_on_a_pooling_server_names_the_runner(emb: tuple[FastAPI, AsyncEngine]) -> None:
    r = post(emb[0], "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"], r.text
    r = post(emb[0], "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400 and "runner" in r.json()["error"]["message"]
    r = post(emb[0], "/api/generate", {"model": NAME, "prompt": "hi", "raw": True})
    assert r.status_code == 400 and "runner" in r.json()["error"]
    shown = post(emb[0], "/api/show", {"model": NAME}).json()
    assert shown["capabilities"] == ["embedding"]


def test_embeddings_on_a_generate_server_name_the_runner(llama_dir: Path) -> None:
    for app, _ in serve(llama_dir):
        r = post(app, "/v1/embeddings", {"input": "hi"})
        assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"], r.text
        r = post(app, "/api/embed", {"model": NAME, "input": "hi"})
        assert r.status_code == 400 and "runner" in r.json()["error"]


def test_yes_no_scorer_rerank_equals_hf_p_yes(tmp_path: Path, tokenizer_dir: Path) -> None:
    """A causal LM run as a Qwen3-Reranker-style scorer: p(yes) over {no, yes} at the end of query + document."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = build_model(tmp_path / "rr", "qwen3", tokenizer_dir, seed=5, head_dim=32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    no, yes = tok.convert_ids_to_tokens([300, 301])
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = []
        for d in DOCS:
            logits = hf(torch.tensor([tok.encode(QUERY + d)])).logits[0, -1]
            want.append(float(torch.softmax(logits[[300, 301]], -1)[1]))
    for app, engine in serve(model_dir, runner="pooling", pooler_config={"score_tokens": [no, yes]}):
        assert engine.config.pooler.is_scorer
        r = post(app, "/v1/rerank", {"query": QUERY, "documents": DOCS})
        results = r.json()["results"]
        assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -want[i])
        assert [x["relevance_score"] for x in results] == pytest.approx(sorted(want, reverse=True), abs=1e-5)
        r = post(app, "/score", {"text_1": QUERY, "text_2": DOCS[0]})
        assert r.json()["data"][0]["score"] == pytest.approx(want[0], abs=1e-5)


def test_sequence_classification_cross_encoder_equals_hf(tmp_path: Path, tokenizer_dir: Path) -> None:
    """A Qwen3ForSequenceClassification checkpoint (one label): --runner auto scores with its classifier head on the
    last token of query + document, sigmoid, as HF's model computes it."""
    import shutil

    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForSequenceClassification

    torch.manual_seed(7)
    cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, max_position_embeddings=512, eos_token_id=0, pad_token_id=0,
                      num_labels=1, tie_word_embeddings=True, initializer_range=0.2)  # fmt: skip
    hf = Qwen3ForSequenceClassification(cfg).eval()
    hf.save_pretrained(tmp_path / "ce", safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path / "ce" / f.name)
    tok = AutoTokenizer.from_pretrained(tmp_path / "ce")
    with torch.no_grad():
        want = [float(torch.sigmoid(hf(torch.tensor([tok.encode(QUERY + d)])).logits[0, 0])) for d in DOCS]
    for app, engine in serve(tmp_path / "ce"):
        assert engine.config.runner == "pooling" and engine.config.pooler.classifier
        r = post(app, "/rerank", {"query": QUERY, "documents": DOCS})
        results = r.json()["results"]
        assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -want[i])
        assert [x["relevance_score"] for x in results] == pytest.approx(sorted(want, reverse=True), abs=1e-5)
