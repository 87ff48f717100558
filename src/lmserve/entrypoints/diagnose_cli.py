"""`lmserve diagnose --url URL [--window 30] | --report bench.json`: the bottleneck finder
(lmserve.observability.diagnose)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "diagnose",
        help="find the bottleneck of a running server (/metrics) or of a `lmserve bench serve` report",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a running lmserve server; /metrics is scraped twice, --window seconds apart")
    src.add_argument("--report", help="a `lmserve bench serve` JSON report")
    p.add_argument("--window", type=float, default=30.0, help="seconds between the two scrapes (default 30)")
    p.add_argument("--api-key", default=os.environ.get("LMSERVE_API_KEY"), help="sent as a Bearer token")
    p.add_argument("--ttft-slo-ms", type=float, default=None, help="TTFT above this is a symptom (default 500)")
    p.add_argument("--tpot-slo-ms", type=float, default=None, help="TPOT / ITL above this is a symptom (default 50)")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    p.set_defaults(func=run_diagnose)


def run_diagnose(args: argparse.Namespace) -> int:
    import dataclasses

    import httpx

    from lmserve.observability import diagnose as dx
    th = dx.Thresholds()
    try:
        if args.window <= 0:
            raise ValueError(f"--window must be > 0 seconds, got {args.window}")
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            v = getattr(args, name)
            if v is not None and v <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {v}")
        if args.ttft_slo_ms is not None:
            th = dataclasses.replace(th, ttft_s=args.ttft_slo_ms / 1e3)
        if args.tpot_slo_ms is not None:
            th = dataclasses.replace(th, tpot_s=args.tpot_slo_ms / 1e3)
        if args.report is not None:
            result = dx.diagnose_report(args.report, th)
        else:
            before = dx.scrape_url(args.url, args.api_key)
            print(f"scraped {args.url}/metrics; again in {args.window:g} s ...", file=sys.stderr, flush=True)
            time.sleep(args.window)
            after = dx.scrape_url(args.url, args.api_key)
            if not after.samples.get(dx.PREFIX + "num_steps_total"):
                raise ValueError(f"{args.url}/metrics has no lmserve engine metrics (still loading?)")
            result = dx.diagnose(dx.window_between(before, after), th)
    except (ValueError, OSError, httpx.HTTPError) as e:
        print(f"lmserve diagnose: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=1) if args.json else result.format())
    return 0
