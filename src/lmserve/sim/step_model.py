"""How long one engine step takes, as a function of what the scheduler put in it.

Features of a step (core.outputs.step_features of a SchedulerOutput, read before update_from_output advances the
counters):

    prefill_tokens            tokens of requests still in their prompt (chunks, recompute after preemption)
    prefill_segments          such requests (each prefill chunk is its own attention call)
    decode_rows               requests past their prompt (one query each)
    decode_context_tokens     keys the decode rows attend to: Σ (start + 1)   — the KV a decode step reads
    prefill_attention_pairs   query-key pairs of the prefill chunks: Σ n·c + n(n+1)/2 (chunk n, cached context c)

Two step models share one interface (`step_time_s(features)`) and one JSON file format:

* LinearStepModel, fitted by `lmserve simulate calibrate` from timed steps:
      t = c0 + c1·prefill_tokens + cs·prefill_segments + c2·decode_rows + c3·decode_context_tokens
          [+ c4·prefill_attention_pairs] [+ c5·decode_off_stack]
  c0 is the per-step overhead (schedule, launch, the LM head's fixed part), c1 the per-token cost of the
  projections, cs a prefill segment's own cost (its attention call, its sampled row; on the CPU a step with a
  prefill beside decodes also leaves the one-call decode stack, which this term absorbs: without it the held-out
  median error on mixed workloads doubled), c2 a decode row's cost (its small-M matmul share, sampling,
  detokenizing), c3 reading its KV; c4, the quadratic prefill attention, is kept only when it lowers the held-out
  error (calibrate says which). c5: a pure-decode step of more rows than the one-call decode stack takes
  (model/decode_stack.py; `stack_rows` in the model, 0 where the model has no stack) leaves it for the module
  path, whose Python between kernels costs the same whatever the rows: measured on the bundled model, 8 rows
  2.1 ms and 9 rows 3.9 ms, where a slope alone put 9 rows at 2.3 ms.
* RooflineStepModel, an analytic estimate for machines we do not have: per step
      t = overhead + max(FLOPs / (peak · mfu), bytes / (bandwidth · mbu)) + all-reduces (tensor parallel)
  from published peak FLOP/s and memory bandwidth. Labelled an estimate everywhere it is printed.

Tensor parallelism is a step-time factor: the roofline splits FLOPs, weights and KV over the ranks and adds two
all-reduces per layer; a fitted profile is timed at one tensor-parallel size (`calibrate --tensor-parallel-size N`
times the steps of a real TP = N group: measured, no factor), and at another size its variable part scales by
(its size / tp) / efficiency (efficiency assumed, stored in the file: an estimate).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "lmserve-step-model-v1"
FEATURE_NAMES = (
    "prefill_tokens",
    "prefill_segments",
    "decode_rows",
    "decode_context_tokens",
    "prefill_attention_pairs",
)
LINEAR_TERMS = ("prefill_tokens", "prefill_segments", "decode_rows", "decode_context_tokens")  # the base form
QUADRATIC_TERM = "prefill_attention_pairs"
# 1 for a pure-decode step with more rows than the one-call decode stack takes (LinearStepModel.stack_rows): such a
# step runs the module path, with its Python between kernels, on every layer (a jump, not a slope, in step time)
OFF_STACK_TERM = "decode_off_stack"
# 1 for a mixed step (prefill segments beside decode rows): what such a step costs once, however many segments it
# has (the decode rows leave the one-call decode stack for the module path): without it the per-segment
# coefficient carried that fixed part for every segment, and a step of 32 new prompts beside decodes (a burst, a
# closed-loop start) came out 1.4-1.5x the served one, while a lone prefill (no stack to leave) came out too slow
MIXED_STEP_TERM = "mixed_step"
# 1 for a pure-decode step whose core's previous step computed prompt tokens: the first decode after a prefill runs
# slower than steady ones (single streams on the 2-core development machine, after a 512-token prompt: 2.07, 1.60,
# 1.34 ms for the first three decodes against 1.25 ms steady), the prefill's activations having pushed the weights
# and KV out of the caches. One step's jump: the first decode carries about two thirds of the excess, the next ones
# less (not modelled). Not a feature of one SchedulerOutput: the simulator and calibrate set it from the same core's
# previous step (mark_decode_after_prefill). A step model without it (older files, a roofline) has it 0.
POST_PREFILL_TERM = "decode_after_prefill"
TERMS = (*FEATURE_NAMES, OFF_STACK_TERM, MIXED_STEP_TERM, POST_PREFILL_TERM)
DEFAULT_TP_EFFICIENCY = 0.85  # assumed for fitted profiles (calibrate runs one process; no TP to time)

StepTimeFn = Callable[[int, int, int, int, float], float]  # (prefill, segments, rows, context, pairs) → s


@dataclass(frozen=True)
class StepFeatures:
    prefill_tokens: int = 0
    prefill_segments: int = 0
    decode_rows: int = 0
    decode_context_tokens: int = 0
    prefill_attention_pairs: float = 0.0
    decode_after_prefill: int = 0  # POST_PREFILL_TERM: 1 for a pure decode right after the core's prefill step

    def as_tuple(self) -> tuple[int, int, int, int, float]:
        """The five features of the step itself (StepTimeFn's arguments; decode_after_prefill is the core's)."""
        return (
            self.prefill_tokens,
            self.prefill_segments,
            self.decode_rows,
            self.decode_context_tokens,
            self.prefill_attention_pairs,
        )


def mark_decode_after_prefill(features: list[tuple[Any, ...]]) -> list[int]:
    """decode_after_prefill of each step of one engine core, in the order it took them (each a feature tuple:
    prefill_tokens first, decode_rows third): 1 for a pure-decode step whose previous step computed prompt tokens."""
    flags = []
    prev_prefill = False
    for f in features:
        flags.append(int(prev_prefill and f[0] == 0 and f[2] > 0))
        prev_prefill = f[0] > 0
    return flags


# ---- overheads outside the step ------------------------------------------------------------------------


@dataclass(frozen=True)
class Overheads:
    """Time a served request spends outside engine steps (constants; calibrate measures them on a server)."""

    ingress_s: float = 0.0  # client send → the engine core has the request (HTTP, tokenize, validate, route)
    egress_s: float = 0.0  # a step's end → its token chunk at the client (outputs, zmq, SSE, HTTP)
    core_step_overhead_s: float = 0.0  # per step, the core loop beyond LLMEngine.step (encode, send, drain)
    measured: bool = False
    how: str = "not measured (zeros)"
    # prefill/decode disaggregation: a KV pull between two engine cores on this machine (ZeroMQ ipc, the model's KV
    # geometry and dtype) = kv_transfer_latency_s + blocks × kv_transfer_block_s; None: not measured
    kv_transfer_latency_s: float | None = None
    kv_transfer_block_s: float | None = None
    # The API process (and, on a benchmark machine, the load generator beside it) as one FIFO server of measured CPU
    # costs: a request's arrival occupies it api_request_s before the request travels on (ingress_s is then only the
    # rest of the way), each streamed chunk api_chunk_s (+ api_first_chunk_s for a request's first, the response's
    # start; + api_last_chunk_s for its last, the finish and usage) before it travels egress_s to the client. On
    # cores it shares with an engine core's OpenMP team that work also stretches the engine's steps: a replica's step
    # is longer by api_step_stretch × the API work beside it, the service of its previous step's chunks (with their
    # first / last extras) and the api_request_s of the requests routed to it while that step ran. All 0 (the
    # default, and an older step model's): no queue, no stretch.
    api_request_s: float = 0.0
    api_chunk_s: float = 0.0
    api_first_chunk_s: float = 0.0
    api_last_chunk_s: float = 0.0
    api_step_stretch: float = 0.0  # dimensionless: step seconds per second of API work
    # A request being sent (the load generator's and the API process's work for it) stalls the engine step in
    # progress (the OpenMP team waits at its barriers for the core the kernel gave to that work): that step runs
    # api_arrival_stall_s longer per request sent on its own schedule while it runs (an open loop's arrival: the
    # load generator wakes to send; ~2.2-3.9 ms on the 2-core machine), and api_held_send_stall_s per request the
    # client's concurrency cap held until another finished (a closed loop: the client is awake, reading that last
    # chunk; ~1.3-2.5 ms). calibrate measures both, does not apply them (fit.why_send_stalls). The simulator adds
    # it to the replica's step in progress at the send (one front replica) or at the delivery (several: to the one
    # the request is routed to). 0: none (every calibrated and older step model).
    api_arrival_stall_s: float = 0.0
    api_held_send_stall_s: float = 0.0

    @property
    def api_queue(self) -> bool:
        """Whether the API process is modelled as a queue (any of its CPU costs measured)."""
        return bool(self.api_request_s or self.api_chunk_s or self.api_first_chunk_s or self.api_last_chunk_s)

    def __post_init__(self) -> None:
        for name in ("ingress_s", "egress_s", "core_step_overhead_s", "kv_transfer_latency_s", "kv_transfer_block_s",
                     "api_request_s", "api_chunk_s", "api_first_chunk_s", "api_last_chunk_s",
                     "api_step_stretch", "api_arrival_stall_s", "api_held_send_stall_s"):  # fmt: skip
            value = getattr(self, name)
            if value is None and name.startswith("kv_"):
                continue
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"overheads.{name} must be a number of seconds >= 0, got {value!r}")


# ---- the fitted model ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearStepModel:
    """t = intercept_s + Σ coefficients_s[term] · value(term) (seconds); value(decode_off_stack) is 1 for a pure
    decode step of more than stack_rows rows (stack_rows > 0), else every term is the feature of that name."""

    intercept_s: float
    coefficients_s: dict[str, float]
    stack_rows: int = 0  # the most decode rows the one-call decode stack takes (0: none, the term is unused)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.coefficients_s) - set(TERMS))
        if unknown:
            raise ValueError(f"linear step model: unknown terms {unknown}; known: {list(TERMS)}")
        if not (isinstance(self.stack_rows, int) and self.stack_rows >= 0):
            raise ValueError(f"linear step model: stack_rows must be an integer >= 0, got {self.stack_rows!r}")
        for name, value in [("intercept_s", self.intercept_s), *self.coefficients_s.items()]:
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"linear step model: {name} must be a finite number >= 0, got {value!r}")

    @property
    def terms(self) -> tuple[str, ...]:
        return tuple(t for t in TERMS if t in self.coefficients_s)

    def step_time_s(self, f: StepFeatures) -> float:
        return self.fast()(*f.as_tuple()) + self.post_prefill_s() * f.decode_after_prefill

    @staticmethod
    def _tp_scale(tp: int, tp_efficiency: float, timed_tp: int) -> float:
        ratio = timed_tp / tp
        return 1.0 if ratio == 1 else ratio / tp_efficiency if ratio < 1 else ratio * tp_efficiency

    def post_prefill_s(self, tp: int = 1, tp_efficiency: float = DEFAULT_TP_EFFICIENCY, timed_tp: int = 1) -> float:
        """POST_PREFILL_TERM's seconds at tensor-parallel size tp (scaled as fast() scales the variable part): what
        the simulator adds to a pure decode right after the core's prefill step (0 without the term)."""
        return self.coefficients_s.get(POST_PREFILL_TERM, 0.0) * self._tp_scale(tp, tp_efficiency, timed_tp)

    def fast(self, tp: int = 1, tp_efficiency: float = DEFAULT_TP_EFFICIENCY, timed_tp: int = 1) -> StepTimeFn:
        """The model as a plain function of the feature tuple (the simulator's hot path), at tensor-parallel size
        tp for a model timed at timed_tp: the variable part × (timed_tp / tp), divided by tp_efficiency when tp is
        larger (the collectives' cost) and multiplied by it when smaller. POST_PREFILL_TERM is not a feature of the
        step alone: post_prefill_s() gives it."""
        c = self.coefficients_s
        c0 = self.intercept_s
        scale = self._tp_scale(tp, tp_efficiency, timed_tp)
        c1, cs, c2 = (
            c.get("prefill_tokens", 0.0) * scale,
            c.get("prefill_segments", 0.0) * scale,
            c.get("decode_rows", 0.0) * scale,
        )
        c3, c4 = c.get("decode_context_tokens", 0.0) * scale, c.get("prefill_attention_pairs", 0.0) * scale
        c5, stack = c.get(OFF_STACK_TERM, 0.0) * scale, self.stack_rows
        c6 = c.get(MIXED_STEP_TERM, 0.0) * scale

        def step_time(prefill: int, segments: int, rows: int, context: int, pairs: float) -> float:
            return c0 + c1 * prefill + cs * segments + c2 * rows + c3 * context + c4 * pairs

        if c6:

            def step_time_mixed(prefill: int, segments: int, rows: int, context: int, pairs: float) -> float:
                t = c0 + c1 * prefill + cs * segments + c2 * rows + c3 * context + c4 * pairs
                if segments:
                    return t + c6 if rows else t
                return t + c5 if stack and rows > stack else t

            return step_time_mixed
        if not (c5 and stack):
            return step_time

        def step_time_stack(prefill: int, segments: int, rows: int, context: int, pairs: float) -> float:
            t = c0 + c1 * prefill + cs * segments + c2 * rows + c3 * context + c4 * pairs
            return t + c5 if segments == 0 and rows > stack else t

        return step_time_stack

    def formula(self) -> str:
        parts = [f"{self.intercept_s * 1e3:.4g} ms"]
        parts += [f"{self.coefficients_s[t] * 1e6:.4g} µs·{t}" for t in self.terms]
        where = (
            f" ({OFF_STACK_TERM}: a pure decode of > {self.stack_rows} rows)" if OFF_STACK_TERM in self.terms else ""
        )
        return "t = " + " + ".join(parts) + where


