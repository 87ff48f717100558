"""engine/closing.py: LLM.close() / `with` / collection end every process and thread the engine started and give its
memory back; a closed engine says so. The RSS loops run in a fresh interpreter (the pytest process holds other
tests' allocations), on the bundled model."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from lmserve import LLM, SamplingParams
from lmserve.config.engine import EngineArgs
from lmserve.default_model import default_model_path
from lmserve.engine.async_engine import AsyncEngine
from lmserve.engine.closing import EngineClosedError
from lmserve.engine.llm_engine import LLMEngine
from lmserve.engine.streams import EngineDeadError

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_close_is_idempotent_and_a_closed_llm_says_so() -> None:
    with LLM(num_kv_blocks=64) as llm:
        out = llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        engine = llm.engine
    assert engine.closed and engine.runner is None, "the `with` block closed it: the model and KV pool are dropped"
    llm.close()
    llm.close()
    for use in (lambda: llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False), llm.get_metrics, lambda: llm.engine):
        with pytest.raises(EngineClosedError, match="closed"):
            use()
    with pytest.raises(EngineClosedError):
        engine.step()
    with pytest.raises(EngineClosedError):
        engine.add_request(None, [1, 2, 3], PARAMS)


def test_async_engine_shutdown_closes_its_engine() -> None:
    args = EngineArgs.from_kwargs(default_model_path(), num_kv_blocks=64)
    engine = AsyncEngine(LLMEngine.from_engine_args(args)).start()

    async def one() -> int:
        return len([o async for o in engine.generate([1, 2, 3], PARAMS)])

    assert asyncio.run(one()) >= 1
    engine.shutdown()
    engine.shutdown()
    assert engine.engine.closed and not engine.is_running
    assert "lmserve-engine" not in {t.name for t in threading.enumerate() if t.is_alive()}

    async def late() -> None:
        engine.add_request(None, [1, 2], PARAMS)

    with pytest.raises(EngineDeadError, match="shut down"):
        asyncio.run(late())


# ---- the loops: RSS back near the start after every del, no process or thread left -------------------------------

LOOP = r"""
import gc, json, os, sys, threading
import psutil
from lmserve import LLM, SamplingParams
from lmserve.checkpoint.tokenizer import load_tokenizer
from lmserve.default_model import default_model_path

kwargs, lora = json.loads(sys.argv[1]), json.loads(sys.argv[2])
load_tokenizer(default_model_path())  # (the tokenizer's imports are the process's, not an engine's)
proc = psutil.Process()
rows = [{"rss": proc.memory_info().rss}]
for i in range(3):
    llm = LLM(**kwargs)
    if lora:
        from lmserve.lora.request import LoRARequest
        req = LoRARequest("a", 1, lora)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False,
                       lora_request=req if lora else None)
    assert len(out[0].outputs[0].token_ids) == 4
    del llm, out
    rows.append({"rss": proc.memory_info().rss, "children": [c.pid for c in proc.children(recursive=True)],
                 "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("lmserve-")),
                 "shm": [f for f in os.listdir("/dev/shm") if f.startswith(f"lmserve-tp-{os.getpid()}-")]})
print(json.dumps(rows))
"""


def _loop(kwargs: dict, lora: str | None = None) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", LOOP, json.dumps(kwargs), json.dumps(lora)], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _assert_given_back(rows: list[dict]) -> None:
    start = rows[0]["rss"]
    for i, row in enumerate(rows[1:]):
        grown = (row["rss"] - start) / 2**20
        assert grown < 100, f"engine {i}: RSS {grown:.0f} MiB above the start after del"
        assert row["children"] == [] and row["threads"] == [] and row["shm"] == [], f"engine {i} left {row}"


@pytest.mark.slow
def test_tensor_parallel_engines_give_back_memory_and_ranks() -> None:
    _assert_given_back(_loop({"tensor_parallel_size": 2, "num_kv_blocks": 64}))


@pytest.mark.slow
def test_speculative_decoding_engines_give_back_memory() -> None:
    draft = default_model_path("draft")
    _assert_given_back(
        _loop({"num_kv_blocks": 64, "speculative_config": {"model": draft, "num_speculative_tokens": 2}})
    )


@pytest.mark.slow
def test_lora_engines_give_back_memory(tmp_path: Path) -> None:
    from tests.lora_helpers import build_adapter

    adapter = build_adapter(Path(default_model_path()), tmp_path / "adapter", 8, 16, ("q_proj", "v_proj"))
    _assert_given_back(_loop({"num_kv_blocks": 64, "enable_lora": True, "max_lora_rank": 8}, str(adapter)))


@pytest.mark.slow
def test_kv_producer_engines_end_their_kv_server_thread() -> None:
    _assert_given_back(_loop({"num_kv_blocks": 64, "kv_transfer_config": {"kv_role": "kv_producer"}}))
