"""lmserve.sim.plan on a toy space with a known optimum, an impossible SLO, and the CLI end to end (simulate run
writes bench serve's JSON keys; plan prints its table and winner)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmserve.bench.metrics import BenchSummary, RequestRecord, SLOs, summarize
from lmserve.config.engine import EngineArgs
from lmserve.entrypoints.cli import main
from lmserve.sim.linear_fit import LinearStepModel
from lmserve.sim.plan import Candidate, format_plan, parse_space, search, slo_lower_bound
from lmserve.sim.sim_config import SimConfig
from lmserve.sim.simulator import Simulator
from lmserve.sim.step_model import profile_for
from lmserve.sim.workload import Workload

RATE = 150.0  # requests/s, evenly spaced


def _toy(llama_dir: Path):
    """t = 5 ms + 0.5 ms per decode row, 10 output tokens. Batched (max-num-seqs 64) a replica at λ req/s decodes
    rows = 9 λ TPOT (Little), so TPOT = 5 ms / (1 − 0.0045 λ): 150 req/s on one replica → 15 ms, on two → 7.5 ms.
    One at a time (max-num-seqs 1) a replica finishes a request per 5 + 9 · 5.5 ms: at most 18 req/s, so 150 req/s
    needs 9 of them. With TPOT <= 10 ms the optimum of {1, 2, 3, 4, 6} x {1, 64} is 2 replicas of 64."""
    config = EngineArgs.from_kwargs(str(llama_dir), num_kv_blocks=512).create_engine_config()
    profile = profile_for(config, LinearStepModel(0.005, {"decode_rows": 0.0005}))
    n = 600
    workload = Workload([[1 + (i * 7 + j) % 400 for j in range(16)] for i in range(n)], [10] * n,
                        [i / RATE for i in range(n)])  # fmt: skip
    return config, profile, workload


def test_plan_finds_the_known_optimum(llama_dir: Path) -> None:
    config, profile, workload = _toy(llama_dir)
    slos = SLOs(ttft_ms=200, tpot_ms=10)
    configs = {}

    def evaluate(c: Candidate):
        mns = c.values["max-num-seqs"]
        if mns not in configs:
            configs[mns] = EngineArgs.from_kwargs(
                str(llama_dir), num_kv_blocks=512, max_num_seqs=mns
            ).create_engine_config()
        r = Simulator(profile, SimConfig(configs[mns], data_parallel_size=c.dp)).run(workload)
        return summarize(r.records, r.duration_s, RATE, None, slos), None, r.wall_s

    space = parse_space(["data-parallel-size,max-num-seqs"], ["data-parallel-size=1,2,3,4,6", "max-num-seqs=1,64"])
    result = search(space, evaluate, 90.0)
    assert result.winner is not None
    assert result.winner.candidate.values == {"data-parallel-size": 2, "max-num-seqs": 64}
    tried = {(t.candidate.dp, t.candidate.values["max-num-seqs"]) for t in result.trials}
    assert (3, 64) not in tried and (6, 1) in tried  # a line stops at the first size that meets
    full = search(space, evaluate, 90.0, exhaustive=True)
    meeting = {(t.candidate.dp, t.candidate.values["max-num-seqs"]) for t in full.trials if t.meets}
    assert meeting == {(2, 64), (3, 64), (4, 64), (6, 64)} and full.winner.candidate == result.winner.candidate
    text = format_plan(result, slos)
    assert "winner" in text and "data-parallel-size=2 max-num-seqs=64" in text


def test_impossible_slo_says_so_and_shows_the_closest(llama_dir: Path) -> None:
    config, profile, workload = _toy(llama_dir)
    slos = SLOs(tpot_ms=2)  # below an idle replica's 5.5 ms decode step
    bound = slo_lower_bound(slos, [16] * len(workload), workload.output_lens, profile.step_time_fn(), profile.overheads,
                            90.0)  # fmt: skip
    assert bound is not None and "no configuration can meet" in bound

    def evaluate(c: Candidate):
        r = Simulator(profile, SimConfig(config, data_parallel_size=c.dp)).run(workload)
        return summarize(r.records, r.duration_s, RATE, None, slos), None, r.wall_s

    result = search(parse_space(["data-parallel-size"], ["data-parallel-size=1,2,4"]), evaluate, 90.0)
    result.impossible = bound
    assert result.winner is None and result.closest is not None
    text = format_plan(result, slos)
    assert "NO configuration" in text and "closest:" in text and "no configuration can meet" in text
    assert slo_lower_bound(SLOs(tpot_ms=10), [16], [10], profile.step_time_fn(), profile.overheads, 90.0) is None


def test_parse_space_names_bad_flags() -> None:
    assert parse_space(["max-num-seqs"], None) == {"max-num-seqs": (16, 32, 64, 128, 256)}
    with pytest.raises(ValueError, match="cannot be searched"):
        parse_space(["max-model-len"], None)
    with pytest.raises(ValueError, match="--grid"):
        parse_space(["max-num-seqs"], ["max-num-seqs=a,b"])
    with pytest.raises(ValueError, match="no default values"):
        parse_space(["num-kv-blocks"], None)
    with pytest.raises(ValueError, match="one or the other"):
        parse_space(["data-parallel-size", "prefill-replicas"], None)


def test_disaggregated_candidates_cost_their_replicas() -> None:
    from lmserve.sim.plan import Candidate, candidates

    space = parse_space(["prefill-replicas", "decode-replicas"], ["prefill-replicas=1,2", "decode-replicas=1,3"])
    cands = [c for line in candidates(space) for c in line]
    assert [(c.disaggregation, c.cost) for c in cands] == [("1P1D", 2), ("1P3D", 4), ("2P1D", 3), ("2P3D", 5)]
    assert Candidate({"decode-replicas": 2, "tensor-parallel-size": 2}).cost == 6  # 1P2D x TP 2
    assert Candidate({"data-parallel-size": 4}).disaggregation is None


def test_cli_run_writes_bench_serve_keys_and_plan_runs(llama_dir: Path, tmp_path: Path, capsys) -> None:
    config = EngineArgs.from_kwargs(str(llama_dir)).create_engine_config()
    step_model = profile_for(config, LinearStepModel(0.002, {"prefill_tokens": 1e-5, "decode_rows": 5e-4}))
    step_model.save(tmp_path / "sm.json")
    out = tmp_path / "sim.json"
    common = ["--step-model", str(tmp_path / "sm.json"), "--model", str(llama_dir), "--dataset", "random",
              "--input-len", "24", "--output-len", "6", "--num-requests", "40", "--request-rate", "20"]  # fmt: skip
    assert main(["simulate", "run", *common, "--goodput", "ttft:100", "tpot:20", "--output-json", str(out),
                 "--data-parallel-size", "2"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "simulate:" in text and "TTFT (ms)" in text and "goodput" in text
    doc = json.loads(out.read_text())
    assert {"args", "summary", "run", "requests"} <= set(doc)
    assert set(doc["summary"]) == set(BenchSummary.__dataclass_fields__)
    assert set(doc["requests"][0]) == set(RequestRecord.__dataclass_fields__)
    assert doc["summary"]["num_succeeded"] == 40 and doc["summary"]["output_len"]["mean"] == 6
    assert doc["simulation"]["data_parallel_size"] == 2

    plan_out = tmp_path / "plan.json"
    code = main(["simulate", "plan", *common, "--goodput", "ttft:100", "--search", "data-parallel-size",
                 "--grid", "data-parallel-size=1,2", "--output-json", str(plan_out), "--plot"])  # fmt: skip
    text = capsys.readouterr().out
    assert ("winner" in text) == (code == 0)
    assert json.loads(plan_out.read_text())["trials"]
    assert (tmp_path / "plan_plan.png").is_file()

    bf16 = ["--dtype", "bfloat16"]
    assert main(["simulate", "run", *common, *bf16, "--output-json", str(out)]) == 2
    assert "dtype='float32'" in capsys.readouterr().err
    pd_out = tmp_path / "pd.json"
    assert main(["simulate", "run", *common, "--disaggregation", "2P1D", "--kv-transfer-block-us", "50",
                 "--output-json", str(pd_out)]) == 0  # fmt: skip
    assert "on 2P1D" in capsys.readouterr().out
    sim = json.loads(pd_out.read_text())["simulation"]
    assert sim["roles"] == ["prefill", "prefill", "decode"] and sim["kv_transfer_block_us"] == pytest.approx(50)
    assert sim["kv_blocks_pulled"] > 0
    assert main(["simulate", "run", *common, "--disaggregation", "2P1D", "--data-parallel-size", "2"]) == 2
    assert "--data-parallel-size must stay 1" in capsys.readouterr().err
    code = main(["simulate", "plan", *common, "--goodput", "ttft:100", "--search", "prefill-replicas",
                 "decode-replicas", "--grid", "prefill-replicas=1,2", "decode-replicas=1", "--exhaustive",
                 "--output-json", str(plan_out)])  # fmt: skip
    text = capsys.readouterr().out
    assert "prefill-replicas=2 decode-replicas=1" in text and ("winner" in text) == (code == 0)
    assert [t["cost"] for t in json.loads(plan_out.read_text())["trials"]] == [2, 3]


def test_cli_roofline_then_run_a_model_we_do_not_have(tmp_path: Path, capsys) -> None:
    """An H200 estimate for Llama-3-8B (public config numbers only, no weights) runs through the real scheduler."""
    path = tmp_path / "h200.json"
    assert main(["simulate", "roofline", "--hardware", "h200", "--preset", "llama-3-8b", "--out", str(path)]) == 0
    assert "ESTIMATE" in capsys.readouterr().out
    out = tmp_path / "sim.json"
    args = ["simulate", "run", "--step-model", str(path), "--input-len", "512", "--output-len", "16",
            "--num-requests", "20", "--request-rate", "50", "--output-json", str(out)]  # fmt: skip
    assert main([*args, "--tensor-parallel-size", "2", "--data-parallel-size", "2"]) == 0
    text = capsys.readouterr().out
    assert "(ESTIMATE)" in text and "x TP 2" in text
    doc = json.loads(out.read_text())
    assert doc["summary"]["num_succeeded"] == 20 and doc["simulation"]["estimate"] is True
    assert doc["simulation"]["num_kv_blocks_per_replica"] > 10_000  # two H200s' memory beside the weights


def test_cli_calibrate_refit_from_saved_steps(llama_dir: Path, tmp_path: Path, capsys) -> None:
    import random

    from lmserve.sim.step_features import StepFeatures
    from lmserve.sim.step_model import StepProfile

    config = EngineArgs.from_kwargs(str(llama_dir)).create_engine_config()
    truth = LinearStepModel(0.001, {"prefill_tokens": 2e-5, "prefill_segments": 1e-3, "decode_rows": 3e-4,
                                    "decode_context_tokens": 1e-6})  # fmt: skip
    rng = random.Random(1)
    rows = []
    for _ in range(120):
        p = rng.choice([0, 0, 16, 256])
        f = StepFeatures(p, int(p > 0), rng.randrange(1, 40), rng.randrange(100, 9000), p * (p + 1) / 2)
        rows.append([*f.as_tuple(), truth.step_time_s(f) * rng.uniform(0.99, 1.01)])
    profile = profile_for(
        config, LinearStepModel(0.0, {}), calibration={"samples": rows, "workload_samples": rows[:20]}
    )
    path = profile.save(tmp_path / "old.json")
    assert main(["simulate", "calibrate", "--refit", str(path), "--out", str(tmp_path / "new.json")]) == 0
    assert "held-out grid steps" in capsys.readouterr().out
    new = StepProfile.load(tmp_path / "new.json")
    assert new.linear is not None and new.fit["chosen"] == "linear"
    for k, v in truth.coefficients_s.items():
        assert new.linear.coefficients_s[k] == pytest.approx(v, rel=0.1)
    assert len(new.noise_quantiles) == 201 and 0.95 < new.noise_quantiles[100] < 1.05


def test_refit_fits_the_served_steps_when_there_are_enough(llama_dir: Path, tmp_path: Path, capsys) -> None:
    import random

    from lmserve.sim.calibrate import MIN_SERVED_STEPS
    from lmserve.sim.step_features import StepFeatures
    from lmserve.sim.step_model import StepProfile

    config = EngineArgs.from_kwargs(str(llama_dir)).create_engine_config()
    grid_truth = LinearStepModel(0.001, {"prefill_tokens": 2e-5, "prefill_segments": 1e-3, "decode_rows": 3e-4})
    served_truth = LinearStepModel(0.0014, {"prefill_tokens": 2.5e-5, "prefill_segments": 1e-3, "decode_rows": 4e-4,
                                            "decode_off_stack": 2e-3}, 8)  # fmt: skip
    rng = random.Random(3)

    def rows(truth: LinearStepModel, n: int) -> list[list[float]]:
        out = []
        for _ in range(n):
            p = rng.choice([0, 0, 16, 256])
            f = StepFeatures(p, int(p > 0), rng.randrange(1, 33), 0, p * (p + 1) / 2)
            out.append([*f.as_tuple(), truth.step_time_s(f) * rng.uniform(0.99, 1.01)])
        return out

    grid = rows(grid_truth, 120)
    cal = {"samples": grid, "workload_samples": grid[:20], "decode_stack_rows": 8}
    few = profile_for(config, LinearStepModel(0.0, {}), calibration={**cal, "served_samples": rows(served_truth, 10)})
    assert main(["simulate", "calibrate", "--refit", str(few.save(tmp_path / "few.json")), "--out",
                 str(tmp_path / "few-new.json")]) == 0  # fmt: skip
    assert StepProfile.load(tmp_path / "few-new.json").fit["fitted_on"] == "in-process grid"  # too few served
    served = rows(served_truth, MIN_SERVED_STEPS + 100)
    profile = profile_for(config, LinearStepModel(0.0, {}), calibration={**cal, "served_samples": served})
    assert main(["simulate", "calibrate", "--refit", str(profile.save(tmp_path / "old.json")), "--out",
                 str(tmp_path / "new.json")]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "fitted on: served steps" in out and "held-out served steps" in out and "in-process grid steps" in out
    new = StepProfile.load(tmp_path / "new.json")
    assert new.fit["fitted_on"] == "served" and new.linear is not None and new.linear.stack_rows == 8
    for k, v in served_truth.coefficients_s.items():
        assert new.linear.coefficients_s[k] == pytest.approx(v, rel=0.1), k
    assert new.fit["in_process_grid"]["sum_error_pct"] > 20  # the grid's steps are faster than the served ones
    # the total-time correction: the served steps' sum is the model's (a tail of slow steps counted, not ignored)
    steps = [(StepFeatures(*r[:5]), r[5]) for r in served]
    assert sum(new.linear.step_time_s(f) for f, _ in steps) == pytest.approx(sum(t for _, t in steps), rel=1e-9)
    assert new.fit["total_time_correction"] == pytest.approx(1.0, abs=0.02)  # (no tail in these steps)
    tail = [[*r[:5], r[5] * (5 if i % 10 == 0 else 1)] for i, r in enumerate(served)]  # every 10th step 5x slower
    profile = profile_for(config, LinearStepModel(0.0, {}), calibration={**cal, "served_samples": tail})
    assert main(["simulate", "calibrate", "--refit", str(profile.save(tmp_path / "tail.json")), "--out",
                 str(tmp_path / "tail-new.json")]) == 0  # fmt: skip
    tailed = StepProfile.load(tmp_path / "tail-new.json")
    assert tailed.fit["total_time_correction"] > 1.3  # the median fit ignores the tail; the correction puts it back
    for k, v in served_truth.coefficients_s.items():
        assert tailed.linear.coefficients_s[k] == pytest.approx(v * tailed.fit["total_time_correction"], rel=0.1), k


def test_mixed_step_term_separates_a_mixed_steps_fixed_cost() -> None:
    """Steps cost 1 ms + 0.05 ms a prefill token + 3 ms once for a mixed step (prefills beside decodes) + 0.2 ms a
    segment + 0.1 ms a decode row: with mixed steps of several segments (a burst joining decodes) the fit keeps the
    fixed part apart, so 32 segments beside decodes cost 3 + 32 × 0.2 ms, not 32 × 3.2, and a lone prefill 0.2."""
    import numpy as np

    from lmserve.sim.linear_fit import choose_form
    from lmserve.sim.step_features import MIXED_STEP_TERM, StepFeatures

    rng = np.random.default_rng(3)
    samples = []
    for _ in range(400):
        segments = int(rng.choice([0, 0, 1, 1, 2, 4, 8, 32]))
        tokens = int(sum(rng.integers(8, 64) for _ in range(segments)))
        rows = int(rng.integers(0, 16)) if segments else int(rng.integers(1, 16))
        t = 1e-3 + 5e-5 * tokens + (3e-3 if segments and rows else 0.0) + 2e-4 * segments + 1e-4 * rows
        samples.append((StepFeatures(tokens, segments, rows, int(rng.integers(rows, 50 * rows + 1)), 0.0), t))
    model, _, _ = choose_form(samples)
    c = model.coefficients_s
    assert c[MIXED_STEP_TERM] == pytest.approx(3e-3, rel=1e-3)
    assert c["prefill_segments"] == pytest.approx(2e-4, rel=1e-2)
    f = StepFeatures(32 * 32, 32, 4, 100, 0.0)
    assert model.step_time_s(f) == pytest.approx(1e-3 + 5e-5 * 1024 + 3e-3 + 32 * 2e-4 + 4e-4, rel=1e-3)
    assert model.fast()(*f.as_tuple()) == model.step_time_s(f)
    lone = StepFeatures(32, 1, 0, 0, 0.0)
    assert model.step_time_s(lone) == pytest.approx(1e-3 + 5e-5 * 32 + 2e-4, rel=1e-3)
    old = LinearStepModel(1e-3, {"prefill_tokens": 5e-5, "prefill_segments": 3e-3})  # an older model: no such term
    assert MIXED_STEP_TERM not in old.terms and old.step_time_s(f) == pytest.approx(1e-3 + 5e-5 * 1024 + 0.096)
