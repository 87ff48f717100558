"""How long one engine step takes, as a function of what the scheduler put in it.

StepProfile holds either a LinearStepModel fitted by calibrate or a RooflineStepModel (an analytic estimate), with
the features of core.outputs.step_features, the overheads and what the profile is valid for, saved as JSON.
The features, both models and the tensor-parallel factor are described in docs/simulator.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lmserve.sim.linear_fit import LinearStepModel, _model_dict
from lmserve.sim.roofline import HARDWARE, Hardware, RooflineStepModel
from lmserve.sim.step_features import (
    DEFAULT_TP_EFFICIENCY,
    FORMAT,
    Overheads,
    StepFeatures,
    StepTimeFn,
)

# ---- the file --------------------------------------------------------------------------------------------

# ModelConfig fields that decide a step's cost: a profile from another model (or dtype) is refused
SHAPE_FIELDS = (
    "architecture",
    "num_layers",
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
)


@dataclass
class StepProfile:
    """A step-time model with what it is valid for, as saved to / loaded from JSON."""

    kind: str  # "linear" | "roofline"
    model: dict[str, Any]  # name, hf_config (config.json subset), and SHAPE_FIELDS
    dtype: str
    kv_cache_dtype: str
    quantization: str | None
    weight_dtype: str | None
    device: str
    machine: dict[str, Any]
    overheads: Overheads = field(default_factory=Overheads)
    linear: LinearStepModel | None = None
    roofline: RooflineStepModel | None = None
    tp_efficiency: float = DEFAULT_TP_EFFICIENCY
    tensor_parallel_size: int = 1  # the TP size a fitted profile's steps were timed at
    estimate: bool = False
    fit: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)
    # measured / fitted step time at evenly spaced quantiles (0 %, 0.5 %, ..., 100 %) of the calibration steps: the
    # machine's step-to-step variation (a busy machine's stalls), which the simulator can sample (step noise)
    noise_quantiles: list[float] = field(default_factory=list)
    source: str = ""  # the file it was loaded from

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "roofline"):
            raise ValueError(f"step model kind must be 'linear' or 'roofline', got {self.kind!r}")
        if self.kind == "linear" and self.linear is None:
            raise ValueError("step model kind 'linear' needs its 'linear' coefficients")
        if self.kind == "roofline" and self.roofline is None:
            raise ValueError("step model kind 'roofline' needs its 'roofline' description")
        if not 0 < self.tp_efficiency <= 1:
            raise ValueError(f"tensor_parallel.efficiency must be in (0, 1], got {self.tp_efficiency!r}")
        if not (isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1):
            raise ValueError(f"tensor_parallel.size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        q = self.noise_quantiles
        if q and not (all(math.isfinite(v) and v >= 0 for v in q) and sum(q) > 0):
            raise ValueError("noise.ratio_quantiles must be finite measured / fitted ratios >= 0, not all 0; got "
                             f"{q[:5]}{' ...' if len(q) > 5 else ''}")  # fmt: skip

    @property
    def label(self) -> str:
        if self.kind == "roofline":
            assert self.roofline is not None
            return f"roofline ESTIMATE for {self.roofline.hardware.name} (not measured)"
        return f"fitted on {self.machine.get('cpu_model') or self.machine.get('device') or 'this machine'}"

    def step_time_fn(self, tp: int = 1) -> StepTimeFn:
        if tp < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {tp}")
        if self.kind == "roofline":
            assert self.roofline is not None
            return self.roofline.fast(tp)
        assert self.linear is not None
        return self.linear.fast(tp, self.tp_efficiency, self.tensor_parallel_size)

    def tp_is_estimate(self, tp: int) -> bool:
        """Whether step times at tensor-parallel size tp are an estimate (a roofline, or a fitted profile timed at
        another size)."""
        return self.estimate or tp != self.tensor_parallel_size

    def post_prefill_s(self, tp: int = 1) -> float:
        """POST_PREFILL_TERM's seconds at tensor-parallel size tp: 0 for a roofline and for a fitted model without
        the term (every step model from before it)."""
        if self.linear is None:
            return 0.0
        return self.linear.post_prefill_s(tp, self.tp_efficiency, self.tensor_parallel_size)

    def step_time_s(self, f: StepFeatures, tp: int = 1) -> float:
        return self.step_time_fn(tp)(*f.as_tuple()) + self.post_prefill_s(tp) * f.decode_after_prefill

    def scaled(self, factor: float) -> StepProfile:
        """A copy whose fitted step times are `factor` times longer (validation: the machine's drift since the
        calibration, measured on the server, taken out to see the rest of the error)."""
        import dataclasses

        if self.linear is None or not factor > 0:
            raise ValueError(f"only a fitted (linear) profile can be scaled, by a factor > 0 (got {factor!r})")
        lin = LinearStepModel(
            self.linear.intercept_s * factor,
            {k: v * factor for k, v in self.linear.coefficients_s.items()},
            self.linear.stack_rows,
        )
        return dataclasses.replace(self, linear=lin)

    def noise_sampler(self, seed: int) -> Callable[[], float] | None:
        """A seeded draw of a step's measured / fitted ratio from noise_quantiles, scaled to mean 1 (None: the
        profile has none). Mean 1: the fitted model already carries the steps' mean time (its coefficients are
        scaled so that the served steps' total is kept), and the ratios' own mean is above 1 (1.14-1.21 on the 2-core
        machine: a short step's relative noise is larger, and a draw is independent of the step's size), which made
        a noisy run 14-21 % slower than the deterministic one instead of only spread around it."""
        q = self.noise_quantiles
        if len(q) < 2:
            return None
        import random

        mean = (sum(q) - (q[0] + q[-1]) / 2) / (len(q) - 1)  # the piecewise-linear draw's exact mean
        assert mean > 0, f"noise quantiles must be positive ratios, got mean {mean}"
        q = [v / mean for v in q]
        rng = random.Random(seed)
        last = len(q) - 1

        def draw() -> float:
            x = rng.random() * last
            i = int(x)
            return q[i] + (q[min(i + 1, last)] - q[i]) * (x - i)

        return draw

    def check_compatible(self, config: Any) -> None:
        """ValueError naming the first field where this profile's model / dtypes differ from an EngineConfig's."""
        mc = config.model
        where = f"step model {self.source or '(in memory)'} was made for {self.model.get('name', '?')}"
        for name in SHAPE_FIELDS:
            mine, theirs = self.model.get(name), getattr(mc, name)
            if mine != theirs:
                raise ValueError(
                    f"{where} with {name}={mine!r}, but the engine config's model ({mc.path}) has {name}={theirs!r}: "
                    f"calibrate for this model (lmserve simulate calibrate --model ...)"
                )
        quant = config.quantization.method if config.quantization is not None else None
        for name, mine, theirs in (
            ("dtype", self.dtype, mc.dtype),
            ("kv_cache_dtype", self.kv_cache_dtype, config.cache.kv_cache_dtype),
            ("quantization", self.quantization, quant),
            ("weight_dtype", self.weight_dtype, config.weight_dtype),
        ):
            if mine != theirs:
                raise ValueError(
                    f"{where} with {name}={mine!r}, but the engine config has {name}={theirs!r}: pass "
                    f"--{name.replace('_', '-')} {mine} or calibrate with this {name}"
                )

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "format": FORMAT,
            "kind": self.kind,
            "estimate": self.estimate,
            "label": self.label,
            "model": self.model,
            "dtype": self.dtype,
            "kv_cache_dtype": self.kv_cache_dtype,
            "quantization": self.quantization,
            "weight_dtype": self.weight_dtype,
            "device": self.device,
            "machine": self.machine,
            "overheads": asdict(self.overheads),
            "tensor_parallel": {
                "size": self.tensor_parallel_size,
                "efficiency": self.tp_efficiency,
                "note": "a fitted profile's steps were timed at tensor-parallel size `size` (measured there); at "
                "another size its variable part scales by (size / tp) / efficiency (efficiency assumed, not "
                "measured: an estimate); a roofline splits FLOPs, weights and KV and adds two all-reduces per layer",
            },
            "fit": self.fit,
            "noise": {
                "ratio_quantiles": self.noise_quantiles,
                "note": "measured / fitted step time at quantiles 0, 0.5, ..., 100 % of the calibration steps; "
                "`simulate run --step-noise` multiplies each step by a draw from it",
            },
            "calibration": self.calibration,
        }
        if self.linear is not None:
            doc["linear"] = {**_model_dict(self.linear), "formula": self.linear.formula()}
        if self.roofline is not None:
            r = self.roofline
            doc["roofline"] = {
                "hardware": asdict(r.hardware),
                "hf_config": r.hf_config,
                "weight_dtype_bytes": r.weight_dtype_bytes,
                "kv_bytes_per_token": r.kv_bytes_per_token,
                "quantization": r.quantization,
                "mfu": r.mfu,
                "mbu": r.mbu,
            }
        return doc

    def save(self, path: str | Path) -> Path:
        from lmserve.bench.report import json_safe

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(json_safe(self.to_dict()), indent=1, allow_nan=False))
        return path

    @staticmethod
    def from_dict(doc: dict[str, Any], source: str = "") -> StepProfile:
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise ValueError(f"--step-model {source}: not a step model file (format {got!r}, expected {FORMAT!r})")
        try:
            linear = roofline = None
            if "linear" in doc:
                lin = doc["linear"]
                linear = LinearStepModel(
                    float(lin["intercept_s"]), {k: float(v) for k, v in lin["coefficients_s"].items()},
                    int(lin.get("stack_rows", 0)),
                )  # fmt: skip
            if "roofline" in doc:
                r = doc["roofline"]
                roofline = RooflineStepModel(
                    Hardware(**r["hardware"]), dict(r["hf_config"]), float(r["weight_dtype_bytes"]),
                    int(r["kv_bytes_per_token"]), r.get("quantization"), float(r["mfu"]), float(r["mbu"]),
                )  # fmt: skip
            ov = doc.get("overheads") or {}
            return StepProfile(
                kind=doc["kind"],
                model=dict(doc["model"]),
                dtype=doc["dtype"],
                kv_cache_dtype=doc["kv_cache_dtype"],
                quantization=doc.get("quantization"),
                weight_dtype=doc.get("weight_dtype"),
                device=doc.get("device", "cpu"),
                machine=dict(doc.get("machine") or {}),
                overheads=Overheads(**ov),
                linear=linear,
                roofline=roofline,
                tp_efficiency=float((doc.get("tensor_parallel") or {}).get("efficiency", DEFAULT_TP_EFFICIENCY)),
                tensor_parallel_size=int((doc.get("tensor_parallel") or {}).get("size", 1)),
                estimate=bool(doc.get("estimate", False)),
                fit=dict(doc.get("fit") or {}),
                calibration=dict(doc.get("calibration") or {}),
                noise_quantiles=[float(q) for q in (doc.get("noise") or {}).get("ratio_quantiles") or []],
                source=source,
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"--step-model {source}: malformed step model file ({type(e).__name__}: {e})") from None

    @staticmethod
    def load(path: str | Path) -> StepProfile:
        p = Path(path)
        try:
            doc = json.loads(p.read_text())
        except OSError as e:
            raise ValueError(f"--step-model: cannot read {path}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"--step-model: {path} is not JSON: {e}") from None
        return StepProfile.from_dict(doc, str(path))


def model_description(config: Any, name: str) -> dict[str, Any]:
    """The `model` entry of a profile: a name, the config.json it was built from, and the SHAPE_FIELDS."""
    mc = config.model
    hf_config: dict[str, Any] = {}
    cfg_file = Path(mc.path) / "config.json"
    if cfg_file.is_file():
        hf_config = json.loads(cfg_file.read_text())
        hf_config.pop("quantization_config", None)
    return {"name": name, "path": mc.path, "hf_config": hf_config, **{f: getattr(mc, f) for f in SHAPE_FIELDS}}


def profile_for(
    config: Any, step_model: LinearStepModel | RooflineStepModel, name: str = "", **kwargs: Any
) -> StepProfile:
    """A profile for an EngineConfig's model and dtypes around a step model (tests, toy planning)."""
    kind = "linear" if isinstance(step_model, LinearStepModel) else "roofline"
    quant = config.quantization.method if config.quantization is not None else None
    return StepProfile(
        kind=kind,
        model=model_description(config, name or Path(config.model.path).name),
        dtype=config.model.dtype,
        kv_cache_dtype=config.cache.kv_cache_dtype,
        quantization=quant,
        weight_dtype=config.weight_dtype,
        device=config.device,
        machine=kwargs.pop("machine", {}),
        linear=step_model if kind == "linear" else None,
        roofline=step_model if kind == "roofline" else None,
        estimate=kind == "roofline",
        **kwargs,
    )


