"""`lmserve memory` subcommand, driven through a parser built here (not cli.py)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmserve.entrypoints.memory_cli import add_memory_parser, run_memory
from lmserve.memory.presets import get_preset

GiB = 2**30


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmserve")
    sub = parser.add_subparsers(dest="command")
    add_memory_parser(sub)
    return parser


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    args = _parser().parse_args(["memory", *argv])
    assert args.func is run_memory
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_defaults() -> None:
    args = _parser().parse_args(["memory", "--preset", "llama-2-7b"])
    # weight dtype None: bf16, or fp32 for a GGUF (what lmserve holds after dequantizing; tests/gguf/test_gguf.py)
    assert (args.seq_len, args.batch, args.kv_dtype, args.weight_dtype) == (4096, 1, "bf16", None)
    assert (args.memory, args.reserve, args.block_size, args.tp, args.json) == (None, "0", 16, 1, False)


def test_table_llama2_7b(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(
        ["--preset", "llama-2-7b", "--batch", "16", "--memory", "80GB", "--reserve", "5GB"], capsys
    )
    assert rc == 0 and err == ""
    assert "6,738,415,616" in out
    assert "512.00 KiB (524,288 B)" in out
    assert "2.00 GiB" in out  # per 4096-token request
    assert "32.00 GiB" in out  # batch of 16
    assert "28 × 4,096 tokens" in out
    assert "1× smaller" in out  # MHA: no GQA saving


def test_the_disk_tier(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(["--preset", "llama-3-8b", "--kv-cache-disk-gib", "64", "--json"], capsys)
    assert rc == 0
    d = json.loads(out)
    file_bytes = 52 + 16 * 131_072  # a block file: its header and 16 tokens of 128 KiB
    assert d["kv_disk_blocks"] == 64 * GiB // file_bytes == 32_767
    assert d["kv_disk_tokens"] == 16 * 32_767 and d["kv_disk_prompts"] == 32_767 // 256
    rc, out, _ = _run(["--preset", "llama-3-8b", "--kv-cache-disk-gib", "64"], capsys)
    assert rc == 0 and "127 prompts of 4,096 tokens" in out
    rc, _, err = _run(["--preset", "llama-3-8b", "--kv-cache-disk-gib", "0"], capsys)
    assert rc == 2 and "--kv-cache-disk-gib must be a positive number" in err
    rc, _, err = _run(["--preset", "llama-3-8b", "--kv-cache-disk-gib", "inf"], capsys)
    assert rc == 2 and "--kv-cache-disk-gib must be a positive number" in err


def test_json_llama3_8b_128k(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(["--preset", "llama-3-8b", "--seq-len", "131072", "--json"], capsys)
    assert rc == 0
    d = json.loads(out)
    assert d["num_parameters"] == 8_030_261_248
    assert d["kv_bytes_per_token"] == 131_072
    assert d["kv_bytes_per_request"] == 16 * GiB
    assert d["mha_kv_bytes_per_token"] == 4 * d["kv_bytes_per_token"]
    assert d["gqa_factor"] == 4.0
    assert d["max_concurrent_requests"] is None  # no --memory given


def test_json_with_budget_and_tp(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(
        ["--preset", "llama-3.1-70b", "--tp", "4", "--memory", "80GiB", "--reserve", "2G", "--json"], capsys
    )
    assert rc == 0
    d = json.loads(out)
    assert d["tp"] == 4 and d["kv_heads_per_rank"] == 2
    assert d["memory_bytes"] == 80 * GiB and d["reserve_bytes"] == 2 * GiB
    assert d["kv_bytes_per_token_per_rank"] * 4 == d["kv_bytes_per_token"]
    assert d["weights_fit"] is True and d["max_concurrent_requests"] > 0


def test_batch_8_x_2048(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(["--preset", "llama-2-7b", "--batch", "8", "--seq-len", "2048", "--json"], capsys)
    assert rc == 0 and json.loads(out)["kv_bytes_batch"] == 8 * GiB


def test_model_dir_and_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(dict(get_preset("qwen2.5-0.5b").config)))
    rc, out, _ = _run(["--model", str(tmp_path), "--json"], capsys)
    assert rc == 0 and json.loads(out)["num_parameters"] == 494_032_768
    rc, out, _ = _run(["--config", str(tmp_path / "config.json"), "--json"], capsys)
    assert rc == 0 and json.loads(out)["num_parameters"] == 494_032_768


def test_list_presets(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(["--list-presets"], capsys)
    assert rc == 0
    for name in ("llama-2-7b", "llama-3-8b", "llama-3.1-70b", "mistral-7b", "qwen2.5-7b", "qwen2.5-0.5b"):
        assert name in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "--preset"),
        (["--preset", "gpt-5"], "known presets: llama-2-7b"),
        (["--preset", "llama-2-7b", "--memory", "80XB"], "--memory"),
        (["--preset", "llama-2-7b", "--memory", "0"], "--memory must be positive"),
        (["--preset", "llama-2-7b", "--reserve", "lots"], "--reserve"),
        (["--preset", "llama-2-7b", "--memory", "1GiB", "--reserve", "2GiB"], "--reserve"),
        (["--preset", "llama-2-7b", "--kv-dtype", "fp4"], "--kv-dtype"),
        (["--preset", "llama-2-7b", "--weight-dtype", "int3"], "--weight-dtype"),
        (["--preset", "llama-2-7b", "--seq-len", "0"], "--seq-len"),
        (["--preset", "llama-2-7b", "--batch", "-1"], "--batch"),
        (["--preset", "llama-2-7b", "--block-size", "0"], "--block-size"),
        (["--preset", "llama-2-7b", "--tp", "3"], "tp (3)"),
        (["--model", "/nonexistent/model/dir"], "not found"),
    ],
)
def test_errors_return_2_with_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = _run(argv, capsys)
    assert rc == 2
    assert out == ""
    assert err.startswith("lmserve memory: error:")
    assert message in err


def test_config_missing_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4096, "num_attention_heads": 32}))
    rc, _, err = _run(["--model", str(tmp_path)], capsys)
    assert rc == 2
    assert "num_hidden_layers" in err and "vocab_size" in err


def test_namespace_with_two_sources_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(["memory", "--preset", "llama-2-7b"])
    args.config = "x.json"
    assert run_memory(args) == 2
    assert "only one" in capsys.readouterr().err


def test_subprocess_json_parses() -> None:
    code = (
        "import argparse, sys\n"
        "from lmserve.entrypoints.memory_cli import add_memory_parser\n"
        "p = argparse.ArgumentParser(prog='lmserve'); add_memory_parser(p.add_subparsers())\n"
        "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))\n"
    )
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    ok = subprocess.run(
        [sys.executable, "-c", code, "memory", "--preset", "mistral-7b", "--memory", "24GiB", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["num_parameters"] == 7_241_732_096
    bad = subprocess.run(
        [sys.executable, "-c", code, "memory", "--preset", "nope"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert bad.returncode == 2 and "unknown preset" in bad.stderr
