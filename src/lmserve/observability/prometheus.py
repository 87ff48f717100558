"""Prometheus metrics for the server (the only module that imports prometheus_client).

Metrics is the server's registry: per-request histograms observed from RequestOutputs, counters the HTTP / gRPC
layers bump, and engine counters and gauges read at scrape time from the latest EngineSnapshot (_EngineCollector).
Every name is prefixed `lmserve:`; counters carry the `_total` suffix on the wire. See docs/observability.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from lmserve.core.outputs import RequestOutput

PREFIX = "lmserve:"

LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

SnapshotFn = Callable[[], Any]  # () -> EngineSnapshot | None (None while the model loads)

GRPC_REQUEST_ID_PREFIX = "grpc-"
"""Request ids the gRPC frontend gives its requests; every other request is counted as "http"."""


def frontend_of(request_id: str) -> str:
    return "grpc" if request_id.startswith(GRPC_REQUEST_ID_PREFIX) else "http"


KV_TRANSFER_METRICS = (
    ("kv_transfer_handoffs_total", "Requests a prefill engine handed to a decode engine after their first token."),
    ("kv_transfer_leases", "Handed-off sequences whose KV a prefill engine still holds for a pull."),
    ("kv_transfer_leases_expired_total", "KV leases that expired unpulled (kv_lease_s): their blocks freed."),
    ("kv_transfer_leases_pulled_total", "KV leases ended by a decode engine's pull."),
    ("kv_transfer_waiting", "Sequences a decode engine holds waiting for their KV."),
    ("kv_transfer_blocks_pulled_total", "KV blocks a decode engine pulled from a prefill engine."),
    ("kv_transfer_blocks_hit_total", "KV blocks a decode engine found in its own prefix cache instead."),
    ("kv_transfer_bytes_pulled_total", "Bytes of KV a decode engine pulled (values and scales)."),
    ("kv_transfer_failures_total", "KV transfers that failed or timed out (kv_load_failure_policy applied)."),
    ("kv_transfer_recomputes_total", "Failed KV transfers the decode engine recomputed (policy recompute)."),
)


KV_DISK_METRICS = (
    ("kv_disk_usage_bytes", "Bytes of KV block files in the disk tier's directory."),
    ("kv_disk_capacity_bytes", "The disk tier's size (kv_cache_disk_gib): least recently used files go past it."),
    ("kv_disk_num_blocks", "KV block files in the disk tier."),
    ("kv_disk_write_disabled", "1 once the disk filled up (ENOSPC): no more blocks are written, reads go on."),
    ("kv_disk_blocks_written_total", "KV blocks written to the disk tier (evicted from RAM, or saved at close)."),
    ("kv_disk_blocks_read_total", "KV blocks read back from the disk tier (prefix hits)."),
    ("kv_disk_bytes_written_total", "Bytes of block files written to the disk tier."),
    ("kv_disk_bytes_read_total", "Bytes of block files read from the disk tier."),
    ("kv_disk_misses_total", "Disk-tier lookups that found no usable block."),
    ("kv_disk_bad_files_total", "Truncated, corrupted or foreign block files (deleted; their tokens recomputed)."),
    ("kv_disk_evicted_total", "Block files deleted to stay within the disk tier's size."),
    ("kv_disk_write_errors_total", "Block writes that failed for a reason other than a full disk."),
    ("kv_disk_writes_dropped_total", "Evicted blocks not written because the writer's queue was full."),
    ("kv_disk_prefetches_total", "Requests whose disk blocks were read in the background before admission."),
    ("kv_disk_blocks_read_sync_total", "Disk blocks read while scheduling a step (not prefetched): that step waited."),
)


def _kv_disk_metrics(m: dict[str, Any], labels: list[str], values: list[str], gauge, counter) -> Iterator[Metric]:
    """With the disk tier: prefix-cache hits by tier, its counters, and its read latency histogram."""
    if "kv_disk_usage_bytes" not in m:
        return
    doc = "Prompt tokens found in the prefix cache, by tier (ram, disk); they sum to prefix_cache_hits."
    by_tier = CounterMetricFamily(PREFIX + "prefix_cache_hits_by_tier", doc, labels=[*labels, "tier"])
    disk = m["prefix_cache_disk_hits_total"]
    by_tier.add_metric([*values, "ram"], m["prefix_cache_hits_total"] - disk)
    by_tier.add_metric([*values, "disk"], disk)
    yield by_tier
    for key, doc in KV_DISK_METRICS:
        yield (counter if key.endswith("_total") else gauge)(key.removesuffix("_total"), doc, m[key])
    hist = HistogramMetricFamily(PREFIX + "kv_disk_read_latency_seconds", "Time to read and verify one KV block file.",
                                 labels=labels)  # fmt: skip
    cumulative, buckets = 0, []
    for le, count in m["kv_disk_read_latency_seconds_buckets"].items():
        cumulative += count
        buckets.append((le, cumulative))
    hist.add_metric(values, buckets, m["kv_disk_read_latency_seconds_sum"])
    yield hist


class _EngineCollector(Collector):
    """Engine counters/gauges from the latest snapshot, produced at scrape time."""

    def __init__(self, snapshot_fn: SnapshotFn, model_name: str) -> None:
        self._snapshot_fn = snapshot_fn
        self._model_name = model_name

    def describe(self) -> list[Metric]:
        return []  # dynamic; skip registry-time collection

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot_fn()
        if snap is None:
            return
        families = list(self._families(snap))
        # Several engine cores (data parallel): each family also carries every core's own samples, labelled
        # engine="i", after the aggregate (which has no engine label; sum over one or the other, not both).
        for i, engine_snap in enumerate(snap.engines):
            extra = {"engine": str(i)}
            if "kv_role" in engine_snap.metrics:  # disaggregation: each core's role
                extra["role"] = "prefill" if engine_snap.metrics["kv_role"] == "kv_producer" else "decode"
            for family, per_engine in zip(families, self._families(engine_snap), strict=True):
                family.samples.extend(s._replace(labels={**s.labels, **extra}) for s in per_engine.samples)
        yield from families

    def _families(self, snap: Any) -> Iterator[Metric]:
        m = snap.metrics
        labels, values = ["model_name"], [self._model_name]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        yield counter("prompt_tokens", "Prompt tokens of all accepted requests.", m["prompt_tokens_total"])
        yield counter("generation_tokens", "Generated tokens.", m["generation_tokens_total"])
        yield counter(
            "num_preemptions", "Sequences preempted (KV blocks reclaimed).", m["num_preemptions_total"]
        )
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            m["prefix_cache_queries_total"],
        )
        yield counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.", m["prefix_cache_hits_total"]
        )
        yield counter(
            "num_aborted_requests",
            "Requests aborted (client gone or cancelled).",
            snap.num_aborted_requests_total,
        )
        yield counter("num_steps", "Engine steps (model executions).", m["num_steps_total"])
        by_reason = CounterMetricFamily(
            PREFIX + "request_success",
            "Finished sequences by finish reason (stop, length, abort).",
            labels=["model_name", "finished_reason"],
        )
        for reason, count in sorted(m["finished_requests_by_reason"].items()):
            by_reason.add_metric([self._model_name, reason], count)
        yield by_reason
        yield gauge("engine_alive", "Engine cores alive (1 each; a dead core reads 0).", m.get("engine_alive", 1))
        yield counter(
            "num_failed_requests",
            "Requests that failed because an engine core they needed died.",
            m.get("num_requests_failed_total", 0),
        )
        yield gauge("num_requests_running", "Sequences in the running batch.", m["num_requests_running"])
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.", m["num_requests_waiting"])
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", m["kv_cache_usage"])
        yield gauge(
            "num_batched_tokens", "Tokens computed in the latest engine step.", snap.num_batched_tokens
        )
        yield gauge("kv_cache_capacity_tokens", "Tokens the KV pool holds.", m["kv_cache_capacity_tokens"])
        yield gauge(
            "kv_cache_bytes_per_token", "KV bytes per token over all layers.", m["kv_cache_bytes_per_token"]
        )
        yield gauge(
            "kv_cache_capacity_bytes", "Bytes of the KV pool (values and scales).", m["kv_cache_capacity_bytes"]
        )
        yield gauge(
            "kv_cache_committed_bytes",
            "Bytes of the KV pool committed to memory: blocks first used so far, in chunks (at most the capacity).",
            m.get("kv_cache_committed_bytes", 0),
        )
        yield gauge(
            "kv_cache_scale_bytes_per_token",
            "Bytes per token of int8 / fp8 KV scales (part of kv_cache_bytes_per_token).",
            m["kv_cache_scale_bytes_per_token"],
        )
        yield gauge(
            "kv_cache_max_concurrent_requests",
            "Requests of max_model_len tokens whose KV fits the pool at once.",
            m["kv_cache_max_concurrent_requests"],
        )
        info = GaugeMetricFamily(
            PREFIX + "kv_cache_dtype_info", "The KV cache storage dtype (value 1).", labels=[*labels, "kv_cache_dtype"]
        )
        info.add_metric([*values, m["kv_cache_dtype"]], 1)
        yield info
        if "kv_role" in m:  # prefill/decode disaggregation (engine/disaggregation.py)
            for key, doc in KV_TRANSFER_METRICS:
                make = counter if key.endswith("_total") else gauge
                yield make(key.removesuffix("_total"), doc, m.get(key, 0))
        yield counter(
            "spec_decode_num_drafts", "Speculative verifications (requests x steps with proposals).",
            m["spec_decode_num_drafts_total"],
        )  # fmt: skip
        yield counter(
            "spec_decode_num_draft_tokens", "Proposed tokens verified by the target.",
            m["spec_decode_num_draft_tokens_total"],
        )  # fmt: skip
        yield counter(
            "spec_decode_num_accepted_tokens", "Proposed tokens the target accepted.",
            m["spec_decode_num_accepted_tokens_total"],
        )  # fmt: skip
        yield gauge(
            "spec_decode_acceptance_rate", "Accepted / proposed tokens (0 before any proposal).",
            m["spec_decode_acceptance_rate"],
        )  # fmt: skip
        yield gauge(
            "spec_decode_mean_accepted_length", "Tokens a verification emits on average (accepted + 1).",
            m["spec_decode_mean_accepted_length"],
        )  # fmt: skip
        yield from _lora_metrics(m, labels, values, gauge, counter)
        yield from _expert_metrics(m, labels, values)
        yield from _kv_disk_metrics(m, labels, values, gauge, counter)
        if "num_state_slots" in m:  # a hybrid model's recurrent-state slots
            used = m["num_state_slots_used"]
            yield gauge("state_slots_used", "Recurrent-state slots held by running sequences.", used)
            yield gauge("state_slots_total", "Recurrent-state slots (max_num_seqs is at most this).",
                        m["num_state_slots"])  # fmt: skip
        if "num_state_snapshots" in m:  # a hybrid's prefix cache: its state snapshots at block boundaries
            yield gauge("state_snapshots_cached", "Recurrent-state snapshots the prefix cache keeps.",
                        m["num_state_snapshots_cached"])  # fmt: skip
            yield gauge("state_snapshots_total", "Recurrent-state snapshot slots.", m["num_state_snapshots"])
            yield counter("state_snapshot_restores", "Prefix hits that restored a state snapshot.",
                          m["state_snapshot_restores_total"])  # fmt: skip
        yield from _step_metrics(m, counter, gauge)
        config = GaugeMetricFamily(
            PREFIX + "engine_config_info",
            "The scheduler, cache and model-shape settings a diagnosis names (value 1).",
            labels=[*labels, *CONFIG_LABELS],
        )
        config.add_metric([*values, *(str(m[k]) for k in CONFIG_LABELS)], 1)
        yield config


def _expert_metrics(m: dict, labels: list[str], values: list[str]) -> Iterator[Metric]:
    """A mixture-of-experts model: tokens routed to each expert by group of layers, and each group's imbalance."""
    load = m.get("moe_expert_tokens_total")
    if not load:
        return
    tokens = CounterMetricFamily(PREFIX + "moe_expert_tokens", "Tokens routed to each expert, summed over a group "
                                 "of MoE layers.", labels=[*labels, "layer_group", "expert"])  # fmt: skip
    for key, n in load.items():
        group, expert = key.rsplit(":", 1)
        tokens.add_metric([*values, group, expert], n)
    yield tokens
    ratios = imbalance(load)
    per_group = GaugeMetricFamily(PREFIX + "moe_expert_load_imbalance", "A layer group's busiest expert over its "
                                  "mean tokens per expert (1: even).", labels=[*labels, "layer_group"])  # fmt: skip
    for group, r in ratios.items():
        per_group.add_metric([*values, group], r)
    yield per_group
    worst = GaugeMetricFamily(PREFIX + "moe_expert_load_imbalance_max", "The largest moe_expert_load_imbalance "
                              "over the layer groups.", labels=labels)  # fmt: skip
    worst.add_metric(values, max(ratios.values()))
    yield worst