@dataclass(frozen=True)
class FitQuality:
    num_train: int
    num_heldout: int
    r2_train: float
    r2_heldout: float
    mape_train_pct: float  # mean |pred − t| / t
    mape_heldout_pct: float
    max_ape_heldout_pct: float
    median_ape_heldout_pct: float


def term_value(f: StepFeatures, term: str, stack_rows: int = 0) -> float:
    """The value a LinearStepModel multiplies `term`'s coefficient by for a step with features f."""
    if term == OFF_STACK_TERM:
        return float(stack_rows > 0 and f.prefill_segments == 0 and f.decode_rows > stack_rows)
    if term == MIXED_STEP_TERM:
        return float(f.prefill_segments > 0 and f.decode_rows > 0)
    return float(getattr(f, term))


def fit_linear(
    samples: list[tuple[StepFeatures, float]],
    terms: tuple[str, ...],
    heldout_fraction: float = 0.25,
    seed: int = 0,
    stack_rows: int = 0,
) -> tuple[LinearStepModel, FitQuality]:
    """Least absolute relative error (each step's error relative to its time, so a 2 ms decode step counts as much
    as a 300 ms prefill: TPOT is made of the small ones; absolute, not squared, so the model follows the typical
    step and not the stalls a busy machine adds to a few), non-negative coefficients (a negative one is dropped and
    the rest refitted). A random `heldout_fraction` of the samples is kept out of the fit and scored; the returned
    model is refitted on all samples."""
    if len(samples) < len(terms) + 2:
        raise ValueError(
            f"fitting {len(terms) + 1} coefficients needs at least {len(terms) + 2} steps, got {len(samples)}"
        )
    x = np.array([[term_value(f, t, stack_rows) for t in terms] for f, _ in samples], dtype=np.float64)
    y = np.array([t for _, t in samples], dtype=np.float64)
    assert (y > 0).all(), "step times must be positive"
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    num_heldout = max(1, int(round(len(y) * heldout_fraction))) if heldout_fraction > 0 else 0
    test, train = order[:num_heldout], order[num_heldout:]
    model = _nnls_fit(x[train], y[train], terms, stack_rows)
    quality = FitQuality(
        num_train=len(train),
        num_heldout=len(test),
        r2_train=_r2(model, x[train], y[train], terms),
        r2_heldout=_r2(model, x[test], y[test], terms) if len(test) else math.nan,
        mape_train_pct=_mape(model, x[train], y[train], terms),
        mape_heldout_pct=_mape(model, x[test], y[test], terms) if len(test) else math.nan,
        max_ape_heldout_pct=float(np.max(_ape(model, x[test], y[test], terms))) if len(test) else math.nan,
        median_ape_heldout_pct=float(np.median(_ape(model, x[test], y[test], terms))) if len(test) else math.nan,
    )
    return _nnls_fit(x, y, terms, stack_rows), quality


