"""The web pages and the dashboard feed: GET / (playground), GET /dashboard, GET /static/..., and
GET /v1/dashboard/stream (SSE, one JSON update per interval, behind the API key like every /v1 route).

feed_update reads the server's metrics registry (through a shared ScrapeHistory window) and the engine's block map,
and runs the same diagnosis as `lmserve diagnose`. See docs/observability.md.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

from lmserve.entrypoints.openai.sse import SSEResponse
from lmserve.entrypoints.openai.state import engine_health
from lmserve.observability import diagnose as dx
from lmserve.observability.prometheus import imbalance

STATIC_DIR = Path(__file__).resolve().parent.parent.parent / "web" / "static"
PAGES = {"/": "index.html", "/dashboard": "dashboard.html"}  # open (no key): the pages ask for it
WINDOW_S = 30.0
INTERVAL_S = 0.5  # updates per feed: twice a second


class ScrapeHistory:
    """Registry readings of the last `window_s` seconds, at most one per `min_gap_s`, shared by the feeds."""

    def __init__(self, window_s: float = WINDOW_S, min_gap_s: float = 0.25) -> None:
        self.window_s = window_s
        self.min_gap_s = min_gap_s
        self._scrapes: deque[dx.Scrape] = deque()

    def window(self, registry: Any) -> tuple[dx.Window, dx.Scrape]:
        now = time.time()
        if not self._scrapes or now - self._scrapes[-1].time >= self.min_gap_s:
            self._scrapes.append(dx.Scrape.from_registry(registry, now))
        while len(self._scrapes) > 2 and self._scrapes[1].time <= now - self.window_s:
            self._scrapes.popleft()
        first, last = self._scrapes[0], self._scrapes[-1]
        return dx.window_between(first, last), last


def add_web_routes(app: FastAPI, state: Any) -> None:
    """`state` is the server's ServerState (its engine, metrics and served model name)."""
    history = ScrapeHistory()
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    for path, name in PAGES.items():

        async def page(name: str = name) -> Response:
            return FileResponse(STATIC_DIR / name, media_type="text/html", headers={"Cache-Control": "no-cache"})

        app.add_api_route(path, page, methods=["GET"], include_in_schema=False)

    @app.get("/v1/dashboard/stream", include_in_schema=False)
    async def dashboard_stream(interval_s: float = INTERVAL_S) -> Response:
        engine = state.engine if state.engine is not None else state.ready_engine()  # a dead one: the feed says so
        interval_s = min(max(interval_s, 0.1), 1.0)  # at least one update a second
        engine.watch_block_map(True)
        watching = [True]

        def unwatch() -> None:
            if watching[0]:
                watching[0] = False
                engine.watch_block_map(False)

        async def events() -> AsyncIterator[str]:
            try:
                while True:
                    yield f"data: {json.dumps(feed_update(state, history), allow_nan=False)}\n\n"
                    await asyncio.sleep(interval_s)
            finally:
                unwatch()

        return SSEResponse(events(), on_close=unwatch)


def feed_update(state: Any, history: ScrapeHistory) -> dict[str, Any]:
    """One dashboard update (plain JSON)."""
    snap = state.engine.snapshot()
    w, _ = history.window(state.metrics.registry)
    m = snap.metrics
    dur = w.duration_s
    rate = lambda key: (w.c(key) or 0.0) / dur if dur > 0.05 else 0.0  # noqa: E731
    queries, hits = w.c("prefix_queries") or 0.0, w.c("prefix_hits") or 0.0
    num_blocks = int(m["num_kv_blocks"])
    # used / free from this snapshot's usage: the block map is rebuilt at most once a second (and when the engine
    # goes idle), so a burst shorter than that would never show in it; the map's own counts describe the map
    free = round(num_blocks * (1.0 - m["kv_cache_usage"]))
    block_map = snap.block_map
    if block_map is not None:
        cached_free = sum(1 for r, c in zip(block_map.ref_counts, block_map.cached, strict=True) if r == 0 and c)
        shared = sum(1 for r in block_map.ref_counts if r > 1)
    else:
        cached_free = shared = None
    return {
        "time": snap.time,
        "model": state.served_model_name,
        "window_s": round(dur, 3),
        "running": m["num_requests_running"],
        "running_by_lora": m.get("lora_num_requests_running_by_adapter"),  # adapter name → sequences ("" = base)
        "waiting": m["num_requests_waiting"],
        "step": {"prefill_tokens": m["num_prefill_tokens_step"], "decode_tokens": m["num_decode_tokens_step"]},
        "moe_imbalance": imbalance(m["moe_expert_tokens_total"]) if "moe_expert_tokens_total" in m else None,
        "kv": {
            "num_blocks": num_blocks,
            "used": num_blocks - free,
            "free": free,
            "cached_free": cached_free,
            "shared": shared,
            "block_size": m["block_size"],
            "dtype": m["kv_cache_dtype"],
            "disk": _disk_tier(m),
        },
        "prefix_hit_rate": hits / queries if queries else None,
        "preemptions_total": m["num_preemptions_total"],
        "preemptions_window": w.c("preemptions") or 0.0,
        "throughput": {
            "generation_tok_s": rate("generation_tokens"),
            "prefill_tok_s": rate("prefill_tokens"),
            "decode_tok_s": rate("decode_tokens"),
            "steps_s": rate("steps"),
        },
        "latency": {k: _dist(w.d(k)) for k in ("ttft", "tpot", "itl", "e2e", "queue")},
        "block_map": None if block_map is None else asdict(block_map),
        "config": w.config,
        "diagnosis": dx.diagnose(w).to_dict(),
        "health": engine_health(state.engine)[1],  # a dead core (or role) reads dead here too
        "cores": [_core(i, s.metrics) for i, s in enumerate(snap.engines)],  # several cores: each one's state
    }


def _disk_tier(m: dict[str, Any]) -> dict[str, Any] | None:
    """The prefix cache's disk tier (--kv-cache-disk-dir): its bytes, blocks and the prompt tokens it served."""
    if "kv_disk_capacity_bytes" not in m:
        return None
    return {"used_bytes": m["kv_disk_usage_bytes"], "capacity_bytes": m["kv_disk_capacity_bytes"],
            "num_blocks": m["kv_disk_num_blocks"], "hit_tokens": m.get("prefix_cache_disk_hits_total", 0)}  # fmt: skip


def _core(index: int, m: dict[str, Any]) -> dict[str, Any]:
    role = {"kv_producer": "prefill", "kv_consumer": "decode"}.get(m.get("kv_role"))
    return {"engine": index, "role": role, "alive": bool(m.get("engine_alive", 1)),
            "running": m["num_requests_running"], "waiting": m["num_requests_waiting"],
            "kv_usage": m["kv_cache_usage"]}  # fmt: skip


def _dist(d: dx.Dist | None) -> dict[str, Any] | None:
    if d is None:
        return None
    buckets = [[None if b == float("inf") else b, n] for b, n in d.buckets]
    return {"count": d.count, "mean": d.mean, "p50": d.p50, "p95": d.p95, "p99": d.p99, "buckets": buckets}