def imbalance(load: dict[str, int]) -> dict[str, float]:
    """Each layer group's busiest expert over its mean tokens per expert (1.0: perfectly even; 0.0: no tokens)."""
    groups: dict[str, list[int]] = {}
    for key, n in load.items():
        groups.setdefault(key.rsplit(":", 1)[0], []).append(n)
    return {g: (max(ns) * len(ns) / sum(ns) if sum(ns) else 0.0) for g, ns in groups.items()}


def _lora_metrics(m: dict, labels: list[str], values: list[str], gauge, counter) -> Iterator[Metric]:
    """With LoRA enabled: running sequences per adapter (lora_name "" = the base model), the slots' bytes."""
    if "lora_num_requests_running_by_adapter" not in m:
        return
    by_lora = GaugeMetricFamily(PREFIX + "lora_num_requests_running", "Running sequences by LoRA adapter "
                                "(lora_name empty: the base model).", labels=[*labels, "lora_name"])  # fmt: skip
    for name, count in sorted(m["lora_num_requests_running_by_adapter"].items()):
        by_lora.add_metric([*values, name], count)
    yield by_lora
    yield gauge("lora_slot_bytes", "Bytes of the LoRA compute slots' stacked weights.", m["lora_slot_bytes"])
    yield gauge("lora_cpu_bytes", "Bytes of the LoRA adapters loaded in RAM.", m["lora_cpu_bytes"])
    yield counter("lora_slot_loads", "Adapters copied into a compute slot.", m["lora_num_slot_loads_total"])


