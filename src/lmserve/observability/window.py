"""A window of serving metrics, the input of lmserve.observability.diagnose: `Window` holds counters as deltas over
the window,
gauges and the engine's config as their latest values, and latencies as `Dist`s. Built from two readings of the
Prometheus metrics (`Scrape`: a /metrics body via `scrape_url`, or the server's own registry, which the dashboard
reads every second) with `window_between`, or from a `lmserve bench serve` JSON with `window_from_report`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

PREFIX = "lmserve:"

# the histograms a Window carries: attribute → metric name (without the prefix)
HISTOGRAMS = {
    "ttft": "time_to_first_token_seconds",
    "tpot": "request_time_per_output_token_seconds",
    "itl": "inter_token_latency_seconds",
    "e2e": "e2e_request_latency_seconds",
    "queue": "request_queue_time_seconds",
    "prefill": "request_prefill_time_seconds",
    "prompt_len": "request_prompt_tokens",
    "output_len": "request_generation_tokens",
}
# counters a Window carries as deltas: key → metric sample name (without the prefix)
COUNTERS = {
    "prompt_tokens": "prompt_tokens_total",
    "generation_tokens": "generation_tokens_total",
    "preemptions": "num_preemptions_total",
    "prefix_queries": "prefix_cache_queries_total",
    "prefix_hits": "prefix_cache_hits_total",
    "prefix_shareable": "prefix_shareable_tokens_total",
    "steps": "num_steps_total",
    "prefill_tokens": "prefill_tokens_computed_total",
    "decode_tokens": "decode_tokens_computed_total",
    "step_time_s": "engine_step_time_seconds_total",
    "decode_steps": "num_decode_steps_total",
    "decode_step_time_s": "decode_step_time_seconds_total",
    "decode_step_seqs": "decode_step_seqs_total",
    "mixed_steps": "num_mixed_steps_total",
    "mixed_step_time_s": "mixed_step_time_seconds_total",
    "mixed_step_prefill_tokens": "mixed_step_prefill_tokens_total",
}
GAUGES = {
    "running": "num_requests_running",
    "waiting": "num_requests_waiting",
    "kv_usage": "kv_cache_usage_perc",
    "kv_capacity_tokens": "kv_cache_capacity_tokens",
    "kv_bytes_per_token": "kv_cache_bytes_per_token",
    "kv_capacity_bytes": "kv_cache_capacity_bytes",
    "decode_step_time_min_s": "decode_step_time_min_seconds",
    "moe_imbalance": "moe_expert_load_imbalance_max",
    "state_slots_used": "state_slots_used",  # a hybrid model's recurrent-state slots
    "state_slots_total": "state_slots_total",
}


# ---- inputs -------------------------------------------------------------------------------------


@dataclass
class Dist:
    """A latency (seconds) or length (tokens) distribution over the window; None where unknown."""

    count: int
    mean: float | None = None
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    # (upper bound, observations in the bucket) from a histogram, for display; empty from a report
    buckets: list[tuple[float, int]] = field(default_factory=list)

    @staticmethod
    def from_histogram(bounds: list[float], cumulative: list[float], total: float) -> Dist:
        """From cumulative bucket counts (the last bound +Inf), quantiles interpolated inside buckets as
        Prometheus' histogram_quantile does."""
        count = int(round(cumulative[-1])) if cumulative else 0
        buckets = [(b, int(round(c - p))) for b, c, p in zip(bounds, cumulative, [0.0, *cumulative[:-1]], strict=True)]
        if count <= 0:
            return Dist(0, buckets=buckets)

        def quantile(q: float) -> float:
            rank = q * count
            lower = 0.0
            prev = 0.0
            for b, c in zip(bounds, cumulative, strict=True):
                if c >= rank:
                    if math.isinf(b):
                        return lower  # past the last finite bound: its lower edge
                    inside = c - prev
                    return lower + (b - lower) * ((rank - prev) / inside if inside else 1.0)
                lower, prev = b, c
            return lower

        return Dist(count, total / count, quantile(0.5), quantile(0.95), quantile(0.99), buckets)


@dataclass
class Window:
    """The numbers the rules read. Counters are deltas over `duration_s`; gauges and config the latest."""

    duration_s: float
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    config: dict[str, str] = field(default_factory=dict)  # engine_config_info labels (strings)
    dists: dict[str, Dist] = field(default_factory=dict)  # keys of HISTOGRAMS
    source: str = "metrics"  # "metrics" | "report"
    ttft_growth: float | None = None  # report: mean TTFT of the last third of requests / the first third

    def c(self, key: str) -> float | None:
        return self.counters.get(key)

    def d(self, key: str) -> Dist | None:
        dist = self.dists.get(key)
        return dist if dist is not None and dist.count > 0 else None

    def cfg_int(self, key: str) -> int | None:
        v = self.config.get(key)
        return int(v) if v is not None and v.lstrip("-").isdigit() else None

    def cfg_bool(self, key: str) -> bool | None:
        v = self.config.get(key)
        return None if v is None else v == "True"


