"""`lmserve simulate calibrate | roofline | run | plan`: the engine's scheduler on a step-time model.

`run` prints and writes `lmserve bench serve`'s report (the same summary keys), so a measured and a simulated run
of one workload can be diffed. Heavy imports happen inside the run functions. Usage: docs/simulator.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("simulate", help="simulate serving: the real scheduler on a fitted step-time model")
    sub = p.add_subparsers(dest="simulate_command", metavar="{calibrate,roofline,run,plan}")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    from lmserve.sim.calibrate import add_calibrate_args, run_calibrate

    c = sub.add_parser("calibrate", help="time real engine steps on this machine, fit a step model, save it")
    add_calibrate_args(c)
    c.set_defaults(func=run_calibrate)

    r = sub.add_parser("roofline", help="an analytic step model (ESTIMATE) from published accelerator figures")
    add_roofline_args(r)
    r.set_defaults(func=run_roofline)

    s = sub.add_parser("run", help="simulate a workload; prints and writes lmserve bench serve's report")
    add_run_args(s)
    s.set_defaults(func=run_simulate)

    pl = sub.add_parser("plan", help="the cheapest configuration meeting goodput SLOs, by simulation")
    add_plan_args(pl)
    pl.set_defaults(func=run_plan)


# ---- roofline ---------------------------------------------------------------------------------------------


def add_roofline_args(p: argparse.ArgumentParser) -> None:
    from lmserve.sim.roofline import HARDWARE

    p.add_argument("--hardware", required=True, choices=sorted(HARDWARE), help="published figures of this accelerator")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="HF model directory (its config.json; default: the bundled model)")
    src.add_argument("--preset", default=None, help="a well-known model's public config (lmserve memory --preset)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32", "int8", "fp8_e4m3"]
    )
    p.add_argument("--quantization", default=None, choices=["int8", "int4"])
    p.add_argument("--mfu", type=float, default=0.5, help="achievable fraction of peak FLOP/s (assumed, default 0.5)")
    p.add_argument("--mbu", type=float, default=0.8, help="achievable fraction of memory bandwidth (default 0.8)")
    p.add_argument("--overheads-from", default=None, help="copy the API/network overheads of this step model JSON")
    p.add_argument("--out", required=True, help="the step model JSON to write")


def run_roofline(args: argparse.Namespace) -> int:
    import json

    from lmserve.sim.step_model import StepProfile, roofline_profile

    try:
        if args.preset:
            from lmserve.memory.presets import get_preset

            preset = get_preset(args.preset)
            hf, name = dict(preset.config), preset.hf_id
        else:
            from lmserve.default_model import default_model_path

            model = args.model or default_model_path()
            cfg_file = Path(model) / "config.json"
            if not cfg_file.is_file():
                raise ValueError(f"--model: {model!r} has no config.json")
            hf, name = json.loads(cfg_file.read_text()), args.model or "bundled (lmserve/default_model/target)"
            hf.pop("quantization_config", None)
        overheads = StepProfile.load(args.overheads_from).overheads if args.overheads_from else None
        profile = roofline_profile(
            args.hardware, hf, name, args.dtype, args.kv_cache_dtype, args.quantization, args.mfu, args.mbu, overheads
        )
    except (ValueError, KeyError) as e:
        print(f"lmserve simulate roofline: error: {e}", file=sys.stderr)
        return 2
    out = profile.save(args.out)
    assert profile.roofline is not None
    print(f"{profile.label}: {name}, {args.dtype}, KV {profile.kv_cache_dtype}; {profile.fit['note']}")
    print(f"  {profile.roofline.hardware.source}")
    print(f"wrote {out}")
    return 0


# ---- run ----------------------------------------------------------------------------------------------------


def add_sim_args(p: argparse.ArgumentParser, plan: bool = False) -> None:
    from lmserve.config.args import add_engine_args
    from lmserve.sim.inputs import add_workload_args

    s = p.add_argument_group("simulation")
    s.add_argument("--step-model", required=True, help="a step model JSON (simulate calibrate / roofline)")
    s.add_argument(
        "--step-noise",
        action="store_true",
        help="multiply each step's time by a seeded draw from the calibration's measured/fitted ratios (the "
        "machine's step-to-step variation; default: the fitted typical step)",
    )
    if not plan:
        s.add_argument("--data-parallel-size", type=int, default=1, help="replicas behind the server's router")
        s.add_argument(
            "--tensor-parallel-size",
            type=int,
            default=1,
            help="a step-time factor from the step model (an ESTIMATE: see its tensor_parallel note)",
        )
        s.add_argument(
            "--disaggregation", default=None, metavar="xPyD",
            help="prefill/decode disaggregation as lmserve serve --disaggregation: x prefill and y decode replicas "
            "(instead of --data-parallel-size); calibrate the step model at each role's threads",
        )  # fmt: skip
    s.add_argument(
        "--kv-transfer-latency-us", type=float, default=None,
        help="disaggregation: a KV pull's fixed cost (default: the step model's measured one, else 200 µs)",
    )  # fmt: skip
    s.add_argument(
        "--kv-transfer-block-us", type=float, default=None,
        help="disaggregation: the cost per pulled KV block (default: the step model's measured one, else 20 µs)",
    )  # fmt: skip
    r = p.add_argument_group("report (as lmserve bench serve)")
    r.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2e:MS")
    r.add_argument("--output-json", default=None, help="default: bench_results/simulate-<time>.json")
    r.add_argument("--plot", action="store_true", help="PNGs beside the JSON")
    r.add_argument("--label", default="", help="a name for this run in the report")
    add_workload_args(p)
    add_engine_args(p)


def add_run_args(p: argparse.ArgumentParser) -> None:
    add_sim_args(p)


def prepare(args: argparse.Namespace, overrides: dict[str, Any] | None = None, tp: int = 1) -> tuple[Any, Any, Any]:
    """(profile, engine config, workload) from the flags; ValueError names the bad one."""
    from lmserve.config.args import engine_kwargs
    from lmserve.sim.inputs import build_workload_from_args, engine_config
    from lmserve.sim.step_model import StepProfile

    profile = StepProfile.load(args.step_model)
    kwargs = {**engine_kwargs(args), **(overrides or {})}
    config = engine_config(profile, kwargs, args.model, tp)
    workload, _ = build_workload_from_args(args, config.tokenizer)
    return profile, config, workload


def simulate(profile: Any, config: Any, workload: Any, dp: int, tp: int, max_concurrency: int | None,
             step_noise: bool = False, seed: int = 0, pd: dict[str, Any] | None = None) -> Any:  # fmt: skip
    """pd: SimConfig's disaggregation fields (disaggregation, kv_transfer_latency_s, kv_transfer_block_s)."""
    from lmserve.sim.sim_config import SimConfig
    from lmserve.sim.simulator import Simulator

    sim_cfg = SimConfig(config, dp, tp, max_concurrency, step_noise=step_noise, seed=seed, **(pd or {}))
    return Simulator(profile, sim_cfg, config.model.eos_token_ids).run(workload)


