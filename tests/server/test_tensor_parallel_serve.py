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

from lmserve.config.engine import EngineArgs
from lmserve.engine.async_engine import EngineDeadError
from lmserve.engine.core_client import EngineCoreClient
from lmserve.sampling_params import SamplingParams
from tests.engine.test_core_client import _final, greedy

pytestmark = pytest.mark.slow  # TP servers: in `-m slow` (CI runs it), out of the default run

BLOCK = 16


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


# ---- `lmserve serve --tensor-parallel-size 2` as real processes ------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.server.test_server import make_chat_model

    return make_chat_model(llama_dir, tmp_path_factory.mktemp("tp-serve") / "model")


@pytest.fixture
def serve(chat_model: Path, tmp_path: Path):  # noqa: ANN201 (a factory of LiveServers)
    from tests.server.test_server import live_servers

    with live_servers(chat_model, tmp_path, 240) as start:
        yield start


def _complete(srv, max_tokens: int = 4) -> dict:  # noqa: ANN001
    import httpx

    from tests.server.test_server import MODEL_NAME

    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_serve_tp2_then_a_killed_rank_is_503_and_sigterm_leaves_nothing(serve) -> None:  # noqa: ANN001
    import httpx

    from tests.server.test_server_processes import core_pids, descendants

    srv = serve("--tensor-parallel-size", "2", "--num-threads", "2")
    (core,) = core_pids(srv.proc.pid)
    (worker,) = _children(core)
    assert _complete(srv)["usage"]["completion_tokens"] == 4
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    os.kill(worker, signal.SIGKILL)
    t0 = time.monotonic()
    while httpx.get(srv.url + "/health").status_code != 503:
        assert time.monotonic() - t0 < 1.0, "the dead rank was not reported within 1 s"
        time.sleep(0.02)
    assert httpx.get(srv.url + "/health").json()["status"] == "dead"
    assert "tensor-parallel rank 1" in srv.log() and "died" in srv.log()
    srv2 = serve("--tensor-parallel-size", "2", "--num-threads", "2")
    everyone = descendants(srv2.proc.pid)
    assert len(everyone) >= 2
    srv2.proc.send_signal(signal.SIGTERM)
    assert srv2.proc.wait(30) in (0, -signal.SIGTERM), srv2.log()
    deadline = time.monotonic() + 5
    while not all(_gone(p) for p in everyone):
        assert time.monotonic() < deadline, [p for p in everyone if not _gone(p)]
        time.sleep(0.05)


@pytest.mark.slow
def test_ray_backend_serves_tp2(serve, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    from tests.helpers import require_extra

    require_extra("ray", "ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    srv = serve("--distributed-executor-backend", "ray", "--tensor-parallel-size", "2", "--num-threads", "2")
    assert "engine core(s) ready (ray backend" in srv.log()
    assert _complete(srv, 6)["usage"]["completion_tokens"] == 6
    # the core actor's log line (Ray forwards it to the server's output only sometimes; its own file has it)
    line = "tensor parallel: 2 ranks (workers Ray actors"
    logs = [srv.log()] + [p.read_text(errors="replace") for p in Path("/tmp/ray/session_latest/logs").glob("worker-*")]
    assert any(line in text for text in logs), "rank 1 should be a Ray actor in the core's placement group"
