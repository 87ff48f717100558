"""How fast the simulator runs: N requests on R replicas (default 100,000 on 64), wall and CPU seconds.

    python benchmarks/bench_sim_speed.py [--step-model step-model.json] [--num-requests 100000] [--replicas 64]
        [--input-len 256] [--output-len 64] [--load 0.7] [--profile]

Without --step-model the bundled model's reference step model below is used (a fit of `lmserve simulate
calibrate` on the 2-core development machine, rounded), so the figure does not move with a new calibration. The
rate is `--load` × the replicas' saturation throughput, which is estimated first by simulating one replica with
the workload sent all at once. Phases are timed separately: building the workload (prompt token ids), the
simulation itself, and bench/metrics.summarize over the records.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import os
import pstats
import time
from pathlib import Path

from lmserve.bench.datasets import DatasetConfig, load_tokenizer
from lmserve.bench.metrics import summarize
from lmserve.config.engine import EngineArgs
from lmserve.default_model import default_model_path
from lmserve.sim.inputs import engine_config
from lmserve.sim.linear_fit import LinearStepModel
from lmserve.sim.sim_config import SimConfig
from lmserve.sim.simulator import Simulator, paused_gc
from lmserve.sim.step_features import Overheads
from lmserve.sim.step_model import StepProfile, profile_for
from lmserve.sim.workload import Workload, build_workload

REFERENCE = LinearStepModel(
    0.0012,
    {"prefill_tokens": 3.8e-4, "prefill_segments": 7.6e-3, "decode_rows": 2.3e-4, "decode_context_tokens": 1.4e-6},
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-model", default=None)
    ap.add_argument("--num-requests", type=int, default=100_000)
    ap.add_argument("--replicas", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--load", type=float, default=0.7, help="fraction of the replicas' saturation throughput")
    ap.add_argument("--profile", action="store_true", help="cProfile the simulation (slower), top 25 functions")
    ap.add_argument(
        "--api-queue",
        action="store_true",
        help="also model the API process (Overheads.api_*: tiny costs, so one API for 64 replicas never saturates, "
        "and a stretch): times the queue and stretch code path",
    )
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    if args.step_model:  # its model (a roofline's needs no weights) and, for a roofline, the accelerator's KV pool
        profile = StepProfile.load(args.step_model)
        config = engine_config(profile, {}, None)
    else:
        config = EngineArgs.from_kwargs(default_model_path(), kv_cache_memory_gib=0.25).create_engine_config()
        profile = profile_for(config, REFERENCE, overheads=Overheads(0.004, 0.004, 0.0006))
    if args.api_queue:
        import dataclasses

        profile.overheads = dataclasses.replace(profile.overheads, api_request_s=1e-6, api_chunk_s=1e-8,
                                                api_first_chunk_s=1e-7, api_last_chunk_s=1e-7,
                                                api_step_stretch=1.0, api_arrival_stall_s=1e-7)  # fmt: skip
    tok = load_tokenizer(config.tokenizer)
    load_start = os.getloadavg()[0]

    probe = build_workload(DatasetConfig(num_requests=400, input_len=args.input_len, output_len=args.output_len),
                           tok, math.inf, prompts="fast")  # fmt: skip
    burst = Simulator(profile, SimConfig(config)).run(probe)
    saturation = summarize(burst.records, burst.duration_s).request_throughput_rps * args.replicas
    rate = args.load * saturation

    t0, c0 = time.perf_counter(), time.process_time()
    cfg = DatasetConfig(num_requests=args.num_requests, input_len=args.input_len, output_len=args.output_len)
    workload: Workload = build_workload(cfg, tok, rate, 1.0, 0, prompts="fast")
    t1, c1 = time.perf_counter(), time.process_time()
    sim = Simulator(profile, SimConfig(config, data_parallel_size=args.replicas))
    if args.profile:
        prof = cProfile.Profile()
        result = prof.runcall(sim.run, workload)
    else:
        result = sim.run(workload)
    t2, c2 = time.perf_counter(), time.process_time()
    with paused_gc():  # as `lmserve simulate run` summarizes
        summary = summarize(result.records, result.duration_s, rate)
    t3, c3 = time.perf_counter(), time.process_time()
    stats = result.stats_dict()
    tokens = summary.total_output_tokens
    figures = {
        "num_requests": args.num_requests,
        "replicas": args.replicas,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "rate_rps": rate,
        "saturation_rps": saturation,
        "simulated_duration_s": result.duration_s,
        "num_steps": stats["num_steps"],
        "mean_replica_utilization": stats["mean_replica_utilization"],
        "workload_wall_s": t1 - t0,
        "simulation_wall_s": t2 - t1,
        "simulation_cpu_s": c2 - c1,
        "summarize_wall_s": t3 - t2,
        "total_wall_s": t3 - t0,
        "total_cpu_s": c3 - c0,
        "us_per_output_token_wall": 1e6 * (t2 - t1) / tokens,
        "load_avg_1m": [load_start, os.getloadavg()[0]],
        "cpus": os.cpu_count(),
        "step_model": args.step_model or "reference (bench_sim_speed.REFERENCE)",
        "api_queue": profile.overheads.api_queue,
        "step_model_label": profile.label,
        "model": profile.model.get("name"),
    }
    print(
        f"{args.num_requests} requests ({args.input_len} in / {args.output_len} out) on {args.replicas} replicas at "
        f"{rate:.1f} req/s ({args.load:.0%} of {saturation:.1f}): {stats['num_steps']} steps, "
        f"{result.duration_s:.0f} s simulated, utilization {100 * stats['mean_replica_utilization']:.0f} %\n"
        f"  workload {t1 - t0:.1f} s, simulation {t2 - t1:.1f} s wall / {c2 - c1:.1f} s CPU "
        f"({figures['us_per_output_token_wall']:.1f} µs per output token), summarize {t3 - t2:.1f} s; "
        f"total {t3 - t0:.1f} s wall, {c3 - c0:.1f} s CPU; load average {load_start:.2f} → {os.getloadavg()[0]:.2f} "
        f"on {os.cpu_count()} CPUs"
    )
    if args.profile:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
