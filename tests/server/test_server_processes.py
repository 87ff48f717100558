"""`lmserve serve` with engine-core processes, as real processes: a core killed with -9 mid-stream (the
stream ends with an error, /health says so, new requests get 503), no process left after SIGTERM, and the
Ray backend serving a request through a Ray-actor engine core."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import require_extra
from tests.server.test_server import MODEL_NAME, LiveServer, live_servers, make_chat_model, metrics

pytestmark = pytest.mark.slow  # process-split servers: in `-m slow` (CI runs it), out of the default run


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for c in children(todo.pop()):
            found.append(c)
            todo.append(c)
    return found


def core_pids(pid: int) -> list[int]:
    """The engine-core processes (spawned children running lmserve's core, not multiprocessing's tracker)."""
    pids = []
    for c in children(pid):
        cmdline = Path(f"/proc/{c}/cmdline").read_bytes()
        if b"spawn_main" in cmdline:
            pids.append(c)
    return pids


def gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


@pytest.fixture(scope="module")
def chat_model(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_model(llama_dir, tmp_path_factory.mktemp("procs") / "model")


@pytest.fixture
def start_server(chat_model: Path, tmp_path: Path) -> Iterator:
    with live_servers(chat_model, tmp_path, 180) as start:
        yield start


def _stream_killing_the_core(srv: LiveServer) -> list[dict]:
    """A long stream's events; after its second event the engine core is killed with -9."""
    body = {"model": MODEL_NAME, "prompt": "long story", "max_tokens": 240, "stream": True, "ignore_eos": True}
    events = []
    with httpx.Client(timeout=30) as c, c.stream("POST", srv.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                if len(events) == 2:
                    for pid in core_pids(srv.proc.pid):
                        os.kill(pid, signal.SIGKILL)
    return events


def test_kill_9_of_the_engine_core_mid_stream(start_server) -> None:
    srv = start_server()
    assert len(core_pids(srv.proc.pid)) == 1
    t0 = time.monotonic()
    events = _stream_killing_the_core(srv)
    assert time.monotonic() - t0 < 20
    assert "choices" in events[0] and "error" in events[-1], events[-3:]
    assert events[-1]["error"]["code"] == "engine_dead" and "engine core 0 died" in events[-1]["error"]["message"]
    assert sum(len(e["choices"][0]["text"]) > 0 for e in events if "choices" in e) < 240
    health = httpx.get(srv.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "dead"
    assert "engine core 0 died: killed by signal 9" in health.json()["error"]
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    m = metrics(srv)  # the dead core's gauges read 0 (the stream was running there), its failed request counted
    assert m["lmserve:num_requests_running"] == m["lmserve:kv_cache_usage_perc"] == m["lmserve:engine_alive"] == 0
    assert m["lmserve:num_failed_requests_total"] == 1


def test_sigterm_leaves_no_process_behind(start_server) -> None:
    srv = start_server("--data-parallel-size", "2", "--num-threads", "1")
    cores = core_pids(srv.proc.pid)
    assert len(cores) == 2
    everyone = descendants(srv.proc.pid)
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200
    health = httpx.get(srv.url + "/health").json()
    assert health == {"status": "ok"}
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(30) in (0, -signal.SIGTERM), srv.log()  # uvicorn re-raises the signal it handled
    deadline = time.monotonic() + 5
    while not all(gone(p) for p in everyone):
        assert time.monotonic() < deadline, [p for p in everyone if not gone(p)]
        time.sleep(0.05)


@pytest.mark.slow
def test_ray_backend_serves_a_request(start_server, monkeypatch: pytest.MonkeyPatch) -> None:
    require_extra("ray", "ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    srv = start_server("--distributed-executor-backend", "ray", "--num-threads", "1")
    assert "engine core(s) ready (ray backend" in srv.log()
    r = httpx.post(
        srv.url + "/v1/completions",
        json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    m = httpx.get(srv.url + "/metrics").text
    assert "lmserve:generation_tokens_total" in m
