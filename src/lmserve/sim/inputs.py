"""From command-line flags and a step model to the simulator's inputs: the EngineConfig, the tokenizer, the workload.

Defaults (model, dtypes, KV pool size) come from the step model; given flags must agree with it
(StepProfile.check_compatible). Entry points: resolve_model, engine_config, build_workload_from_args.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from lmserve.config.engine import EngineArgs, EngineConfig
from lmserve.sim.model_dir import ARCHITECTURES as ARCHITECTURES
from lmserve.sim.model_dir import hf_config_with_architecture as hf_config_with_architecture
from lmserve.sim.model_dir import materialize_model_dir
from lmserve.sim.step_model import StepProfile

ROOFLINE_MEMORY_UTILIZATION = (
    0.9  # of the accelerator's memory for weights + KV (vLLM's default gpu_memory_utilization)
)


def resolve_model(profile: StepProfile, model: str | None) -> str:
    """The model flag, else the step model's directory when it exists, else a config.json written from it.

    The scheduler reads only shapes, so a roofline profile of a model we do not have needs no weights.
    """
    if model:
        return model
    path = profile.model.get("path")
    if path and (Path(path) / "config.json").is_file():
        return str(path)
    hf = profile.model.get("hf_config")
    if not hf:
        raise ValueError(f"--model: the step model {profile.source} carries no config.json; pass --model")
    return materialize_model_dir(hf)


def tokenizer_path(args_tokenizer: str | None, model_dir: str) -> str:
    """--tokenizer, else the model's when its directory has one, else the bundled model's (ids only decide
    prefix-cache equality, so any tokenizer with the model's special tokens will do for the scheduler)."""
    if args_tokenizer:
        return args_tokenizer
    d = Path(model_dir)
    if d.is_dir() and any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return str(d)
    from lmserve.default_model import default_model_path

    return default_model_path()


def engine_config(profile: StepProfile, kwargs: dict[str, Any], model: str | None, tp: int = 1) -> EngineConfig:
    """The EngineConfig of one simulated replica (engine flags as EngineArgs keywords)."""
    kwargs = dict(kwargs)
    if kwargs.get("dtype", "auto") == "auto":
        kwargs["dtype"] = profile.dtype
    if kwargs.get("kv_cache_dtype", "auto") == "auto":
        kwargs["kv_cache_dtype"] = profile.kv_cache_dtype
    if kwargs.get("quantization") is None and profile.quantization is not None:
        kwargs["quantization"] = profile.quantization
    if kwargs.get("weight_dtype") is None and profile.weight_dtype is not None:
        kwargs["weight_dtype"] = profile.weight_dtype
    kwargs["device"] = "cpu"  # only sizes and dtypes are read; no device is touched
    model_dir = resolve_model(profile, model)
    kwargs["tokenizer"] = tokenizer_path(kwargs.get("tokenizer"), model_dir)
    if profile.kind == "roofline" and kwargs.get("num_kv_blocks") is None and kwargs.get("kv_cache_memory_gib") is None:
        kwargs["kv_cache_memory_gib"] = roofline_kv_gib(profile, tp)
    config = EngineArgs.from_kwargs(model_dir, **kwargs).create_engine_config()
    profile.check_compatible(config)
    return config


def roofline_kv_gib(profile: StepProfile, tp: int) -> float:
    """What ROOFLINE_MEMORY_UTILIZATION of tp accelerators holds beside one copy of the weights."""
    from lmserve.memory import ledger as memory

    r = profile.roofline
    assert r is not None, "a roofline profile has its roofline description"
    shape = memory.model_shape_from_hf_config(dict(r.hf_config))
    weights = memory.weight_bytes_per_rank(shape, r.weight_dtype_bytes, tp, r.quantization) * tp
    free = r.hardware.mem_bytes * tp * ROOFLINE_MEMORY_UTILIZATION - weights
    if free <= 0:
        raise ValueError(
            f"--tensor-parallel-size {tp}: the weights ({weights / 1e9:.1f} GB) do not fit "
            f"{tp} x {r.hardware.name} ({r.hardware.mem_bytes / 1e9:.0f} GB each at {ROOFLINE_MEMORY_UTILIZATION:.0%})"
        )
    return free / 2**30


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """`lmserve bench serve`'s workload flags (those not already engine flags: --seed, --tokenizer, --model are
    shared with the engine's)."""
    from lmserve.bench.datasets import add_dataset_args, parse_rate

    t = p.add_argument_group("traffic (as lmserve bench serve)")
    t.add_argument("--request-rate", type=parse_rate, default=math.inf, help="requests/s (inf = all at once)")
    t.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    t.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (closed loop)")
    t.add_argument("--trace", default=None, help="a `lmserve bench serve` JSON: replay its arrivals and lengths")
    t.add_argument(
        "--prompts",
        default="auto",
        choices=["auto", "exact", "fast"],
        help="exact: bench's prompt builder (the same token ids as bench serve); fast: numpy draws with the "
        "same lengths; auto: exact up to 2000 requests",
    )
    add_dataset_args(p)


def build_workload_from_args(args: argparse.Namespace, tokenizer_dir: str) -> Any:
    from lmserve.bench.datasets import dataset_config_from_args, load_tokenizer
    from lmserve.sim.workload import build_workload, trace_workload

    tokenizer = load_tokenizer(tokenizer_dir)
    if args.trace:
        return trace_workload(args.trace, tokenizer), tokenizer
    cfg = dataset_config_from_args(args)
    return build_workload(cfg, tokenizer, args.request_rate, args.burstiness, args.seed, args.prompts), tokenizer
