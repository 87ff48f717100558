"""`lmserve bench offline` on the tiny random Llama: lmserve engine, HF naive loop and HF static batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmserve.bench.datasets import DatasetConfig, build_requests, load_tokenizer
from lmserve.bench.metrics import request_latency
from lmserve.bench.offline import offline_runs
from lmserve.entrypoints.cli import main

ENGINE = {"num_kv_blocks": 32, "block_size": 16, "max_model_len": 128}


def test_backends_report_the_same_metrics(llama_dir: Path):
    tok = load_tokenizer(str(llama_dir))
    reqs = build_requests(DatasetConfig(num_requests=4, input_len=8, output_len=5, range_ratio=0.5), tok)
    runs = offline_runs(str(llama_dir), reqs, "all", "both", hf_batch_size=3, engine_kwargs=ENGINE)
    assert [r.label for r in runs] == ["lmserve", "hf-naive", "hf-static"]
    for run in runs:
        assert run.summary.num_succeeded == 4 and run.summary.output_len_matched_pct == 100.0, run.label
        assert run.summary.output_throughput_tok_s > 0
        for rec, q in zip(run.records, reqs, strict=True):
            assert rec.num_output_tokens == q.output_len == sum(rec.chunk_num_tokens)
            lat = request_latency(rec)
            assert 0 <= lat.ttft_s <= lat.e2e_s
            assert len(lat.itls_s) == q.output_len - 1 and all(x >= 0 for x in lat.itls_s)
    assert runs[0].info["engine"]["generation_tokens_total"] >= sum(q.output_len for q in reqs)
    # the naive loop serves one request at a time: each starts after the previous one's last token
    naive = runs[1].records
    assert all(b.send_s >= a.chunk_times_s[-1] for a, b in zip(naive, naive[1:], strict=False))
    # static batches of 3: the first three share a send time, the fourth waits for the batch
    static = runs[2].records
    assert static[0].send_s == static[1].send_s == static[2].send_s < static[3].send_s


def test_cli_writes_json_and_plot(llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "offline.json"
    argv = ["bench", "offline", "--model", str(llama_dir), "--backend", "all", "--hf-mode", "naive"]
    argv += ["--num-requests", "3", "--input-len", "6", "--output-len", "3", "--warmup-requests", "1"]
    argv += ["--num-kv-blocks", "32", "--max-model-len", "128", "--output-json", str(out), "--plot"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "offline: lmserve" in text and "hf-naive" in text and "TTFT (ms)" in text
    doc = json.loads(out.read_text())
    assert doc["summary"]["num_succeeded"] == 3 and len(doc["requests"]) == 3
    assert doc["args"]["backend"] == "all" and doc["backend"] == "lmserve"
    assert doc["other_runs"]["hf-naive"]["summary"]["num_succeeded"] == 3
    assert (tmp_path / "offline_latency_cdf.png").stat().st_size > 1000


def test_cli_bad_flag_is_a_clear_error(llama_dir: Path, capsys: pytest.CaptureFixture[str]):
    argv = ["bench", "offline", "--model", str(llama_dir), "--num-requests", "0"]
    assert main(argv) == 2
    assert "--num-requests must be >= 1" in capsys.readouterr().err
