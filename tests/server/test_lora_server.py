"""LoRA through `lmserve serve` (a real process, engine cores in their own processes, two of them: data parallel):
the `model` field picks the adapter, /v1/models lists them with their parent, unknown names are 404 model_not_found,
load / unload at run time (a broken path 400, an adapter in use not unloaded), each answer PeftModel's tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from tests.helpers import build_model, require_extra
from tests.lora_helpers import ADAPTER_SPECS, build_adapter, peft_greedy
from tests.server.test_server import MODEL_NAME, LiveServer

require_extra("test", "peft")

PROMPTS = ["The capital of France is", "def fib(n):", "import json\n", "a b c d"]


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_serve")
    base = build_model(root / "base", "llama", tokenizer_dir)
    out = {"base": base}
    for i, name in enumerate(("all8", "qv64", "mlp8rs")):
        r, alpha, targets, rslora = ADAPTER_SPECS[name]
        out[name] = build_adapter(base, root / name, r, alpha, targets, rslora, seed=i)
    return out


@pytest.fixture(scope="module")
def server(lora_setup: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("lora_serve_log")
    srv = LiveServer(
        lora_setup["base"], root / "server.log", "--enable-lora", "--lora-modules",
        f"all8={lora_setup['all8']}", json.dumps({"name": "qv64", "path": str(lora_setup["qv64"])}),
        "--max-loras", "2", "--max-lora-rank", "64", "--enable-lora-runtime-updates", "--data-parallel-size", "2",
    )  # fmt: skip
    try:
        srv.wait_healthy(240)
        yield srv
    finally:
        srv.stop()


def complete(server: LiveServer, model: str, prompt: str, max_tokens: int = 8) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


def expected_text(setup: dict[str, Path], adapter: str | None, prompt: str, max_tokens: int = 8) -> str:
    tok = AutoTokenizer.from_pretrained(setup["base"])
    ids = tok.encode(prompt)
    return tok.decode(peft_greedy(setup["base"], None if adapter is None else setup[adapter], ids, max_tokens))


def test_models_lists_adapters_with_their_parent(server: LiveServer, lora_setup) -> None:
    data = httpx.get(server.url + "/v1/models").json()["data"]
    cards = {c["id"]: c for c in data}
    assert cards[MODEL_NAME]["parent"] is None
    for name in ("all8", "qv64"):
        assert cards[name]["parent"] == MODEL_NAME
        assert cards[name]["root"] == str(lora_setup[name])


def test_mixed_concurrent_requests_match_peft(server: LiveServer, lora_setup) -> None:
    jobs = [(m, p) for p in PROMPTS for m in ("all8", "qv64", MODEL_NAME)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: complete(server, *job), jobs))
    for (model, prompt), r in zip(jobs, answers, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        adapter = None if model == MODEL_NAME else model
        assert r.json()["choices"][0]["text"] == expected_text(lora_setup, adapter, prompt), (model, prompt)


def test_metrics_have_the_lora_families(server: LiveServer) -> None:
    assert complete(server, "all8", "x").status_code == 200
    lines = httpx.get(server.url + "/metrics").text.splitlines()
    assert any(ln.startswith("lmserve:lora_slot_bytes") and not ln.endswith(" 0.0") for ln in lines)
    assert any(ln.startswith("lmserve:lora_slot_loads_total") and not ln.endswith(" 0.0") for ln in lines)
    assert any(ln.startswith("# TYPE lmserve:lora_num_requests_running gauge") for ln in lines)


def test_unknown_model_is_404(server: LiveServer) -> None:
    r = complete(server, "nope", "x")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"


def test_load_use_and_unload_at_run_time(server: LiveServer, lora_setup, tmp_path: Path) -> None:
    url = server.url
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path / "missing")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
    assert str(tmp_path / "missing") in r.json()["error"]["message"]
    (tmp_path / "dora").mkdir()
    cfg = json.loads((lora_setup["all8"] / "adapter_config.json").read_text()) | {"use_dora": True}
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps(cfg))
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path / "dora")})
    assert r.status_code == 400 and "use_dora" in r.json()["error"]["message"]

    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "new", "lora_path": str(lora_setup["mlp8rs"])})
    assert r.status_code == 200, r.text
    assert "new" in {c["id"] for c in httpx.get(url + "/v1/models").json()["data"]}
    r = complete(server, "new", PROMPTS[0])
    assert r.json()["choices"][0]["text"] == expected_text(lora_setup, "mlp8rs", PROMPTS[0])

    # in use (a stream held open by max_tokens + ignore_eos): refused, and the stream goes on
    body = {"model": "new", "prompt": "x", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["model"] == "new"
        r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "new"})
        assert r.status_code == 400 and "in use" in r.json()["error"]["message"]
        rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "new"})
    assert r.status_code == 200, r.text
    assert complete(server, "new", "x").status_code == 404
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "new"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
