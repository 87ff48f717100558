"""`lmserve serve` as a real process on a loopback port, driven by the official `openai` client.

One server per module (tiny random Llama with a ChatML template); every test leaves it idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.test_server_logprobs import token_bytes

MODEL_NAME = "tiny"
MAX_MODEL_LEN = 256
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_chat_model(src: Path, dst: Path) -> Path:
    """A copy of a test model whose tokenizer_config.json carries a chat template."""
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHATML
    cfg_path.write_text(json.dumps(cfg))
    return dst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, model_dir: Path, log_path: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            sys.executable, "-m", "lmserve.entrypoints.cli", "serve", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", MODEL_NAME,
            "--num-kv-blocks", "512", "--max-model-len", str(MAX_MODEL_LEN), "--no-access-log", *extra,
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1", LMSERVE_API_KEY="")
        self._log = open(log_path, "w")  # a file, not a pipe: nobody must drain it
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy after {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()


@contextlib.contextmanager
def live_servers(model_dir: Path, log_dir: Path, healthy_s: float) -> Iterator[Callable[..., LiveServer]]:
    """A factory of LiveServers on model_dir (extra `lmserve serve` flags each), every one healthy within
    healthy_s when returned; those still running are stopped on exit."""
    started: list[LiveServer] = []

    def start(*extra: str) -> LiveServer:
        srv = LiveServer(model_dir, log_dir / f"server{len(started)}.log", *extra)
        started.append(srv)
        srv.wait_healthy(healthy_s)
        return srv

    try:
        yield start
    finally:
        for srv in started:
            if srv.proc.poll() is None:
                srv.stop()


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("serve")
    srv = LiveServer(make_chat_model(llama_dir, root / "model"), root / "server.log")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def metrics(server: LiveServer) -> dict[str, float]:
    """Every sample of /metrics as {'name{label=value,...}': value} (labels sorted, model_name dropped)."""
    text = httpx.get(server.url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def idle(server: LiveServer) -> bool:
    m = metrics(server)
    return m["lmserve:num_requests_running"] == 0 and m["lmserve:num_requests_waiting"] == 0


# ---- start-up, models ---------------------------------------------------------------------------


def test_startup_log_line_and_models(server: LiveServer, client: openai.OpenAI) -> None:
    line = next((ln for ln in server.log().splitlines() if "serving" in ln and "KV pool" in ln), None)
    assert line is not None, server.log()
    # tiny llama: 2 layers x 2 KV heads x head_dim 16 x 2 (K, V) x 4 B = 512 B/token; 8192 tokens = 4 MiB
    for part in ("dtype=float32", "device=cpu", "512 blocks", "8192 tokens", "(4.00 MiB, 512 B/token)", server.url):
        assert part in line, (part, line)
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


# ---- completions --------------------------------------------------------------------------------


def test_completion_usage_and_finish(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL_NAME, prompt="def fib(n):", max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion" and r.model == MODEL_NAME and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7 and r.usage.prompt_tokens > 0


def test_completion_stream_concatenates_to_non_streamed(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL_NAME, prompt="The quick brown fox", max_tokens=16, temperature=1.0, seed=1234, n=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    full = client.completions.create(**kwargs)
    texts = {0: "", 1: ""}
    finish = {}
    usage = None
    chunks = 0
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        chunks += 1
        assert len(chunk.choices) <= 1, "one event per choice"
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in full.choices}
    assert finish == {0: "length", 1: "length"}
    assert chunks > 3, "several events, not one blob"
    assert (
        usage is not None
        and usage.completion_tokens == 32
        and usage.prompt_tokens == full.usage.prompt_tokens
    )


def test_completion_several_prompts_and_token_ids(server: LiveServer, client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL_NAME,
        prompt=["hello", "world"],
        n=2,
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 12
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "hello"}).json()["tokens"]
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json() == {"prompt": "hello"}
    by_ids = client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert by_ids.choices[0].text == r.choices[0].text
    nested = client.completions.create(model=MODEL_NAME, prompt=[ids, ids], max_tokens=2, temperature=0)
    assert len(nested.choices) == 2


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL_NAME,
        prompt="import os",
        max_tokens=5,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    # a random model emits parts of characters (named bytes:\\x..): the tokens' bytes are the text
    assert b"".join(token_bytes(t) for t in lp.tokens).decode("utf-8", "replace") == r.choices[0].text
    for _tok, tok_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert tok_lp <= 0 and 1 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(tok_lp, abs=1e-5), "greedy: the chosen token is the top one"


def test_stop_strings(client: openai.OpenAI) -> None:
    base = dict(
        model=MODEL_NAME, prompt="class Foo:", max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    text = client.completions.create(**base).choices[0].text
    assert len(text) > 8
    stop = text[4:7]
    cut = client.completions.create(stop=[stop], **base).choices[0]
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == "stop" and cut.model_extra["stop_reason"] == stop
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(stop=[stop], stream=True, **base) if c.choices
    )
    assert streamed == cut.text


def test_min_tokens_holds_back_stop_strings(client: openai.OpenAI) -> None:
    """No stop string may end in the first min_tokens tokens' text; the first one after them cuts (both modes)."""
    m = 8
    base = dict(model=MODEL_NAME, prompt="class Foo:", temperature=0, extra_body={"ignore_eos": True})
    head = client.completions.create(max_tokens=m, **base).choices[0].text  # the first m tokens' text
    text = client.completions.create(max_tokens=24, **base).choices[0].text
    assert text.startswith(head) and not head.endswith("\ufffd")
    stop = next(ch for ch in head if ch in text[len(head) :])  # occurs inside the first m tokens and after
    base["extra_body"] = {"ignore_eos": True, "min_tokens": m}
    cut = client.completions.create(max_tokens=24, stop=[stop], **base)
    choice = cut.choices[0]
    assert choice.text == text[: text.index(stop, len(head))]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    assert cut.usage.completion_tokens > m
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(max_tokens=24, stop=[stop], stream=True, **base)
        if c.choices
    )
    assert streamed == choice.text