def _nnls_fit(
    x: np.ndarray, y: np.ndarray, terms: tuple[str, ...], stack_rows: int = 0, iterations: int = 40
) -> LinearStepModel:
    """min Σ |pred − y| / y over coefficients >= 0: iteratively reweighted least squares (weights 1 / |relative
    residual|), a term whose coefficient goes negative dropped and the fit redone."""
    active = list(range(len(terms)))
    while True:
        design = np.column_stack([np.ones(len(y)), x[:, active]]) / y[:, None]
        target = np.ones(len(y))  # y / y
        weights = np.ones(len(y))
        coef = np.zeros(design.shape[1])
        for _ in range(iterations):
            coef, *_ = np.linalg.lstsq(design * weights[:, None], target * weights, rcond=None)
            resid = np.abs(design @ coef - target)
            weights = 1.0 / np.sqrt(np.maximum(resid, 1e-4))
        negative = [i for i, c in enumerate(coef[1:]) if c < 0]
        if not negative:
            break
        worst = min(negative, key=lambda i: coef[1 + i])
        del active[worst]
    intercept = max(0.0, float(coef[0]))
    coefs = {t: 0.0 for t in terms}
    for i, c in zip(active, coef[1:], strict=True):
        coefs[terms[i]] = float(c)
    return LinearStepModel(intercept, coefs, stack_rows)


