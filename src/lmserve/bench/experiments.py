"""`lmserve bench experiments`: the classic serving experiments, written up as Markdown with PNG plots.

exp1 .. exp6 each run their points and write their own Markdown section (experiment 7 is pd_goodput.py);
run_bench_experiments runs them in order and writes report.md and results.json. The harness they stand on is
harness.py; the list of experiments is in docs/benchmarking.md.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmserve.bench import pd_goodput
from lmserve.bench.harness import Harness, Point, Section
from lmserve.bench.metrics import Distribution, summarize

EXPERIMENT_TITLES = {
    1: "Prompt length sweep → TTFT",
    2: "Output length sweep → E2E (and E2E ≈ TTFT + (N−1)·TPOT)",
    3: "Concurrency sweep → throughput vs P99 TPOT",
    4: "HF transformers one-request loop vs lmserve continuous batching",
    5: "Static vs continuous batching on the same engine",
    6: "Prefix cache on vs off with a shared system prompt → TTFT (and a burst: in-step sharing on vs off)",
    7: pd_goodput.TITLE,
}


# ---- Markdown helpers ----------------------------------------------------------------------------------


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pcts(d: Distribution) -> str:
    return f"{_f(d.p50)} / {_f(d.p95)} / {_f(d.p99)}"


def _lens(d: Distribution) -> str:
    return f"{_f(d.min, 0)} / {_f(d.mean)} / {_f(d.max, 0)}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def _plot(out: Path, name: str, draw: Callable[[Any], None]) -> str | None:
    try:
        from lmserve.bench.report import load_pyplot

        plt = load_pyplot()
    except ValueError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    draw(ax)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / name, dpi=100)
    plt.close(fig)
    return name


def _image(name: str | None) -> list[str]:
    return [f"![]({name})", ""] if name else ["(plot skipped: matplotlib is not installed)", ""]


# ---- the experiments -----------------------------------------------------------------------------------


def exp1_prompt_sweep(h: Harness, sec: Section) -> None:
    w = h.work
    with h.server("default") as url:
        for n in w.prompt_sweep:
            reqs = h.requests(w.requests_per_point, n, w.prompt_sweep_output_len)
            records, s = h.load(url, reqs, max_concurrency=1)
            sec.points.append(Point(f"prompt {n}", s, records, {"input_len": n}))
    sec.markdown += [
        f"Output fixed at {w.prompt_sweep_output_len} tokens, {w.requests_per_point} requests per prompt "
        "length, sent one at a time (max concurrency 1), so TTFT is prefill plus HTTP, without queueing.",
        "",
        *_table(
            [
                "prompt len",
                "actual min / mean / max",
                "TTFT P50 / P95 / P99 (ms)",
                "TPOT P50 (ms)",
                "E2E P50 (ms)",
            ],
            [
                [
                    str(p.params["input_len"]),
                    _lens(p.summary.prompt_len),
                    _pcts(p.summary.ttft_from_send_ms),
                    _f(p.summary.tpot_ms.p50),
                    _f(p.summary.e2e_from_send_ms.p50),
                ]
                for p in sec.points
            ],
        ),
        "",
    ]

    def draw(ax: Any) -> None:
        xs = [p.summary.prompt_len.mean for p in sec.points]
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(
                xs,
                [getattr(p.summary.ttft_from_send_ms, q) for p in sec.points],
                style,
                label=f"TTFT {q.upper()}",
            )
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("TTFT (ms)")
        ax.set_title("1. TTFT vs prompt length")
        ax.legend()

    sec.markdown += _image(_plot(h.out_dir, "exp1_ttft_vs_prompt.png", draw))


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares y = a + b·x → (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


def exp2_output_sweep(h: Harness, sec: Section) -> None:
    w = h.work
    with h.server("default") as url:
        for n in w.output_sweep:
            reqs = h.requests(w.requests_per_point, w.output_sweep_input_len, n)
            records, s = h.load(url, reqs, max_concurrency=1)
            sec.points.append(Point(f"output {n}", s, records, {"output_len": n}))
    rows = []
    for p in sec.points:
        s = p.summary
        n = p.params["output_len"]
        # medians: with means the identity is exact by TPOT's definition, so it would check nothing
        predicted = (s.ttft_from_send_ms.p50 or 0) + (n - 1) * (s.tpot_ms.p50 or 0)
        err = 100 * (predicted - (s.e2e_from_send_ms.p50 or 0)) / (s.e2e_from_send_ms.p50 or 1)
        rows.append(
            [
                str(n),
                _pcts(s.ttft_from_send_ms),
                _pcts(s.tpot_ms),
                _pcts(s.e2e_from_send_ms),
                f"{_f(predicted)} ({err:+.1f}%)",
            ]
        )
    xs = [float(p.params["output_len"] - 1) for p in sec.points]
    ys = [p.summary.e2e_from_send_ms.mean or 0.0 for p in sec.points]
    a, b = _fit_line(xs, ys)
    ttft_mean = sum(p.summary.ttft_from_send_ms.mean or 0 for p in sec.points) / len(sec.points)
    tpot_mean = sum(p.summary.tpot_ms.mean or 0 for p in sec.points) / len(sec.points)
    sec.markdown += [
        f"Prompt fixed at {w.output_sweep_input_len} tokens, {w.requests_per_point} requests per output "
        "length, one at a time; `ignore_eos` makes every output exactly N tokens.",
        "",
        *_table(
            [
                "N (output)",
                "TTFT P50/P95/P99 (ms)",
                "TPOT P50/P95/P99 (ms)",
                "E2E P50/P95/P99 (ms)",
                "P50 TTFT + (N−1)·P50 TPOT vs P50 E2E",
            ],
            rows,
        ),
        "",
        f"Check: a least-squares line through mean E2E vs (N−1) gives intercept {a:.1f} ms (mean TTFT "
        f"{ttft_mean:.1f} ms) and slope {b:.2f} ms/token (mean TPOT {tpot_mean:.2f} ms): "
        "E2E ≈ TTFT + (N−1)·TPOT holds when the slope matches TPOT and the intercept matches TTFT.",
        "",
    ]

    def draw(ax: Any) -> None:
        ax.plot([x + 1 for x in xs], ys, "o", label="mean E2E")
        grid = [0.0, max(xs)]
        ax.plot([x + 1 for x in grid], [a + b * x for x in grid], "-", label=f"fit: {a:.0f} ms + {b:.1f} ms·(N−1)")
        ax.set_xlabel("output tokens N")
        ax.set_ylabel("E2E (ms)")
        ax.set_title("2. E2E vs output length")
        ax.legend()

    sec.markdown += _image(_plot(h.out_dir, "exp2_e2e_vs_output.png", draw))


def exp3_concurrency_sweep(h: Harness, sec: Section) -> None:
    w = h.work
    with h.server("default") as url:
        for c in w.concurrency_sweep:
            n = max(w.requests_per_point, 2 * c)
            reqs = h.requests(n, w.concurrency_input_len, w.concurrency_output_len)
            records, s = h.load(url, reqs, max_concurrency=c)
            sec.points.append(Point(f"concurrency {c}", s, records, {"concurrency": c, "num_requests": n}))
    rows = [
        [
            str(p.params["concurrency"]),
            str(p.params["num_requests"]),
            _f(p.summary.output_throughput_tok_s),
            _f(p.summary.request_throughput_rps, 2),
            _pcts(p.summary.tpot_ms),
            _pcts(p.summary.ttft_from_send_ms),
        ]
        for p in sec.points
    ]
    sec.markdown += [
        f"Prompt {w.concurrency_input_len}, output {w.concurrency_output_len} tokens; a closed loop keeps "
        "`concurrency` requests in flight. TTFT is measured from send (the client-side wait for a free slot "
        "is the closed loop's own doing).",
        "",
        *_table(
            [
                "concurrency",
                "requests",
                "output tok/s",
                "req/s",
                "TPOT P50/P95/P99 (ms)",
                "TTFT from send P50/P95/P99",
            ],
            rows,
        ),
        "",
    ]

    def draw(ax: Any) -> None:
        xs = [p.summary.tpot_ms.p99 or 0 for p in sec.points]
        ys = [p.summary.output_throughput_tok_s for p in sec.points]
        ax.plot(xs, ys, "o-")
        for p, x, y in zip(sec.points, xs, ys, strict=True):
            ax.annotate(f"c={p.params['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4))
        ax.set_xlabel("P99 TPOT (ms)")
        ax.set_ylabel("output throughput (tok/s)")
        ax.set_title("3. latency / throughput trade-off")

    sec.markdown += _image(_plot(h.out_dir, "exp3_throughput_vs_tpot.png", draw))


def exp4_hf_vs_lmserve(h: Harness, sec: Section) -> None:
    from lmserve.bench.offline import load_hf_model, run_hf

    w = h.work
    if not Path(h.model_dir).is_dir():
        sec.skipped = f"--model {h.model_dir!r} is not a local HF directory, so HF transformers cannot load it"
        return
    reqs = h.requests(w.hf_num_requests, w.hf_input_len, w.hf_output_len)
    model, tok = load_hf_model(h.model_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    run_hf(model, h.requests(1, 16, 4), 1, pad)  # warm-up
    hf_records = run_hf(model, reqs, 1, pad)
    del model
    sec.points.append(Point("HF transformers, one request at a time", summarize(hf_records), hf_records))
    with h.server("default") as url:
        records, s = h.load(url, reqs)
    sec.points.append(Point("lmserve serve, continuous batching", s, records))
    hf, lm = sec.points[0].summary, sec.points[1].summary
    ratio = lm.output_throughput_tok_s / hf.output_throughput_tok_s if hf.output_throughput_tok_s else float("nan")
    sec.markdown += [
        f"The same {w.hf_num_requests} prompts ({w.hf_input_len} tokens, output {w.hf_output_len}), all "
        "submitted at time 0. HF: in-process `generate` (greedy, fp32), one request after another. lmserve: "
        "every request sent at once to the server, which batches them continuously (its numbers include "
        "HTTP).",
        "",
        *_table(
            [
                "backend",
                "output tok/s",
                "TTFT P50/P95/P99 (ms)",
                "TPOT P50 (ms)",
                "E2E P50/P95/P99 (ms)",
                "wall (s)",
            ],
            [
                [
                    p.label,
                    _f(p.summary.output_throughput_tok_s),
                    _pcts(p.summary.ttft_ms),
                    _f(p.summary.tpot_ms.p50),
                    _pcts(p.summary.e2e_ms),
                    _f(p.summary.duration_s, 2),
                ]
                for p in sec.points
            ],
        ),
        "",
        f"lmserve output throughput is **{ratio:.2f}×** the one-request HF loop.",
        "",
    ]
    sec.markdown += _image(_cdf_plot(h, sec, "exp4_hf_vs_lmserve.png", "e2e_s", "E2E", "4. HF loop vs lmserve"))


def exp5_static_vs_continuous(h: Harness, sec: Section) -> None:
    w = h.work
    if h.args.base_url:
        sec.skipped = "needs servers started by the harness with different --scheduling-policy (no --base-url)"
        return
    reqs = h.requests(w.static_num_requests, 32, w.static_output_len, range_ratio=0.9)
    for policy in ("static", "continuous"):
        flags = ["--scheduling-policy", policy, "--max-num-seqs", str(w.static_max_num_seqs)]
        with h.server(policy, flags) as url:
            records, s = h.load(url, reqs)
        sec.points.append(Point(policy, s, records))
    sec.markdown += [
        f"{w.static_num_requests} requests sent at once, prompt ~32 tokens, output lengths mixed "
        f"({_lens(sec.points[0].summary.output_len)} min / mean / max); both servers run with "
        f"`--max-num-seqs {w.static_max_num_seqs}`, only `--scheduling-policy` differs. Static batching "
        "admits a new batch only when the whole running batch has finished; continuous batching refills a "
        "slot as soon as any request finishes.",
        "",
        *_table(
            [
                "policy",
                "output tok/s",
                "req/s",
                "TTFT P50/P95/P99 (ms)",
                "TPOT P50/P95/P99 (ms)",
                "E2E P99 (ms)",
            ],
            [
                [
                    p.label,
                    _f(p.summary.output_throughput_tok_s),
                    _f(p.summary.request_throughput_rps, 2),
                    _pcts(p.summary.ttft_ms),
                    _pcts(p.summary.tpot_ms),
                    _f(p.summary.e2e_ms.p99),
                ]
                for p in sec.points
            ],
        ),
        "",
    ]
    sec.markdown += _image(_cdf_plot(h, sec, "exp5_static_vs_continuous.png", "ttft_s", "TTFT", "5. TTFT CDF"))


def exp6_prefix_cache(h: Harness, sec: Section) -> None:
    w = h.work
    if h.args.base_url:
        sec.skipped = "needs servers started by the harness with and without --no-prefix-caching (no --base-url)"
        return
    reqs = h.requests(
        w.prefix_num_requests,
        w.prefix_suffix_len,
        8,
        name="prefix",
        prefix_len=w.prefix_len,
        num_prefix_groups=1,
    )
    burst = h.requests(
        w.prefix_burst_num_requests,
        w.prefix_suffix_len,
        8,
        name="prefix",
        prefix_len=w.prefix_burst_len,
        num_prefix_groups=1,
    )
    burst_points = []
    # server order: the default one (left running by 1-4) serves both of its loads before the others start
    for label, name, flags, requests, concurrency in (
        ("prefix cache on", "default", [], reqs, 1),
        ("burst, in-step sharing on", "default", [], burst, None),
        ("burst, in-step sharing off", "no-in-step-sharing", ["--no-in-step-prefix-sharing"], burst, None),
        ("prefix cache off", "no-prefix-caching", ["--no-prefix-caching"], reqs, 1),
    ):
        with h.server(name, flags) as url:
            records, s = h.load(url, requests, max_concurrency=concurrency)
        point = Point(label, s, records)
        (burst_points if requests is burst else sec.points).append(point)
    sequential = list(sec.points)
    sec.points += burst_points
    on, off = sequential[0].summary, sequential[1].summary
    speedup = (off.ttft_from_send_ms.p50 or 0) / (on.ttft_from_send_ms.p50 or 1)
    sec.markdown += [
        f"{w.prefix_num_requests} requests sharing a {w.prefix_len}-token system prompt, each with its own "
        f"{w.prefix_suffix_len}-token question, output 8 tokens, sent one at a time. With the cache on, only "
        "the first request prefills the shared prefix.",
        "",
        *_table(
            ["server", "prompt len min / mean / max", "TTFT P50/P95/P99 (ms)", "E2E P50 (ms)"],
            [
                [
                    p.label,
                    _lens(p.summary.prompt_len),
                    _pcts(p.summary.ttft_from_send_ms),
                    _f(p.summary.e2e_from_send_ms.p50),
                ]
                for p in sequential
            ],
        ),
        "",
        f"Median TTFT is **{speedup:.2f}×** lower with the prefix cache on.",
        "",
    ]
    shared, unshared = burst_points[0].summary, burst_points[1].summary
    burst_speedup = (unshared.ttft_from_send_ms.p50 or 0) / (shared.ttft_from_send_ms.p50 or 1)
    sec.markdown += [
        f"Burst: {w.prefix_burst_num_requests} requests sharing a {w.prefix_burst_len}-token system prompt "
        "(not cached before), all sent at once. With in-step sharing the first request scheduled computes the "
        "prefix and the others admitted in the same step read its blocks; with `--no-in-step-prefix-sharing` "
        "each request admitted in that step computes it too.",
        "",
        *_table(
            ["server", "TTFT P50/P95/P99 (ms)", "E2E P50 (ms)", "output tok/s"],
            [
                [
                    p.label,
                    _pcts(p.summary.ttft_from_send_ms),
                    _f(p.summary.e2e_from_send_ms.p50),
                    _f(p.summary.output_throughput_tok_s),
                ]
                for p in burst_points
            ],
        ),
        "",
        f"Median burst TTFT is **{burst_speedup:.2f}×** lower with in-step sharing.",
        "",
    ]
    sec.markdown += _image(_cdf_plot(h, sec, "exp6_prefix_cache.png", "ttft_from_send_s", "TTFT", "6. TTFT CDF"))


def _cdf_plot(h: Harness, sec: Section, name: str, attr: str, metric: str, title: str) -> str | None:
    from lmserve.bench.metrics import request_latency

    def draw(ax: Any) -> None:
        for p in sec.points:
            xs = sorted(getattr(request_latency(r), attr) * 1e3 for r in p.records if r.success)
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], drawstyle="steps-post", label=p.label)
        ax.set_xlabel(f"{metric} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(title)
        ax.legend(fontsize=8)

    return _plot(h.out_dir, name, draw)


EXPERIMENTS: dict[int, Callable[[Harness, Section], None]] = {
    1: exp1_prompt_sweep,
    2: exp2_output_sweep,
    3: exp3_concurrency_sweep,
    4: exp4_hf_vs_lmserve,
    5: exp5_static_vs_continuous,
    6: exp6_prefix_cache,
    7: lambda h, sec: pd_goodput.exp7_pd_goodput(h, sec, _plot, _image),
}
