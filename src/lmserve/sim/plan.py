"""`lmserve simulate plan`: the cheapest configuration that meets goodput SLOs, found by simulation.

parse_space and candidates build the searched configurations, search runs them (smallest data-parallel size first),
slo_lower_bound says when no configuration can meet the SLOs, format_plan / plot_plan show the result.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmserve.bench.metrics import BenchSummary, SLOs

# searchable flags → default values (ascending); engine flags map to EngineArgs keywords
SEARCHABLE: dict[str, tuple[int, ...]] = {
    "data-parallel-size": (1, 2, 4, 8, 16, 32, 64),
    "tensor-parallel-size": (1, 2, 4, 8),
    "max-num-seqs": (16, 32, 64, 128, 256),
    "max-num-batched-tokens": (256, 512, 1024, 2048, 4096),
    "block-size": (16, 32),
    "num-kv-blocks": (),
    "prefill-replicas": (1, 2, 4, 8),  # prefill/decode disaggregation: xPyD instead of data parallel
    "decode-replicas": (1, 2, 4, 8),
}
SIM_FLAGS = ("data-parallel-size", "tensor-parallel-size", "prefill-replicas", "decode-replicas")  # the others:
# engine flags
PD_FLAGS = ("prefill-replicas", "decode-replicas")


@dataclass(frozen=True)
class Candidate:
    values: dict[str, int]

    @property
    def dp(self) -> int:
        return self.values.get("data-parallel-size", 1)

    @property
    def tp(self) -> int:
        return self.values.get("tensor-parallel-size", 1)

    @property
    def disaggregation(self) -> str | None:
        """ "xPyD" when prefill / decode replicas are searched (one of them alone: the other is 1), else None."""
        if not any(k in self.values for k in PD_FLAGS):
            return None
        return f"{self.values.get('prefill-replicas', 1)}P{self.values.get('decode-replicas', 1)}D"

    @property
    def cost(self) -> int:
        if self.disaggregation is not None:
            return (self.values.get("prefill-replicas", 1) + self.values.get("decode-replicas", 1)) * self.tp
        return self.dp * self.tp

    def engine_overrides(self) -> dict[str, int]:
        return {k.replace("-", "_"): v for k, v in self.values.items() if k not in SIM_FLAGS}

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.values.items())


@dataclass
class Trial:
    candidate: Candidate
    summary: BenchSummary | None
    meets: bool
    error: str | None = None
    sim_wall_s: float = 0.0

    @property
    def attainment_pct(self) -> float:
        return (
            -1.0 if self.summary is None or self.summary.slo_attainment_pct is None else self.summary.slo_attainment_pct
        )

    def row(self) -> dict[str, Any]:
        s = self.summary
        return {
            **self.candidate.values,
            "cost": self.candidate.cost,
            "meets": self.meets,
            "slo_attainment_pct": None if s is None else s.slo_attainment_pct,
            "goodput_rps": None if s is None else s.goodput_rps,
            "request_throughput_rps": None if s is None else s.request_throughput_rps,
            "ttft_mean_ms": None if s is None else s.ttft_ms.mean,
            "ttft_p99_ms": None if s is None else s.ttft_ms.p99,
            "tpot_mean_ms": None if s is None else s.tpot_ms.mean,
            "tpot_p99_ms": None if s is None else s.tpot_ms.p99,
            "error": self.error,
            "sim_wall_s": self.sim_wall_s,
        }


@dataclass
class PlanResult:
    trials: list[Trial]
    winner: Trial | None
    closest: Trial | None
    target_pct: float
    impossible: str | None = None  # why no configuration of the space can meet the SLOs, when a bound shows it
    space: dict[str, tuple[int, ...]] = field(default_factory=dict)


def parse_space(search: list[str], grid: list[str] | None) -> dict[str, tuple[int, ...]]:
    """`--search a,b c` (names, default values) and `--grid a=1,2,4` (values) → name → ascending values."""
    names = [n.strip() for item in search for n in item.split(",") if n.strip()]
    if not names:
        raise ValueError("--search: name at least one flag to search")
    values: dict[str, tuple[int, ...]] = {}
    for item in grid or []:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or name not in SEARCHABLE:
            raise ValueError(f"--grid: expected NAME=V1,V2,... with NAME one of {sorted(SEARCHABLE)}, got {item!r}")
        try:
            vals = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
        except ValueError:
            raise ValueError(f"--grid {name}: values must be integers, got {text!r}") from None
        if not vals or vals[0] < 1:
            raise ValueError(f"--grid {name}: values must be integers >= 1, got {text!r}")
        values[name] = vals
        if name not in names:
            names.append(name)
    space: dict[str, tuple[int, ...]] = {}
    for name in names:
        if name not in SEARCHABLE:
            raise ValueError(f"--search: {name!r} cannot be searched; searchable: {sorted(SEARCHABLE)}")
        vals = values.get(name, SEARCHABLE[name])
        if not vals:
            raise ValueError(f"--search {name}: it has no default values; give them with --grid {name}=V1,V2")
        space[name] = vals
    if "data-parallel-size" in space and any(k in space for k in PD_FLAGS):
        raise ValueError("--search: data-parallel-size and prefill-replicas / decode-replicas are two kinds of "
                         "deployment; search one or the other")  # fmt: skip
    return space


def candidates(space: dict[str, tuple[int, ...]]) -> list[list[Candidate]]:
    """Lines of candidates: each line fixes the flags other than data-parallel-size and walks it upwards."""
    others = [n for n in space if n != "data-parallel-size"]
    dps = space.get("data-parallel-size", (1,))
    lines = []
    for combo in itertools.product(*(space[n] for n in others)):
        fixed = dict(zip(others, combo, strict=True))
        line = []
        for dp in dps:
            values = {"data-parallel-size": dp, **fixed} if "data-parallel-size" in space else fixed
            line.append(Candidate(values))
        lines.append(line)
    return lines


def search(
    space: dict[str, tuple[int, ...]],
    evaluate: Callable[[Candidate], tuple[BenchSummary | None, str | None, float]],
    target_pct: float = 90.0,
    exhaustive: bool = False,
    log: Callable[[str], None] | None = None,
) -> PlanResult:
    """Evaluate the space's candidates (evaluate → (summary with SLO attainment, error, wall seconds)).

    Per line of the other flags, data-parallel sizes go smallest first and the first that meets ends the line
    (unless `exhaustive`). The winner is the lowest cost that meets; ties go to higher attainment, then goodput.
    """
    if not 0 < target_pct <= 100:
        raise ValueError(f"--attainment must be in (0, 100], got {target_pct}")
    trials: list[Trial] = []
    for line in candidates(space):
        for cand in line:
            summary, error, wall = evaluate(cand)
            att = None if summary is None else summary.slo_attainment_pct
            meets = att is not None and att >= target_pct
            trial = Trial(cand, summary, meets, error, wall)
            trials.append(trial)
            if log:
                what = f"error: {error}" if error else f"attainment {att:.1f} %" if att is not None else "no SLO"
                log(f"  {cand.label():<60} cost {cand.cost:>4}  {what}{'  ✓' if meets else ''}")
            if meets and not exhaustive:
                break
    meeting = [t for t in trials if t.meets]
    winner = min(meeting, key=_rank) if meeting else None
    ok = [t for t in trials if t.summary is not None]
    closest = None if winner is not None or not ok else max(ok, key=lambda t: (t.attainment_pct, -t.candidate.cost))
    return PlanResult(trials, winner, closest, target_pct, space=space)


def _rank(t: Trial) -> tuple[float, float, float]:
    s = t.summary
    assert s is not None, "a meeting trial has a summary"
    return (t.candidate.cost, -t.attainment_pct, -(s.goodput_rps or 0.0))


def slo_lower_bound(
    slos: SLOs, prompt_lens: list[int], output_lens: list[int], step_time: Callable[..., float], overheads: Any,
    target_pct: float,
) -> str | None:  # fmt: skip
    """Why no configuration can meet the SLOs, if an idle replica (alone, no queueing, the fastest step model of
    the space) already misses them for more than (100 − target_pct) % of the requests; else None."""
    if not slos.any or not prompt_lens:
        return None
    ing_eg = overheads.ingress_s + overheads.egress_s
    core = overheads.core_step_overhead_s
    misses = 0
    worst = ""
    for p, o in zip(prompt_lens, output_lens, strict=True):
        ttft = ing_eg + step_time(p, 1, 0, 0, p * (p + 1) / 2) + core
        tpot = step_time(0, 0, 1, p + o // 2, 0.0) + core
        e2e = ttft + (o - 1) * tpot
        for name, value, bound in (("ttft", slos.ttft_ms, ttft), ("tpot", slos.tpot_ms if o > 1 else None, tpot),
                                   ("e2e", slos.e2e_ms, e2e)):  # fmt: skip
            if value is not None and bound * 1e3 > value:
                misses += 1
                worst = (
                    worst
                    or f"{name} of a {p}-token prompt alone on an idle replica is {bound * 1e3:.1f} ms > {value:g} ms"
                )
                break
    if 100.0 * (len(prompt_lens) - misses) / len(prompt_lens) < target_pct:
        return (
            f"no configuration can meet the SLOs: {100.0 * misses / len(prompt_lens):.1f} % of the requests miss "
            f"them even alone on an idle replica with the fastest step model of the space (e.g. the {worst}); "
            f"at most {100.0 - 100.0 * misses / len(prompt_lens):.1f} % < {target_pct:g} % attainment"
        )
    return None


def format_plan(result: PlanResult, slos: SLOs) -> str:
    names = list(result.space)
    head = (
        "".join(f"{n:>24}" for n in names)
        + f"{'cost':>6}{'attain %':>10}{'goodput':>10}{'TTFT p99':>10}{'TPOT p99':>10}  "
    )
    lines = [head, "-" * len(head)]
    for t in result.trials:
        r = t.row()
        cells = "".join(f"{r.get(n, '-')!s:>24}" for n in names) + f"{t.candidate.cost:>6}"
        if t.error:
            cells += f"  error: {t.error[:80]}"
        else:
            cells += "".join(_cell(r[k]) for k in ("slo_attainment_pct", "goodput_rps", "ttft_p99_ms", "tpot_p99_ms"))
            cells += "  ✓ meets" if t.meets else ""
        lines.append(cells)
    slo_text = ", ".join(f"{k.removesuffix('_ms')}<={v:g}ms" for k, v in vars(slos).items() if v is not None)
    if result.winner is not None:
        w = result.winner
        lines.append(f"winner (cheapest meeting {slo_text} for >= {result.target_pct:g} % of requests): "
                     f"{w.candidate.label()} — cost {w.candidate.cost}, attainment {w.attainment_pct:.1f} %, "
                     f"goodput {w.summary.goodput_rps:.3f} req/s")  # fmt: skip
    else:
        lines.append(f"NO configuration of the space meets {slo_text} for >= {result.target_pct:g} % of requests")
        if result.closest is not None:
            c = result.closest
            lines.append(
                f"closest: {c.candidate.label()} — cost {c.candidate.cost}, attainment {c.attainment_pct:.1f} %"
            )
    if result.impossible:
        lines.append(result.impossible)
    return "\n".join(lines)


def _cell(x: float | None) -> str:
    return f"{'-':>10}" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:>10.2f}"


def plot_plan(result: PlanResult, path: Any) -> Any:
    from lmserve.bench.report import _save, load_pyplot

    plt = load_pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ok = [t for t in result.trials if t.summary is not None]
    for meets, color, label in ((False, "tab:red", "misses"), (True, "tab:green", "meets")):
        pts = [t for t in ok if t.meets == meets]
        ax.scatter([t.candidate.cost for t in pts], [t.attainment_pct for t in pts], c=color, label=label, alpha=0.7)
    best = result.winner or result.closest
    if best is not None:
        ax.scatter([best.candidate.cost], [best.attainment_pct], s=200, facecolors="none", edgecolors="k",
                   label=("winner: " if result.winner else "closest: ") + best.candidate.label())  # fmt: skip
    ax.axhline(result.target_pct, ls="--", c="gray", label=f"target {result.target_pct:g} %")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cost (accelerators = data parallel × tensor parallel)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title("lmserve simulate plan")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, plt, path)
