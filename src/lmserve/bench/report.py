"""Benchmark output: a console table, a JSON file (arguments + summary + per-request records), PNG plots.

matplotlib is optional (the `bench` extra) and only imported when plots are asked for.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from lmserve.bench.metrics import (
    BenchSummary,
    Distribution,
    RequestRecord,
    in_flight_over_time,
    output_tokens_over_time,
    request_latency,
)

DIST_ROWS = (
    ("ttft_ms", "TTFT (ms)"),
    ("ttft_from_send_ms", "TTFT from send (ms)"),
    ("tpot_ms", "TPOT (ms)"),
    ("itl_ms", "ITL (ms)"),
    ("e2e_ms", "E2E (ms)"),
    ("e2e_from_send_ms", "E2E from send (ms)"),
    ("queue_delay_ms", "client queueing (ms)"),
    ("prompt_len", "prompt length (tok)"),
    ("output_len", "output length (tok)"),
)


def _num(x: float | None, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.{digits}f}"


def format_distribution_table(summary: BenchSummary, rows: tuple[tuple[str, str], ...] = DIST_ROWS) -> str:
    head = f"{'metric':<22}{'mean':>10}{'P50':>10}{'P90':>10}{'P95':>10}{'P99':>10}{'max':>10}"
    lines = [head, "-" * len(head)]
    for attr, label in rows:
        d: Distribution = getattr(summary, attr)
        if d.count == 0:
            continue
        values = (d.mean, d.p50, d.p90, d.p95, d.p99, d.max)
        lines.append(f"{label:<22}" + "".join(f"{_num(v):>10}" for v in values))
    return "\n".join(lines)


def format_summary(summary: BenchSummary, title: str = "Serving benchmark") -> str:
    s = summary
    width = 72
    slo_text = ", ".join(f"{k.removesuffix('_ms')}<={v:g}ms" for k, v in s.slos.items() if v is not None)
    rows = [
        ("requests succeeded / failed", f"{s.num_succeeded} / {s.num_failed}"),
        ("duration (s)", _num(s.duration_s)),
        (
            "arrival rate target / scheduled / sent (req/s)",
            f"{_num(s.target_rate_rps)} / {_num(s.scheduled_rate_rps)} / {_num(s.achieved_send_rate_rps)}",
        ),
        ("max concurrency", "-" if s.max_concurrency is None else str(s.max_concurrency)),
        ("request throughput (req/s)", _num(s.request_throughput_rps, 3)),
        ("output token throughput (tok/s)", _num(s.output_throughput_tok_s)),
        ("total token throughput (tok/s)", _num(s.total_token_throughput_tok_s)),
        ("prompt / output tokens", f"{s.total_prompt_tokens} / {s.total_output_tokens}"),
    ]
    if s.goodput_rps is not None:
        rows.append((f"goodput (req/s) [{slo_text}]", _num(s.goodput_rps, 3)))
        rows.append(("SLO attainment (%)", _num(s.slo_attainment_pct, 1)))
    rows.append(("requested output length produced (%)", _num(s.output_len_matched_pct, 1)))
    out = [f" {title} ".center(width, "="), *(f"{k:<50}{v:>22}" for k, v in rows), "=" * width]
    out.append(format_distribution_table(s))
    if s.num_failed:
        out.append(f"errors ({s.num_failed} failed requests), first messages:")
        out += [f"  [{s.error_counts[e]}x] {e}" for e in s.errors]
    return "\n".join(out)


def json_safe(obj: Any) -> Any:
    """Dataclasses to dicts; inf → "inf" and nan → None so the file is strict JSON."""
    if is_dataclass(obj) and not isinstance(obj, type):
        obj = asdict(obj)
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
    if isinstance(obj, Path):
        return str(obj)
    return obj


def write_json(
    path: str | Path,
    args: dict[str, Any],
    summary: BenchSummary,
    records: list[RequestRecord],
    extra: dict[str, Any] | None = None,
) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"args": args, "summary": summary, **(extra or {}), "requests": records}
    path.write_text(json.dumps(json_safe(doc), indent=1, allow_nan=False, ensure_ascii=False))
    return path


def load_pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'lmserve[bench]'") from None
    return plt


def _cdf(ax: Any, values: list[float], label: str) -> None:
    if not values:
        return
    xs = sorted(values)
    ax.step([xs[0], *xs], [0.0, *((i + 1) / len(xs) for i in range(len(xs)))], where="post", label=label)


def plot_latency_cdfs(runs: dict[str, list[RequestRecord]], path: str | Path, title: str = "") -> Path:
    """2×2 CDFs of TTFT, TPOT, ITL and E2E (ms, from arrival), one line per labelled run."""
    plt = load_pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itls_s"), ("E2E", "e2e_s"))
    for ax, (name, attr) in zip(axes.flat, panels, strict=True):
        for label, records in runs.items():
            lats = [request_latency(r) for r in records if r.success]
            if attr == "itls_s":
                values = [x * 1e3 for lat in lats for x in lat.itls_s]
            else:
                values = [getattr(lat, attr) * 1e3 for lat in lats if getattr(lat, attr) is not None]
            _cdf(ax, values, label)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of tokens")
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize=7)
    fig.suptitle(title or "latency CDFs")
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_throughput_over_time(records: list[RequestRecord], path: str | Path, bin_s: float = 1.0) -> Path:
    """Output tokens per second and requests in flight, per time bin."""
    plt = load_pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    starts, tok_s = output_tokens_over_time(records, bin_s)
    ax.step(starts, tok_s, where="post", label="output tok/s")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens / s")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    _, in_flight = in_flight_over_time(records, bin_s)
    ax2.step(starts, in_flight, where="post", color="tab:orange", label="requests in flight")
    ax2.set_ylabel("requests in flight")
    fig.legend(loc="upper right", fontsize=8)
    fig.suptitle("throughput over time")
    fig.tight_layout()
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def save_plots(records: list[RequestRecord], json_path: str | Path, title: str = "") -> list[Path]:
    """`<stem>_latency_cdf.png` and `<stem>_throughput.png` beside the JSON file."""
    p = Path(json_path)
    stem = p.with_suffix("")
    return [
        plot_latency_cdfs({title or "run": records}, f"{stem}_latency_cdf.png", title),
        plot_throughput_over_time(records, f"{stem}_throughput.png"),
    ]
