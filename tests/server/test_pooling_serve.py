"""`lmserve serve` on an embedding checkpoint as a real process (--runner auto picks pooling; the engine core in
its own process): POST /v1/embeddings and the gRPC Embed equal to HF's pooling, and the runner refusals."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.helpers import require_extra
from tests.pooling_helpers import build_embedding_model, hf_embeddings

require_extra("grpc", "grpc", "google.protobuf", "grpc_health", "grpc_reflection")

import grpc  # noqa: E402

from lmserve.grpc_proto import lmserve_pb2 as pb  # noqa: E402
from lmserve.grpc_proto import lmserve_pb2_grpc as pb_grpc  # noqa: E402
from tests.server.test_server import MODEL_NAME, LiveServer, free_port  # noqa: E402

pytestmark = pytest.mark.slow
TEXTS = ["The capital of France is Paris.", "café", "def fib(n): return n"]


@pytest.fixture(scope="module")
def emb_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_embedding_model(tmp_path_factory.mktemp("emb-serve"), tokenizer_dir, "mean", normalize=True)


@pytest.fixture(scope="module")
def server(emb_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, int]]:
    port = free_port()
    srv = LiveServer(emb_dir, tmp_path_factory.mktemp("pool-serve") / "server.log", "--grpc-port", str(port))
    try:
        srv.wait_healthy()
        yield srv, port
    finally:
        srv.stop()


def test_http_and_grpc_embeddings_equal_hf(server: tuple[LiveServer, int], emb_dir: Path) -> None:
    srv, port = server
    ids = [srv_tokens(srv, t) for t in TEXTS]
    ref = hf_embeddings(emb_dir, ids, "mean", True)
    r = httpx.post(srv.url + "/v1/embeddings", json={"input": TEXTS, "model": MODEL_NAME}, timeout=60)
    assert r.status_code == 200, r.text
    for d, want in zip(r.json()["data"], ref, strict=True):
        torch.testing.assert_close(torch.tensor(d["embedding"]), want, atol=1e-5, rtol=1e-5)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.GenerationStub(ch)
        out = stub.Embed(pb.EmbedRequest(texts=TEXTS[:2], token_ids=[pb.TokenIds(ids=ids[2])]), timeout=60)
        for e, want in zip(out.embeddings, ref, strict=True):
            torch.testing.assert_close(torch.tensor(list(e.values)), want, atol=1e-5, rtol=1e-5)
        assert out.prompt_tokens == sum(map(len, ids))
        with pytest.raises(grpc.RpcError) as e:
            stub.Embed(pb.EmbedRequest(texts=["x"], dimensions=1000), timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dimensions" in e.value.details()
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]


def srv_tokens(srv: LiveServer, text: str) -> list[int]:
    return httpx.post(srv.url + "/tokenize", json={"prompt": text}, timeout=60).json()["tokens"]
