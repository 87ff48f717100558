"""Scoring through the server: `echo`, `max_tokens: 0` and `prompt_logprobs` on /v1/completions (and
prompt_logprobs on chat), against HF transformers' log_softmax of the whole sequence's forward (float32, 1e-4).

In-process servers (httpx ASGITransport) with the whole prompt in one step and with prompts chunked 7 tokens a
step; string, token-id and batched prompts, max_tokens 0, a prefix-cache hit, n = 2, streaming; then the same
through `lmserve serve`'s engine-core process. The checks of every logprobs object: tokens name the sequence's
tokens (prompt first), the first prompt token has null logprob and alternatives, every other logprob and its
k alternatives are HF's, text_offset counts the characters of the tokens before it, and the tokens' bytes are
the returned text.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi import FastAPI

from lmserve.config.engine import EngineArgs
from lmserve.engine.async_engine import AsyncEngine
from lmserve.engine.llm_engine import LLMEngine
from lmserve.engine.token_bytes import TokenBytes
from lmserve.entrypoints.openai.server import build_app
from tests.hf_reference import hf_model
from tests.server.test_server import MODEL_NAME, LiveServer, make_chat_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-4
PROMPT = "import json\nimport os\nclass Foo:\n    def bar(self):\n        return 42\n"  # 35 tokens: 2 full blocks
OTHER = "The capital of France is Paris. The quick brown fox jumps over the lazy dog."
C, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def model_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_model(llama_dir, tmp_path_factory.mktemp("echo") / "model")


@pytest.fixture(scope="module", params=[None, 7], ids=["whole", "chunked"])
def app(model_dir: Path, request: pytest.FixtureRequest) -> Iterator[FastAPI]:
    args = EngineArgs.from_kwargs(
        str(model_dir), num_kv_blocks=64, block_size=16, max_model_len=256, max_num_batched_tokens=request.param
    )
    engine = AsyncEngine(LLMEngine.from_engine_args(args))
    yield build_app(engine, served_model_name=MODEL_NAME)
    engine.shutdown()


def post(app: FastAPI, path: str, body: dict[str, Any]) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            return await c.post(path, json=body)

    return asyncio.run(run())


def ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    return r.json()


def sse(text: str) -> list[dict[str, Any]]:
    data = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


class Vocab:
    """Token names (as the API spells them) back to ids, and the HF reference."""

    def __init__(self, model_dir: Path) -> None:
        from lmserve.checkpoint.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(str(model_dir))
        self.tb = TokenBytes(self.tokenizer)
        size = len(self.tokenizer)
        self.ids = {self.tb.token_text(i): i for i in range(size)}
        assert len(self.ids) == size, "token names are distinct"
        self.model_dir = model_dir

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    @torch.inference_mode()
    def hf(self, ids: list[int]) -> torch.Tensor:
        """Row p: HF's log_softmax at position p (it scores token p + 1)."""
        return torch.log_softmax(hf_model(self.model_dir)(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module")
def vocab(model_dir: Path) -> Vocab:
    return Vocab(model_dir)


def check_logprobs(vocab: Vocab, lp: dict[str, Any], text: str, prompt_ids: list[int], k: int) -> list[int]:
    """Check an echoed choice's logprobs object against HF; returns its generated token ids."""
    tokens, chosen, tops, offsets = lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"]
    assert len(tokens) == len(chosen) == len(tops) == len(offsets)
    ids = [vocab.ids[t] for t in tokens]
    assert ids[: len(prompt_ids)] == prompt_ids, "the prompt's tokens come first"
    assert chosen[0] is None and tops[0] is None, "the first prompt token has no logprob"
    ref = vocab.hf(ids)
    for i in range(1, len(ids)):
        assert chosen[i] == pytest.approx(float(ref[i - 1, ids[i]]), abs=TOL), f"token {i}"
        top = ref[i - 1].topk(k)
        expected = {vocab.tb.token_text(t): v for v, t in zip(top.values.tolist(), top.indices.tolist(), strict=True)}
        expected[tokens[i]] = float(ref[i - 1, ids[i]])
        assert tops[i].keys() == expected.keys(), f"token {i}: alternatives"
        assert list(tops[i].values()) == pytest.approx(list(expected.values()), abs=TOL), f"token {i}"
    raw = [b"" if t in vocab.tb.special_ids else vocab.tb.bytes_of(t) for t in ids]
    assert b"".join(raw).decode("utf-8", "replace") == text, "the tokens' bytes are the text"
    for i, off in enumerate(offsets):
        assert off == len(b"".join(raw[:i]).decode("utf-8", "replace")), f"text_offset of token {i}"
    return ids[len(prompt_ids) :]


def test_echo_string_prompt(app: FastAPI, vocab: Vocab) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "echo": True, "logprobs": 3, "temperature": 0, "ignore_eos": True}
    out = ok(post(app, C, body))
    choice, plain = out["choices"][0], ok(post(app, C, dict(body, echo=False)))["choices"][0]
    assert choice["text"] == PROMPT + plain["text"], "text = prompt + completion"
    generated = check_logprobs(vocab, choice["logprobs"], choice["text"], vocab.encode(PROMPT), 3)
    assert len(generated) == 4 and choice["finish_reason"] == "length"
    # the generated part is the plain completion's logprobs, its offsets shifted by the prompt's length
    n = len(vocab.encode(PROMPT))
    assert choice["logprobs"]["tokens"][n:] == plain["logprobs"]["tokens"]
    assert choice["logprobs"]["token_logprobs"][n:] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=TOL)
    assert [o - len(PROMPT) for o in choice["logprobs"]["text_offset"][n:]] == plain["logprobs"]["text_offset"]
    assert out["usage"]["prompt_tokens"] == n and out["usage"]["completion_tokens"] == 4