def _predict(model: LinearStepModel, x: np.ndarray, terms: tuple[str, ...]) -> np.ndarray:
    coef = np.array([model.coefficients_s[t] for t in terms])
    return model.intercept_s + x @ coef


def _r2(model: LinearStepModel, x: np.ndarray, y: np.ndarray, terms: tuple[str, ...]) -> float:
    resid = y - _predict(model, x, terms)
    total = float(((y - y.mean()) ** 2).sum())
    return 1.0 - float((resid**2).sum()) / total if total > 0 else math.nan


def _ape(model: LinearStepModel, x: np.ndarray, y: np.ndarray, terms: tuple[str, ...]) -> np.ndarray:
    return 100.0 * np.abs(_predict(model, x, terms) - y) / y


def _mape(model: LinearStepModel, x: np.ndarray, y: np.ndarray, terms: tuple[str, ...]) -> float:
    return float(np.mean(_ape(model, x, y, terms)))


def choose_form(
    samples: list[tuple[StepFeatures, float]], seed: int = 0, min_gain_pct: float = 5.0, stack_rows: int = 0
) -> tuple[LinearStepModel, FitQuality, dict[str, Any]]:
    """Fit the base form and the form with the quadratic prefill-attention term; keep the quadratic one only if
    its held-out median relative error is lower by at least min_gain_pct percent (relative) and its coefficient
    survives the non-negativity. Both forms have the decode-off-stack term when the model has a decode stack
    (stack_rows > 0) and the samples hold pure-decode steps on both sides of it, and the mixed-step term when
    some mixed steps hold several prefill segments (else it cannot be told from the per-segment one). Returns
    (model, its quality, the comparison for the JSON)."""
    decode_rows = {f.decode_rows for f, _ in samples if f.prefill_segments == 0 and f.decode_rows}
    both_sides = (
        stack_rows > 0 and any(r <= stack_rows for r in decode_rows) and any(r > stack_rows for r in decode_rows)
    )
    base_terms = (*LINEAR_TERMS, OFF_STACK_TERM) if both_sides else LINEAR_TERMS
    if sum(f.prefill_segments > 1 and f.decode_rows > 0 for f, _ in samples) >= 5:
        base_terms = (*base_terms, MIXED_STEP_TERM)
    if sum(f.decode_after_prefill for f, _ in samples) >= 5:  # decodes right after a prefill: their own jump
        base_terms = (*base_terms, POST_PREFILL_TERM)
    rows = stack_rows if both_sides else 0
    base, base_q = fit_linear(samples, base_terms, seed=seed, stack_rows=rows)
    quad, quad_q = fit_linear(samples, (*base_terms, QUADRATIC_TERM), seed=seed, stack_rows=rows)
    gain = 100.0 * (base_q.median_ape_heldout_pct - quad_q.median_ape_heldout_pct) / base_q.median_ape_heldout_pct
    use_quad = quad.coefficients_s[QUADRATIC_TERM] > 0 and gain >= min_gain_pct
    why = (
        f"the quadratic prefill-attention term lowers the held-out median relative error by {gain:.1f} % "
        f"({base_q.median_ape_heldout_pct:.1f} % → {quad_q.median_ape_heldout_pct:.1f} %)"
        if use_quad
        else f"the quadratic prefill-attention term does not help enough on held-out steps (gain {gain:.1f} % < "
        f"{min_gain_pct:g} %, or its coefficient fitted to 0): the linear form is kept"
    )
    comparison = {
        "chosen": "linear+quadratic_prefill_attention" if use_quad else "linear",
        "why": why,
        "linear": {"model": _model_dict(base), "fit": asdict(base_q)},
        "linear+quadratic_prefill_attention": {"model": _model_dict(quad), "fit": asdict(quad_q)},
    }
    return (quad, quad_q, comparison) if use_quad else (base, base_q, comparison)


