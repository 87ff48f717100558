"""Experiment 7 of `lmserve bench experiments`: goodput, colocated vs prefill/decode disaggregated (1P1D), on the
same machine and the same CPUs (exp7_pd_goodput).

Poisson rates are swept as multiples of the colocated server's idle capacity; SLOs are scaled from idle TTFT and
TPOT; goodput is the highest rate with >= 90 % attainment. The method is in docs/benchmarking.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmserve.bench.harness import Harness, Point, Section
from lmserve.bench.metrics import SLOs

TITLE = "Prefill/decode disaggregation: colocated vs 1P1D → SLO attainment and goodput (DistServe)"
ATTAINMENT_TARGET = 90.0
TTFT_SLO_X = 10.0
TPOT_SLO_X = 2.0


@dataclass(frozen=True)
class PDSizes:
    input_len: int
    output_len: int
    requests_per_rate: int
    rate_multipliers: tuple[float, ...]


QUICK = PDSizes(256, 32, 8, (0.5, 1.0, 2.0, 4.0))
FULL = PDSizes(768, 128, 40, (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))

CONFIGS = (
    ("colocated", ["--num-threads", "2"]),
    ("1P1D", ["--disaggregation", "1P1D", "--num-threads", "1"]),
)


def goodput(points: list[Point]) -> float | None:
    """The highest rate with attainment ≥ ATTAINMENT_TARGET (DistServe's goodput), or None."""
    ok = [p.params["rate_rps"] for p in points if (p.summary.slo_attainment_pct or 0) >= ATTAINMENT_TARGET]
    return max(ok) if ok else None


def exp7_pd_goodput(h: Harness, sec: Section, plot: Any, image: Any) -> None:
    """plot / image: experiments.py's _plot and _image (passed in: this module does not import that one)."""
    if h.args.base_url:
        sec.skipped = "needs servers started by the harness (colocated and --disaggregation 1P1D), no --base-url"
        return
    size = QUICK if h.args.quick else FULL
    flags = ["--max-model-len", str(size.input_len + size.output_len + 16)]
    with h.server("pd-colocated", flags + list(CONFIGS[0][1])) as url:  # idle figures: one request at a time
        _, idle = h.load(url, h.requests(3, size.input_len, size.output_len), max_concurrency=1)
    idle_ttft, idle_tpot, idle_e2e = idle.ttft_ms.p50, idle.tpot_ms.p50, idle.e2e_ms.p50
    slos = SLOs(ttft_ms=TTFT_SLO_X * idle_ttft, tpot_ms=TPOT_SLO_X * idle_tpot)
    capacity = 1e3 / idle_e2e
    rates = [round(m * capacity, 4) for m in size.rate_multipliers]
    by_config: dict[str, list[Point]] = {}
    for name, config_flags in CONFIGS:
        with h.server(f"pd-{name}", flags + list(config_flags)) as url:
            for rate in rates:
                reqs = h.requests(size.requests_per_rate, size.input_len, size.output_len)
                records, s = h.load(url, reqs, request_rate_rps=rate, slos=slos)
                point = Point(f"{name} @ {rate:g} req/s", s, records, {"config": name, "rate_rps": rate})
                sec.points.append(point)
                by_config.setdefault(name, []).append(point)
    sec.markdown += report(size, slos, (idle_ttft, idle_tpot, idle_e2e), rates, by_config)
    sec.markdown += _image_of(h, by_config, plot, image)


def report(size: PDSizes, slos: SLOs, idle: tuple[float, float, float], rates: list[float],
           by_config: dict[str, list[Point]]) -> list[str]:  # fmt: skip
    idle_ttft, idle_tpot, idle_e2e = idle
    col, pd = by_config["colocated"], by_config["1P1D"]
    rows = []
    for a, b in zip(col, pd, strict=True):
        rows.append(
            f"| {a.params['rate_rps']:g} | {a.summary.slo_attainment_pct:.0f} % | {b.summary.slo_attainment_pct:.0f} % "
            f"| {a.summary.tpot_ms.p99:.1f} | {b.summary.tpot_ms.p99:.1f} | {a.summary.ttft_ms.p99:.0f} "
            f"| {b.summary.ttft_ms.p99:.0f} |"
        )
    g_col, g_pd = goodput(col), goodput(pd)
    attained = [min(a.summary.slo_attainment_pct or 0, b.summary.slo_attainment_pct or 0)
                for a, b in zip(col, pd, strict=True)]  # fmt: skip
    both = [i for i, pct in enumerate(attained) if pct >= ATTAINMENT_TARGET]
    i = both[-1] if both else 0
    ratio = pd[i].summary.tpot_ms.p99 / col[i].summary.tpot_ms.p99 if col[i].summary.tpot_ms.p99 else float("nan")
    verdict = (
        f"1P1D's goodput {g_pd:g} req/s vs colocated {g_col:g} req/s ({g_pd / g_col:.2f}×)"
        if g_pd and g_col
        else f"goodput: colocated {g_col}, 1P1D {g_pd} (None: no swept rate reached {ATTAINMENT_TARGET:.0f} %)"
    )
    return [
        f"Prompt {size.input_len}, output {size.output_len} tokens, {size.requests_per_rate} requests per rate, "
        "Poisson arrivals. Colocated: one engine core with 2 threads; 1P1D: a prefill core and a decode core with 1 "
        f"thread each, KV moved over ipc. Idle (colocated, one request at a time): TTFT {idle_ttft:.0f} ms, TPOT "
        f"{idle_tpot:.1f} ms, E2E {idle_e2e:.0f} ms; rates are {list(size.rate_multipliers)} × 1 / idle E2E.",
        f"SLOs: TTFT ≤ {TTFT_SLO_X:g} × idle = {slos.ttft_ms:.0f} ms and TPOT ≤ {TPOT_SLO_X:g} × idle = "
        f"{slos.tpot_ms:.1f} ms; attainment = requests meeting both; goodput = the highest rate with ≥ "
        f"{ATTAINMENT_TARGET:.0f} % attainment.",
        "",
        "| rate (req/s) | attainment colocated | attainment 1P1D | TPOT P99 colocated (ms) | TPOT P99 1P1D (ms) "
        "| TTFT P99 colocated (ms) | TTFT P99 1P1D (ms) |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"- {verdict}.",
        f"- TPOT P99 1P1D / colocated at {col[i].params['rate_rps']:g} req/s "
        f"({'the highest rate both sustain' if both else 'neither sustains any rate: the lowest'}): {ratio:.2f} "
        "(target ≤ 0.5: the decode core never runs a prompt chunk).",
        "",
    ]


def _image_of(h: Harness, by_config: dict[str, list[Point]], plot: Any, image: Any) -> list[str]:
    def draw(ax: Any) -> None:
        for name, points in by_config.items():
            ax.plot([p.params["rate_rps"] for p in points], [p.summary.slo_attainment_pct for p in points], "o-",
                    label=name)  # fmt: skip
        ax.axhline(ATTAINMENT_TARGET, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment (%)")
        ax.set_title("7. colocated vs 1P1D")
        ax.legend()

    return image(plot(h.out_dir, "exp7_pd_goodput.png", draw))