def test_echo_token_id_prompt(app: FastAPI, vocab: Vocab) -> None:
    ids = vocab.encode(OTHER)
    out = ok(post(app, C, {"prompt": ids, "max_tokens": 2, "echo": True, "logprobs": 1, "temperature": 0}))
    choice = out["choices"][0]
    assert choice["text"].startswith(OTHER), "a token-id prompt echoes its tokens' text"
    check_logprobs(vocab, choice["logprobs"], choice["text"], ids, 1)


def test_echo_batched_prompts(app: FastAPI, vocab: Vocab) -> None:
    prompts = [PROMPT, OTHER, "x = 1"]
    out = ok(post(app, C, {"prompt": prompts, "max_tokens": 3, "echo": True, "logprobs": 2, "temperature": 0}))
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    for prompt, choice in zip(prompts, out["choices"], strict=True):
        assert choice["text"].startswith(prompt)
        check_logprobs(vocab, choice["logprobs"], choice["text"], vocab.encode(prompt), 2)
    ids = [vocab.encode(p) for p in prompts]  # token-id lists too
    by_ids = ok(post(app, C, {"prompt": ids, "max_tokens": 3, "echo": True, "logprobs": 2, "temperature": 0}))
    assert [c["logprobs"]["tokens"] for c in by_ids["choices"]] == [c["logprobs"]["tokens"] for c in out["choices"]]


