"""Serving metrics from per-request timelines: pure math, no I/O, no clock.

request_latency gives one request's TTFT, TPOT, E2E and per-token ITLs, from its scheduled arrival and from its
send; summarize aggregates RequestRecords into a BenchSummary (throughputs, goodput, SLO attainment, percentiles).
The definitions are in docs/benchmarking.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestRecord:
    """One request, as the load generator (or the offline runner) saw it. Times are seconds from the
    benchmark start; chunk lists hold only token-bearing chunks."""

    index: int
    prompt_len: int  # tokens, counted client-side with the benchmark tokenizer
    requested_output_len: int  # max_tokens asked for
    scheduled_s: float  # when the arrival process said the request arrives
    send_s: float | None = None  # when it was actually sent (after any concurrency limit)
    end_s: float | None = None  # when the response (or the error) was complete
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_num_tokens: list[int] = field(default_factory=list)
    success: bool = False
    error: str | None = None
    num_output_tokens: int = 0
    server_prompt_len: int | None = None  # usage.prompt_tokens when the server sent it
    output_tokens_source: str = ""  # usage | token_ids | tokenizer | engine
    # continuous_usage | token_ids | one_per_chunk | tokenizer_estimate | engine
    chunk_tokens_source: str = ""
    generated_text: str = ""

    @property
    def effective_prompt_len(self) -> int:
        return self.server_prompt_len if self.server_prompt_len is not None else self.prompt_len

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RequestLatency:
    """Per-request latencies in seconds; None where undefined (failed request, 1-token TPOT)."""

    ttft_s: float | None
    ttft_from_send_s: float | None
    e2e_s: float | None
    e2e_from_send_s: float | None
    tpot_s: float | None
    queue_delay_s: float | None  # send − scheduled: time spent waiting in the client
    itls_s: list[float]


def itl_per_token_s(chunk_times_s: list[float], chunk_num_tokens: list[int]) -> list[float]:
    """Inter-token latencies, one per output token after the first.

    A chunk of k tokens arriving g seconds after the previous chunk gives k values of g / k; the first chunk's
    extra tokens give zeros. So a request's ITLs sum to E2E − TTFT and their mean is its TPOT.
    """
    if len(chunk_times_s) != len(chunk_num_tokens):
        raise ValueError(f"{len(chunk_times_s)} chunk times but {len(chunk_num_tokens)} chunk token counts")
    itls: list[float] = []
    prev_s: float | None = None
    for t_s, k in zip(chunk_times_s, chunk_num_tokens, strict=True):
        if k <= 0:
            continue
        if prev_s is None:
            itls.extend([0.0] * (k - 1))  # came together with the first token
        else:
            itls.extend([(t_s - prev_s) / k] * k)
        prev_s = t_s
    return itls


def request_latency(rec: RequestRecord) -> RequestLatency:
    """Latencies of one request; all None for a failed one (or one without a token)."""
    queue_s = None if rec.send_s is None else rec.send_s - rec.scheduled_s
    times = [t for t, k in zip(rec.chunk_times_s, rec.chunk_num_tokens, strict=True) if k > 0]
    if not rec.success or not times:
        return RequestLatency(None, None, None, None, None, queue_s, [])
    send_s = rec.send_s if rec.send_s is not None else rec.scheduled_s
    first_s, last_s = times[0], times[-1]
    n_out = rec.num_output_tokens
    tpot_s = (last_s - first_s) / (n_out - 1) if n_out > 1 else None
    return RequestLatency(
        ttft_s=first_s - rec.scheduled_s,
        ttft_from_send_s=first_s - send_s,
        e2e_s=last_s - rec.scheduled_s,
        e2e_from_send_s=last_s - send_s,
        tpot_s=tpot_s,
        queue_delay_s=queue_s,
        itls_s=itl_per_token_s(rec.chunk_times_s, rec.chunk_num_tokens),
    )


@dataclass
class Distribution:
    """count, mean, P50/P90/P95/P99 and max of one metric (units in the owner's field name)."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p95: float | None
    p99: float | None
    max: float | None
    min: float | None

    @staticmethod
    def of(values: list[float], scale: float = 1.0) -> Distribution:
        if not values:
            return Distribution(0, None, None, None, None, None, None, None)
        a = np.asarray(values, dtype=np.float64) * scale
        p50, p90, p95, p99 = (float(x) for x in np.percentile(a, PERCENTILES))
        return Distribution(len(a), float(a.mean()), p50, p90, p95, p99, float(a.max()), float(a.min()))


@dataclass(frozen=True)
class SLOs:
    """Latency objectives in milliseconds (None = not constrained), measured from the scheduled arrival."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))


def parse_slos(items: list[str] | None, flag: str = "--goodput") -> SLOs:
    """`["ttft:500", "tpot:50", "e2e:3000"]` (milliseconds) → SLOs. ValueError names the flag."""
    values: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        key = key.strip().lower()
        if not sep or key not in ("ttft", "tpot", "e2e"):
            raise ValueError(f"{flag}: expected KEY:MS with KEY one of ttft, tpot, e2e; got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"{flag}: {key} needs a number of milliseconds, got {value!r}") from None
        if not math.isfinite(ms) or ms <= 0:
            raise ValueError(f"{flag}: {key} must be a positive number of milliseconds, got {value!r}")
        values[f"{key}_ms"] = ms
    return SLOs(**values)


def meets_slos(lat: RequestLatency, success: bool, slos: SLOs) -> bool:
    """A failed request misses; a 1-token output has no TPOT and so cannot miss the TPOT objective."""
    if not success or lat.ttft_s is None or lat.e2e_s is None:
        return False
    if slos.ttft_ms is not None and lat.ttft_s * 1e3 > slos.ttft_ms:
        return False
    if slos.tpot_ms is not None and lat.tpot_s is not None and lat.tpot_s * 1e3 > slos.tpot_ms:
        return False
    return not (slos.e2e_ms is not None and lat.e2e_s * 1e3 > slos.e2e_ms)


@dataclass
class BenchSummary:
    num_requests: int
    num_succeeded: int
    num_failed: int
    duration_s: float
    total_prompt_tokens: int  # of successful requests (server count when reported)
    total_output_tokens: int
    request_throughput_rps: float
    output_throughput_tok_s: float
    total_token_throughput_tok_s: float
    target_rate_rps: float | None  # inf = all at once; None = not an open-loop run
    scheduled_rate_rps: float | None  # rate of the sampled arrival times
    achieved_send_rate_rps: float | None  # rate at which requests actually left the client
    max_concurrency: int | None
    slos: dict[str, float | None]
    goodput_rps: float | None
    slo_attainment_pct: float | None
    num_output_len_matched: int  # successful requests that produced exactly the requested length
    output_len_matched_pct: float | None
    ttft_ms: Distribution
    ttft_from_send_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    e2e_from_send_ms: Distribution
    queue_delay_ms: Distribution
    prompt_len: Distribution  # tokens, successful and failed requests (what was sent)
    output_len: Distribution  # tokens, successful requests
    errors: list[str]  # the first few distinct error messages
    error_counts: dict[str, int]  # message → count (first 200 characters as the key)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rate(times_s: list[float]) -> float | None:
    if len(times_s) < 2:
        return None
    span_s = max(times_s) - min(times_s)
    return math.inf if span_s <= 0 else (len(times_s) - 1) / span_s


def benchmark_duration_s(records: list[RequestRecord]) -> float:
    """From the benchmark start (time 0) to the last moment any request was still being answered."""
    ends = [r.end_s for r in records if r.end_s is not None]
    ends += [r.chunk_times_s[-1] for r in records if r.chunk_times_s]
    return max(ends, default=0.0)


def summarize(
    records: list[RequestRecord],
    duration_s: float | None = None,
    target_rate_rps: float | None = None,
    max_concurrency: int | None = None,
    slos: SLOs | None = None,
    max_errors: int = 5,
) -> BenchSummary:
    slos = slos or SLOs()
    duration_s = benchmark_duration_s(records) if duration_s is None else duration_s
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    lats = [request_latency(r) for r in records]
    ok = [(r, lat) for r, lat in zip(records, lats, strict=True) if r.success]
    total_out = sum(r.num_output_tokens for r, _ in ok)
    total_in = sum(r.effective_prompt_len for r, _ in ok)
    n_good = sum(meets_slos(lat, r.success, slos) for r, lat in zip(records, lats, strict=True))
    n_matched = sum(r.num_output_tokens == r.requested_output_len for r, _ in ok)

    def dist(attr: str) -> Distribution:
        return Distribution.of([getattr(lat, attr) for _, lat in ok if getattr(lat, attr) is not None], 1e3)

    error_counts: dict[str, int] = {}
    for r in records:
        if not r.success:
            key = (r.error or "unknown error")[:200]
            error_counts[key] = error_counts.get(key, 0) + 1
    sends = [r.send_s for r in records if r.send_s is not None]
    return BenchSummary(
        num_requests=len(records),
        num_succeeded=len(ok),
        num_failed=len(records) - len(ok),
        duration_s=duration_s,
        total_prompt_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput_rps=per_s(len(ok)),
        output_throughput_tok_s=per_s(total_out),
        total_token_throughput_tok_s=per_s(total_in + total_out),
        target_rate_rps=target_rate_rps,
        scheduled_rate_rps=_rate([r.scheduled_s for r in records]),
        achieved_send_rate_rps=_rate(sends),
        max_concurrency=max_concurrency,
        slos={"ttft_ms": slos.ttft_ms, "tpot_ms": slos.tpot_ms, "e2e_ms": slos.e2e_ms},
        goodput_rps=per_s(n_good) if slos.any else None,
        slo_attainment_pct=(100.0 * n_good / len(records) if records else None) if slos.any else None,
        num_output_len_matched=n_matched,
        output_len_matched_pct=100.0 * n_matched / len(ok) if ok else None,
        ttft_ms=dist("ttft_s"),
        ttft_from_send_ms=dist("ttft_from_send_s"),
        tpot_ms=dist("tpot_s"),
        itl_ms=Distribution.of([x for _, lat in ok for x in lat.itls_s], 1e3),
        e2e_ms=dist("e2e_s"),
        e2e_from_send_ms=dist("e2e_from_send_s"),
        queue_delay_ms=Distribution.of(
            [lat.queue_delay_s for lat in lats if lat.queue_delay_s is not None], 1e3
        ),
        prompt_len=Distribution.of([float(r.effective_prompt_len) for r in records]),
        output_len=Distribution.of([float(r.num_output_tokens) for r, _ in ok]),
        errors=list(error_counts)[:max_errors],
        error_counts=error_counts,
    )


def output_tokens_over_time(
    records: list[RequestRecord], bin_s: float = 1.0
) -> tuple[list[float], list[float]]:
    """(bin start times, output tokens per second in each bin), from every chunk's arrival and size."""
    if bin_s <= 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s}")
    end_s = benchmark_duration_s(records)
    num_bins = max(1, math.ceil(end_s / bin_s))
    tokens = [0.0] * num_bins
    for r in records:
        for t_s, k in zip(r.chunk_times_s, r.chunk_num_tokens, strict=True):
            tokens[min(num_bins - 1, max(0, int(t_s / bin_s)))] += k
    return [i * bin_s for i in range(num_bins)], [x / bin_s for x in tokens]


def in_flight_over_time(records: list[RequestRecord], bin_s: float = 1.0) -> tuple[list[float], list[int]]:
    """(bin start times, requests sent but not finished at each bin start)."""
    end_s = benchmark_duration_s(records)
    starts = [i * bin_s for i in range(max(1, math.ceil(end_s / bin_s)))]
    spans = [(r.send_s, r.end_s) for r in records if r.send_s is not None and r.end_s is not None]
    return starts, [sum(a <= t < b for a, b in spans) for t in starts]
