"""`lmserve serve --disaggregation 1P1D` as real processes (an API process, a prefill core, a decode core): greedy
answers identical to a colocated server's (completions, chat, streaming, n = 2, a decode-side prefix hit), KV
usage 0 on both cores afterwards, a client disconnect mid-stream, and kill -9 of either core (in-flight requests
end with an error within 1 s)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.test_server import MODEL_NAME, LiveServer, make_chat_model, metrics, wait_until
from tests.server.test_server_processes import core_pids

pytestmark = pytest.mark.slow  # prefill and decode servers: in `-m slow` (CI runs it), out of the default run


@pytest.fixture(scope="module")
def pd_model(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_model(llama_dir, tmp_path_factory.mktemp("pd") / "model")


@pytest.fixture(scope="module")
def servers(pd_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, LiveServer]]:
    root = tmp_path_factory.mktemp("pd-logs")
    colocated = LiveServer(pd_model, root / "colocated.log")
    pd = LiveServer(pd_model, root / "pd.log", "--disaggregation", "1P1D", "--num-threads", "1")
    try:
        colocated.wait_healthy(240)
        pd.wait_healthy(240)
        yield colocated, pd
    finally:
        colocated.stop()
        pd.stop()


def _post(srv: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json={"model": MODEL_NAME, **body}, timeout=120)


def _strip(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def _events(srv: LiveServer, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.Client(timeout=120) as c, c.stream("POST", srv.url + path, json={"model": MODEL_NAME, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(_strip(json.loads(line[6:])))
    return events


def _per_choice(events: list[dict]) -> dict:
    """A stream's content per choice: its chunks' text, logprobs and finish reason in order; the usage."""
    out: dict = {}
    for e in events:
        for c in e.get("choices", []):
            parts = out.setdefault(c["index"], [])
            parts.append({k: v for k, v in c.items() if k != "index"})
        if e.get("usage"):
            out["usage"] = e["usage"]
    return out


def _kv_idle(srv: LiveServer) -> bool:
    m = metrics(srv)
    usages = [v for k, v in m.items() if k.startswith("lmserve:kv_cache_usage_perc")]
    return all(u == 0 for u in usages) and m["lmserve:num_requests_running"] == 0


PROMPT = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 2


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}),
        ("/v1/completions", {"prompt": "The capital of France", "max_tokens": 8, "temperature": 0, "n": 2,
                             "ignore_eos": True, "logprobs": 2}),
        ("/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0.8, "seed": 11,
                             "ignore_eos": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 10,
                                  "temperature": 0, "ignore_eos": True}),
        ("/v1/completions", {"prompt": "prompt scores", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                             "prompt_logprobs": 1, "echo": True, "logprobs": 1}),
    ],
)  # fmt: skip
def test_answers_equal_the_colocated_server(servers: tuple[LiveServer, LiveServer], path: str, body: dict) -> None:
    colocated, pd = servers
    a, b = _post(colocated, path, body), _post(pd, path, body)
    assert a.status_code == b.status_code == 200, b.text
    assert _strip(b.json()) == _strip(a.json())
    sa, sb = _events(colocated, path, {**body, "stream": True}), _events(pd, path, {**body, "stream": True})
    assert _per_choice(sb) == _per_choice(sa)  # n = 2: the choices' chunks may interleave differently
    wait_until(lambda: _kv_idle(pd))


def test_decode_side_prefix_hit_and_metrics(servers: tuple[LiveServer, LiveServer]) -> None:
    colocated, pd = servers
    system = "You are a careful assistant. " * 8
    for tail in ("first question", "second one"):
        body = {"prompt": system + tail, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        a, b = _post(colocated, "/v1/completions", body), _post(pd, "/v1/completions", body)
        assert _strip(b.json()) == _strip(a.json())
    m = metrics(pd)
    assert m['lmserve:kv_transfer_blocks_hit_total{engine=1,role=decode}'] > 0
    assert m['lmserve:kv_transfer_blocks_pulled_total{engine=1,role=decode}'] > 0
    assert m['lmserve:num_requests_running{engine=0,role=prefill}'] == 0
    wait_until(lambda: _kv_idle(pd))


def test_client_disconnect_mid_stream_frees_both_sides(servers: tuple[LiveServer, LiveServer]) -> None:
    _, pd = servers
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", pd.url + "/v1/completions", json=body) as r:
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data: ")
            if n >= 3:  # decoding on the decode core by now
                break
    wait_until(lambda: _kv_idle(pd), 10)


@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_a_killed_core_ends_in_flight_requests_within_1s(pd_model: Path, tmp_path: Path, victim: str) -> None:
    srv = LiveServer(pd_model, tmp_path / "pd.log", "--disaggregation", "1P1D", "--num-threads", "1")
    try:
        srv.wait_healthy(240)
        prefill, decode = sorted(core_pids(srv.proc.pid))  # spawned in index order: core 0 prefills
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 150, "ignore_eos": True, "stream": True}
        events, t_kill = [], None
        with httpx.Client(timeout=30) as c, c.stream("POST", srv.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if len(events) == 2:
                        t_kill = time.monotonic()
                        os.kill(decode if victim == "decode" else prefill, signal.SIGKILL)
        index = 0 if victim == "prefill" else 1
        if victim == "decode":  # the request was decoding there: it ends with an error event at once
            assert "error" in events[-1] and events[-1]["error"]["code"] == "engine_dead", events[-1]
            assert "engine core 1 (decode) died" in events[-1]["error"]["message"]
            assert time.monotonic() - t_kill < 1.0
        else:  # its KV had moved: the decode core finishes it
            assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
        r = _post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 2})  # no core of that role: refused
        assert r.status_code == 503 and f"no live {victim} engine core" in r.json()["error"]["message"], r.text
        health = httpx.get(srv.url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "dead", health.text
        assert f"engine core {index} ({victim}) died: killed by signal 9" in health.json()["error"]
        # the dead core reads dead in /metrics (its gauges 0, the request that failed with it counted) ...
        m = metrics(srv)
        dead = f"{{engine={index},role={victim}}}"
        for name in ("engine_alive", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert m[f"lmserve:{name}{dead}"] == 0, name
        assert m["lmserve:engine_alive"] == 1
        assert m[f"lmserve:num_failed_requests_total{dead}"] == (victim == "decode")
        # ... and in the dashboard feed
        with httpx.Client(timeout=10) as c, c.stream("GET", srv.url + "/v1/dashboard/stream") as feed:
            assert feed.status_code == 200
            update = json.loads(next(line for line in feed.iter_lines() if line.startswith("data: "))[6:])
        assert update["health"]["status"] == "dead" and f"no live {victim}" in update["health"]["error"]
        assert [c["alive"] for c in update["cores"]] == [victim != "prefill", victim != "decode"]
        assert update["cores"][index]["role"] == victim and update["cores"][index]["running"] == 0
    finally:
        srv.stop()


@pytest.mark.slow
def test_ray_actors_as_prefill_and_decode_cores(servers: tuple[LiveServer, LiveServer], pd_model: Path,
                                                tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from tests.helpers import require_extra

    require_extra("ray", "ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    colocated, _ = servers
    srv = LiveServer(pd_model, tmp_path / "pd-ray.log", "--disaggregation", "1P1D", "--num-threads", "1",
                     "--distributed-executor-backend", "ray")  # fmt: skip
    try:
        srv.wait_healthy(400)
        assert "1 prefill + 1 decode engine cores (ray)" in srv.log()
        body = {"prompt": "Ray actors: one prefills, one decodes. " * 3, "max_tokens": 10, "temperature": 0,
                "ignore_eos": True}  # a prompt of its own: neither server has it cached
        a, b = _post(colocated, "/v1/completions", body), _post(srv, "/v1/completions", body)
        assert b.status_code == 200, b.text
        assert _strip(b.json()) == _strip(a.json())
        assert _per_choice(_events(srv, "/v1/completions", {**body, "stream": True})) == _per_choice(
            _events(colocated, "/v1/completions", {**body, "stream": True}))
        wait_until(lambda: _kv_idle(srv))
    finally:
        srv.stop()