@dataclass
class Scrape:
    """One reading of the metrics: sample name → {labels (model_name dropped, sorted) → value}."""

    time: float
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]]

    @staticmethod
    def from_families(families: Iterable[Any], at: float | None = None) -> Scrape:
        samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        for family in families:
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                samples.setdefault(s.name, {})[labels] = float(s.value)
        return Scrape(time.time() if at is None else at, samples)

    @staticmethod
    def parse(text: str, at: float | None = None) -> Scrape:
        """From the Prometheus text exposition (a /metrics body)."""
        from prometheus_client.parser import text_string_to_metric_families

        return Scrape.from_families(text_string_to_metric_families(text), at)

    @staticmethod
    def from_registry(registry: Any, at: float | None = None) -> Scrape:
        return Scrape.from_families(registry.collect(), at)

    def value(self, name: str, default: float | None = None) -> float | None:
        values = self.samples.get(PREFIX + name)
        return default if not values else next(iter(values.values()))

    def labels_of(self, name: str) -> dict[str, str]:
        values = self.samples.get(PREFIX + name)
        return {} if not values else dict(next(iter(values)))

    def histogram(self, name: str) -> tuple[list[float], list[float], float]:
        """(upper bounds, cumulative counts, sum); empty when the histogram is absent."""
        buckets = self.samples.get(PREFIX + name + "_bucket", {})
        pairs = sorted((float(dict(labels)["le"]), v) for labels, v in buckets.items())
        return [b for b, _ in pairs], [v for _, v in pairs], self.value(name + "_sum", 0.0) or 0.0


def window_between(before: Scrape, after: Scrape) -> Window:
    """The window from `before` to `after` (counters and histograms as deltas). A counter that went down (the
    server restarted) counts from zero."""
    w = Window(duration_s=max(after.time - before.time, 1e-9))
    for key, name in COUNTERS.items():
        new = after.value(name)
        if new is not None:
            old = before.value(name, 0.0) or 0.0
            w.counters[key] = new - old if new >= old else new
    for key, name in GAUGES.items():
        v = after.value(name)
        if v is not None:
            w.gauges[key] = v
    w.config = after.labels_of("engine_config_info")
    if "kv_cache_dtype" not in w.config:
        dtype = after.labels_of("kv_cache_dtype_info").get("kv_cache_dtype")
        if dtype is not None:
            w.config["kv_cache_dtype"] = dtype
    for key, name in HISTOGRAMS.items():
        bounds, cum, total = after.histogram(name)
        if not bounds:
            continue
        old_bounds, old_cum, old_total = before.histogram(name)
        if old_bounds == bounds and old_cum[-1] <= cum[-1]:
            cum = [a - b for a, b in zip(cum, old_cum, strict=True)]
            total -= old_total
        w.dists[key] = Dist.from_histogram(bounds, cum, total)
    return w


def window_from_report(doc: dict[str, Any]) -> Window:
    """A `lmserve bench serve` JSON (bench.report.write_json): the client's view. Latencies in ms there."""
    if "summary" not in doc:
        raise ValueError("report: no 'summary' (is this a `lmserve bench serve` JSON?)")
    s = doc["summary"]
    w = Window(duration_s=float(s.get("duration_s") or 0.0) or 1e-9, source="report")

    def dist(key: str, scale: float) -> Dist | None:
        d = s.get(key)
        if not d or not d.get("count"):
            return None
        get = lambda k: None if d.get(k) is None else float(d[k]) * scale  # noqa: E731
        return Dist(int(d["count"]), get("mean"), get("p50"), get("p95"), get("p99"))

    for key, src, scale in (
        ("ttft", "ttft_ms", 1e-3), ("tpot", "tpot_ms", 1e-3), ("itl", "itl_ms", 1e-3), ("e2e", "e2e_ms", 1e-3),
        ("prompt_len", "prompt_len", 1.0), ("output_len", "output_len", 1.0),
    ):  # fmt: skip
        dd = dist(src, scale)
        if dd is not None:
            w.dists[key] = dd
    w.counters["prompt_tokens"] = float(s.get("total_prompt_tokens") or 0)
    w.counters["generation_tokens"] = float(s.get("total_output_tokens") or 0)
    ttfts = [_record_ttft(r) for r in doc.get("requests", [])]
    ttfts = [t for t in ttfts if t is not None]
    if len(ttfts) >= 6:
        third = len(ttfts) // 3
        first, last = sum(ttfts[:third]) / third, sum(ttfts[-third:]) / third
        w.ttft_growth = last / first if first > 0 else None
    return w


def _record_ttft(r: dict[str, Any]) -> float | None:
    times = [t for t, k in zip(r.get("chunk_times_s", []), r.get("chunk_num_tokens", []), strict=False) if k > 0]
    if not r.get("success") or not times:
        return None
    return times[0] - r["scheduled_s"]


# ---- sources ------------------------------------------------------------------------------------


def scrape_url(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> Scrape:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(url.rstrip("/") + "/metrics", headers=headers, timeout=timeout_s)
    r.raise_for_status()
    return Scrape.parse(r.text)
