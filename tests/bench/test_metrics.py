"""Metric math on synthetic timelines with known answers."""

from __future__ import annotations

import math

import pytest

from lmserve.bench.metrics import (
    Distribution,
    RequestRecord,
    SLOs,
    itl_per_token_s,
    output_tokens_over_time,
    parse_slos,
    request_latency,
    summarize,
)


def rec(
    index: int = 0,
    scheduled_s: float = 0.0,
    send_s: float | None = None,
    chunks: list[tuple[float, int]] | None = None,
    requested: int | None = None,
    prompt_len: int = 10,
    success: bool = True,
    error: str | None = None,
) -> RequestRecord:
    chunks = chunks or []
    n_out = sum(k for _, k in chunks)
    return RequestRecord(
        index=index,
        prompt_len=prompt_len,
        requested_output_len=n_out if requested is None else requested,
        scheduled_s=scheduled_s,
        send_s=scheduled_s if send_s is None else send_s,
        end_s=chunks[-1][0] if chunks else scheduled_s + 0.01,
        chunk_times_s=[t for t, _ in chunks],
        chunk_num_tokens=[k for _, k in chunks],
        success=success,
        error=error,
        num_output_tokens=n_out if success else 0,
    )


def test_single_token_chunks():
    r = rec(scheduled_s=1.0, send_s=1.5, chunks=[(2.0, 1), (2.1, 1), (2.3, 1), (2.6, 1)])
    lat = request_latency(r)
    assert lat.ttft_s == pytest.approx(1.0)
    assert lat.ttft_from_send_s == pytest.approx(0.5)
    assert lat.e2e_s == pytest.approx(1.6)
    assert lat.e2e_from_send_s == pytest.approx(1.1)
    assert lat.queue_delay_s == pytest.approx(0.5)
    assert lat.tpot_s == pytest.approx(0.6 / 3)
    assert lat.itls_s == pytest.approx([0.1, 0.2, 0.3])


def test_multi_token_chunks_split_gap_across_tokens():
    # first chunk carries 2 tokens (one gets TTFT, the other a zero gap), then 3 tokens after 0.3 s
    chunks = [(1.0, 2), (1.3, 3), (1.4, 1)]
    assert itl_per_token_s([t for t, _ in chunks], [k for _, k in chunks]) == pytest.approx(
        [0.0, 0.1, 0.1, 0.1, 0.1]
    )
    lat = request_latency(rec(chunks=chunks))
    assert lat.tpot_s == pytest.approx(0.4 / 5)
    # the ITLs of a request sum to E2E − TTFT, so their mean is the request's TPOT
    assert sum(lat.itls_s) == pytest.approx(lat.e2e_s - lat.ttft_s)
    assert sum(lat.itls_s) / len(lat.itls_s) == pytest.approx(lat.tpot_s)


def test_zero_token_chunks_are_ignored():
    assert itl_per_token_s([1.0, 1.1, 1.5], [1, 0, 1]) == pytest.approx([0.5])
    with pytest.raises(ValueError):
        itl_per_token_s([1.0], [1, 1])


def test_one_token_output_has_no_tpot_and_meets_tpot_slo():
    r = rec(chunks=[(0.2, 1)])
    lat = request_latency(r)
    assert lat.ttft_s == pytest.approx(0.2) and lat.e2e_s == pytest.approx(0.2)
    assert lat.tpot_s is None and lat.itls_s == []
    s = summarize([r], slos=SLOs(ttft_ms=300, tpot_ms=1))
    assert s.tpot_ms.count == 0 and s.tpot_ms.mean is None
    assert s.goodput_rps == pytest.approx(1 / 0.2)
    assert s.slo_attainment_pct == 100.0


def test_failed_requests_count_as_slo_misses_and_not_in_latency():
    good = [rec(index=i, scheduled_s=i * 1.0, chunks=[(i + 0.1, 1), (i + 0.2, 1)]) for i in range(3)]
    bad = rec(index=3, scheduled_s=3.0, success=False, error="HTTP 500: boom")
    s = summarize([*good, bad], duration_s=4.0, slos=SLOs(ttft_ms=150))
    assert (s.num_requests, s.num_succeeded, s.num_failed) == (4, 3, 1)
    assert s.ttft_ms.count == 3 and s.ttft_ms.mean == pytest.approx(100.0)
    assert s.goodput_rps == pytest.approx(3 / 4.0)
    assert s.slo_attainment_pct == pytest.approx(75.0)
    assert s.request_throughput_rps == pytest.approx(3 / 4.0)
    assert s.output_throughput_tok_s == pytest.approx(6 / 4.0)
    assert s.total_token_throughput_tok_s == pytest.approx((6 + 30) / 4.0)
    assert s.errors == ["HTTP 500: boom"] and s.error_counts == {"HTTP 500: boom": 1}
    assert request_latency(bad).ttft_s is None


