"""The two-server form on loopback: a kv_producer server, a kv_consumer server and `lmserve router` in front; greedy
answers (streamed or not) identical to a colocated server's, KV usage 0 on both servers afterwards; the router's
start-up check of roles and KV geometry; kv_transfer_params refused where they do not belong."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lmserve.entrypoints.router_cli import check_servers
from tests.server.test_pd_server import PROMPT, _events, _per_choice, _post, _strip
from tests.server.test_server import MODEL_NAME, LiveServer, free_port, make_chat_model, metrics, wait_until

pytestmark = pytest.mark.slow  # PD servers behind the router: in `-m slow` (CI runs it), out of the default run

PRODUCER = '{"kv_connector":"lmserve","kv_role":"kv_producer","kv_lease_s":3}'
CONSUMER = '{"kv_connector":"lmserve","kv_role":"kv_consumer"}'


class RouterProcess:
    def __init__(self, prefill: str, decode: str, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        cmd = [sys.executable, "-m", "lmserve.entrypoints.cli", "router", "--prefill", prefill, "--decode", decode,
               "--port", str(self.port), "--wait-s", "240"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(self.log_path.read_text())

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(15)
        self._log.close()


@pytest.fixture(scope="module")
def two_servers(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    root = tmp_path_factory.mktemp("pd-router")
    model = make_chat_model(llama_dir, root / "model")
    started: list = []

    def start(srv):  # one at a time: a producer's KV server takes a free port, which must not be a server's
        started.append(srv)
        srv.wait_healthy(240)
        return srv

    try:
        colocated = start(LiveServer(model, root / "colocated.log"))
        producer = start(LiveServer(model, root / "producer.log", "--kv-transfer-config", PRODUCER))
        consumer = start(LiveServer(model, root / "consumer.log", "--kv-transfer-config", CONSUMER))
        router = start(RouterProcess(producer.url, consumer.url, root / "router.log"))
        yield colocated, producer, consumer, router
    finally:
        for srv in reversed(started):
            srv.stop()


def _kv_zero(srv: LiveServer) -> bool:
    return metrics(srv)["lmserve:kv_cache_usage_perc"] == 0


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}),
        ("/v1/completions", {"prompt": "The capital of France", "max_tokens": 8, "temperature": 0, "n": 2,
                             "ignore_eos": True, "logprobs": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 10,
                                  "temperature": 0, "ignore_eos": True}),
        ("/v1/completions", {"prompt": "short", "max_tokens": 1, "temperature": 0}),  # no handoff: finished at once
    ],
)  # fmt: skip
def test_router_answers_equal_the_colocated_server(two_servers: tuple, path: str, body: dict) -> None:
    colocated, producer, consumer, router = two_servers
    a, b = _post(colocated, path, body), _post(router, path, body)
    assert a.status_code == b.status_code == 200, b.text
    assert _strip(b.json()) == _strip(a.json())
    sa, sb = _events(colocated, path, {**body, "stream": True}), _events(router, path, {**body, "stream": True})
    assert _per_choice(sb) == _per_choice(sa)
    wait_until(lambda: _kv_zero(producer) and _kv_zero(consumer))


def test_kv_transfer_params_where_they_do_not_belong(two_servers: tuple) -> None:
    colocated, producer, consumer, _ = two_servers
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": True}}
    for srv in (colocated, consumer):
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and "kv_transfer_params" in r.json()["error"]["message"], r.text
    bad = {**body, "kv_transfer_params": {"do_remote_prefill": True, "request_id": 3}}
    r = httpx.post(consumer.url + "/v1/completions", json=bad, timeout=30)
    assert r.status_code == 400 and "kv_transfer_params" in r.json()["error"]["message"], r.text
    r = httpx.post(producer.url + "/v1/completions", json={**body, "best_of": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("best_of:"), r.text
    info = httpx.get(producer.url + "/v1/kv_transfer", timeout=5).json()
    assert info["kv_role"] == "kv_producer" and info["block_size"] == 16


def test_router_start_up_check_names_the_field() -> None:
    geo = {"model": "m", "vocab_size": 512, "hidden_size": 64, "block_size": 16, "kv_cache_dtype": "float32",
           "num_layers": 2, "num_kv_heads": 2, "head_dim": 16}  # fmt: skip
    urls = ["http://p", "http://d"]
    assert check_servers([{**geo, "kv_role": "kv_producer"}], [{**geo, "kv_role": "kv_consumer"}], urls) is None
    problem = check_servers([{**geo, "kv_role": "kv_producer"}], [{**geo, "kv_role": None}], urls)
    assert problem.startswith("kv_role: http://d is None")
    problem = check_servers([{**geo, "kv_role": "kv_consumer"}], [{**geo, "kv_role": "kv_consumer"}], urls)
    assert problem.startswith("kv_role: http://p")
    for key, other in (("block_size", 32), ("kv_cache_dtype", "int8"), ("model", "other")):
        problem = check_servers([{**geo, "kv_role": "kv_producer"}],
                                [{**geo, key: other, "kv_role": "kv_consumer"}], urls)  # fmt: skip
        assert problem is not None and f"{key}:" in problem, problem


def test_unpulled_kv_expires_and_a_stale_handoff_is_a_503(two_servers: tuple) -> None:
    _, producer, consumer, _ = two_servers
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    r = httpx.post(producer.url + "/v1/completions", json={**body, "kv_transfer_params": {"do_remote_decode": True}},
                   timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["producer_address"].startswith("tcp://127.0.0.1:")
    assert r.json()["usage"]["completion_tokens"] == 1 and r.json()["choices"][0]["finish_reason"] == "length"
    assert metrics(producer)["lmserve:kv_transfer_leases"] == 1 and not _kv_zero(producer)  # held for a pull
    wait_until(lambda: _kv_zero(producer), 10)  # nobody pulled: the lease (3 s) expired
    assert metrics(producer)["lmserve:kv_transfer_leases_expired_total"] >= 1
    r = httpx.post(consumer.url + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "kv_transfer_failed", r.text
    assert "no KV lease" in r.json()["error"]["message"]
    assert metrics(consumer)["lmserve:kv_transfer_failures_total"] >= 1
    wait_until(lambda: _kv_zero(producer) and _kv_zero(consumer))


def test_policy_recompute_prefills_on_the_decode_server_and_counts_it(two_servers: tuple, tmp_path: Path) -> None:
    colocated, producer, _, _ = two_servers
    config = '{"kv_connector":"lmserve","kv_role":"kv_consumer","kv_load_failure_policy":"recompute"}'
    consumer = LiveServer(Path(producer.proc.args[producer.proc.args.index("--model") + 1]), tmp_path / "c.log",
                          "--kv-transfer-config", config)  # fmt: skip
    try:
        consumer.wait_healthy(240)
        body = {"model": MODEL_NAME, "prompt": "recompute me " * 6, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        r = httpx.post(producer.url + "/v1/completions",
                       json={**body, "kv_transfer_params": {"do_remote_decode": True}}, timeout=60)  # fmt: skip
        params = r.json()["kv_transfer_params"]
        wait_until(lambda: _kv_zero(producer), 10)  # the lease (3 s) expired: the pull will fail
        got = httpx.post(consumer.url + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=60)
        ref = httpx.post(colocated.url + "/v1/completions", json=body, timeout=60)
        assert got.status_code == 200, got.text
        assert got.json()["choices"] == ref.json()["choices"]
        m = metrics(consumer)
        assert m["lmserve:kv_transfer_recomputes_total"] == 1 and m["lmserve:kv_transfer_failures_total"] == 1
        wait_until(lambda: _kv_zero(consumer))
    finally:
        consumer.stop()
