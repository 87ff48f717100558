"""`lmserve simulate calibrate`: time real LLMEngine steps over a grid, fit the step-time model, measure the
server's overheads, save a StepProfile.

Entry points: add_calibrate_args, run_calibrate, refit, format_profile. The grid, the fit and the overhead
measurement are described in docs/simulator.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from lmserve.sim.grid_profile import (
    Grid,
    fit_quality,
    machine_description,
    profile_in_core_process,
    sample_of_row,
)
from lmserve.sim.kv_transfer_timing import measure_kv_transfer
from lmserve.sim.linear_fit import LinearStepModel, choose_form, ratio_quantiles, term_value
from lmserve.sim.served_steps import measure_on_server
from lmserve.sim.step_features import Overheads, StepFeatures
from lmserve.sim.step_model import StepProfile, model_description


def add_calibrate_args(p: argparse.ArgumentParser) -> None:
    from lmserve.config.args import add_engine_args

    p.add_argument("--out", default="step-model.json", help="the step model JSON to write (default step-model.json)")
    p.add_argument("--quick", action="store_true", help="a small grid (minutes on the bundled model)")
    p.add_argument(
        "--refit",
        default=None,
        metavar="STEP_MODEL",
        help="fit again from the steps saved in this step model (no profiling)",
    )
    p.add_argument("--repeats", type=int, default=None, help="times each mixed step is taken (default: the grid's)")
    p.add_argument(
        "--no-server",
        dest="server",
        action="store_false",
        help="do not start `lmserve serve` to measure the API/network overheads (they stay 0)",
    )
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: as a served engine core)")
    p.add_argument(
        "--cpu-wait-policy",
        default="adaptive",
        choices=["adaptive", "bounded", "spin", "passive"],
        help="the OpenMP wait policy of the profiling process, as lmserve serve's (default adaptive)",
    )
    add_engine_args(p)


def refit(path: str, out: str) -> int:
    """The fit again from a step model's saved samples (its overheads, machine and grid kept)."""
    try:
        profile = StepProfile.load(path)
        cal = profile.calibration
        samples = [sample_of_row(row) for row in cal.get("samples") or []]
        held = [sample_of_row(row) for row in cal.get("workload_samples") or []]
        served = [sample_of_row(row) for row in cal.get("served_samples") or []]
        if len(samples) < 10:
            raise ValueError(f"--refit: {path} holds {len(samples)} profiled steps; at least 10 are needed")
    except ValueError as e:
        print(f"lmserve simulate calibrate: error: {e}", file=sys.stderr)
        return 2
    # (four numbers a row in a file from before the sends' stalls: no sends counted, none measured)
    inputs = [tuple(int(v) for v in x) for x in cal.get("served_api_inputs") or []]
    stretch = _fit_into(profile, samples, held, int(cal.get("decode_stack_rows") or 0), served, inputs,
                        profile.overheads)  # fmt: skip
    if profile.overheads.api_queue:
        import dataclasses

        profile.overheads = dataclasses.replace(profile.overheads, api_step_stretch=stretch)
    profile.calibration = {**cal, "refit_of": path, "refit_time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    out_path = profile.save(out)
    print(format_profile(profile))
    print(f"wrote {out_path}")
    return 0


MIN_SERVED_STEPS = 40  # served steps enough to fit on (else the in-process grid is the training set)


def _fit_into(
    profile: StepProfile,
    samples: list[tuple[StepFeatures, float]],
    held: list[tuple[StepFeatures, float]],
    stack_rows: int = 0,
    served: list[tuple[StepFeatures, float]] | None = None,
    inputs: list[tuple[int, ...]] | None = None,
    overheads: Overheads | None = None,
) -> float:
    """Fit the profile's linear model: on the served steps (core-loop iterations of a real server) when there are
    MIN_SERVED_STEPS of them, else on the in-process grid; the other sets are scored against it. With the served
    steps' API-work inputs (api_costs.stretch_inputs) and measured API costs (`overheads`), the model, the API's
    step stretch are fitted together (api_costs.fit_stretch), and the sends' stalls measured beside them, recorded in
    profile.fit and not applied (why_send_stalls). Returns the stretch (0 without)."""
    from lmserve.sim.api_costs import api_work, fit_stretch, sends_during

    on_served = served is not None and len(served) >= MIN_SERVED_STEPS
    train = served if on_served else samples
    assert train is not None
    linear, quality, comparison = choose_form(train, stack_rows=stack_rows)
    profile.kind, profile.linear = "linear", linear
    correction, stretch, stalls = 1.0, 0.0, None
    work = np.zeros(len(train))
    if on_served and inputs and overheads is not None and overheads.api_queue and len(inputs) == len(train):
        work = api_work(overheads, inputs)
        terms, rows = linear.terms, linear.stack_rows  # the chosen form, refitted with the stretch beside it
        x = np.array([[term_value(f, t, rows) for t in terms] for f, _ in train], dtype=np.float64)
        measured = np.array([t for _, t in train])
        c0, coefs, stretch, _ = fit_stretch(x, work, measured)
        profile.linear = linear = LinearStepModel(c0, dict(zip(terms, coefs, strict=True)), rows)
        sent = sends_during(inputs)
        if sent.any():  # measured beside the model, not applied (why_send_stalls)
            stalls = fit_stretch(x, work, measured, sent=sent)[3]
    beside = stretch * work  # what the API's work adds to each step
    if on_served:  # the fit follows the typical step; the served total has a tail (GC, first shapes) it misses
        base = sum(linear.step_time_s(f) for f, _ in train)
        correction = (sum(t for _, t in train) - float(beside.sum())) / base
        correction = correction if correction > 0 else 1.0
        profile.linear = linear = profile.scaled(correction).linear
    if stretch:  # measured / (model + the stretch): the noise of what the simulator times
        pred = np.array([linear.step_time_s(f) for f, _ in train]) + beside
        ratios = np.array([t for _, t in train]) / pred
        profile.noise_quantiles = [float(v) for v in np.quantile(ratios, np.linspace(0, 1, 201))]
    else:
        profile.noise_quantiles = ratio_quantiles(linear, train)
    profile.fit = {
        **comparison,
        "fitted_on": "served" if on_served else "in-process grid",
        "heldout_grid" if not on_served else "heldout_served": asdict(quality),
        "heldout_workload": fit_quality(profile, held),
        "weighting": "least absolute relative error (IRLS), coefficients >= 0",
    }
    if stretch:
        profile.fit["api_step_stretch"] = stretch
        profile.fit["why_api_stretch"] = (
            "served steps ≈ model + f · (the API work beside the step: the previous step's chunks × api_chunk_s + "
            "the requests sent while it ran × their API costs), the model's coefficients and f fitted together "
            "(least absolute relative error, all >= 0); the simulator adds f × the API work it queues beside a "
            "replica's step (Overheads.api_step_stretch)"
        )
    if stalls is not None:
        profile.fit["send_stalls_measured_s"] = {"arrival": stalls[0], "held_by_the_cap": stalls[1]}
        profile.fit["why_send_stalls"] = (
            "a send stalls the engine step in progress (the load generator's and the API's work for it take a core "
            "from the OpenMP team): served steps ≈ model + f · W + g · (requests sent on their own schedule while the "
            "step runs) + h · (those the client's concurrency cap held), g and h by least squares on the sends' "
            "surprise, sent − λ · length (api_costs.stall_per_send: steps that are long for any reason collect more "
            "sends). Measured, not applied: added per send (Overheads.api_arrival_stall_s / api_held_send_stall_s, "
            "which the simulator supports) they left the validation's end-to-end figures no better on the 2-core "
            "machine (benchmarks/validate_sim.py --rescore, docs/performance.md): the model fitted without them "
            "carries their mean in its other terms"
        )
    if on_served:
        profile.fit["total_time_correction"] = correction
        profile.fit["why_correction"] = (
            "the fit follows the typical step (median-like); every coefficient is then scaled by the served steps' "
            "total measured / total fitted time, so that sums of steps (throughput, mean TTFT / TPOT) keep the tail"
        )
        profile.fit["in_process_grid"] = fit_quality(profile, samples)
        profile.fit["why_served"] = (
            "the steps are a served engine core's loop iterations (engine/step_trace.py): they include the API "
            "process taking turns on the step's cores and the loop's own work, which an in-process profile misses; "
            "the in-process grid's steps are scored against the fit (in_process_grid)"
        )
    return stretch


def run_calibrate(args: argparse.Namespace) -> int:
    if args.refit:
        return refit(args.refit, args.out)
    import dataclasses
    import shlex

    from lmserve.config.args import engine_kwargs, model_path
    from lmserve.config.engine import EngineArgs

    def log(msg: str) -> None:
        print(msg, flush=True)

    try:
        grid = Grid.quick() if args.quick else Grid.full()
        if args.repeats is not None:
            if args.repeats < 1:
                raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
            grid = dataclasses.replace(grid, repeats=args.repeats)
        if args.num_threads is not None and args.num_threads < 1:
            raise ValueError(f"--num-threads must be >= 1, got {args.num_threads}")
        model = model_path(args)
        kwargs = engine_kwargs(args)
        # the grid's steps must fit one step's budget and the sequence limit; the KV pool must hold the states
        kwargs["max_num_batched_tokens"] = max(kwargs["max_num_batched_tokens"] or 0, grid.max_tokens_per_step())
        kwargs["max_num_seqs"] = max(kwargs["max_num_seqs"], max(grid.decode_batches) + 2)
        engine_args = EngineArgs.from_kwargs(model, **kwargs)
        config = engine_args.create_engine_config()
        max_len = config.scheduler.max_model_len
        grid = dataclasses.replace(grid, decode_contexts=tuple(c for c in grid.decode_contexts if c + 200 < max_len))
        if not grid.decode_contexts:
            raise ValueError(f"max_model_len {max_len} is too short for the calibration grid (needs > 232)")
        if config.speculative is not None:
            raise ValueError("--speculative-config: the simulator does not model speculative decoding")
    except ValueError as e:
        print(f"lmserve simulate calibrate: error: {e}", file=sys.stderr)
        return 2
    from lmserve.engine.core_client import default_num_threads

    num_threads = args.num_threads or default_num_threads(1)
    log(f"calibrating {model} ({config.model.dtype}, KV {config.cache.kv_cache_dtype}, "
        f"quantization {config.quantization.method if config.quantization else None}) in a process set up as an "
        f"engine core: {num_threads} threads, --cpu-wait-policy {args.cpu_wait_policy}; "
        f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]
    try:
        samples, held, threads_used, counted_fraction, stack_rows = profile_in_core_process(
            config, grid, num_threads, args.cpu_wait_policy, log
        )
    except RuntimeError as e:
        print(f"lmserve simulate calibrate: error: {e}", file=sys.stderr)
        return 1
    log(f"profiled {len(samples)} grid steps and {len(held)} workload steps in {time.perf_counter() - t0:.0f} s "
        f"(steps by torch threads: {threads_used})")  # fmt: skip
    if len(samples) < 10:
        print("lmserve simulate calibrate: error: too few steps profiled to fit", file=sys.stderr)
        return 1
    name = args.model or "bundled (lmserve/default_model/target)"
    profile = StepProfile(
        kind="linear",
        model=model_description(config, name),
        dtype=config.model.dtype,
        kv_cache_dtype=config.cache.kv_cache_dtype,
        quantization=config.quantization.method if config.quantization else None,
        weight_dtype=config.weight_dtype,
        device=config.device,
        machine={},
        linear=LinearStepModel(0.0, {}),
        tensor_parallel_size=config.tensor_parallel_size,
    )
    _fit_into(profile, samples, held, stack_rows)
    profile.calibration = {"counted_fraction": counted_fraction}
    overheads = Overheads()
    served: list[tuple[StepFeatures, float]] = []
    inputs: list[tuple[int, ...]] = []
    if args.server:
        flags = _server_flags(args)
        log(f"serving the calibration loads and measuring API/network overheads: lmserve serve {shlex.join(flags)}")
        try:
            overheads, served, inputs = measure_on_server(
                profile, model, flags, config.tokenizer, Path(args.out).resolve().parent, grid, max_len
            )
            log(f"served {len(served)} traced steps")
        except Exception as e:  # noqa: BLE001 - the fit is still worth saving
            log(f"warning: overheads not measured ({type(e).__name__}: {e}); they stay 0")
    stretch = _fit_into(profile, samples, held, stack_rows, served, inputs, overheads)
    if overheads.api_queue:
        overheads = dataclasses.replace(overheads, api_step_stretch=stretch)
        log(f"API step stretch: {stretch:.2f} s of step per s of API work beside it")
    if profile.fit["fitted_on"] == "served":  # the fitted steps are whole core-loop iterations
        overheads = dataclasses.replace(
            overheads,
            core_step_overhead_s=0.0,
            how=overheads.how + "; the core loop's per-step cost is inside the fitted (served) steps: 0 here",
        )
    try:
        latency_s, block_s = measure_kv_transfer(config)
        overheads = dataclasses.replace(overheads, kv_transfer_latency_s=latency_s, kv_transfer_block_s=block_s)
        log(f"KV transfer (ZeroMQ ipc, {config.cache.kv_cache_dtype}): {latency_s * 1e6:.0f} µs per pull + "
            f"{block_s * 1e6:.1f} µs per block")  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the fit is still worth saving
        log(f"warning: KV transfer not measured ({type(e).__name__}: {e}); the simulator's defaults apply")
    profile.overheads = overheads
    profile.machine = machine_description(config.device)
    profile.calibration = {
        # median of (the engine's own step counter: execute + update) / LLMEngine.step()'s wall time: what a server's
        # /metrics step times are of the step model's steps (schedule, detokenize and outputs are outside them)
        "counted_fraction": counted_fraction,
        "grid": asdict(grid),
        "num_threads": num_threads,
        "cpu_wait_policy": args.cpu_wait_policy,
        "steps_by_torch_threads": threads_used,
        "load_avg_1m_start": load_start,
        "elapsed_s": time.perf_counter() - t0,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "decode_stack_rows": stack_rows,
        # a sample: the five features, the time, then decode_after_prefill (older files: six numbers, flag 0)
        "samples": [[*f.as_tuple(), t, f.decode_after_prefill] for f, t in samples],
        "workload_samples": [[*f.as_tuple(), t, f.decode_after_prefill] for f, t in held],
        # (a served sample's time: the core loop's iteration)
        "served_samples": [[*f.as_tuple(), t, f.decode_after_prefill] for f, t in served],
        # per served sample: the previous step's chunks, first chunks, finished requests, the requests sent while
        # it ran, and those sent while this one ran on their own schedule and held by the cap (stretch_inputs)
        "served_api_inputs": [list(x) for x in inputs],
        "sample_columns": [
            "prefill_tokens",
            "prefill_segments",
            "decode_rows",
            "decode_context_tokens",
            "prefill_attention_pairs",
            "step_time_s",
        ],  # fmt: skip
    }
    out = profile.save(args.out)
    print(format_profile(profile))
    print(f"wrote {out}")
    return 0


def _server_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags of this calibration as `lmserve serve` arguments."""
    from lmserve.config.args import ENGINE_ARG_NAMES

    defaults = argparse.ArgumentParser()
    from lmserve.config.args import add_engine_args

    add_engine_args(defaults)
    base = vars(defaults.parse_args([]))
    flags: list[str] = []
    negated = {"enable_prefix_caching": "--no-prefix-caching", "enable_chunked_prefill": "--no-chunked-prefill",
               "share_prefix_in_step": "--no-in-step-prefix-sharing"}  # fmt: skip
    for name in ENGINE_ARG_NAMES:
        value = getattr(args, name)
        if value == base.get(name):
            continue
        if name in negated:
            flags.append(negated[name])
        else:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    if args.cpu_wait_policy != "adaptive":
        flags += ["--cpu-wait-policy", args.cpu_wait_policy]
    if args.num_threads is not None:
        flags += ["--num-threads", str(args.num_threads)]
    if args.num_kv_blocks is None and args.kv_cache_memory_gib is None:
        flags += ["--kv-cache-memory-gib", "0.25"]  # the measurement needs little KV; do not reserve the default pool
    return flags


def format_profile(profile: StepProfile) -> str:
    lines = [f"step model ({profile.label}): kind {profile.kind}"]
    if profile.linear is not None:
        lines.append("  " + profile.linear.formula())
    fit = profile.fit
    if fit:
        lines.append(f"  form: {fit.get('chosen')} — {fit.get('why')}")
        lines.append(f"  fitted on: {fit.get('fitted_on', 'in-process grid')} steps")
        for key, what in (("heldout_grid", "grid"), ("heldout_served", "served")):
            g = fit.get(key) or {}
            if g:
                lines.append(
                    f"  held-out {what} steps: R² {g['r2_heldout']:.3f}, median |error| "
                    f"{g['median_ape_heldout_pct']:.1f} %, mean {g['mape_heldout_pct']:.1f} % (train R² "
                    f"{g['r2_train']:.3f}, mean {g['mape_train_pct']:.1f} %; {g['num_train']} / {g['num_heldout']} "
                    "steps)"
                )
        for key, what in (("heldout_workload", "in-process workload"), ("in_process_grid", "in-process grid")):
            w = fit.get(key) or {}
            if w:
                lines.append(
                    f"  {what} steps against it: R² {w['r2']:.3f}, median |error| {w['median_ape_pct']:.1f} %, mean "
                    f"{w['mape_pct']:.1f} %, total time {w['sum_error_pct']:+.1f} % ({w['num_steps']} steps)"
                )
    ov = profile.overheads
    lines.append(
        f"  overheads: ingress {ov.ingress_s * 1e3:.2f} ms, egress {ov.egress_s * 1e3:.2f} ms, core loop "
        f"{ov.core_step_overhead_s * 1e3:.2f} ms/step ({'measured' if ov.measured else 'not measured'})"
    )
    if ov.api_queue:
        lines.append(
            f"  API queue: request {ov.api_request_s * 1e3:.2f} ms, chunk {ov.api_chunk_s * 1e3:.3f} ms (+ first "
            f"{ov.api_first_chunk_s * 1e3:.2f}, + last {ov.api_last_chunk_s * 1e3:.2f} ms); step stretch "
            f"{ov.api_step_stretch:.2f} × the API work beside a step"
        )
    stalls = profile.fit.get("send_stalls_measured_s")
    if ov.api_arrival_stall_s or ov.api_held_send_stall_s:
        lines.append(f"  a send stalls the step in progress {ov.api_arrival_stall_s * 1e3:.2f} ms (one the client's "
                     f"cap held {ov.api_held_send_stall_s * 1e3:.2f} ms)")  # fmt: skip
    elif stalls:
        lines.append(f"  measured, not applied (fit.why_send_stalls): a send stalls the step in progress "
                     f"{stalls['arrival'] * 1e3:.2f} ms (one the client's cap held "
                     f"{stalls['held_by_the_cap'] * 1e3:.2f} ms)")  # fmt: skip
    if ov.kv_transfer_block_s is not None and ov.kv_transfer_latency_s is not None:
        lines.append(f"  KV transfer (disaggregation): {ov.kv_transfer_latency_s * 1e6:.0f} µs per pull + "
                     f"{ov.kv_transfer_block_s * 1e6:.1f} µs per block")  # fmt: skip
    return "\n".join(lines)
