"""`lmserve bench serve | offline | experiments`: measure an inference service (add_parser, run_bench_serve).

Heavy imports (torch, transformers, aiohttp, matplotlib) happen inside the run functions. See docs/benchmarking.md.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="benchmark a server (serve), the engine in-process (offline), experiments"
    )
    sub = p.add_subparsers(dest="bench_command", metavar="{serve,offline,experiments}")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    s = sub.add_parser("serve", help="load-test an OpenAI-compatible endpoint (lmserve, vLLM, llama.cpp)")
    add_serve_args(s)
    s.set_defaults(func=run_bench_serve)

    o = sub.add_parser("offline", help="in-process throughput: lmserve engine vs HF transformers generate")
    from lmserve.bench.offline import add_offline_args, run_bench_offline

    add_offline_args(o)
    o.set_defaults(func=run_bench_offline)

    e = sub.add_parser("experiments", help="the classic serving experiments, as a Markdown report with plots")
    from lmserve.bench.experiment_runner import add_experiment_args, run_bench_experiments

    add_experiment_args(e)
    e.set_defaults(func=run_bench_experiments)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from lmserve.bench.datasets import add_dataset_args, parse_rate

    g = p.add_argument_group("endpoint")
    g.add_argument("--base-url", default=None, help="default http://127.0.0.1:8000 (grpc://127.0.0.1:50051 for grpc)")
    g.add_argument(
        "--backend",
        default="openai",
        choices=["openai", "grpc"],
        help="openai: SSE streaming over HTTP; grpc: lmserve's gRPC GenerateStream (lmserve serve --grpc-port)",
    )
    g.add_argument(
        "--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"]
    )
    g.add_argument("--model", default=None, help="model name to send (default: the first at /v1/models)")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer dir to build and count prompts (default: --model if a dir, else the bundled model's)",
    )
    g.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (env OPENAI_API_KEY)"
    )
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument(
        "--no-ignore-eos", dest="ignore_eos", action="store_false", help="let EOS end outputs early"
    )
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    t = p.add_argument_group("traffic")
    t.add_argument("--request-rate", type=parse_rate, default=math.inf, help="requests/s (inf = all at once)")
    t.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    t.add_argument(
        "--max-concurrency", type=int, default=None, help="cap on requests in flight (closed loop)"
    )
    t.add_argument("--warmup-requests", type=int, default=0, help="untimed requests sent first")
    t.add_argument("--seed", type=int, default=0)
    r = p.add_argument_group("report")
    r.add_argument(
        "--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2e:MS"
    )
    r.add_argument("--output-json", default=None, help="default: bench_results/serve-<time>.json")
    r.add_argument("--plot", action="store_true", help="latency CDF and throughput PNGs beside the JSON")
    r.add_argument("--label", default="", help="a name for this run in the report")
    r.add_argument("--no-progress", dest="progress", action="store_false")
    add_dataset_args(p)


def run_bench_serve(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from lmserve.bench.datasets import build_requests, dataset_config_from_args, load_tokenizer
    from lmserve.bench.harness import resolve_tokenizer_path
    from lmserve.bench.loadgen import LoadConfig, finalize_all, run_load
    from lmserve.bench.metrics import parse_slos, summarize
    from lmserve.bench.report import format_summary, json_safe, load_pyplot, save_plots, write_json

    try:
        slos = parse_slos(args.goodput)
        if args.warmup_requests < 0:
            raise ValueError(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
        if args.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
        extra = {}
        if args.extra_body:
            try:
                extra = json.loads(args.extra_body)
            except json.JSONDecodeError as e:
                raise ValueError(f"--extra-body must be a JSON object: {e}") from None
            if not isinstance(extra, dict):
                raise ValueError("--extra-body must be a JSON object")
        default_url = "grpc://127.0.0.1:50051" if args.backend == "grpc" else "http://127.0.0.1:8000"
        cfg = LoadConfig(
            base_url=args.base_url or default_url,
            backend=args.backend,
            endpoint=args.endpoint,
            model=args.model,
            request_rate_rps=args.request_rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
            temperature=args.temperature,
            timeout_s=args.request_timeout,
            api_key=args.api_key,
            extra_body=extra,
            show_progress=args.progress,
        )
        cfg.validate()
        if args.plot:
            load_pyplot()  # fail before the run, not after it
        tokenizer = load_tokenizer(resolve_tokenizer_path(args.tokenizer, args.model))
        all_requests = build_requests(
            dataset_config_from_args(args, args.num_requests + args.warmup_requests), tokenizer
        )
    except ValueError as e:
        print(f"lmserve bench serve: error: {e}", file=sys.stderr)
        return 2
    warmup, requests = all_requests[: args.warmup_requests], all_requests[args.warmup_requests :]
    result = asyncio.run(run_load(requests, cfg, warmup))
    records = finalize_all(result, requests, cfg, tokenizer)
    summary = summarize(
        records,
        duration_s=result.duration_s or None,
        target_rate_rps=cfg.request_rate_rps,
        max_concurrency=cfg.max_concurrency,
        slos=slos,
    )
    print(format_summary(summary, f"serve: {args.label or cfg.url}"))
    if result.fatal_error:
        print(f"lmserve bench serve: error: {result.fatal_error}", file=sys.stderr)
    if result.warmup_errors:
        print(
            f"warning: {len(result.warmup_errors)} warmup requests failed: {result.warmup_errors[0]}",
            file=sys.stderr,
        )
    out = Path(args.output_json or f"bench_results/serve-{time.strftime('%Y%m%d-%H%M%S')}.json")
    run_info = {
        "model": result.model,
        "url": cfg.url,
        "start_wall_time": result.start_wall_time,
        "fatal_error": result.fatal_error,
        "warmup_errors": result.warmup_errors,
    }
    args_dict = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
    write_json(out, json_safe(args_dict), summary, records, {"run": run_info})
    print(f"wrote {out}")
    if args.plot and summary.num_succeeded:
        for png in save_plots(records, out, args.label):
            print(f"wrote {png}")
    return 1 if result.fatal_error or summary.num_succeeded == 0 else 0
