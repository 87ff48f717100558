"""`lmserve diagnose`: --url against a live `lmserve serve` process (two scrapes around real requests), --report
on a bench JSON, argument errors."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.test_server import MODEL_NAME, LiveServer


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("diagnose")
    srv = LiveServer(llama_dir, root / "server.log", "--scheduling-policy", "static")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def _cli(*args: str, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lmserve.entrypoints.cli", "diagnose", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_url_scrapes_twice_around_the_traffic(server: LiveServer) -> None:
    proc = _cli("--url", server.url, "--window", "4", "--json", "--ttft-slo-ms", "0.001")
    assert proc.stderr.readline().startswith("scraped ")  # the first scrape is done: now the traffic
    body = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    for _ in range(3):
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    doc = json.loads(out)
    assert doc["source"] == "metrics" and doc["window_s"] == pytest.approx(4.0, abs=1.5)
    assert doc["summary"][0].startswith("3 requests finished"), doc["summary"]
    # every TTFT above 1 µs counts as high; one request at a time: prefill, not queueing, is the cause
    rules = {f["rule"] for f in doc["findings"]}
    assert "ttft_long_prefill" in rules and "ttft_static_batching" not in rules, doc


def test_report(tmp_path: Path) -> None:
    def dist(v: float) -> dict:
        return dict(count=20, mean=v, p50=v, p90=v, p95=v, p99=v, max=v, min=v)

    doc = {
        "args": {},
        "summary": dict(duration_s=5.0, total_prompt_tokens=100, total_output_tokens=100, ttft_ms=dist(40.0),
                        tpot_ms=dist(10.0), itl_ms=dist(10.0), e2e_ms=dist(200.0), prompt_len=dist(5),
                        output_len=dist(5)),
        "requests": [],
    }  # fmt: skip
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    proc = _cli("--report", str(path))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "(report)" in out and "no bottleneck found" in out and "TTFT P50 40.0 ms" in out


def test_errors(tmp_path: Path) -> None:
    proc = _cli("--report", str(tmp_path / "missing.json"))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "lmserve diagnose: error" in err
    proc = _cli("--url", "http://127.0.0.1:9", "--window", "0")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--window must be > 0" in err
