"""Logprobs over the HTTP API where characters span several tokens (byte-level BPE: CJK, emoji): the bundled
model continues Chinese verse, so its outputs are full of tokens that are parts of a character. Checked on both
endpoints, streamed and not: tokens name distinct byte strings, the chosen token is in its top-k with its own
logprob, joined bytes give the text back, and text_offset points at the right characters. With ignore_eos the
model also emits <|endoftext|> mid-text: a special token, left out of the text (skip_special_tokens)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from lmserve.config.engine import EngineArgs
from lmserve.default_model import default_model_path
from lmserve.engine.async_engine import AsyncEngine
from lmserve.engine.llm_engine import LLMEngine
from lmserve.entrypoints.openai.server import build_app

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 5
PROMPT = "Moon 🌙 poem: 床前明月光🙂疑是地上霜🙂舉頭望明月🙂低頭思故鄉🙂"
SAMPLINGS = [{"temperature": 0}, {"temperature": 1.0, "seed": 7}]
# (message, sampling): each continues with characters split across tokens (the seeded one with ASCII too)
CHATS = [("作者：李商隐\n蔔瑁", SAMPLINGS[0]), ("床前明月光🙂疑是地上霜", SAMPLINGS[1])]


@pytest.fixture(scope="module")
def app() -> Iterator[FastAPI]:
    args = EngineArgs.from_kwargs(default_model_path("target"), num_kv_blocks=64, max_model_len=256)
    engine = AsyncEngine(LLMEngine.from_engine_args(args))
    yield build_app(engine, served_model_name="m")
    engine.shutdown()


def post(app: FastAPI, path: str, body: dict[str, Any]) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            return await c.post(path, json=body)

    r = asyncio.run(run())
    assert r.status_code == 200, r.text
    return r


def events(r: httpx.Response) -> list[dict[str, Any]]:
    data = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def token_bytes(token: str) -> bytes:
    """A token name back to its bytes: `bytes:\\xe5\\x89` (a partial character) or the text itself."""
    if token.startswith("bytes:"):
        hexes = re.fullmatch(r"bytes:((?:\\x[0-9a-f]{2})+)", token)
        assert hexes, token
        return bytes.fromhex(hexes.group(1).replace("\\x", ""))
    return token.encode("utf-8")


def specials(app: FastAPI) -> set[str]:
    return set(app.state.lmserve.engine.tokenizer.all_special_tokens)


def check_completion_logprobs(text: str, lp: dict[str, Any], num_tokens: int, skipped: set[str]) -> None:
    tokens, chosen, tops, offsets = lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"]
    assert len(tokens) == len(chosen) == len(tops) == len(offsets) == num_tokens
    raw = [b"" if t in skipped else token_bytes(t) for t in tokens]  # what each token adds to the text
    partial = [t for t in tokens if t.startswith("bytes:")]
    assert partial, "the test must exercise tokens that are parts of characters"
    for t in tokens:  # a name is bytes:... exactly when its bytes are not whole characters
        try:
            assert t == token_bytes(t).decode("utf-8")
        except UnicodeDecodeError:
            assert t.startswith("bytes:")
    # the detokenizer's text is the bytes decoded with U+FFFD for what is not UTF-8 (here: a last character
    # cut by max_tokens)
    assert b"".join(raw).decode("utf-8", "replace") == text, "the tokens' bytes are the text"
    for t, c, top in zip(tokens, chosen, tops, strict=True):
        assert top[t] == c, "the chosen token is in top_logprobs with its own logprob"
        assert len(top) in (K, K + 1), f"alternatives lost to a name collision: {top}"
        if len(top) == K + 1:  # the chosen one was not among the K most likely
            assert all(c <= v for k, v in top.items() if k != t)
    # text_offset[i] = characters of the text begun before token i's first byte; a character still missing
    # bytes there decodes to one U+FFFD, so it counts as begun
    for i, off in enumerate(offsets):
        assert off == len(b"".join(raw[:i]).decode("utf-8", "replace")) <= len(text)
    assert offsets == sorted(offsets) and offsets[0] == 0


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
def test_completion_logprobs_of_partial_characters(app: FastAPI, sampling: dict[str, Any]) -> None:
    body = {"prompt": PROMPT, "max_tokens": 30, "logprobs": K, "ignore_eos": True, **sampling}
    whole = post(app, "/v1/completions", body).json()
    choice = whole["choices"][0]
    check_completion_logprobs(choice["text"], choice["logprobs"], whole["usage"]["completion_tokens"], specials(app))

    streamed_text, merged = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ev in events(post(app, "/v1/completions", dict(body, stream=True))):
        for c in ev["choices"]:
            streamed_text += c["text"]
            for key in merged:
                merged[key] += (c["logprobs"] or {}).get(key, [])
    assert streamed_text == choice["text"]
    assert merged == choice["logprobs"], "streamed logprobs and offsets equal the whole response's"


@pytest.mark.parametrize("message, sampling", CHATS, ids=["greedy", "seeded"])
def test_chat_logprobs_bytes_join_to_the_content(app: FastAPI, message: str, sampling: dict[str, Any]) -> None:
    chat = [{"role": "user", "content": message}]
    body = {"messages": chat, "max_tokens": 30, "logprobs": True, "top_logprobs": K, "ignore_eos": True, **sampling}
    whole = post(app, "/v1/chat/completions", body).json()
    text, content = whole["choices"][0]["message"]["content"], whole["choices"][0]["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"]
    assert any(e["token"].startswith("bytes:") for e in content), "partial characters must be exercised"
    skipped = specials(app)
    joined = b"".join(bytes(e["bytes"]) for e in content if e["token"] not in skipped)
    assert joined.decode("utf-8", "replace") == text
    for e in content:
        assert token_bytes(e["token"]) == bytes(e["bytes"])
        assert len(e["top_logprobs"]) == K and len({t["token"] for t in e["top_logprobs"]}) == K
        for t in e["top_logprobs"]:
            assert token_bytes(t["token"]) == bytes(t["bytes"])
            if t["token"] == e["token"]:
                assert t["logprob"] == pytest.approx(e["logprob"], abs=1e-5)

    streamed_text, streamed_content = "", []
    for ev in events(post(app, "/v1/chat/completions", dict(body, stream=True))):
        for c in ev["choices"]:
            streamed_text += c["delta"].get("content") or ""
            streamed_content += (c["logprobs"] or {}).get("content") or []
    assert streamed_text == text
    # The second request hits the prefix cache: its uncached suffix (a few tokens) takes the few-row C kernel
    # where the first request's whole prompt took oneDNN, so values agree to float32 rounding, not bit for bit.
    assert _without_logprobs(streamed_content) == _without_logprobs(content)
    for a, b in zip(streamed_content, content, strict=True):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
        assert [t["logprob"] for t in a["top_logprobs"]] == pytest.approx([t["logprob"] for t in b["top_logprobs"]],
                                                                          abs=1e-4)  # fmt: skip


def _without_logprobs(content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries with their tokens, bytes and top-logprob tokens, and no logprob values."""
    return [{"token": e["token"], "bytes": e["bytes"], "top": [(t["token"], t["bytes"]) for t in e["top_logprobs"]]}
            for e in content]  # fmt: skip