def test_cached_tokens_on_repeated_prompt(client: openai.OpenAI, server: LiveServer) -> None:
    prompt = "A unique prefix for the prefix cache test: " + " ".join(f"w{i}" for i in range(30))
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens >= 32
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < second.usage.prompt_tokens
    # POST /reset_prefix_cache (vLLM's): the engine core forgets its prefixes before the next request
    r = httpx.post(server.url + "/reset_prefix_cache", timeout=30)
    assert r.status_code == 200, r.text
    third = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert third.usage.prompt_tokens_details.cached_tokens == 0 and third.choices[0].text == first.choices[0].text


# ---- chat ---------------------------------------------------------------------------------------


def test_chat_and_stream_agree(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL_NAME,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
        max_tokens=10, temperature=0.8, seed=7, n=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    full = client.chat.completions.create(**kwargs)
    assert full.object == "chat.completion" and len(full.choices) == 2
    assert all(c.message.role == "assistant" and c.finish_reason == "length" for c in full.choices)
    assert full.usage.completion_tokens == 20
    texts: dict[int, str] = {0: "", 1: ""}
    roles: dict[int, list[str]] = {0: [], 1: []}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        assert chunk.object == "chat.completion.chunk" and len(chunk.choices) == 1
        for c in chunk.choices:
            if c.delta.role:
                assert texts[c.index] == "", "role comes first"
                roles[c.index].append(c.delta.role)
            texts[c.index] += c.delta.content or ""
    assert roles == {0: ["assistant"], 1: ["assistant"]}
    assert texts == {c.index: c.message.content for c in full.choices}


def test_chat_logprobs_and_max_completion_tokens(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace") == r.choices[0].message.content
    assert all(token_bytes(t.token) == bytes(t.bytes) for t in content)
    assert all(
        len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content
    )


# ---- errors over the wire -----------------------------------------------------------------------


def test_bad_requests_over_http(server: LiveServer, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="x" * 10, max_tokens=MAX_MODEL_LEN)
    err = e.value.body
    assert err["type"] == "invalid_request_error" and err["param"] == "max_tokens"
    assert str(MAX_MODEL_LEN) in err["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "wizard", "content": "x"}])
    assert e.value.body["param"] == "messages[0].role"
    r = httpx.post(
        server.url + "/v1/completions",
        content=b'{"prompt": "x", ',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x" * (5 * 2**20)})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/health").status_code == 200


def test_bad_text_is_a_400_and_the_connection_stays_usable(server: LiveServer) -> None:
    """A lone surrogate (legal JSON, not Unicode) used to be a 500 after which uvicorn dropped the keep-alive
    connection: now a 400 naming the field, and the next request goes over the same connection."""
    bad = [
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "abc\ud800", "max_tokens": 4}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages[0].content"),
        ("/tokenize", {"prompt": "x\ud83d"}, "prompt"),
    ]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        local_addrs = set()
        for path, body, param in bad:
            r = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert r.headers.get("connection", "").lower() != "close"
            local_addrs.add(r.extensions["network_stream"].get_extra_info("client_addr"))
            r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "ok", "max_tokens": 2})
            assert r.status_code == 200
            local_addrs.add(r.extensions["network_stream"].get_extra_info("client_addr"))
        assert len(local_addrs) == 1, f"the connection was replaced: {local_addrs}"


# ---- disconnects, load, metrics -----------------------------------------------------------------