def test_slo_misses_per_objective():
    fast = rec(index=0, chunks=[(0.1, 1), (0.15, 1), (0.2, 1)])  # ttft 100, tpot 50, e2e 200
    slow_tpot = rec(index=1, chunks=[(0.1, 1), (0.5, 1), (0.9, 1)])  # tpot 400
    slow_ttft = rec(index=2, chunks=[(0.9, 1), (0.95, 1)])  # ttft 900
    recs = [fast, slow_tpot, slow_ttft]
    assert summarize(recs, duration_s=1.0, slos=SLOs(ttft_ms=500)).slo_attainment_pct == pytest.approx(
        200 / 3
    )
    assert summarize(recs, duration_s=1.0, slos=SLOs(tpot_ms=100)).slo_attainment_pct == pytest.approx(
        200 / 3
    )
    both = summarize(recs, duration_s=1.0, slos=SLOs(ttft_ms=500, tpot_ms=100, e2e_ms=1000))
    assert both.goodput_rps == pytest.approx(1.0)
    assert summarize(recs, duration_s=1.0, slos=SLOs(e2e_ms=150)).slo_attainment_pct == 0.0
    no_slo = summarize(recs, duration_s=1.0)
    assert no_slo.goodput_rps is None and no_slo.slo_attainment_pct is None


def test_percentiles_and_duration():
    recs = [
        rec(index=i, scheduled_s=0.0, chunks=[((i + 1) / 100, 1)]) for i in range(100)
    ]  # ttft 10..1000 ms
    s = summarize(recs)
    assert s.duration_s == pytest.approx(1.0)
    assert s.ttft_ms.p50 == pytest.approx(505.0)
    assert s.ttft_ms.p90 == pytest.approx(901.0)
    assert s.ttft_ms.p99 == pytest.approx(990.1)  # linear interpolation: rank 0.99 * 99
    assert s.ttft_ms.max == pytest.approx(1000.0) and s.ttft_ms.min == pytest.approx(10.0)
    assert s.ttft_ms.mean == pytest.approx(505.0)
    empty = Distribution.of([])
    assert empty.count == 0 and empty.p99 is None


def test_rates_and_output_length_check():
    recs = [
        rec(index=0, scheduled_s=0.0, send_s=0.0, chunks=[(0.1, 1)], requested=1),
        rec(index=1, scheduled_s=0.5, send_s=1.0, chunks=[(1.1, 2)], requested=4),  # short output
        rec(index=2, scheduled_s=1.0, send_s=2.0, chunks=[(2.1, 1)], requested=1),
    ]
    s = summarize(recs, target_rate_rps=2.0, max_concurrency=1)
    assert s.scheduled_rate_rps == pytest.approx(2.0)
    assert s.achieved_send_rate_rps == pytest.approx(1.0)
    assert s.queue_delay_ms.max == pytest.approx(1000.0)
    assert s.num_output_len_matched == 2 and s.output_len_matched_pct == pytest.approx(200 / 3)
    inf = summarize([rec(index=i, chunks=[(0.1, 1)]) for i in range(3)], target_rate_rps=math.inf)
    assert inf.scheduled_rate_rps == math.inf


def test_parse_slos():
    assert parse_slos(["ttft:500", "tpot:50", "E2E:3000.5"]) == SLOs(500.0, 50.0, 3000.5)
    assert parse_slos(None) == SLOs()
    for bad in (["ttft"], ["itl:5"], ["ttft:x"], ["tpot:-1"], ["e2e:inf"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_slos(bad)


def test_output_tokens_over_time():
    recs = [rec(chunks=[(0.5, 2), (1.5, 3), (1.7, 1)]), rec(index=1, chunks=[(0.2, 4)])]
    starts, tok_s = output_tokens_over_time(recs, bin_s=1.0)
    assert starts == [0.0, 1.0] and tok_s == [6.0, 4.0]
    assert sum(tok_s) * 1.0 == sum(r.num_output_tokens for r in recs)