def disaggregation_args(args: argparse.Namespace) -> dict[str, Any]:
    """SimConfig's disaggregation fields from the flags (unset ones keep SimConfig's defaults)."""
    out: dict[str, Any] = {}
    if getattr(args, "disaggregation", None) is not None:
        out["disaggregation"] = args.disaggregation
    if getattr(args, "kv_transfer_latency_us", None) is not None:
        out["kv_transfer_latency_s"] = args.kv_transfer_latency_us * 1e-6
    if getattr(args, "kv_transfer_block_us", None) is not None:
        out["kv_transfer_block_s"] = args.kv_transfer_block_us * 1e-6
    return out


def run_simulate(args: argparse.Namespace) -> int:
    import dataclasses

    from lmserve.bench.metrics import parse_slos, summarize
    from lmserve.bench.report import format_summary, json_safe, load_pyplot, save_plots, write_json
    from lmserve.sim.sim_config import SimConfig, kv_transfer_cost

    try:
        slos = parse_slos(args.goodput)
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
        pd = disaggregation_args(args)
        if args.disaggregation is not None:
            from lmserve.sim.sim_config import check_disaggregation

            check_disaggregation(args.disaggregation)
        if args.plot:
            load_pyplot()
        t0 = time.perf_counter()
        profile, config, workload = prepare(args, tp=args.tensor_parallel_size)
        sim_cfg = SimConfig(config, args.data_parallel_size, args.tensor_parallel_size, args.max_concurrency, **pd)
        kv_cost = kv_transfer_cost(sim_cfg, profile.overheads)
        t_prep = time.perf_counter() - t0
        result = simulate(profile, config, workload, args.data_parallel_size, args.tensor_parallel_size,
                          args.max_concurrency, args.step_noise, args.seed, pd)  # fmt: skip
    except ValueError as e:
        print(f"lmserve simulate run: error: {e}", file=sys.stderr)
        return 2
    from lmserve.sim.simulator import paused_gc

    rate = None if args.trace else args.request_rate  # a trace's arrivals are its own
    with paused_gc():
        summary = summarize(result.records, result.duration_s or None, rate, args.max_concurrency, slos)
    estimate = profile.tp_is_estimate(args.tensor_parallel_size)
    title = f"simulate: {args.label or profile.model.get('name')}" + (" (ESTIMATE)" if estimate else "")
    print(format_summary(summary, title))
    stats = result.stats_dict()
    replicas = args.disaggregation or f"{args.data_parallel_size} replica(s)"
    print(
        f"simulated {len(workload)} requests on {replicas} x TP {args.tensor_parallel_size} "
        f"with {profile.label}: {stats['num_steps']} steps, {stats['num_preemptions']} preemptions, prefix-cache hit "
        f"rate {100 * stats['prefix_cache_hit_rate']:.1f} %, replica utilization "
        f"{100 * stats['mean_replica_utilization']:.1f} %; prompts {workload.description.get('prompts')}; "
        f"setup {t_prep:.1f} s, simulation {result.wall_s:.1f} s"
    )
    out = Path(args.output_json or f"bench_results/simulate-{time.strftime('%Y%m%d-%H%M%S')}.json")
    run_info = {
        "model": profile.model.get("name"),
        "url": None,
        "start_wall_time": time.time(),
        "fatal_error": None,
        "warmup_errors": [],
        "simulated": True,
    }
    sim_info = {
        **stats,
        "step_model": profile.source,
        "step_model_label": profile.label,
        "estimate": estimate,
        "data_parallel_size": args.data_parallel_size,
        "tensor_parallel_size": args.tensor_parallel_size,
        "disaggregation": args.disaggregation,
        "kv_transfer_latency_us": 1e6 * kv_cost[0],
        "kv_transfer_block_us": 1e6 * kv_cost[1],
        "step_noise": args.step_noise,
        "workload": workload.description,
        "num_kv_blocks_per_replica": config.cache.num_blocks,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "overheads": dataclasses.asdict(profile.overheads),
    }
    args_dict = {k: v for k, v in vars(args).items() if k != "func"}
    write_json(out, json_safe(args_dict), summary, result.records, {"run": run_info, "simulation": sim_info})
    print(f"wrote {out}")
    if args.plot and summary.num_succeeded:
        for png in save_plots(result.records, out, args.label or "simulated"):
            print(f"wrote {png}")
    return 0 if summary.num_succeeded else 1