CONFIG_LABELS = (
    "scheduling_policy", "enable_chunked_prefill", "enable_prefix_caching", "max_num_seqs",
    "max_num_batched_tokens", "max_model_len", "block_size", "num_layers", "num_kv_heads", "head_dim",
)  # fmt: skip
# snapshot key → (metric name, kind, help): the step split and step times lmserve.observability.diagnose reads
STEP_METRICS = (
    ("num_prefill_tokens_step", "num_prefill_tokens", "gauge", "Prompt tokens computed in the latest step."),
    ("num_decode_tokens_step", "num_decode_tokens", "gauge", "Decode tokens computed in the latest step."),
    ("prefill_tokens_total", "prefill_tokens_computed", "counter",
     "Prompt tokens computed (prefill chunks and recompute after preemption; prefix-cache hits excluded)."),
    ("decode_tokens_total", "decode_tokens_computed", "counter", "Decode tokens computed (1 + proposals each)."),
    ("step_time_s_total", "engine_step_time_seconds", "counter", "Wall time of model steps."),
    ("num_decode_steps_total", "num_decode_steps", "counter", "Steps with decode tokens only."),
    ("decode_step_time_s_total", "decode_step_time_seconds", "counter", "Wall time of decode-only steps."),
    ("decode_step_seqs_total", "decode_step_seqs", "counter", "Sequences in decode-only steps (summed)."),
    ("decode_step_time_min_s", "decode_step_time_min_seconds", "gauge",
     "The fastest decode-only step so far (the step's idle figure)."),
    ("num_mixed_steps_total", "num_mixed_steps", "counter", "Steps computing prompt tokens beside decodes."),
    ("mixed_step_time_s_total", "mixed_step_time_seconds", "counter", "Wall time of those mixed steps."),
    ("mixed_step_prefill_tokens_total", "mixed_step_prefill_tokens", "counter",
     "Prompt tokens computed in mixed steps."),
    ("prefix_shareable_tokens_total", "prefix_shareable_tokens", "counter",
     "Prompt tokens (whole blocks) an earlier prompt already had, cached or not."),
)  # fmt: skip


