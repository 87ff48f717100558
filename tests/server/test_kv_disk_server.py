"""The KV disk tier through the server: cached_tokens counts disk hits, /metrics shows the tier, and
POST /reset_prefix_cache?include_disk=true clears it."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lmserve.config.engine import EngineArgs
from lmserve.engine.async_engine import AsyncEngine
from lmserve.engine.llm_engine import LLMEngine
from lmserve.entrypoints.openai.dashboard import ScrapeHistory, feed_update
from lmserve.entrypoints.openai.server import build_app
from tests.engine.test_kv_tier import POOL, _prompts
from tests.server.test_server_validation import call

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_disk_hits_usage_metrics_and_reset(llama_dir: Path, tmp_path: Path) -> None:
    args = EngineArgs.from_kwargs(str(llama_dir), num_kv_blocks=POOL, block_size=16, kv_cache_disk_dir=str(tmp_path))
    engine = AsyncEngine(LLMEngine.from_engine_args(args))
    app = build_app(engine, served_model_name="tiny")
    a, others = _prompts()

    def cached(prompt: list[int]) -> int:
        r = call(app, "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    try:
        assert cached(a) == 0 and cached(a) == 416
        for p in others:
            cached(p)
        assert cached(a) == 416, "evicted from RAM, found on disk"
        samples = {
            (s.name, s.labels.get("tier"), s.labels.get("le")): s.value
            for fam in text_string_to_metric_families(call(app, "GET", "/metrics").text)
            for s in fam.samples
        }
        assert samples[("lmserve:prefix_cache_hits_by_tier_total", "disk", None)] == 416
        assert samples[("lmserve:prefix_cache_hits_by_tier_total", "ram", None)] == 416
        assert samples[("lmserve:kv_disk_read_latency_seconds_count", None, None)] == 26
        assert samples[("lmserve:kv_disk_bytes_read_total", None, None)] > 0
        assert samples[("lmserve:kv_disk_usage_bytes", None, None)] > 0
        disk = feed_update(app.state.lmserve, ScrapeHistory())["kv"]["disk"]  # the dashboard's KV card
        assert disk["hit_tokens"] == 416 and disk["num_blocks"] > 0
        assert 0 < disk["used_bytes"] == samples[("lmserve:kv_disk_usage_bytes", None, None)]
        assert call(app, "POST", "/reset_prefix_cache?include_disk=maybe").status_code == 400
        assert call(app, "POST", "/reset_prefix_cache?include_disk=true").status_code == 200
        assert cached(a) == 0 and not list(tmp_path.glob("*/*.kv"))
    finally:
        engine.shutdown()