# ---- plan ---------------------------------------------------------------------------------------------------


def add_plan_args(p: argparse.ArgumentParser) -> None:
    add_sim_args(p, plan=True)
    g = p.add_argument_group("search")
    g.add_argument(
        "--search",
        nargs="+",
        required=True,
        help="flags to search, comma or space separated: data-parallel-size, tensor-parallel-size, max-num-seqs, "
        "max-num-batched-tokens, block-size, num-kv-blocks; or prefill-replicas, decode-replicas (xPyD deployments "
        "instead of data parallel)",
    )
    g.add_argument("--grid", nargs="+", default=None, metavar="NAME=V1,V2", help="values of a searched flag")
    g.add_argument("--attainment", type=float, default=90.0, help="SLO attainment to reach, in %% (default 90)")
    g.add_argument("--exhaustive", action="store_true", help="try every configuration (no pruning)")


def run_plan(args: argparse.Namespace) -> int:
    import json

    from lmserve.bench.metrics import parse_slos, summarize
    from lmserve.bench.report import json_safe, load_pyplot
    from lmserve.sim.plan import Candidate, format_plan, parse_space, plot_plan, search, slo_lower_bound
    from lmserve.sim.simulator import paused_gc
    from lmserve.sim.step_model import StepProfile

    try:
        slos = parse_slos(args.goodput)
        if not slos.any:
            raise ValueError("--goodput: plan needs SLOs to meet, e.g. --goodput ttft:2000 tpot:100")
        space = parse_space(args.search, args.grid)
        if args.plot:
            load_pyplot()
        profile = StepProfile.load(args.step_model)
        base_profile, base_config, workload = prepare(args)
    except ValueError as e:
        print(f"lmserve simulate plan: error: {e}", file=sys.stderr)
        return 2
    del base_profile
    configs: dict[tuple, Any] = {}

    def evaluate(cand: Candidate) -> tuple[Any, str | None, float]:
        try:
            key = (tuple(sorted(cand.engine_overrides().items())), cand.tp)
            if key not in configs:
                from lmserve.config.args import engine_kwargs
                from lmserve.sim.inputs import engine_config

                configs[key] = engine_config(profile, {**engine_kwargs(args), **cand.engine_overrides()}, args.model,
                                             cand.tp)  # fmt: skip
            pd = {**disaggregation_args(args), "disaggregation": cand.disaggregation} if cand.disaggregation else None
            result = simulate(profile, configs[key], workload, cand.dp, cand.tp, args.max_concurrency,
                              args.step_noise, args.seed, pd)  # fmt: skip
        except ValueError as e:
            return None, str(e), 0.0
        with paused_gc():
            s = summarize(result.records, result.duration_s or None, args.request_rate, args.max_concurrency, slos)
        return s, None, result.wall_s

    tps = space.get("tensor-parallel-size", (1,))
    fastest = profile.step_time_fn(max(tps))
    prompt_lens = [len(p) for p in workload.prompt_token_ids]
    impossible = slo_lower_bound(slos, prompt_lens, workload.output_lens, fastest, profile.overheads, args.attainment)
    print(f"plan: {len(workload)} requests, {workload.description}, SLOs {args.goodput}, target {args.attainment:g} %")
    if impossible:
        print(impossible)
    t0 = time.perf_counter()
    result = search(space, evaluate, args.attainment, args.exhaustive, log=print)
    result.impossible = impossible
    print(format_plan(result, slos))
    print(f"{len(result.trials)} configurations simulated in {time.perf_counter() - t0:.1f} s ({profile.label})")
    out = Path(args.output_json or f"bench_results/plan-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "space": space,
        "target_attainment_pct": args.attainment,
        "slos": vars(slos),
        "trials": [t.row() for t in result.trials],
        "winner": result.winner.row() if result.winner else None,
        "closest": result.closest.row() if result.closest else None,
        "impossible": impossible,
        "step_model": {"source": profile.source, "label": profile.label, "estimate": profile.estimate},
    }
    out.write_text(json.dumps(json_safe(doc), indent=1, allow_nan=False))
    print(f"wrote {out}")
    if args.plot:
        print(f"wrote {plot_plan(result, out.with_name(out.stem + '_plan.png'))}")
    return 0 if result.winner is not None else 1