def test_max_tokens_zero_scores_the_prompt(app: FastAPI, vocab: Vocab) -> None:
    engine = app.state.lmserve.engine
    before, histogram_before = engine.snapshot().metrics, generation_histogram(app)
    prefill_before = prefill_histogram_count(app)
    out = ok(post(app, C, {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}))
    choice = out["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert check_logprobs(vocab, choice["logprobs"], PROMPT, vocab.encode(PROMPT), 1) == []
    n = len(vocab.encode(PROMPT))
    assert out["usage"] == {
        "prompt_tokens": n, "completion_tokens": 0, "total_tokens": n, "prompt_tokens_details": {"cached_tokens": 0}
    }  # fmt: skip
    # counted like any request: its prompt tokens, no generated ones
    after = engine.snapshot().metrics
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == n
    assert after["generation_tokens_total"] == before["generation_tokens_total"]
    assert after["prefill_tokens_total"] - before["prefill_tokens_total"] == n, "the dashboard's prefill tok/s"
    assert after["num_requests_total"] - before["num_requests_total"] == 1
    length = "finished_requests_by_reason"
    assert after[length]["length"] - before[length]["length"] == 1
    count, total = generation_histogram(app)
    assert (count - histogram_before[0], total) == (1, histogram_before[1]), "one request, 0 tokens generated"
    assert prefill_histogram_count(app) == prefill_before + 1, "its prefill time is the whole request's"
    # echo without logprobs: the text only
    bare = ok(post(app, C, {"prompt": PROMPT, "max_tokens": 0, "echo": True}))["choices"][0]
    assert bare["text"] == PROMPT and bare["logprobs"] is None


def http_samples(app: FastAPI) -> dict[str, float]:
    """/metrics' samples of the HTTP frontend, by name."""
    from prometheus_client.parser import text_string_to_metric_families

    async def run() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return (await c.get("/metrics")).text

    families = text_string_to_metric_families(asyncio.run(run()))
    return {s.name: s.value for f in families for s in f.samples if s.labels.get("frontend") == "http"}


def generation_histogram(app: FastAPI) -> tuple[float, float]:
    """request_generation_tokens: (count, sum)."""
    samples = http_samples(app)
    return samples["lmserve:request_generation_tokens_count"], samples["lmserve:request_generation_tokens_sum"]


def prefill_histogram_count(app: FastAPI) -> float:
    return http_samples(app)["lmserve:request_prefill_time_seconds_count"]


def test_echo_after_a_prefix_cache_hit(app: FastAPI, vocab: Vocab) -> None:
    prompt = PROMPT + "# cached\n"
    primed = ok(post(app, C, {"prompt": prompt, "max_tokens": 1, "temperature": 0}))  # caches the prompt's full blocks
    again = ok(post(app, C, {"prompt": prompt, "max_tokens": 1}))
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32, "the prompt is in the prefix cache"
    out = ok(post(app, C, {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 2, "temperature": 0}))
    # a cached prefix has no logits: the echo request computes every position (and is right)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    check_logprobs(vocab, out["choices"][0]["logprobs"], out["choices"][0]["text"], vocab.encode(prompt), 2)
    assert out["choices"][0]["text"] == prompt + primed["choices"][0]["text"]


def test_echo_with_n_2(app: FastAPI, vocab: Vocab) -> None:
    body = {"prompt": PROMPT, "n": 2, "max_tokens": 5, "echo": True, "logprobs": 2, "temperature": 1.0, "seed": 3}
    out = ok(post(app, C, dict(body, ignore_eos=True)))
    prompt_ids = vocab.encode(PROMPT)
    n = len(prompt_ids)
    first, second = out["choices"]
    assert (first["index"], second["index"]) == (0, 1)
    assert first["logprobs"]["tokens"][:n] == second["logprobs"]["tokens"][:n]
    for c in out["choices"]:
        assert len(check_logprobs(vocab, c["logprobs"], c["text"], prompt_ids, 2)) == 5
    assert first["text"] != second["text"], "two sampled continuations (seeded: they differ)"
    assert out["usage"]["completion_tokens"] == 10


def merge_stream(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per choice index: the joined text and logprobs, the chunks, and the finish reason."""
    merged: dict[int, dict[str, Any]] = {}
    for ev in events:
        for c in ev["choices"]:
            m = merged.setdefault(c["index"], {"text": "", "chunks": [], "logprobs": None, "finish_reason": None})
            m["text"] += c["text"]
            m["chunks"].append(c)
            if c["logprobs"] is not None:
                m["logprobs"] = m["logprobs"] or {k: [] for k in c["logprobs"]}
                for k, v in c["logprobs"].items():
                    m["logprobs"][k] += v
            m["finish_reason"] = c["finish_reason"] or m["finish_reason"]
    return merged


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_echo_streaming(app: FastAPI, vocab: Vocab, max_tokens: int) -> None:
    body = {"prompt": [PROMPT, OTHER], "n": 2, "max_tokens": max_tokens, "echo": True, "logprobs": 2,
            "temperature": 0, "ignore_eos": True, "prompt_logprobs": 1}  # fmt: skip
    whole = ok(post(app, C, body))
    merged = merge_stream(sse(post(app, C, dict(body, stream=True)).text))
    assert sorted(merged) == [0, 1, 2, 3]
    for choice in whole["choices"]:
        m = merged[choice["index"]]
        prompt = [PROMPT, OTHER][choice["index"] // 2]
        first = m["chunks"][0]
        assert first["text"].startswith(prompt), "the echoed prompt goes in the choice's first chunk"
        assert first["prompt_logprobs"] == choice["prompt_logprobs"], "so do its prompt logprobs"
        assert all("prompt_logprobs" not in c for c in m["chunks"][1:])
        assert m["text"] == choice["text"] and m["finish_reason"] == choice["finish_reason"] == "length"
        assert m["logprobs"]["tokens"] == choice["logprobs"]["tokens"]
        assert m["logprobs"]["text_offset"] == choice["logprobs"]["text_offset"]
        assert m["logprobs"]["token_logprobs"] == pytest.approx(choice["logprobs"]["token_logprobs"], abs=TOL)
        generated = check_logprobs(vocab, m["logprobs"], m["text"], vocab.encode(prompt), 2)
        assert len(generated) == max_tokens


def check_prompt_logprobs(vocab: Vocab, entries: list[Any], ids: list[int], k: int) -> None:
    """vLLM's shape: None, then per position {token id: {logprob, rank, decoded_token}} of the k most likely
    tokens and the prompt's own."""
    assert entries[0] is None and len(entries) == len(ids)
    ref = vocab.hf(ids)
    for pos in range(1, len(ids)):
        row = ref[pos - 1]
        top = row.topk(k)
        pairs = zip(top.values.tolist(), top.indices.tolist(), strict=True)
        expected = {t: (v, r) for r, (v, t) in enumerate(pairs, start=1)}
        expected[ids[pos]] = (float(row[ids[pos]]), int((row > row[ids[pos]]).sum()) + 1)
        got = {int(t): e for t, e in entries[pos].items()}
        assert got.keys() == expected.keys(), f"position {pos}"
        for t, (value, rank) in expected.items():
            assert got[t]["logprob"] == pytest.approx(value, abs=TOL) and got[t]["rank"] == rank
            assert got[t]["decoded_token"] == vocab.tb.token_text(t)


def test_prompt_logprobs_on_completions(app: FastAPI, vocab: Vocab) -> None:
    out = ok(post(app, C, {"prompt": [PROMPT, OTHER], "max_tokens": 1, "prompt_logprobs": 3}))
    for prompt, choice in zip([PROMPT, OTHER], out["choices"], strict=True):
        assert choice["logprobs"] is None and not choice["text"].startswith(prompt), "no echo asked for"
        check_prompt_logprobs(vocab, choice["prompt_logprobs"], vocab.encode(prompt), 3)
    assert "prompt_logprobs" not in ok(post(app, C, {"prompt": PROMPT, "max_tokens": 1}))["choices"][0]
    # with echo's logprobs asking for more alternatives, each view keeps its own k
    both = ok(post(app, C, {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 4, "prompt_logprobs": 1}))
    check_prompt_logprobs(vocab, both["choices"][0]["prompt_logprobs"], vocab.encode(PROMPT), 1)
    check_logprobs(vocab, both["choices"][0]["logprobs"], PROMPT, vocab.encode(PROMPT), 4)


def test_prompt_logprobs_on_chat(app: FastAPI, vocab: Vocab) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    tokenized = ok(post(app, "/tokenize", {"messages": messages}))["tokens"]
    body = {"messages": messages, "max_tokens": 3, "prompt_logprobs": 2, "temperature": 0, "ignore_eos": True}
    out = ok(post(app, CHAT, body))
    check_prompt_logprobs(vocab, out["prompt_logprobs"], tokenized, 2)
    assert "prompt_logprobs" not in ok(post(app, CHAT, dict(body, prompt_logprobs=None)))
    events = sse(post(app, CHAT, dict(body, stream=True)).text)
    carrying = [ev for ev in events if "prompt_logprobs" in ev]
    assert len(carrying) == 1 and carrying[0]["choices"][0]["delta"].get("content"), "the first content chunk"
    assert carrying[0]["prompt_logprobs"] == out["prompt_logprobs"]


# ---- through the engine-core process (`lmserve serve`'s default) ------------------------------------------


@pytest.fixture(scope="module")
def served(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("echo-serve")
    srv = LiveServer(model_dir, root / "server.log", "--max-num-batched-tokens", "7")
    try:
        srv.wait_healthy(180)
        yield srv
    finally:
        srv.stop()


def test_echo_and_prompt_logprobs_through_the_engine_core_process(served: LiveServer, vocab: Vocab) -> None:
    body = {"prompt": [PROMPT, OTHER], "max_tokens": 3, "echo": True, "logprobs": 2, "prompt_logprobs": 2,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    with httpx.Client(timeout=120) as c:
        whole = c.post(served.url + C, json=body).json()
        streamed = merge_stream(sse(c.post(served.url + C, json=dict(body, stream=True)).text))
        scored = c.post(served.url + C, json=dict(body, max_tokens=0, prompt_logprobs=None)).json()
    for i, prompt in enumerate([PROMPT, OTHER]):
        ids = vocab.encode(prompt)
        choice = whole["choices"][i]
        check_logprobs(vocab, choice["logprobs"], choice["text"], ids, 2)
        check_prompt_logprobs(vocab, choice["prompt_logprobs"], ids, 2)
        assert streamed[i]["text"] == choice["text"]
        assert streamed[i]["chunks"][0]["prompt_logprobs"] == choice["prompt_logprobs"]
        check_logprobs(vocab, streamed[i]["logprobs"], streamed[i]["text"], ids, 2)
        assert scored["choices"][i]["text"] == prompt
        check_logprobs(vocab, scored["choices"][i]["logprobs"], prompt, ids, 2)
    assert scored["usage"]["completion_tokens"] == 0
