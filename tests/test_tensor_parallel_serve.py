"""Tensor parallelism behind the engine-core client (what `lmserve serve --tensor-parallel-size` runs): DP = 2 x TP = 1
and DP = 1 x TP = 2 give the same outputs; a killed TP rank fails its requests within a second and the client is dead
(/health 503); shutdown leaves no worker behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from lmserve.config import EngineArgs
from lmserve.engine.async_engine import EngineDeadError
from lmserve.engine.core_client import EngineCoreClient
from lmserve.sampling_params import SamplingParams

BLOCK = 16


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


async def _final(client: EngineCoreClient, rid: str, prompt, params: SamplingParams):
    last = None
    async for out in client.add_request(rid, prompt, params):
        last = out
    return last


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def _client(llama_dir: Path, dp: int, tp: int) -> EngineCoreClient:
    config = EngineArgs.from_kwargs(
        str(llama_dir), num_kv_blocks=128, max_model_len=256, block_size=BLOCK, tensor_parallel_size=tp
    ).create_engine_config()
    return EngineCoreClient(config, data_parallel_size=dp, num_threads=tp).start()  # one thread per rank


def _run_all(client: EngineCoreClient, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    async def run():
        pairs = enumerate(zip(prompts, params, strict=True))
        return await asyncio.gather(*(_final(client, f"r-{i}", p, sp) for i, (p, sp) in pairs))

    return asyncio.run(run())


def test_dp2_tp1_equals_dp1_tp2_and_shutdown_leaves_no_process(llama_dir: Path) -> None:
    prompts = [[(7 * i + j) % 400 + 3 for j in range(5 + i)] for i in range(6)]
    params = [greedy(8), SamplingParams(max_tokens=8, temperature=0.8, seed=11, ignore_eos=True)] * 3
    outs = {}
    for dp, tp in [(2, 1), (1, 2)]:
        client = _client(llama_dir, dp, tp)
        try:
            outs[dp, tp] = [o.outputs[0].token_ids for o in _run_all(client, prompts, params)]
            pids = client.core_pids + [c for p in client.core_pids for c in _children(p)]
            if tp == 2:
                assert len(pids) == 2, f"one core and its rank-1 worker, got {pids}"
        finally:
            client.shutdown()
        t0 = time.monotonic()
        while not all(_gone(p) for p in pids) and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        assert all(_gone(p) for p in pids), f"processes outlived shutdown: {[p for p in pids if not _gone(p)]}"
    assert outs[1, 2] == outs[2, 1]


def test_killed_rank_fails_requests_and_the_client(llama_dir: Path) -> None:
    client = _client(llama_dir, 1, 2)
    try:
        (core_pid,) = client.core_pids
        (worker,) = _children(core_pid)

        async def run():
            stream = client.add_request("victim", [5, 6, 7], greedy(200))
            assert not (await stream.__anext__()).finished
            t0 = time.monotonic()
            os.kill(worker, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="tensor-parallel rank 1"):
                async for _ in stream:
                    pass
            return time.monotonic() - t0

        detected_s = asyncio.run(run())
        assert detected_s < 1.0, detected_s
        assert client.dead_error is not None  # /health answers 503 {"status": "dead"}
        t0 = time.monotonic()
        while not _gone(core_pid) and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        assert _gone(core_pid)
    finally:
        client.shutdown()