def roofline_profile(
    hardware: str,
    hf_config: dict[str, Any],
    name: str,
    dtype: str = "bfloat16",
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
    mfu: float = 0.5,
    mbu: float = 0.8,
    overheads: Overheads | None = None,
) -> StepProfile:
    """An analytic profile of `hf_config`'s model on a HARDWARE entry (an estimate, labelled so)."""
    from lmserve.config.engine import ModelConfig
    from lmserve.memory import ledger as memory
    from lmserve.sim.model_dir import materialize_model_dir

    key = hardware.lower()
    if key not in HARDWARE:
        raise ValueError(f"--hardware must be one of {sorted(HARDWARE)}, got {hardware!r}")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"--dtype must be bfloat16, float16 or float32 for a roofline, got {dtype!r}")
    if quantization not in (None, "int8", "int4"):
        raise ValueError(f"--quantization must be int8 or int4 (or none), got {quantization!r}")
    model_dir = materialize_model_dir(hf_config)
    mc = ModelConfig.from_hf(model_dir, dtype, "cuda")
    kv_dtype = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    kv_bpt = memory.kv_cache_bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, kv_dtype)
    roof = RooflineStepModel(HARDWARE[key], dict(hf_config), memory.dtype_bytes(dtype), kv_bpt, quantization, mfu, mbu)
    hw = HARDWARE[key]
    return StepProfile(
        kind="roofline",
        model={"name": name, "path": None, "hf_config": dict(hf_config), **{f: getattr(mc, f) for f in SHAPE_FIELDS}},
        dtype=dtype,
        kv_cache_dtype=kv_dtype,
        quantization=quantization,
        weight_dtype=None,
        device="cuda",
        machine={"device": hw.name, "source": hw.source, "estimate": True},
        overheads=overheads
        or Overheads(how="not measured for this machine (zeros); --overheads-from copies measured ones"),
        roofline=roof,
        estimate=True,
        fit={
            "note": f"analytic roofline ESTIMATE: mfu {mfu}, mbu {mbu}, per-step overhead "
            f"{hw.step_overhead_s * 1e3:g} ms and all-reduce latency {hw.link_latency_s * 1e6:g} µs assumed"
        },
    )