def ratio_quantiles(model: LinearStepModel, samples: list[tuple[StepFeatures, float]], num: int = 201) -> list[float]:
    """measured / predicted step time at num evenly spaced quantiles of the samples."""
    ratios = np.array([t / model.step_time_s(f) for f, t in samples if model.step_time_s(f) > 0])
    return [float(v) for v in np.quantile(ratios, np.linspace(0, 1, num))] if len(ratios) else []


def _model_dict(m: LinearStepModel) -> dict[str, Any]:
    return {"intercept_s": m.intercept_s, "coefficients_s": dict(m.coefficients_s), "stack_rows": m.stack_rows}


# ---- the analytic estimate -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """One accelerator's published figures (dense, no sparsity) and the interconnect between ranks."""

    name: str
    peak_flops: float  # FLOP/s at the compute dtype (16-bit)
    peak_flops_8bit: float  # FP8 / INT8 tensor FLOP/s (W8A8 / fp8 paths)
    mem_bw_bytes_s: float
    mem_bytes: float
    link_bw_bytes_s: float  # per direction, per GPU (NVLink)
    link_latency_s: float = 5e-6  # per all-reduce (assumed)
    step_overhead_s: float = 1e-3  # per step: scheduling, launches, sampling (assumed, CUDA graphs not modelled)
    source: str = ""


