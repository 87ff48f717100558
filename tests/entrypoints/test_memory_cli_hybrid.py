"""`lmserve memory` for hybrid models from a Hub id whose cache holds config.json alone (offline): Qwen3.5-9B's and
Qwen3-Next-80B-A3B's KV per token (full-attention layers only), state per sequence and the slots a budget gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.checkpoint.test_hub import COMMIT, hf_cache, lay_out_cache  # noqa: F401 (hf_cache: a fixture)
from tests.entrypoints.test_memory_cli import _run
from tests.memory.test_hybrid import QWEN3_5_9B, QWEN3_NEXT_80B

STATE_PER_LAYER = (8192 * 3 + 32 * 128 * 128) * 4  # conv window 8192 x 3 and 32 heads x 128 x 128, float32


@pytest.mark.parametrize(
    ("repo", "config", "kv_per_token", "linear_layers", "memory"),
    [
        ("Qwen/Qwen3.5-9B", QWEN3_5_9B, 32768, 24, "80GB"),
        ("Qwen/Qwen3-Next-80B-A3B-Instruct", QWEN3_NEXT_80B, 24576, 36, "200GB"),  # (160 GB of bf16 weights)
    ],
)
def test_hub_config_alone_gives_kv_and_state(
    hf_cache: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    repo: str,
    config: dict,
    kv_per_token: int,
    linear_layers: int,
    memory: str,
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    files = tmp_path / "files"
    files.mkdir()
    (files / "config.json").write_text(json.dumps(config))
    lay_out_cache(hf_cache, repo, files, COMMIT)
    rc, out, err = _run(["--model", repo, "--memory", memory, "--seq-len", "8192", "--json"], capsys)
    assert rc == 0, err
    report = json.loads(out)
    assert report["kv_bytes_per_token"] == kv_per_token  # bf16, the full-attention layers only
    state = report["state_bytes_per_sequence"]
    assert state == linear_layers * STATE_PER_LAYER
    budget, blocks, slots = report["kv_budget_bytes_per_rank"], report["num_kv_blocks"], report["num_state_slots"]
    snapshots = report["num_state_snapshots"]
    assert snapshots == budget // 8 // state  # the prefix cache's state snapshots: 1/8 of the budget
    assert slots == 256 and blocks * 16 * kv_per_token + (slots + snapshots) * state <= budget  # all from one budget
    per_request = 8192 * kv_per_token  # 512 blocks of 16 tokens
    assert report["max_concurrent_requests"] == min(slots, blocks * 16 * kv_per_token // per_request)
    rc, table, _ = _run(["--model", repo, "--memory", memory], capsys)
    assert rc == 0 and "linear-attention state" in table and f"{linear_layers} of" in table
    assert "state snapshots" in table and f"{snapshots:,} x " in table