def _step_metrics(m: dict[str, Any], counter: Callable, gauge: Callable) -> Iterator[Metric]:
    for key, name, kind, doc in STEP_METRICS:
        yield (counter if kind == "counter" else gauge)(name, doc, m[key])


@dataclass(frozen=True)
class _Histograms:
    """The per-request histograms of one frontend (label children of the Metrics families)."""

    ttft: Any
    itl: Any
    tpot: Any
    e2e: Any
    queue: Any
    prefill: Any
    decode: Any
    prompt_len: Any
    gen_len: Any


class Metrics:
    """The server's metrics. Implements the engine's StatLogger (on_request_output / on_request_aborted).

    Per-request series carry a `frontend` label ("http" or "grpc", from the request-id prefix: frontend_of).
    Engine series come from the snapshot, which keeps the running totals (never double-counted here); with several
    engine cores it is their aggregate, and each engine family also has one sample per core, `engine="i"`.
    """

    def __init__(self, model_name: str, snapshot_fn: SnapshotFn) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(_EngineCollector(snapshot_fn, model_name))
        lbl = ["model_name", "frontend"]

        def hist(name: str, doc: str, buckets: tuple) -> Any:
            return Histogram(PREFIX + name, doc, lbl, buckets=buckets, registry=self.registry)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS_S)
        self.itl = hist(
            "inter_token_latency_seconds", "Time between tokens of a sequence.", LATENCY_BUCKETS_S
        )
        self.tpot = hist(
            "request_time_per_output_token_seconds", "Decode time / (output tokens - 1).", LATENCY_BUCKETS_S
        )
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS_S)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS_S)
        self.prefill = hist(
            "request_prefill_time_seconds", "First scheduled to first token.", LATENCY_BUCKETS_S
        )
        self.decode = hist("request_decode_time_seconds", "First token to finish.", LATENCY_BUCKETS_S)
        self.prompt_len = hist("request_prompt_tokens", "Prompt length of finished requests.", TOKEN_BUCKETS)
        self.gen_len = hist(
            "request_generation_tokens", "Tokens generated per finished request.", TOKEN_BUCKETS
        )
        self._rejected = Counter(
            PREFIX + "num_rejected_requests",
            "Requests refused before reaching the engine, by reason.",
            ["model_name", "reason", "frontend"],
            registry=self.registry,
        )
        self._children: dict[str, _Histograms] = {}
        self._for("http")  # the HTTP series exist (at 0) from the start

    def _for(self, frontend: str) -> _Histograms:
        h = self._children.get(frontend)
        if h is None:
            families = {f.name: getattr(self, f.name) for f in fields(_Histograms)}
            h = _Histograms(**{name: fam.labels(self.model_name, frontend) for name, fam in families.items()})
            self._children[frontend] = h
        return h

    # ---- StatLogger (engine thread) ---------------------------------------------------------

    def on_request_output(self, output: RequestOutput, prev_token_time: float | None, now: float) -> None:
        h = self._for(frontend_of(output.request_id))
        m = output.metrics
        num_new = max((len(c.delta_token_ids) for c in output.outputs), default=0)
        if prev_token_time is None:
            if m.first_token_time is not None:
                h.ttft.observe(m.first_token_time - m.arrival_time)
        elif num_new and m.last_token_time is not None:
            gap = (m.last_token_time - prev_token_time) / num_new
            for _ in range(num_new):
                h.itl.observe(gap)
        if not output.finished or any(c.finish_reason == "abort" for c in output.outputs):
            return
        finished = m.finished_time or now
        num_out = max((len(c.token_ids) for c in output.outputs), default=0)
        h.e2e.observe(finished - m.arrival_time)
        h.prompt_len.observe(len(output.prompt_token_ids))
        h.gen_len.observe(sum(len(c.token_ids) for c in output.outputs))
        if m.first_scheduled_time is not None:
            h.queue.observe(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                h.prefill.observe(m.first_token_time - m.first_scheduled_time)
            elif num_out == 0:  # scoring (max_tokens 0): computing the prompt was the whole request
                h.prefill.observe(finished - m.first_scheduled_time)
        if m.first_token_time is not None:
            h.decode.observe(finished - m.first_token_time)
            if num_out > 1:
                h.tpot.observe((finished - m.first_token_time) / (num_out - 1))

    def on_request_aborted(self) -> None:
        pass  # counted by the engine side (snapshot.num_aborted_requests_total)

    # ---- HTTP / gRPC side ------------------------------------------------------------------

    def on_request_rejected(self, reason: str, frontend: str = "http") -> None:
        self._rejected.labels(self.model_name, reason, frontend).inc()

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition."""
        return generate_latest(self.registry), "text/plain; version=0.0.4; charset=utf-8"
