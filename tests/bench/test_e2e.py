"""End to end: `lmserve bench serve` and `bench experiments` against a live `lmserve serve` on 127.0.0.1."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("lmserve.entrypoints.openai.serve_cli")

from lmserve.bench.harness import Workloads, lmserve_server  # noqa: E402
from lmserve.entrypoints.cli import main  # noqa: E402

SERVER_FLAGS = ["--num-kv-blocks", "64", "--block-size", "16", "--max-model-len", "256"]


CHAT_TEMPLATE = (
    "{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
)


@pytest.fixture(scope="module")
def model_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a chat template, so the chat endpoint works too."""
    out = tmp_path_factory.mktemp("chat-llama")
    for f in llama_dir.iterdir():
        shutil.copy(f, out / f.name)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def server_url(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with lmserve_server(str(model_dir), SERVER_FLAGS, log, startup_timeout_s=120) as (url, _cmd):
        yield url


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_serve_against_live_server(
    server_url: str, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], endpoint: str
):
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--base-url", server_url, "--endpoint", endpoint, "--tokenizer", str(model_dir)]
    argv += ["--num-requests", "5", "--input-len", "12", "--output-len", "6", "--range-ratio", "0.5"]
    argv += ["--request-rate", "20", "--max-concurrency", "3", "--goodput", "ttft:60000", "--no-progress"]
    argv += ["--output-json", str(out)]
    assert main(argv) == 0, capsys.readouterr()
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert s["num_succeeded"] == 5 and s["num_failed"] == 0 and s["slo_attainment_pct"] == 100.0
    assert s["output_len_matched_pct"] == 100.0  # ignore_eos: every request got exactly max_tokens
    assert s["ttft_ms"]["count"] == 5 and s["ttft_ms"]["p50"] > 0 and s["output_throughput_tok_s"] > 0
    for rec in doc["requests"]:
        assert rec["success"] and rec["output_tokens_source"] == "usage"
        assert sum(rec["chunk_num_tokens"]) == rec["num_output_tokens"] == rec["requested_output_len"]
        if endpoint == "/v1/completions":
            assert rec["server_prompt_len"] == rec["prompt_len"]  # the client's count is the server's


def test_bench_serve_reports_http_errors(server_url: str, model_dir: Path, tmp_path: Path):
    out = tmp_path / "too_long.json"
    argv = ["bench", "serve", "--base-url", server_url, "--tokenizer", str(model_dir), "--num-requests", "2"]
    argv += ["--input-len", "300", "--output-len", "4", "--no-progress", "--output-json", str(out)]
    assert main(argv) == 1  # every request refused: over max_model_len
    s = json.loads(out.read_text())["summary"]
    assert s["num_failed"] == 2 and s["errors"][0].startswith("HTTP 400")


def test_experiments_against_base_url(server_url: str, model_dir: Path, tmp_path: Path):
    out = tmp_path / "exp"
    argv = ["bench", "experiments", "--quick", "--only", "2,5", "--base-url", server_url]
    argv += ["--model", str(model_dir), "--out", str(out)]
    assert main(argv) == 0
    report = (out / "report.md").read_text()
    assert "## 2. Output length sweep" in report and "E2E ≈ TTFT + (N−1)·TPOT" in report
    assert "## 5. Static vs continuous" in report and "Skipped:" in report
    assert (out / "exp2_e2e_vs_output.png").stat().st_size > 1000
    results = json.loads((out / "results.json").read_text())
    points = results["experiments"]["2"]["points"]
    assert [p["summary"]["output_len"]["mean"] for p in points] == list(Workloads.quick().output_sweep)
    assert results["experiments"]["5"]["skipped"]
