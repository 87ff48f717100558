"""`lmserve bench experiments`, the command: parse --only, run the chosen experiments in RUN_ORDER against one
harness, and write report.md and results.json."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from lmserve.bench.experiments import EXPERIMENT_TITLES, EXPERIMENTS
from lmserve.bench.harness import Harness, Section, ServerError, resolve_tokenizer_path


def parse_only(text: str | None) -> list[int]:
    if not text:
        return sorted(EXPERIMENTS)
    try:
        chosen = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--only: expected experiment numbers like 1,3,6, got {text!r}") from None
    bad = [x for x in chosen if x not in EXPERIMENTS]
    if bad or not chosen:
        raise ValueError(f"--only: experiments are numbered 1-{max(EXPERIMENTS)}, got {text!r}")
    return chosen


# 6 starts with the default server (prefix cache on), which 1-4 leave running; 5 needs two other servers
RUN_ORDER = (1, 2, 3, 4, 6, 5, 7)


def run_experiments(h: Harness, numbers: list[int]) -> list[Section]:
    sections = []
    for n in sorted(numbers, key=RUN_ORDER.index):
        sec = Section(n)
        t0 = time.perf_counter()
        print(f"[{n}] {EXPERIMENT_TITLES[n]} ...", flush=True)
        try:
            EXPERIMENTS[n](h, sec)
        except (ServerError, ValueError, OSError) as e:
            sec.error = str(e)
        status = "skipped" if sec.skipped else ("FAILED: " + sec.error.splitlines()[0] if sec.error else "done")
        print(f"[{n}] {status} ({time.perf_counter() - t0:.1f} s)", flush=True)
        sections.append(sec)
    return sorted(sections, key=lambda sec: sec.number)


def write_report(h: Harness, sections: list[Section], wall_s: float) -> Path:
    import platform

    import torch

    lines = [
        "# lmserve serving experiments",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S')}; wall time {wall_s:.0f} s; mode: "
        f"{'quick' if h.args.quick else 'full'}",
        f"- model: `{h.model_dir}`" + (f"; endpoint: {h.args.base_url}" if h.args.base_url else ""),
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads in the client process); load average (1 min) at start / end: "
        f"{h.load_avg_start:.2f} / {os.getloadavg()[0]:.2f} (above the CPU count, other work shared the "
        "machine and the numbers are noisy)",
        "- latencies are measured by the client (TTFT = first token, E2E = last token, "
        "TPOT = (E2E − TTFT)/(N − 1)); P50 / P95 / P99 in every table. Experiments 1, 2, 3 and 6 send one "
        "request at a time or keep a fixed number in flight, so they measure from each request's send; "
        "4 and 5 send everything at time 0 with no client-side cap, so from arrival and from send coincide.",
        *(f"- server {c}" for c in dict.fromkeys(h.server_commands)),
        "",
    ]
    for sec in sections:
        lines += [f"## {sec.number}. {EXPERIMENT_TITLES[sec.number]}", ""]
        if sec.skipped:
            lines += [f"Skipped: {sec.skipped}.", ""]
        elif sec.error:
            lines += ["**Failed:**", "", "```", sec.error.strip()[:3000], "```", ""]
        else:
            lines += sec.markdown
    path = h.out_dir / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def write_results_json(h: Harness, sections: list[Section]) -> Path:
    from lmserve.bench.report import json_safe

    doc = {
        "args": {k: v for k, v in vars(h.args).items() if k != "func"},
        "workloads": h.work,
        "experiments": {
            str(sec.number): {
                "title": EXPERIMENT_TITLES[sec.number],
                "skipped": sec.skipped,
                "error": sec.error,
                "points": [
                    {"label": p.label, "params": p.params, "summary": p.summary, "requests": p.records}
                    for p in sec.points
                ],
            }
            for sec in sections
        },
    }
    path = h.out_dir / "results.json"
    path.write_text(json.dumps(json_safe(doc), indent=1, allow_nan=False))
    return path


def run_bench_experiments(args: argparse.Namespace) -> int:
    from lmserve.bench.datasets import load_tokenizer

    try:
        numbers = parse_only(args.only)
        if args.base_url and not args.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {args.base_url!r}")
        if args.model:
            model_dir = args.model
        else:
            from lmserve.default_model import default_model_path

            model_dir = default_model_path()
        if not args.base_url and not Path(model_dir).is_dir():
            raise ValueError(f"--model: {model_dir!r} is not a directory (the harness serves it itself)")
        tokenizer = load_tokenizer(resolve_tokenizer_path(args.tokenizer, model_dir))
    except ValueError as e:
        print(f"lmserve bench experiments: error: {e}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    h = Harness(args, model_dir, tokenizer, out_dir)
    t0 = time.perf_counter()
    try:
        sections = run_experiments(h, numbers)
    finally:
        h.close()
    report = write_report(h, sections, time.perf_counter() - t0)
    results = write_results_json(h, sections)
    print(f"wrote {report} and {results} ({time.perf_counter() - t0:.0f} s)")
    return 1 if any(sec.error for sec in sections) else 0


def add_experiment_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="bench_results/experiments", help="directory for report.md, PNGs, JSON")
    p.add_argument("--quick", action="store_true", help="small sweeps: a few minutes on the bundled model")
    p.add_argument("--only", default=None, help="comma-separated experiment numbers, e.g. 1,3 (default: all)")
    p.add_argument("--model", default=None, help="HF model dir to serve (default: the bundled model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the model's)")
    p.add_argument("--base-url", default=None, help="benchmark this server instead of starting lmserve")
    p.add_argument("--served-model-name", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--server-args", default=None, help="extra flags for every `lmserve serve` started")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