def test_disconnect_mid_stream_aborts_and_frees_kv(server: LiveServer) -> None:
    wait_until(lambda: idle(server))
    before = metrics(server)
    body = {
        "model": MODEL_NAME,
        "prompt": "long story",
        "max_tokens": 240,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=30) as c, c.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        first = next(ln for ln in lines if ln.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
    # the connection is closed here, long before 240 tokens
    key = "lmserve:num_aborted_requests_total"
    wait_until(lambda: metrics(server)[key] == before[key] + 1)
    wait_until(lambda: metrics(server)["lmserve:kv_cache_usage_perc"] == 0.0)
    after = metrics(server)
    reason = "lmserve:request_success_total{finished_reason=abort}"
    assert after[reason] == before[reason] + 1
    assert after["lmserve:generation_tokens_total"] - before["lmserve:generation_tokens_total"] < 240


class HealthProbe:
    """Time-to-first-byte of GET /health, sampled from its own thread while the test loads the server."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies_s: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as h:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                with h.stream("GET", "/health") as r:
                    assert r.status_code == 200
                    self.latencies_s.append(time.perf_counter() - t0)
                self._stop.wait(0.05)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_200_concurrent_streams_nothing_lost(server: LiveServer) -> None:
    num = 200

    async def run() -> list[tuple[str, int, str]]:
        aclient = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120
        )

        async def one(i: int) -> tuple[str, int, str]:
            text, finish, usage = "", None, None
            stream = await aclient.completions.create(
                model=MODEL_NAME, prompt=f"request {i}:", max_tokens=4, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )  # fmt: skip
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    text += c.text
                    finish = c.finish_reason or finish
            return text, usage.completion_tokens, finish

        try:
            return await asyncio.gather(*(one(i) for i in range(num)))
        finally:
            await aclient.close()

    with HealthProbe(server.url) as probe:
        results = asyncio.run(run())
    assert len(results) == num
    assert all(n == 4 and finish == "length" for _, n, finish in results)
    # the same prompt greedily decoded alone gives the same text: batching lost or mixed nothing
    alone = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).completions.create(
        model=MODEL_NAME, prompt="request 17:", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert results[17][0] == alone.choices[0].text
    # the engine loop does not block the HTTP loop: /health answers quickly even during the burst
    lat = sorted(probe.latencies_s)
    print(f"/health under load: n={len(lat)} median={lat[len(lat) // 2]:.3f}s max={lat[-1]:.3f}s")
    assert lat and lat[len(lat) // 2] < 0.5 and lat[-1] < 3.0, lat
    wait_until(lambda: metrics(server)["lmserve:kv_cache_usage_perc"] == 0.0)


def test_http_flood_does_not_stall_the_engine(server: LiveServer) -> None:
    """A long generation's decode speed under a flood of cheap HTTP requests stays within a small factor."""
    body = {"model": MODEL_NAME, "prompt": "timing", "max_tokens": 120, "temperature": 0, "ignore_eos": True}

    def decode_s() -> float:
        t0 = time.perf_counter()
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 120
        return time.perf_counter() - t0

    quiet = min(decode_s() for _ in range(2))

    async def flood(stop: threading.Event) -> int:
        sent = 0
        async with httpx.AsyncClient(base_url=server.url) as c:
            while not stop.is_set():
                await asyncio.gather(
                    *(c.post("/v1/completions", content=b"{bad json") for _ in range(10)),
                    c.get("/metrics"), c.get("/v1/models"),
                )  # fmt: skip
                sent += 12
        return sent

    stop = threading.Event()
    result: list[int] = []
    flooder = threading.Thread(target=lambda: result.append(asyncio.run(flood(stop))))
    flooder.start()
    try:
        # several generations, so the flood is well under way whatever the engine's speed
        busy = statistics.mean(decode_s() for _ in range(4))
    finally:
        stop.set()
        flooder.join()
    print(f"120-token request: quiet {quiet:.3f}s, under a flood of {result[0]} HTTP requests {busy:.3f}s")
    assert result[0] > 50
    assert busy < 10 * quiet + 2.0


def test_metrics_counters_match_what_was_sent(server: LiveServer, client: openai.OpenAI) -> None:
    wait_until(lambda: idle(server))
    before = metrics(server)
    prompts = ["one", "two three", "four five six"]
    prompt_tokens = 0
    for i, prompt in enumerate(prompts):
        r = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=i + 2, temperature=0, extra_body={"ignore_eos": True}
        )
        prompt_tokens += r.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="", max_tokens=2)
    after = metrics(server)

    def delta(key: str) -> float:
        return after[key] - before.get(key, 0.0)

    assert delta("lmserve:prompt_tokens_total") == prompt_tokens
    assert delta("lmserve:generation_tokens_total") == 2 + 3 + 4
    assert delta("lmserve:request_success_total{finished_reason=length}") == 3
    assert delta("lmserve:e2e_request_latency_seconds_count{frontend=http}") == 3
    assert delta("lmserve:time_to_first_token_seconds_count{frontend=http}") == 3
    assert delta("lmserve:request_generation_tokens_sum{frontend=http}") == 9
    assert delta("lmserve:request_prompt_tokens_sum{frontend=http}") == prompt_tokens
    assert delta("lmserve:inter_token_latency_seconds_count{frontend=http}") == (2 - 1) + (3 - 1) + (4 - 1)
    assert delta("lmserve:num_rejected_requests_total{frontend=http,reason=invalid_request}") == 1
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_time_per_output_token_seconds"):  # fmt: skip
        assert delta(f"lmserve:{name}_count{{frontend=http}}") == 3, name
    for gauge in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "num_batched_tokens",
    ):
        assert f"lmserve:{gauge}" in after
    assert {"lmserve:num_preemptions_total", "lmserve:prefix_cache_queries_total",
            "lmserve:prefix_cache_hits_total"} <= set(after)  # fmt: skip
