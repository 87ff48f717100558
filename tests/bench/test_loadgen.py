"""Load generator: arrival statistics, and streaming against a fake OpenAI SSE server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from lmserve.bench.datasets import BenchRequest
from lmserve.bench.loadgen import LoadConfig, arrival_offsets_s, finalize_all, run_load
from lmserve.bench.metrics import request_latency, summarize

FIRST_DELAY_S = 0.05
GAP_S = 0.02


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrival_process_rate_and_cv(burstiness: float):
    offsets = arrival_offsets_s(20001, rate_rps=10.0, burstiness=burstiness, seed=1)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert 1.0 / gaps.mean() == pytest.approx(10.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0 / math.sqrt(burstiness), rel=0.06)


def test_arrival_all_at_once_and_seeded():
    assert arrival_offsets_s(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_offsets_s(5, 2.0, seed=7) == arrival_offsets_s(5, 2.0, seed=7)
    assert arrival_offsets_s(0, 2.0) == []


class WordTokenizer:
    """Counts whitespace-separated words: enough for the client-side fallbacks."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [0] * len(text.split())


class FakeServer:
    """Streams max_tokens words: the first chunk after FIRST_DELAY_S, then one chunk every GAP_S.
    `fake_mode` in the body picks the chunk shape or a failure."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.num_requests = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.num_requests += 1
        mode = body.get("fake_mode", "single")
        if mode == "http_error":
            return web.json_response(
                {"error": {"message": "max_tokens is too large", "code": 400}}, status=400
            )
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["model"] == "fake-model"
        chat = request.path.endswith("chat/completions")
        n = body["max_tokens"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if chat:
                await self.send(
                    resp, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
                )
            per_chunk = 2 if mode == "multi" else 1
            sent = 0
            await asyncio.sleep(FIRST_DELAY_S)
            while sent < n:
                k = min(per_chunk, n - sent)
                sent += k
                text = "" if mode == "held_back" and sent % 2 else " w" * k  # (odd tokens: text not yet whole)
                last = sent == n and mode != "held_back"  # held_back: llama.cpp's separate closing chunk
                choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
                choice.update({"delta": {"content": text}} if chat else {"text": text})
                chunk: dict[str, Any] = {"choices": [choice]}
                if mode == "token_ids":
                    choice["token_ids"] = list(range(k))
                if mode == "continuous":
                    chunk["usage"] = {"prompt_tokens": 5, "completion_tokens": sent}
                await self.send(resp, chunk)
                if mode == "stream_error" and sent >= 2:
                    await self.send(resp, {"error": {"message": "engine died", "code": 500}})
                    return resp
                if sent < n:
                    await asyncio.sleep(GAP_S)
            usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": n + 5}
            if mode == "held_back":
                closing = {"index": 0, "finish_reason": "length"}
                closing.update({"delta": {}} if chat else {"text": ""})
                await self.send(resp, {"choices": [closing], "usage": usage})
            elif mode != "no_usage":
                await self.send(resp, {"choices": [], "usage": usage})
            await resp.write(b"data: [DONE]\n\n")
        finally:
            self.in_flight -= 1
        return resp

    @staticmethod
    async def send(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
        await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")


def run_against_fake(requests: list[BenchRequest], tokenizer: Any = None, **cfg_kwargs: Any):
    server = FakeServer()

    async def main():
        runner = web.AppRunner(server.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            cfg = LoadConfig(base_url=f"http://127.0.0.1:{port}", **cfg_kwargs)
            result = await run_load(requests, cfg)
            return cfg, result
        finally:
            await runner.cleanup()

    cfg, result = asyncio.run(main())
    return server, result, finalize_all(result, requests, cfg, tokenizer)


def reqs(n: int, output_len: int = 4) -> list[BenchRequest]:
    return [BenchRequest(f"prompt {i}", [1, 2, 3], output_len) for i in range(n)]


def test_closed_loop_single_token_chunks():
    server, result, records = run_against_fake(reqs(6, 4), max_concurrency=2)
    assert server.max_in_flight == 2 and server.num_requests == 6
    assert result.model == "fake-model"
    for r in records:
        assert r.success, r.error
        assert r.num_output_tokens == 4 and r.chunk_num_tokens == [1, 1, 1, 1]
        assert (r.output_tokens_source, r.chunk_tokens_source) == ("usage", "one_per_chunk")
        assert r.server_prompt_len == 5 and r.generated_text == " w w w w"
        lat = request_latency(r)
        assert FIRST_DELAY_S <= lat.ttft_from_send_s < FIRST_DELAY_S + 0.25
        assert all(GAP_S * 0.9 <= x < GAP_S + 0.25 for x in lat.itls_s)
    # all arrive at 0; the last two waited in the client for two rounds of two requests
    late = [request_latency(r) for r in records[4:]]
    assert all(lat.queue_delay_s >= 2 * (FIRST_DELAY_S + 3 * GAP_S) * 0.9 for lat in late)
    assert all(lat.ttft_s > lat.ttft_from_send_s for lat in late)
    s = summarize(records, duration_s=result.duration_s, max_concurrency=2)
    assert s.num_succeeded == 6 and s.output_len_matched_pct == 100.0
    assert s.tpot_ms.mean == pytest.approx(s.itl_ms.mean, rel=1e-6)


def test_open_loop_sends_on_schedule():
    _, _, records = run_against_fake(reqs(5, 2), request_rate_rps=20.0, seed=3)
    offsets = arrival_offsets_s(5, 20.0, seed=3)
    for r, scheduled in zip(records, offsets, strict=True):
        assert r.success and r.scheduled_s == pytest.approx(scheduled)
        assert 0 <= r.send_s - r.scheduled_s < 0.2


@pytest.mark.parametrize(
    "mode, chunk_source",
    [("multi", "tokenizer_estimate"), ("continuous", "continuous_usage"), ("token_ids", "token_ids")],
)
def test_multi_token_chunks(mode: str, chunk_source: str):
    _, _, records = run_against_fake(reqs(2, 5), tokenizer=WordTokenizer(), extra_body={"fake_mode": mode})
    per_chunk = [2, 2, 1] if mode == "multi" else [1] * 5
    for r in records:
        assert r.success, r.error
        assert r.num_output_tokens == 5 and r.chunk_num_tokens == per_chunk
        assert r.chunk_tokens_source == chunk_source
        lat = request_latency(r)
        assert len(lat.itls_s) == 4
        if mode == "multi":  # the first chunk's second token came with it; the next chunks' gaps split in two
            assert lat.itls_s[0] == 0.0 and lat.itls_s[1] == lat.itls_s[2]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_a_chunk_per_token_without_text_then_a_closing_chunk(endpoint: str):
    """llama.cpp streams a chunk for every token, empty while its text is held back, then a closing chunk with
    finish_reason and usage: every token chunk counts once (spreading the tokens over the chunks with text
    instead moved the first and last token and shrank TPOT)."""
    _, _, records = run_against_fake(reqs(1, 5), endpoint=endpoint, extra_body={"fake_mode": "held_back"})
    (r,) = records
    assert r.success and r.num_output_tokens == 5 and r.chunk_num_tokens == [1] * 5
    assert r.chunk_tokens_source == "one_per_chunk" and r.generated_text == " w w"
    lat = request_latency(r)
    assert FIRST_DELAY_S <= lat.ttft_from_send_s < FIRST_DELAY_S + 0.25
    assert len(lat.itls_s) == 4 and all(GAP_S * 0.9 <= x < GAP_S + 0.25 for x in lat.itls_s)


def test_chat_role_chunk_is_not_the_first_token():
    _, _, records = run_against_fake(reqs(2, 3), endpoint="/v1/chat/completions")
    for r in records:
        assert r.success and r.num_output_tokens == 3 and r.chunk_num_tokens == [1, 1, 1]
        assert request_latency(r).ttft_from_send_s >= FIRST_DELAY_S


def test_no_usage_counts_with_the_tokenizer():
    _, _, records = run_against_fake(
        reqs(1, 3), tokenizer=WordTokenizer(), extra_body={"fake_mode": "no_usage"}
    )
    (r,) = records
    assert r.success and r.num_output_tokens == 3 and r.output_tokens_source == "tokenizer"
    assert r.server_prompt_len is None


def test_http_errors_are_reported_not_raised():
    _, _, records = run_against_fake(reqs(3), extra_body={"fake_mode": "http_error"})
    s = summarize(records)
    assert s.num_failed == 3 and s.num_succeeded == 0
    assert s.errors == ["HTTP 400: max_tokens is too large"] and s.error_counts[s.errors[0]] == 3


def test_error_in_stream_is_a_failure():
    _, _, records = run_against_fake(reqs(2, 6), extra_body={"fake_mode": "stream_error"})
    assert all(not r.success and "engine died" in r.error for r in records)


def test_unreachable_endpoint():
    with socket.socket() as s:  # a loopback port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    requests = reqs(3)
    cfg = LoadConfig(base_url=f"http://127.0.0.1:{port}")
    result = asyncio.run(run_load(requests, cfg))
    assert result.fatal_error is not None and "cannot connect" in result.fatal_error
    s = summarize(finalize_all(result, requests, cfg))
    assert s.num_failed == 3 and "cannot connect" in s.errors[0]


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"base_url": "localhost:8000"}, "--base-url"),
        ({"endpoint": "/v1/embeddings"}, "--endpoint"),
        ({"request_rate_rps": 0.0}, "--request-rate"),
        ({"burstiness": 0.0}, "--burstiness"),
        ({"max_concurrency": 0}, "--max-concurrency"),
    ],
)
def test_bad_config_names_the_flag(kwargs: dict[str, Any], flag: str):
    cfg = LoadConfig(**{"base_url": "http://127.0.0.1:1", **kwargs})
    with pytest.raises(ValueError, match=flag):
        cfg.validate()


# ---- `lmserve bench serve` end to end against the fake server ------------------------------------------


@contextlib.contextmanager
def fake_server_in_thread() -> Iterator[str]:
    """The fake server on its own event loop in a thread, so the CLI can run its own asyncio.run."""
    loop = asyncio.new_event_loop()
    started: list[Any] = []
    ready = threading.Event()

    async def start() -> None:
        runner = web.AppRunner(FakeServer().app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        started.append((runner, site._server.sockets[0].getsockname()[1]))
        ready.set()

    thread = threading.Thread(
        target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True
    )
    thread.start()
    assert ready.wait(10)
    runner, port = started[0]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_cli_bench_serve_writes_report(tokenizer_dir, tmp_path, capsys):
    from lmserve.entrypoints.cli import main

    out = tmp_path / "serve.json"
    with fake_server_in_thread() as url:
        argv = ["bench", "serve", "--base-url", url, "--tokenizer", str(tokenizer_dir), "--num-requests", "4"]
        argv += ["--input-len", "8", "--output-len", "3", "--request-rate", "50", "--max-concurrency", "2"]
        argv += ["--goodput", "ttft:1000", "tpot:1000", "--warmup-requests", "1", "--no-progress"]
        argv += ["--output-json", str(out), "--plot"]
        assert main(argv) == 0
    text = capsys.readouterr().out
    assert "requests succeeded / failed" in text and "4 / 0" in text and "TPOT (ms)" in text
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert s["num_succeeded"] == 4 and s["slo_attainment_pct"] == 100.0 and s["target_rate_rps"] == 50.0
    assert s["max_concurrency"] == 2 and s["output_len_matched_pct"] == 100.0
    assert doc["args"]["request_rate"] == 50.0 and "api_key" not in doc["args"]
    assert len(doc["requests"]) == 4 and doc["requests"][0]["chunk_num_tokens"] == [1, 1, 1]
    assert doc["run"]["model"] == "fake-model"
    assert (tmp_path / "serve_latency_cdf.png").exists() and (tmp_path / "serve_throughput.png").exists()


def test_cli_bench_serve_unreachable_is_reported(tokenizer_dir, tmp_path, capsys):
    from lmserve.entrypoints.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "down.json"
    argv = ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--tokenizer", str(tokenizer_dir)]
    argv += ["--num-requests", "2", "--input-len", "4", "--output-len", "2", "--output-json", str(out)]
    assert main(argv + ["--no-progress"]) == 1
    captured = capsys.readouterr()
    assert "cannot connect" in captured.err and "Traceback" not in captured.err + captured.out
    doc = json.loads(out.read_text())
    assert doc["summary"]["num_failed"] == 2 and "cannot connect" in doc["summary"]["errors"][0]
    assert main(argv[:-2] + ["--goodput", "ttft"]) == 2
    assert "--goodput" in capsys.readouterr().err
