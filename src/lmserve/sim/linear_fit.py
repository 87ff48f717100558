"""The fitted step-time model: t = c0 + Σ c_i · term_i over the step's features, non-negative least squares on
timed steps, the form (which terms) chosen by held-out error, and the step noise as quantiles of measured/model."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from lmserve.sim.step_features import (
    DEFAULT_TP_EFFICIENCY,
    LINEAR_TERMS,
    MIXED_STEP_TERM,
    OFF_STACK_TERM,
    POST_PREFILL_TERM,
    QUADRATIC_TERM,
    TERMS,
    StepFeatures,
    StepTimeFn,
)

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
