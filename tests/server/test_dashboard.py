"""The dashboard's data: LLMEngine.block_map invariants, AsyncEngine.watch_block_map (built only while watched),
and the /v1/dashboard/stream feed of a live server with an API key (auth, rate, content), the pages it serves."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lmserve import SamplingParams
from lmserve.config.engine import EngineArgs
from lmserve.engine import snapshot as engine_snapshot
from lmserve.engine.async_engine import AsyncEngine, EngineSnapshot
from lmserve.engine.llm_engine import LLMEngine
from tests.server.test_server import MODEL_NAME, LiveServer

KEY = "sk-dashboard"


def _engine(model_dir: Path, **kwargs) -> LLMEngine:
    args = dict(num_kv_blocks=32, block_size=16, max_model_len=256)
    args.update(kwargs)
    return LLMEngine.from_engine_args(EngineArgs.from_kwargs(str(model_dir), **args))


def _check(bm, engine: LLMEngine) -> None:
    """Cells = blocks; free ⇔ no owner ⇔ ref 0; ref counts = tables holding the block; owners hold their block."""
    tables = engine.kv.req_to_blocks
    assert bm.num_blocks == len(bm.ref_counts) == len(bm.cached) == engine.config.cache.num_blocks
    assert bm.request_ids == list(tables)
    counts = [0] * bm.num_blocks
    for table in tables.values():
        for b in table:
            counts[b.block_id] += 1
    assert bm.ref_counts == counts
    for b, owner in enumerate(bm.owners):
        assert (owner == -1) == (bm.ref_counts[b] == 0)
        if owner >= 0:
            assert b in [x.block_id for x in tables[bm.request_ids[owner]]]


def _step_until(engine: LLMEngine, cond) -> None:
    for _ in range(200):
        engine.step()
        if cond():
            return
    raise AssertionError("condition not reached")


def test_block_map_marks_shared_prompt_blocks_of_n_sequences(llama_dir: Path) -> None:
    engine = _engine(llama_dir)
    prompt = list(range(1, 41))  # 40 tokens: blocks 0-1 full and shared by both sequences
    engine.add_request("r", prompt, SamplingParams(n=2, max_tokens=20, temperature=1.0, seed=1, ignore_eos=True))
    _step_until(engine, lambda: all(r.num_output_tokens >= 3 for r in engine.scheduler.running))
    bm = engine.block_map()
    _check(bm, engine)
    assert sorted(bm.request_ids) == ["r#0", "r#1"]
    shared = [b for b, r in enumerate(bm.ref_counts) if r == 2]
    assert len(shared) == 2 and all(bm.cached[b] for b in shared)
    assert sum(1 for r in bm.ref_counts if r == 1) == 2  # each sequence's own tail block
    while engine.has_unfinished_requests():
        engine.step()
    after = engine.block_map()
    _check(after, engine)
    assert after.owners == [-1] * 32 and after.request_ids == []
    assert all(after.cached[b] for b in shared)  # freed but still findable: cached-reusable


def test_block_map_marks_a_shared_system_prompt(llama_dir: Path) -> None:
    engine = _engine(llama_dir)
    system = list(range(100, 148))  # 3 full blocks
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request("a", system + [5, 6, 7], params)
    engine.add_request("b", system + [8, 9], params)
    _step_until(engine, lambda: len(engine.scheduler.running) == 2)
    bm = engine.block_map()
    _check(bm, engine)
    assert [b for b, r in enumerate(bm.ref_counts) if r == 2] == [x.block_id for x in engine.kv.req_to_blocks["a"][:3]]


def test_block_map_without_prefix_caching_shares_nothing(llama_dir: Path) -> None:
    engine = _engine(llama_dir, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(100, 140)), params)
    engine.add_request("b", list(range(100, 140)), params)
    _step_until(engine, lambda: len(engine.scheduler.running) == 2)
    bm = engine.block_map()
    _check(bm, engine)
    assert max(bm.ref_counts) == 1 and not any(bm.cached)


def test_watch_block_map(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_snapshot, "BLOCK_MAP_INTERVAL_S", 0.0)
    engine = AsyncEngine(_engine(llama_dir)).start()
    try:

        async def run() -> list[EngineSnapshot]:
            seen: list[EngineSnapshot] = []
            params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            async for _ in engine.generate(list(range(1, 30)), params):
                seen.append(engine.snapshot())
            return seen

        assert all(s.block_map is None for s in asyncio.run(run()))  # nobody watches: never built
        engine.watch_block_map(True)
        watched = asyncio.run(run())
        maps = [s.block_map for s in watched if s.block_map is not None]
        assert maps and any(sum(1 for r in m.ref_counts if r) == 2 for m in maps)  # 29 prompt + tokens: 2 blocks
        engine.watch_block_map(False)
        assert all(s.block_map is None for s in asyncio.run(run())[1:])
    finally:
        engine.shutdown()


def test_snapshot_with_block_map_survives_msgspec(llama_dir: Path) -> None:
    msgspec = pytest.importorskip("msgspec")
    engine = _engine(llama_dir)
    engine.add_request("r", list(range(1, 41)), SamplingParams(n=2, max_tokens=4, ignore_eos=True))
    engine.step()
    snap = EngineSnapshot(engine.get_metrics(), 3, 0, 1.0, block_map=engine.block_map())
    back = msgspec.json.decode(msgspec.json.encode(snap), type=EngineSnapshot)
    assert back == snap


# ---- the feed of a live server ---------------------------------------------------------------


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("dashboard")
    srv = LiveServer(llama_dir, root / "server.log", "--api-key", KEY)
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def _events(
    server: LiveServer, n: int, timeout_s: float = 30.0, interval_s: float | None = None
) -> tuple[list[dict], float]:
    """The first n feed updates (every interval_s, else the default) and the seconds from the first to the last."""
    out, times = [], []
    headers = {"Authorization": f"Bearer {KEY}"}
    url = server.url + "/v1/dashboard/stream" + (f"?interval_s={interval_s}" if interval_s else "")
    with httpx.stream("GET", url, headers=headers, timeout=timeout_s) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
                times.append(time.monotonic())
                if len(out) == n:
                    break
    return out, times[-1] - times[0]


def test_pages_are_open_and_the_feed_needs_the_key(server: LiveServer) -> None:
    for path, marker in (("/", "playground.js"), ("/dashboard", "dashboard.js")):
        r = httpx.get(server.url + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html") and marker in r.text
    r = httpx.get(server.url + "/static/api.js")
    assert r.status_code == 200 and "Authorization" in r.text
    r = httpx.get(server.url + "/v1/dashboard/stream")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(server.url + "/v1/dashboard/stream", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert httpx.get(server.url + "/static/nope.js").status_code == 404


def test_feed_updates_twice_a_second_with_the_engine_state(server: LiveServer) -> None:
    events, span_s = _events(server, 4)
    assert span_s < 3 * 1.0  # three intervals, at least one update a second each
    last = events[-1]
    assert last["model"] == MODEL_NAME
    assert last["kv"]["num_blocks"] == 512 and last["kv"]["used"] + last["kv"]["free"] == 512
    bm = last["block_map"]  # the watch is applied by the second update
    assert bm is not None and len(bm["owners"]) == len(bm["ref_counts"]) == len(bm["cached"]) == 512
    assert last["config"]["max_model_len"] == "256"
    assert last["diagnosis"]["healthy"] and last["diagnosis"]["findings"] == []


def _seen_a_burst(events: list[dict]) -> bool:
    """Some update saw requests running, one a step decoding, one (the block map, rebuilt once a second) KV used."""
    return (
        any(e["running"] > 0 for e in events)
        and any(e["step"]["decode_tokens"] > 0 for e in events)
        and any(e["kv"]["used"] > 0 for e in events)
    )


def test_feed_counts_a_burst(server: LiveServer) -> None:
    """Bursts of 8 x 240 tokens repeat until the feed's updates (every 0.1 s; the block map once a second) have caught
    them running: however fast the engine finishes a burst, the feed is sampled while one is in flight, not hoped to
    overlap a single one."""
    body = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 240, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    codes: list[int] = []
    seen = threading.Event()

    def bursts() -> None:
        with httpx.Client(timeout=120) as c:
            for _ in range(50):  # bounded: 50 bursts
                threads = [
                    threading.Thread(target=lambda: codes.append(c.post(server.url + "/v1/completions", json=body,
                                                                         headers=headers).status_code))
                    for _ in range(8)
                ]  # fmt: skip
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                if seen.is_set():
                    return

    events: list[dict] = []
    url = server.url + "/v1/dashboard/stream?interval_s=0.1"
    t = threading.Thread(target=bursts)
    with httpx.stream("GET", url, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        t.start()
        try:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if _seen_a_burst(events) or not t.is_alive():
                        break
        finally:
            seen.set()
            t.join()
    assert codes and set(codes) == {200} and len(codes) % 8 == 0
    assert _seen_a_burst(events), (len(codes), [(e["running"], e["kv"]["used"], e["step"]) for e in events[-3:]])
    # the finished requests' TTFTs and tokens are in the window of the next updates
    after, _ = _events(server, 2, interval_s=0.1)
    assert after[-1]["latency"]["ttft"] is not None and after[-1]["latency"]["ttft"]["count"] >= 1
    assert max(e["throughput"]["generation_tok_s"] for e in events + after) > 0