HARDWARE: dict[str, Hardware] = {
    "h200": Hardware(
        "NVIDIA H200 SXM", 989e12, 1979e12, 4.8e12, 141e9, 450e9,
        source="NVIDIA H200 datasheet: 989 TFLOP/s BF16 dense, 1979 FP8 dense, HBM3e 4.8 TB/s, 141 GB, "
        "NVLink 900 GB/s (bidirectional)",
    ),
    "h100": Hardware(
        "NVIDIA H100 SXM", 989e12, 1979e12, 3.35e12, 80e9, 450e9,
        source="NVIDIA H100 datasheet: 989 TFLOP/s BF16 dense, 1979 FP8 dense, HBM3 3.35 TB/s, 80 GB, "
        "NVLink 900 GB/s (bidirectional)",
    ),
    "a100": Hardware(
        "NVIDIA A100 SXM 80GB", 312e12, 624e12, 2.039e12, 80e9, 300e9,
        source="NVIDIA A100 datasheet: 312 TFLOP/s BF16 dense, 624 TOPS INT8, HBM2e 2.039 TB/s, 80 GB, "
        "NVLink 600 GB/s (bidirectional)",
    ),
}  # fmt: skip


@dataclass(frozen=True)
class RooflineStepModel:
    """Analytic step time on `hardware` for a dense decoder (an estimate: no measured kernel efficiencies)."""

    hardware: Hardware
    hf_config: dict[str, Any]
    weight_dtype_bytes: float
    kv_bytes_per_token: int  # all layers, one replica (all ranks together)
    quantization: str | None = None
    mfu: float = 0.5  # achievable fraction of peak FLOP/s (assumed)
    mbu: float = 0.8  # achievable fraction of memory bandwidth (assumed)

    def __post_init__(self) -> None:
        for name in ("mfu", "mbu"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"roofline {name} must be in (0, 1], got {v!r}")

    def fast(self, tp: int = 1, tp_efficiency: float = 1.0) -> StepTimeFn:
        from lmserve import memory

        shape = memory.model_shape_from_hf_config(dict(self.hf_config))
        hw = self.hardware
        params_rank = memory.num_parameters_per_rank(shape, tp)
        weights_rank = memory.weight_bytes_per_rank(shape, self.weight_dtype_bytes, tp, self.quantization)
        embed_rank = math.ceil(shape.vocab_size / tp) * shape.hidden_size
        flops_per_token = 2.0 * (params_rank - embed_rank * (1 if shape.tie_word_embeddings else 0))
        heads_rank = shape.num_attention_heads // tp
        attn_flops_per_pair = 4.0 * shape.num_layers * heads_rank * shape.head_dim  # QKᵀ and PV
        kv_rank = self.kv_bytes_per_token * memory.kv_heads_per_rank(shape.num_kv_heads, tp) / shape.num_kv_heads
        peak = (hw.peak_flops_8bit if self.quantization == "int8" else hw.peak_flops) * self.mfu
        bw = hw.mem_bw_bytes_s * self.mbu
        act_bytes = shape.hidden_size * 2.0  # bf16 activations all-reduced per token per all-reduce
        num_allreduce = 2 * shape.num_layers if tp > 1 else 0
        ring = 2.0 * (tp - 1) / tp if tp > 1 else 0.0

        def step_time(prefill: int, segments: int, rows: int, context: int, pairs: float) -> float:
            tokens = prefill + rows
            flops = flops_per_token * tokens + attn_flops_per_pair * (pairs + context)
            # KV read: decode rows read their context; prefill chunks read cached context (≈ pairs / n, bounded
            # by the chunk's own keys when there is none), written once per new token
            kv_bytes = kv_rank * (context + tokens)
            compute_s = flops / peak
            memory_s = (weights_rank + kv_bytes) / bw
            comm_s = num_allreduce * (hw.link_latency_s + ring * tokens * act_bytes / hw.link_bw_bytes_s)
            return hw.step_overhead_s + max(compute_s, memory_s) + comm_s

        return step_time

    def step_time_s(self, f: StepFeatures, tp: int = 1) -> float:
        return self.fast(tp)(*f.as_tuple())


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
    from lmserve import memory
    from lmserve.config import ModelConfig
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
