"""lmserve.observability.prometheus without a model: engine counters from a snapshot, per-request histograms,
exposition."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from lmserve.core.outputs import CompletionOutput, RequestOutput
from lmserve.engine.async_engine import EngineSnapshot
from lmserve.observability.prometheus import GRPC_REQUEST_ID_PREFIX, Metrics
from lmserve.request import FinishReason, RequestMetrics


def _snapshot(**overrides) -> EngineSnapshot:
    metrics = {
        "num_requests_total": 3,
        "num_requests_running": 2,
        "num_requests_waiting": 5,
        "num_steps_total": 40,
        "prompt_tokens_total": 123,
        "generation_tokens_total": 77,
        "num_preemptions_total": 1,
        "prefix_cache_queries_total": 100,
        "prefix_cache_hits_total": 32,
        "kv_cache_usage": 0.25,
        "num_kv_blocks": 64,
        "kv_cache_capacity_tokens": 1024,
        "kv_cache_bytes_per_token": 512,
        "kv_cache_capacity_bytes": 524288,
        "kv_cache_dtype": "int8",
        "kv_cache_scale_bytes_per_token": 32,
        "kv_cache_max_concurrent_requests": 8,
        "finished_requests_by_reason": {"stop": 1, "length": 2, "abort": 4},
        "spec_decode_num_drafts_total": 10,
        "spec_decode_num_draft_tokens_total": 40,
        "spec_decode_num_accepted_tokens_total": 30,
        "spec_decode_acceptance_rate": 0.75,
        "spec_decode_mean_accepted_length": 4.0,
        "num_prefill_tokens_step": 12,
        "num_decode_tokens_step": 5,
        "prefill_tokens_total": 90,
        "decode_tokens_total": 70,
        "step_time_s_total": 2.5,
        "num_decode_steps_total": 30,
        "decode_step_time_s_total": 1.5,
        "decode_step_seqs_total": 60,
        "decode_step_time_min_s": 0.04,
        "num_mixed_steps_total": 8,
        "mixed_step_time_s_total": 0.8,
        "mixed_step_prefill_tokens_total": 80,
        "prefix_shareable_tokens_total": 48,
        "scheduling_policy": "static",
        "enable_chunked_prefill": False,
        "enable_prefix_caching": True,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "max_model_len": 256,
        "block_size": 16,
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 16,
    }
    metrics.update(overrides)
    return EngineSnapshot(metrics=metrics, num_batched_tokens=17, num_aborted_requests_total=4, time=0.0)


def _samples(m: Metrics) -> dict[str, float]:
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_engine_counters_and_gauges_come_from_the_snapshot() -> None:
    snap = _snapshot()
    s = _samples(Metrics("m", lambda: snap))
    assert s["lmserve:prompt_tokens_total"] == 123
    assert s["lmserve:generation_tokens_total"] == 77
    assert s["lmserve:num_preemptions_total"] == 1
    assert s["lmserve:prefix_cache_queries_total"] == 100 and s["lmserve:prefix_cache_hits_total"] == 32
    assert s["lmserve:num_aborted_requests_total"] == 4
    assert s["lmserve:request_success_total{finished_reason=length}"] == 2
    assert s["lmserve:request_success_total{finished_reason=abort}"] == 4
    assert s["lmserve:num_requests_running"] == 2 and s["lmserve:num_requests_waiting"] == 5
    assert s["lmserve:kv_cache_usage_perc"] == 0.25 and s["lmserve:num_batched_tokens"] == 17
    assert s["lmserve:kv_cache_capacity_tokens"] == 1024 and s["lmserve:kv_cache_bytes_per_token"] == 512
    assert s["lmserve:kv_cache_capacity_bytes"] == 524288
    assert s["lmserve:kv_cache_scale_bytes_per_token"] == 32 and s["lmserve:kv_cache_max_concurrent_requests"] == 8
    assert s["lmserve:kv_cache_dtype_info{kv_cache_dtype=int8}"] == 1
    assert s["lmserve:spec_decode_num_draft_tokens_total"] == 40
    assert s["lmserve:spec_decode_num_accepted_tokens_total"] == 30
    assert s["lmserve:spec_decode_num_drafts_total"] == 10
    assert s["lmserve:spec_decode_acceptance_rate"] == 0.75 and s["lmserve:spec_decode_mean_accepted_length"] == 4.0
    assert s["lmserve:num_prefill_tokens"] == 12 and s["lmserve:num_decode_tokens"] == 5
    assert s["lmserve:prefill_tokens_computed_total"] == 90 and s["lmserve:decode_tokens_computed_total"] == 70
    assert s["lmserve:engine_step_time_seconds_total"] == 2.5 and s["lmserve:decode_step_time_min_seconds"] == 0.04
    assert s["lmserve:num_decode_steps_total"] == 30 and s["lmserve:decode_step_seqs_total"] == 60
    assert s["lmserve:mixed_step_prefill_tokens_total"] == 80 and s["lmserve:prefix_shareable_tokens_total"] == 48
    info = [k for k in s if k.startswith("lmserve:engine_config_info")]
    assert len(info) == 1 and "scheduling_policy=static" in info[0] and "enable_chunked_prefill=False" in info[0]
    assert "head_dim=16" in info[0] and s[info[0]] == 1


def test_nothing_from_the_engine_while_loading() -> None:
    s = _samples(Metrics("m", lambda: None))
    assert "lmserve:prompt_tokens_total" not in s
    assert s["lmserve:e2e_request_latency_seconds_count{frontend=http}"] == 0


def _output(finished: bool, num_tokens: int, delta: int, reason=None, **times) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=100.0, **times)
    c = CompletionOutput(
        index=0, text="", token_ids=list(range(num_tokens)), finish_reason=reason, delta_token_ids=[0] * delta
    )
    return RequestOutput("r", None, [1, 2, 3, 4], [c], finished, 0, metrics)


def test_request_histograms() -> None:
    m = Metrics("m", lambda: None)
    t = dict(first_scheduled_time=100.5, first_token_time=101.0)
    m.on_request_output(_output(False, 1, 1, last_token_time=101.0, **t), None, 101.0)  # first token
    m.on_request_output(
        _output(False, 3, 2, last_token_time=102.0, **t), 101.0, 102.0
    )  # two more in one step
    done = _output(True, 4, 1, FinishReason.LENGTH, last_token_time=102.5, finished_time=102.5, **t)
    m.on_request_output(done, 102.0, 102.5)
    m.on_request_rejected("queue_full")
    s = _samples(m)
    assert (
        s["lmserve:time_to_first_token_seconds_count{frontend=http}"] == 1
        and s["lmserve:time_to_first_token_seconds_sum{frontend=http}"] == 1.0
    )
    assert s["lmserve:inter_token_latency_seconds_count{frontend=http}"] == 3
    assert s["lmserve:inter_token_latency_seconds_sum{frontend=http}"] == 1.5  # 2 × 0.5 + 0.5
    assert s["lmserve:e2e_request_latency_seconds_sum{frontend=http}"] == 2.5
    assert s["lmserve:request_queue_time_seconds_sum{frontend=http}"] == 0.5
    assert s["lmserve:request_prefill_time_seconds_sum{frontend=http}"] == 0.5
    assert s["lmserve:request_decode_time_seconds_sum{frontend=http}"] == 1.5
    assert s["lmserve:request_time_per_output_token_seconds_sum{frontend=http}"] == 0.5  # 1.5 s / (4 - 1)
    assert s["lmserve:request_prompt_tokens_sum{frontend=http}"] == 4
    assert s["lmserve:request_generation_tokens_sum{frontend=http}"] == 4
    assert s["lmserve:num_rejected_requests_total{frontend=http,reason=queue_full}"] == 1


def test_aborted_requests_do_not_pollute_latency_histograms() -> None:
    m = Metrics("m", lambda: None)
    aborted = _output(True, 2, 0, FinishReason.ABORT, first_token_time=101.0, finished_time=103.0)
    m.on_request_output(aborted, 101.0, 103.0)
    assert _samples(m)["lmserve:e2e_request_latency_seconds_count{frontend=http}"] == 0


def test_two_servers_in_one_process_have_separate_registries() -> None:
    a, b = Metrics("a", lambda: None), Metrics("b", lambda: None)
    a.on_request_rejected("invalid_request")
    assert _samples(a)["lmserve:num_rejected_requests_total{frontend=http,reason=invalid_request}"] == 1
    assert "lmserve:num_rejected_requests_total{frontend=http,reason=invalid_request}" not in _samples(b)


def test_frontend_label_from_the_request_id() -> None:
    m = Metrics("m", lambda: None)
    done = dict(first_scheduled_time=100.5, first_token_time=101.0, last_token_time=102.0, finished_time=102.0)
    out = _output(True, 3, 3, FinishReason.LENGTH, **done)
    out.request_id = GRPC_REQUEST_ID_PREFIX + "abc"
    m.on_request_output(out, None, 102.0)
    m.on_request_rejected("invalid_request", "grpc")
    s = _samples(m)
    assert s["lmserve:e2e_request_latency_seconds_count{frontend=grpc}"] == 1
    assert s["lmserve:e2e_request_latency_seconds_count{frontend=http}"] == 0
    assert s["lmserve:request_generation_tokens_sum{frontend=grpc}"] == 3
    assert s["lmserve:num_rejected_requests_total{frontend=grpc,reason=invalid_request}"] == 1
    assert "lmserve:num_rejected_requests_total{frontend=http,reason=invalid_request}" not in s
