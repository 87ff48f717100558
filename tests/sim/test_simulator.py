"""lmserve.sim: hand-checkable latencies from a step model with known coefficients, the simulator's scheduling
decisions equal to the real engine's (model runner stubbed) step by step, bad input, workloads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from lmserve.bench.datasets import DatasetConfig, build_requests, load_tokenizer
from lmserve.bench.metrics import request_latency, summarize
from lmserve.config.engine import EngineArgs
from lmserve.core.outputs import ModelRunnerOutput
from lmserve.engine.llm_engine import LLMEngine
from lmserve.sampling_params import SamplingParams
from lmserve.sim.linear_fit import LinearStepModel, fit_linear
from lmserve.sim.sim_config import SimConfig, check_disaggregation
from lmserve.sim.sim_result import StepTrace
from lmserve.sim.simulator import Simulator, sim_token
from lmserve.sim.step_features import Overheads, StepFeatures
from lmserve.sim.step_model import StepProfile, profile_for
from lmserve.sim.workload import Workload, build_workload, fast_prompts, trace_workload

MS = 1e-3


def _config(model_dir: Path, **kw):
    return EngineArgs.from_kwargs(str(model_dir), **kw).create_engine_config()


def _profile(config, intercept_ms: float, **coef_ms: float) -> StepProfile:
    lin = LinearStepModel(intercept_ms * MS, {k: v * MS for k, v in coef_ms.items()})
    return profile_for(config, lin)


def test_two_requests_hand_checked(llama_dir: Path) -> None:
    """t = 10 ms + 0.1 ms/prefill token + 1 ms/decode row. A: 100-token prompt, 3 tokens, arrives at 0;
    B: 50-token prompt, 2 tokens, arrives at 25 ms (during A's second step):

        step 1  [0, 20]    prefill A (100 tokens): 10 + 10        → A token 1 at 20
        step 2  [20, 31]   decode A: 10 + 1                       → A token 2 at 31
        step 3  [31, 47]   decode A + prefill B (50): 10 + 1 + 5  → A token 3 (done), B token 1 at 47
        step 4  [47, 58]   decode B: 10 + 1                       → B token 2 (done) at 58
    """
    config = _config(llama_dir, num_kv_blocks=64)
    profile = _profile(config, 10.0, prefill_tokens=0.1, decode_rows=1.0)
    workload = Workload([list(range(1, 101)), list(range(200, 250))], [3, 2], [0.0, 0.025])
    result = Simulator(profile, SimConfig(config)).run(workload)
    a, b = result.records
    assert a.chunk_times_s == pytest.approx([0.020, 0.031, 0.047])
    assert b.chunk_times_s == pytest.approx([0.047, 0.058])
    la, lb = request_latency(a), request_latency(b)
    assert la.ttft_s == pytest.approx(0.020) and lb.ttft_s == pytest.approx(0.022)
    assert la.tpot_s == pytest.approx(0.0135) and lb.tpot_s == pytest.approx(0.011)
    assert la.e2e_s == pytest.approx(0.047) and lb.e2e_s == pytest.approx(0.033)
    assert la.itls_s == pytest.approx([0.011, 0.016])
    s = summarize(result.records, result.duration_s)
    assert s.duration_s == pytest.approx(0.058) and result.num_steps == 4
    assert s.ttft_ms.mean == pytest.approx(21.0) and s.tpot_ms.mean == pytest.approx(12.25)
    assert s.num_succeeded == 2 and s.total_output_tokens == 5


def test_overheads_shift_as_documented(llama_dir: Path) -> None:
    """ingress 1 ms delays admission, egress 2 ms delays every chunk, the core loop adds 0.5 ms per step."""
    config = _config(llama_dir, num_kv_blocks=64)
    profile = _profile(config, 10.0, prefill_tokens=0.1, decode_rows=1.0)
    profile.overheads = Overheads(ingress_s=0.001, egress_s=0.002, core_step_overhead_s=0.0005)
    workload = Workload([list(range(1, 101))], [3], [0.0])
    (a,) = Simulator(profile, SimConfig(config)).run(workload).records
    # steps [1, 21.5], [21.5, 33], [33, 44.5]; chunks 2 ms later
    assert a.chunk_times_s == pytest.approx([0.0235, 0.035, 0.0465])
    assert a.send_s == 0.0


def test_api_queue_and_step_stretch_hand_checked(llama_dir: Path) -> None:
    """The API process as one FIFO server (request 0.5 ms; chunk 1 ms, + 2 ms a request's first, + 3 ms its last;
    ingress 1 ms and egress 2 ms the rest of the way) whose work stretches the step beside it by 0.5 × its
    seconds. The two requests of test_two_requests_hand_checked (t = 10 ms + 0.1 ms/prefill token + 1 ms/row):

        A sent at 0: API [0, 0.5], at the core at 1.5 (idle: no stretch)
        step 1  [1.5, 21.5]     prefill A: 20                         API [21.5, 24.5] A's first chunk → 26.5
        step 2  [21.5, 34]      decode A: 11 + 0.5 × 3 (A's first chunk)
          B sent at 25: API [25, 25.5], at the core at 26.5, during step 2: 0.5 of API work beside it
                                                                      API [34, 35] A's 2nd chunk → 37
        step 3  [34, 50.75]     A + prefill B: 16 + 0.5 × (0.5 + 1)   API [50.75, 54.75] A's last → 56.75,
                                                                          [54.75, 57.75] B's first → 59.75
        step 4  [50.75, 65.25]  decode B: 11 + 0.5 × 7                API [65.25, 69.25] B's last → 71.25
    """
    config = _config(llama_dir, num_kv_blocks=64)
    profile = _profile(config, 10.0, prefill_tokens=0.1, decode_rows=1.0)
    profile.overheads = Overheads(ingress_s=0.001, egress_s=0.002, api_request_s=0.0005, api_chunk_s=0.001,
                                  api_first_chunk_s=0.002, api_last_chunk_s=0.003, api_step_stretch=0.5)  # fmt: skip
    workload = Workload([list(range(1, 101)), list(range(200, 250))], [3, 2], [0.0, 0.025])
    result = Simulator(profile, SimConfig(config, record_steps=True)).run(workload)
    a, b = result.records
    assert [t for s in result.steps for t in (s.start_s, s.end_s)] == pytest.approx(
        [0.0015, 0.0215, 0.0215, 0.034, 0.034, 0.05075, 0.05075, 0.06525]
    )
    assert a.chunk_times_s == pytest.approx([0.0265, 0.037, 0.05675])
    assert b.chunk_times_s == pytest.approx([0.05975, 0.07125])
    la, lb = request_latency(a), request_latency(b)
    assert la.ttft_s == pytest.approx(0.0265) and lb.ttft_s == pytest.approx(0.03475)
    assert la.tpot_s == pytest.approx(0.015125) and lb.tpot_s == pytest.approx(0.0115)
    assert result.duration_s == pytest.approx(0.07125)


def test_a_send_stalls_the_step_in_progress_hand_checked(llama_dir: Path) -> None:
    """test_api_queue_and_step_stretch_hand_checked's requests and costs, with a send stalling the step in progress
    by 4 ms (Overheads.api_arrival_stall_s). A is sent to an idle core (nothing stalls); B is sent at 25 during
    step 2, which ends 4 ms later than there, and so does everything after it:

        step 1  [1.5, 21.5]     prefill A                             API [21.5, 24.5] A's first chunk → 26.5
        step 2  [21.5, 38]      decode A: 12.5 + 4 (B sent at 25)     API [38, 39] A's 2nd chunk → 41
        step 3  [38, 54.75]     A + prefill B: 16.75                  A's last → 60.75, B's first → 63.75
        step 4  [54.75, 69.25]  decode B: 14.5                        B's last → 75.25
    """
    config = _config(llama_dir, num_kv_blocks=64)
    profile = _profile(config, 10.0, prefill_tokens=0.1, decode_rows=1.0)
    profile.overheads = Overheads(ingress_s=0.001, egress_s=0.002, api_request_s=0.0005, api_chunk_s=0.001,
                                  api_first_chunk_s=0.002, api_last_chunk_s=0.003, api_step_stretch=0.5,
                                  api_arrival_stall_s=0.004)  # fmt: skip
    workload = Workload([list(range(1, 101)), list(range(200, 250))], [3, 2], [0.0, 0.025])
    result = Simulator(profile, SimConfig(config, record_steps=True)).run(workload)
    a, b = result.records
    assert [t for s in result.steps for t in (s.start_s, s.end_s)] == pytest.approx(
        [0.0015, 0.0215, 0.0215, 0.038, 0.038, 0.05475, 0.05475, 0.06925]
    )
    assert result.num_steps == 4  # the stalled step's first end event was stale: no step ended twice
    assert result.replicas[0].step_s == pytest.approx(0.020 + 0.0165 + 0.01675 + 0.0145)
    assert a.chunk_times_s == pytest.approx([0.0265, 0.041, 0.06075])
    assert b.chunk_times_s == pytest.approx([0.06375, 0.07525])
    assert result.duration_s == pytest.approx(0.07525)


def test_a_closed_loop_send_stalls_the_step_in_progress_at_its_time(llama_dir: Path) -> None:
    """Client concurrency 2, a 4 ms stall a send the cap held (10 ms an arrival's), no other overheads; t = 10 ms +
    0.1 ms/prefill token + 1 ms/row. A (100 tokens, 2 out) and B (100, 6 out) are sent at 0 to an idle core (nothing
    stalls); C (50, 2 out), held by the cap, is sent when A ends, at 42, which is when step 3 starts: that step, not
    the one that just ended, is stalled, by a held send's 4 ms.

        step 1 [0, 30]   prefill A, B    step 2 [30, 42]  decode A, B (A done: C sent at 42)
        step 3 [42, 57]  decode B: 11 + 4 (C's send)       step 4 [57, 73]  B + prefill C: 16
        step 5 [73, 85]  decode B, C     step 6 [85, 96]  decode B
    """
    config = _config(llama_dir, num_kv_blocks=64)
    profile = _profile(config, 10.0, prefill_tokens=0.1, decode_rows=1.0)
    profile.overheads = Overheads(api_arrival_stall_s=0.010, api_held_send_stall_s=0.004)
    workload = Workload([list(range(1, 101)), list(range(101, 201)), list(range(300, 350))], [2, 6, 2], [0.0] * 3)
    result = Simulator(profile, SimConfig(config, max_concurrency=2, record_steps=True)).run(workload)
    assert [t for s in result.steps for t in (s.start_s, s.end_s)] == pytest.approx(
        [0.0, 0.030, 0.030, 0.042, 0.042, 0.057, 0.057, 0.073, 0.073, 0.085, 0.085, 0.096]
    )
    a, b, c = result.records
    assert c.send_s == pytest.approx(0.042) and c.chunk_times_s == pytest.approx([0.073, 0.085])
    assert b.chunk_times_s == pytest.approx([0.030, 0.042, 0.057, 0.073, 0.085, 0.096])
    assert result.num_steps == 6


def test_with_several_replicas_a_send_stalls_the_step_of_the_replica_it_is_routed_to(llama_dir: Path) -> None:
    """Two replicas; A and B at 0 (one each, idle: no stall), C at 25 ms while both step: C's 4 ms stall lengthens
    the step in progress on the replica C is routed to, and only that one; the other replica's steps are those of
    the same run without stalls."""
    config = _config(llama_dir, num_kv_blocks=64)
    profile = _profile(config, 10.0, prefill_tokens=0.1, decode_rows=1.0)
    workload = Workload([list(range(1, 101)), list(range(101, 201)), list(range(300, 350))], [6, 6, 2],
                        [0.0, 0.0, 0.025])  # fmt: skip

    def steps(stall: float) -> list[StepTrace]:
        profile.overheads = Overheads(api_arrival_stall_s=stall)
        return Simulator(profile, SimConfig(config, data_parallel_size=2, record_steps=True)).run(workload).steps

    plain, stalled = steps(0.0), steps(0.004)
    (c_replica,) = {s.replica for s in stalled if "2" in s.admitted}
    other = 1 - c_replica
    assert [(s.start_s, s.end_s) for s in stalled if s.replica == other] == pytest.approx(
        [(s.start_s, s.end_s) for s in plain if s.replica == other]
    )
    mine, before = [s for s in stalled if s.replica == c_replica], [s for s in plain if s.replica == c_replica]
    k = next(i for i, s in enumerate(before) if s.start_s <= 0.025 < s.end_s)  # in progress at C's arrival
    assert [(s.start_s, s.end_s) for s in mine[:k]] == pytest.approx([(s.start_s, s.end_s) for s in before[:k]])
    assert mine[k].start_s == pytest.approx(before[k].start_s)
    assert mine[k].end_s == pytest.approx(before[k].end_s + 0.004)


def test_no_api_costs_no_queue(llama_dir: Path) -> None:
    """An older step model (no api_* keys) loads with the API costs 0: chunks exactly as before."""
    config = _config(llama_dir, num_kv_blocks=64)
    profile = _profile(config, 10.0, prefill_tokens=0.1, decode_rows=1.0)
    doc = profile.to_dict()
    doc["overheads"] = {"ingress_s": 0.001, "egress_s": 0.002, "core_step_overhead_s": 0.0005}
    old = StepProfile.from_dict(doc)
    assert not old.overheads.api_queue and old.overheads.api_step_stretch == 0.0
    (a,) = Simulator(old, SimConfig(config)).run(Workload([list(range(1, 101))], [3], [0.0])).records
    assert a.chunk_times_s == pytest.approx([0.0235, 0.035, 0.0465])
    with pytest.raises(ValueError, match="api_chunk_s"):
        Overheads(api_chunk_s=-1.0)


def test_post_prefill_decode_term_hand_checked(llama_dir: Path) -> None:
    """t = 10 ms + 0.1 ms/prefill token + 1 ms/decode row + 4 ms for the first pure decode after a prefill step.
    A: 100-token prompt, 4 tokens, at 0; B: 50-token prompt, 2 tokens, at 40 ms (during A's third step):

        step 1  [0, 20]    prefill A: 10 + 10                     → A token 1 at 20
        step 2  [20, 35]   decode A, right after a prefill: 10 + 1 + 4 → A token 2 at 35
        step 3  [35, 46]   decode A: 10 + 1                        → A token 3 at 46
        step 4  [46, 62]   decode A + prefill B (mixed): 10 + 1 + 5 → A token 4 (done), B token 1 at 62
        step 5  [62, 77]   decode B, right after a prefill: 10 + 1 + 4 → B token 2 (done) at 77
    """
    config = _config(llama_dir, num_kv_blocks=64)
    profile = _profile(config, 10.0, prefill_tokens=0.1, decode_rows=1.0, decode_after_prefill=4.0)
    assert profile.post_prefill_s() == pytest.approx(0.004)
    workload = Workload([list(range(1, 101)), list(range(200, 250))], [4, 2], [0.0, 0.040])
    a, b = Simulator(profile, SimConfig(config)).run(workload).records
    assert a.chunk_times_s == pytest.approx([0.020, 0.035, 0.046, 0.062])
    assert b.chunk_times_s == pytest.approx([0.062, 0.077])
    assert request_latency(a).tpot_s == pytest.approx(0.014) and request_latency(b).tpot_s == pytest.approx(0.015)
    # StepProfile.step_time_s (calibrate's scores, validation's served/model) counts it the same way
    assert profile.step_time_s(StepFeatures(0, 0, 1, 101, 0.0, 1)) == pytest.approx(0.015)
    assert profile.step_time_s(StepFeatures(0, 0, 1, 101, 0.0, 0)) == pytest.approx(0.011)


def test_a_step_model_without_the_post_prefill_term_simulates_as_before(llama_dir: Path, tmp_path: Path) -> None:
    """A file from before the term (no decode_after_prefill key) loads with it 0: the timeline of
    test_post_prefill_decode_term_hand_checked without the 4 ms, and every step as the plain linear model gives."""
    config = _config(llama_dir, num_kv_blocks=64)
    doc = _profile(config, 10.0, prefill_tokens=0.1, decode_rows=1.0).to_dict()
    assert "decode_after_prefill" not in json.dumps(doc)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    old = StepProfile.load(path)
    assert old.post_prefill_s() == 0.0
    workload = Workload([list(range(1, 101)), list(range(200, 250))], [4, 2], [0.0, 0.040])
    a, b = Simulator(old, SimConfig(config)).run(workload).records
    assert a.chunk_times_s == pytest.approx([0.020, 0.031, 0.042, 0.058])
    assert b.chunk_times_s == pytest.approx([0.058, 0.069])


def test_decode_after_prefill_marks_the_first_pure_decode_after_a_prefill_step() -> None:
    from lmserve.sim.grid_profile import sample_of_row as _sample
    from lmserve.sim.step_features import mark_decode_after_prefill

    # (prefill tokens, segments, decode rows, ...) of one core's steps in order
    steps = [(100, 1, 0), (0, 0, 1), (0, 0, 1), (50, 1, 1), (0, 0, 2), (30, 1, 0), (20, 1, 0), (0, 0, 1), (0, 0, 0)]
    assert mark_decode_after_prefill(steps) == [0, 1, 0, 0, 1, 0, 0, 1, 0]
    assert _sample([0, 0, 1, 10, 0.0, 0.002]) == (StepFeatures(0, 0, 1, 10, 0.0, 0), 0.002)  # an older file's row
    assert _sample([0, 0, 1, 10, 0.0, 0.002, 1]) == (StepFeatures(0, 0, 1, 10, 0.0, 1), 0.002)


def test_fit_finds_the_post_prefill_jump() -> None:
    """Steps of a known model with a 0.8 ms jump on the first decode after a prefill: choose_form adds the term
    and recovers it; the same steps without the jump (and unmarked) fit without the term."""
    import random

    from lmserve.sim.linear_fit import choose_form

    rng = random.Random(1)
    truth = LinearStepModel(
        0.0012, {"prefill_tokens": 4e-5, "prefill_segments": 1e-3, "decode_rows": 2e-4, "decode_after_prefill": 8e-4}
    )
    steps, prev_prefill = [], False
    for _ in range(400):
        prefill = rng.choice([0, 0, 0, 0, 64, 512])
        rows = rng.randrange(1, 8)
        after = int(prev_prefill and not prefill)
        f = StepFeatures(prefill, int(prefill > 0), rows if not prefill else 0, 0, 0.0, after)
        prev_prefill = prefill > 0
        steps.append((f, truth.step_time_s(f) * (1 + rng.uniform(-0.01, 0.01))))
    model, _, _ = choose_form(steps)
    assert model.coefficients_s["decode_after_prefill"] == pytest.approx(8e-4, rel=0.1)
    assert model.coefficients_s["decode_rows"] == pytest.approx(2e-4, rel=0.1)
    plain = [(StepFeatures(*f.as_tuple()), t - 8e-4 * f.decode_after_prefill) for f, t in steps]
    model, _, _ = choose_form(plain)
    assert "decode_after_prefill" not in model.coefficients_s


# ---- the simulator decides as the engine does ---------------------------------------------------------------


@dataclass
class Trace:
    scheduled: list[tuple[str, int, int]]
    preempted: list[str]
    finished: list[str]


def _engine_trace(config, prompts, out_lens, arrive_before_step) -> list[Trace]:
    """The real LLMEngine with its model runner stubbed by the simulator's token function."""
    engine = LLMEngine(config)
    vocab = config.model.vocab_size
    hashes: dict[str, int] = {}

    def execute(sched):
        return ModelRunnerOutput({
            s.request.request_id: sim_token(hashes[s.request.request_id], s.request.num_tokens, vocab)
            for s in sched.scheduled if s.samples
        })  # fmt: skip

    engine.runner.execute = execute
    captured = {}
    inner = engine.scheduler.schedule

    def schedule():
        out = inner()
        captured["s"] = [(s.request.request_id, s.request.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]
        captured["p"] = list(out.preempted_ids)
        return out

    engine.scheduler.schedule = schedule
    traces: list[Trace] = []
    pending = sorted(range(len(prompts)), key=lambda i: (arrive_before_step[i], i))
    while pending or engine.has_unfinished_requests():
        step = len(traces)
        while pending and arrive_before_step[pending[0]] <= step:
            i = pending.pop(0)
            hashes[str(i)] = hash(tuple(prompts[i]))
            engine.add_request(
                str(i), prompts[i], SamplingParams(max_tokens=out_lens[i], temperature=0.0, ignore_eos=True)
            )
        outputs = engine.step()
        assert captured["s"], f"step {step}: the engine idled (the test's arrivals must keep it busy)"
        traces.append(Trace(captured["s"], captured["p"], [o.request_id for o in outputs if o.finished]))
    return traces


def _sim_trace(config, prompts, out_lens, arrive_before_step) -> list[Trace]:
    """The simulator with 1 s steps: step k runs [k, k + 1), so an arrival at k − 0.5 joins step k."""
    profile = _profile(config, 1000.0)
    order = sorted(range(len(prompts)), key=lambda i: (arrive_before_step[i], i))
    arrivals = [max(0.0, arrive_before_step[i] - 0.5) for i in order]
    workload = Workload([prompts[i] for i in order], [out_lens[i] for i in order], arrivals)
    result = Simulator(profile, SimConfig(config, record_steps=True)).run(workload)
    name = {str(k): str(i) for k, i in enumerate(order)}  # workload index → the engine's request id
    traces = []
    for k, st in enumerate(result.steps):
        assert st.start_s == pytest.approx(k), f"simulated step {k} starts at {st.start_s}: the replica idled"
        traces.append(Trace([(name[r], s, n) for r, s, n in st.scheduled], [name[r] for r in st.preempted],
                            sorted(name[r] for r in st.finished)))  # fmt: skip
    return traces


def _workload(num: int, seed: int, shared_prefix: bool):
    import random

    rng = random.Random(seed)
    prefix = [rng.randrange(1, 500) for _ in range(12)]
    prompts, out_lens, arrive = [], [], []
    for i in range(num):
        body = [rng.randrange(1, 500) for _ in range(rng.randrange(4, 20))]
        prompts.append((prefix if shared_prefix and i % 2 else []) + body)
        out_lens.append(rng.randrange(1, 24))
        arrive.append(0 if i < 3 else rng.randrange(0, 25))
    prompts[0], out_lens[0] = prompts[0][:8], 44  # keeps the engine busy past the last arrival
    return prompts, out_lens, arrive


CASES = {
    # tight pool: preemption by recompute; small budget: chunked prefill; shared prefixes: cache hits
    "continuous-preempt-chunked": dict(num_kv_blocks=14, block_size=4, max_num_batched_tokens=24, max_num_seqs=6,
                                       max_model_len=56),
    "static": dict(num_kv_blocks=40, block_size=4, max_num_seqs=4, scheduling_policy="static", max_model_len=56),
    "no-chunked-prefill": dict(num_kv_blocks=18, block_size=4, max_num_batched_tokens=56, enable_chunked_prefill=False,
                               max_model_len=56),
    "no-prefix-caching": dict(num_kv_blocks=16, block_size=4, max_num_batched_tokens=32, enable_prefix_caching=False,
                              max_model_len=56),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_decisions_equal_the_engines(llama_dir: Path, case: str) -> None:
    config = _config(llama_dir, **CASES[case])
    prompts, out_lens, arrive = _workload(14, seed=len(case), shared_prefix=True)
    engine = _engine_trace(config, prompts, out_lens, arrive)
    sim = _sim_trace(config, prompts, out_lens, arrive)
    assert len(sim) == len(engine), f"{len(sim)} simulated steps, {len(engine)} engine steps"
    for k, (e, s) in enumerate(zip(engine, sim, strict=True)):
        assert s.scheduled == e.scheduled, f"step {k}: scheduled differently"
        assert s.preempted == e.preempted, f"step {k}: preempted differently"
        assert s.finished == sorted(e.finished), f"step {k}: finished differently"
    if case == "continuous-preempt-chunked":
        assert any(t.preempted for t in engine), "the case is meant to preempt"
        assert any(start > 0 and start < len(prompts[int(r)]) for t in engine for r, start, _ in t.scheduled), "chunked"


# ---- bad input -----------------------------------------------------------------------------------------------


def test_step_model_for_another_model_or_dtype_is_refused(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    config = _config(model_dirs["llama-gqa"], num_kv_blocks=64)
    profile = _profile(config, 5.0, decode_rows=1.0)
    path = profile.save(tmp_path / "sm.json")
    loaded = StepProfile.load(path)
    loaded.check_compatible(config)  # the same model and dtypes: fine
    other = _config(model_dirs["qwen3"], num_kv_blocks=64)
    with pytest.raises(ValueError, match="head_dim=16.*head_dim=32|architecture"):
        loaded.check_compatible(other)
    bf16 = _config(model_dirs["llama-gqa"], num_kv_blocks=64, dtype="bfloat16")
    with pytest.raises(ValueError, match="dtype='float32'.*dtype='bfloat16'"):
        Simulator(loaded, SimConfig(bf16))
    kv8 = _config(model_dirs["llama-gqa"], num_kv_blocks=64, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        loaded.check_compatible(kv8)
    (tmp_path / "bad.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not a step model file"):
        StepProfile.load(tmp_path / "bad.json")


def test_bad_disaggregation_is_refused(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="must look like 2P1D"):
        check_disaggregation("two")
    config = _config(llama_dir, num_kv_blocks=64)
    with pytest.raises(ValueError, match="--data-parallel-size must stay 1"):
        SimConfig(config, data_parallel_size=2, disaggregation="1P1D")
    with pytest.raises(ValueError, match="KV transfer's cost"):
        SimConfig(config, disaggregation="1P1D", kv_transfer_block_s=-1.0)
    assert check_disaggregation("2p3d") == (2, 3)


def test_a_request_that_cannot_fit_fails_like_a_400(llama_dir: Path) -> None:
    config = _config(llama_dir, num_kv_blocks=4, block_size=4, max_model_len=16)
    profile = _profile(config, 1.0, decode_rows=1.0)
    result = Simulator(profile, SimConfig(config)).run(Workload([[1] * 20, [2] * 4], [2, 2], [0.0, 0.1]))
    bad, good = result.records
    assert not bad.success and "HTTP 400" in (bad.error or "") and "max_model_len" in bad.error
    assert good.success and good.num_output_tokens == 2


def test_token_ids_outside_the_vocabulary_fail_like_a_400(llama_dir: Path) -> None:
    import numpy as np

    config = _config(llama_dir)
    vocab = config.model.vocab_size
    profile = _profile(config, 1.0, decode_rows=1.0)
    prompts = [[1, vocab], np.array([2, -1], dtype=np.int32), np.array([3, vocab - 1], dtype=np.int32)]
    result = Simulator(profile, SimConfig(config)).run(Workload(prompts, [2, 2, 2], [0.0, 0.1, 0.2]))
    past, negative, good = result.records
    assert not past.success and f"out of range [0, {vocab}): [{vocab}]" in (past.error or "")
    assert not negative.success and "out of range" in (negative.error or "") and "[-1]" in negative.error
    assert good.success and good.num_output_tokens == 2


# ---- the fit ---------------------------------------------------------------------------------------------------


def test_fit_recovers_known_coefficients() -> None:
    import random

    rng = random.Random(0)
    truth = LinearStepModel(0.002, {"prefill_tokens": 3e-5, "decode_rows": 4e-4, "decode_context_tokens": 1e-6})
    samples = []
    for _ in range(200):
        f = StepFeatures(rng.choice([0, 16, 128, 512]), 1, rng.randrange(0, 64), rng.randrange(0, 20000), 0.0)
        if f.prefill_tokens == 0 and f.decode_rows == 0:
            continue
        t = truth.step_time_s(f) * (1 + rng.uniform(-0.02, 0.02))
        if rng.random() < 0.05:
            t *= 8  # a stall on a busy machine: the absolute-error fit ignores it
        samples.append((f, t))
    model, q = fit_linear(samples, ("prefill_tokens", "decode_rows", "decode_context_tokens"))
    assert model.intercept_s == pytest.approx(0.002, rel=0.05)
    for k, v in truth.coefficients_s.items():
        assert model.coefficients_s[k] == pytest.approx(v, rel=0.05)
    assert q.median_ape_heldout_pct < 3


def test_off_stack_term_is_a_jump_for_pure_decodes_past_the_stack() -> None:
    model = LinearStepModel(0.001, {"decode_rows": 1e-4, "prefill_segments": 2e-3, "decode_off_stack": 3e-3}, 8)
    fn = model.fast()
    assert fn(0, 0, 8, 0, 0.0) == pytest.approx(0.001 + 8e-4)
    assert fn(0, 0, 9, 0, 0.0) == pytest.approx(0.001 + 9e-4 + 3e-3)  # the module path's fixed cost
    assert fn(16, 1, 9, 0, 0.0) == pytest.approx(0.001 + 9e-4 + 2e-3)  # a step with a prefill: never the stack
    assert model.step_time_s(StepFeatures(0, 0, 20, 0, 0.0)) == pytest.approx(0.001 + 2e-3 + 3e-3)
    assert "decode_off_stack" in model.formula() and "> 8 rows" in model.formula()
    with pytest.raises(ValueError, match="stack_rows"):
        LinearStepModel(0.001, {}, -1)
    with pytest.raises(ValueError, match="unknown terms"):
        LinearStepModel(0.001, {"decode_offstack": 1.0})


def test_fit_finds_the_jump_past_the_stack_and_keeps_it_in_the_file(llama_dir: Path, tmp_path: Path) -> None:
    import random

    from lmserve.sim.linear_fit import choose_form

    rng = random.Random(2)
    truth = LinearStepModel(0.0015, {"prefill_tokens": 5e-5, "prefill_segments": 1e-3, "decode_rows": 1.5e-4,
                                     "decode_context_tokens": 5e-7, "decode_off_stack": 2e-3}, 8)  # fmt: skip
    samples = []
    for _ in range(300):
        p = rng.choice([0, 0, 0, 32, 256])
        rows = rng.randrange(1, 33)
        f = StepFeatures(p, int(p > 0), rows, rows * rng.randrange(16, 400), 0.0)
        samples.append((f, truth.step_time_s(f) * rng.uniform(0.98, 1.02)))
    model, q, comparison = choose_form(samples, stack_rows=8)
    assert model.stack_rows == 8 and q.median_ape_heldout_pct < 3
    for k, v in truth.coefficients_s.items():
        assert model.coefficients_s[k] == pytest.approx(v, rel=0.1), k
    without, _, _ = choose_form(samples)  # no stack known: no such term, and a worse fit
    assert "decode_off_stack" not in without.coefficients_s
    assert fit_linear(samples, ("decode_rows",))[1].median_ape_heldout_pct > q.median_ape_heldout_pct
    on_one_side = [(f, t) for f, t in samples if f.decode_rows <= 8]  # nothing past the stack: the term is left out
    assert "decode_off_stack" not in choose_form(on_one_side, stack_rows=8)[0].coefficients_s
    config = _config(llama_dir)
    path = profile_for(config, model).save(tmp_path / "m.json")
    loaded = StepProfile.load(path)
    assert loaded.linear == model
    assert loaded.step_time_s(StepFeatures(0, 0, 9, 900, 0.0)) == pytest.approx(
        model.step_time_s(StepFeatures(0, 0, 9, 900, 0.0))
    )
    assert loaded.scaled(2.0).linear.stack_rows == 8


# ---- workloads -------------------------------------------------------------------------------------------------


def test_fast_prompts_have_benchs_lengths_and_prefix_sharing(llama_dir: Path) -> None:
    tok = load_tokenizer(str(llama_dir))
    cfg = DatasetConfig(name="random", num_requests=30, input_len=40, output_len=8, range_ratio=0.5, seed=3)
    exact = build_requests(cfg, tok)
    fast = fast_prompts(cfg, tok)
    assert fast is not None
    assert [len(p) for p in fast[0]] == [r.prompt_len for r in exact]
    assert fast[1] == [r.output_len for r in exact]
    pcfg = DatasetConfig(name="prefix", num_requests=12, input_len=10, output_len=4, prefix_len=32, num_prefix_groups=3)
    exact = build_requests(pcfg, tok)
    ids, _ = fast_prompts(pcfg, tok)
    assert [len(p) for p in ids] == [r.prompt_len for r in exact]
    assert list(ids[0][:32]) == list(ids[3][:32]) and list(ids[0][:32]) != list(ids[1][:32])


def test_trace_replays_a_bench_serve_json(llama_dir: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(str(llama_dir))
    args = {"dataset": "random", "num_requests": 5, "input_len": 20, "output_len": 6, "range_ratio": 0.0, "seed": 0,
            "warmup_requests": 0}  # fmt: skip
    reqs = build_requests(DatasetConfig(num_requests=5, input_len=20, output_len=6), tok)
    records = [{"index": i, "prompt_len": r.prompt_len, "requested_output_len": 6, "scheduled_s": 10.0 + 0.5 * i,
                "success": True, "num_output_tokens": 6 - (i == 2)} for i, r in enumerate(reqs)]  # fmt: skip
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"args": args, "summary": {}, "requests": records}))
    w = trace_workload(path, tok)
    assert w.arrivals_s == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0])
    assert w.output_lens == [6, 6, 5, 6, 6]
    assert [list(p) for p in w.prompt_token_ids] == [r.prompt_token_ids for r in reqs]  # the same token ids
    assert "rebuilt" in w.description["prompts"]
    args["seed"] = 7  # another seed: lengths still match, but the ids would not; lengths are all that's checked
    records[0]["prompt_len"] = 99
    path.write_text(json.dumps({"args": args, "requests": records}))
    w = trace_workload(path, tok)
    assert "synthetic" in w.description["prompts"] and len(w.prompt_token_ids[0]) == 99


def test_poisson_workload_and_dp_replicas(llama_dir: Path) -> None:
    tok = load_tokenizer(str(llama_dir))
    config = _config(llama_dir, num_kv_blocks=256)
    profile = _profile(config, 5.0, prefill_tokens=0.05, decode_rows=0.5)
    w = build_workload(DatasetConfig(num_requests=60, input_len=32, output_len=8), tok, 40.0, 1.0, 0)
    one = Simulator(profile, SimConfig(config)).run(w)
    four = Simulator(profile, SimConfig(config, data_parallel_size=4)).run(w)
    assert all(r.success for r in one.records + four.records)
    assert all(n > 0 for n in four.stats_dict()["requests_per_replica"])
    s1, s4 = summarize(one.records, one.duration_s), summarize(four.records, four.duration_s)
    assert s4.ttft_ms.mean < s1.ttft_ms.mean  # four replicas queue less
    capped = Simulator(profile, SimConfig(config, max_concurrency=2)).run(w)
    assert max(_in_flight(capped.records)) <= 2
    assert any(r.send_s > r.scheduled_s for r in capped.records)  # waited in the client


def _in_flight(records) -> list[int]:
    events = sorted([(r.send_s, 1) for r in records] + [(r.end_s, -1) for r in records], key=lambda e: (e[0], e[1]))
    level, out = 0, []
    for _, d in events:
        level += d
        out.append(level)
    return out


def test_one_pass_features_and_tokens_equal_step_features_and_sim_token() -> None:
    """The simulator's fused pass against core's step_features and sim_token, on a real scheduler's steps with
    chunked prefills, prefix hits (a shared first block), decodes and a step that mixes them."""
    from lmserve.config.engine import SchedulerConfig
    from lmserve.core.kv_cache_manager import KVCacheManager
    from lmserve.core.outputs import step_features
    from lmserve.core.scheduler import Scheduler
    from lmserve.request import Request
    from lmserve.sim.simulator import step_features_and_tokens

    sch = Scheduler(SchedulerConfig(8, 24, 256, True, "continuous"), KVCacheManager(64, 4))
    vocab = 97
    prompts = {str(i): [1, 2, 3, 4] + [10 * i + k for k in range(3 + 5 * i)] for i in range(4)}
    prompt_hash = {rid: hash(tuple(p)) for rid, p in prompts.items()}
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    seen = set()
    for step in range(40):
        if step % 3 == 0 and len(seen) < len(prompts):
            rid = str(len(seen))
            seen.add(rid)
            sch.add_request(Request(rid, prompts[rid], params, 3))
        sched = sch.schedule()
        if not sched.scheduled:
            continue
        sampling: list = []
        expected = step_features(sched, sampling)
        tokens = {r.request_id: sim_token(prompt_hash[r.request_id], r.num_tokens, vocab) for r in sampling}
        *features, sampled = step_features_and_tokens(sched, prompt_hash, vocab)
        assert tuple(features) == expected and sampled == tokens, f"step {step}"
        sch.update_from_output(sched, ModelRunnerOutput(sampled), 256)
    assert not sch.has_unfinished_requests() and len(seen) == 4


def test_lazy_block_pool_hands_out_blocks_as_the_real_one() -> None:
    import random

    from lmserve.core.block_pool import BlockPool, block_key
    from lmserve.sim.lazy_pool import LazyBlockPool

    rng = random.Random(0)
    real, lazy = BlockPool(40), LazyBlockPool(40)
    held: list[tuple[list, list]] = []  # (real blocks, lazy blocks) of one holder
    keys = [block_key(None, (i,)) for i in range(12)]
    for step in range(3000):
        op = rng.random()
        if op < 0.35 and real.num_free_blocks:
            n = rng.randrange(1, min(5, real.num_free_blocks) + 1)
            a, b = real.get_new_blocks(n), lazy.get_new_blocks(n)
            assert [x.block_id for x in a] == [x.block_id for x in b], f"op {step}: other blocks handed out"
            held.append((a, b))
        elif op < 0.6 and held:
            a, b = held.pop(rng.randrange(len(held)))
            order = list(range(len(a)))
            rng.shuffle(order)
            real.free_blocks([a[i] for i in order])
            lazy.free_blocks([b[i] for i in order])
        elif op < 0.8 and held:
            a, b = held[rng.randrange(len(held))]
            i, key = rng.randrange(len(a)), rng.choice(keys)
            real.cache_block(a[i], key)
            lazy.cache_block(b[i], key)
        else:
            key = rng.choice(keys)
            a, b = real.lookup(key), lazy.lookup(key)
            assert (a is None) == (b is None) and (a is None or a.block_id == b.block_id), f"op {step}: lookups differ"
            if a is not None:
                real.touch([a])
                lazy.touch([b])
                held.append(([a], [b]))
        assert real.num_free_blocks == lazy.num_free_blocks and real.usage == lazy.usage, f"op {step}: free counts"
        real.check_invariants()
        lazy.check_invariants()
    assert [b.ref_cnt for b in real.blocks] == [b.ref_cnt for b in lazy.blocks]


def test_tensor_parallel_is_a_step_time_factor(llama_dir: Path) -> None:
    from lmserve.memory.presets import get_preset
    from lmserve.sim.step_model import roofline_profile

    config = _config(llama_dir, num_kv_blocks=64)
    profile = _profile(config, 2.0, decode_rows=1.0)
    f = StepFeatures(0, 0, 8, 1000, 0.0)
    t1, t2 = profile.step_time_s(f), profile.step_time_s(f, tp=2)
    assert t2 == pytest.approx(0.002 + (t1 - 0.002) / (2 * profile.tp_efficiency))
    assert profile.tp_is_estimate(2) and not profile.tp_is_estimate(1)
    # a profile timed on a TP = 2 group (calibrate --tensor-parallel-size 2): exact there, scaled elsewhere
    timed2 = profile_for(config, LinearStepModel(0.002, {"decode_rows": 1e-3}), tensor_parallel_size=2)
    assert timed2.step_time_s(f, tp=2) == pytest.approx(0.002 + 8e-3) and not timed2.tp_is_estimate(2)
    assert timed2.step_time_s(f, tp=1) == pytest.approx(0.002 + 8e-3 * 2 * timed2.tp_efficiency)
    assert timed2.step_time_s(f, tp=4) == pytest.approx(0.002 + 8e-3 / 2 / timed2.tp_efficiency)
    assert timed2.tp_is_estimate(1) and timed2.tp_is_estimate(4)
    loaded = StepProfile.from_dict(json.loads(json.dumps(timed2.to_dict())))
    assert loaded.tensor_parallel_size == 2 and loaded.step_time_s(f, tp=2) == timed2.step_time_s(f, tp=2)
    roof = roofline_profile("h200", dict(get_preset("llama-3-8b").config), "llama-3-8b")
    assert roof.estimate and "ESTIMATE" in roof.label
    decode = StepFeatures(0, 0, 32, 32 * 1024, 0.0)
    r1, r2, r8 = (roof.step_time_s(decode, tp=tp) for tp in (1, 2, 8))
    assert r8 < r2 < r1 and r2 > r1 / 2  # the all-reduces and the fixed overhead do not split
    prefill = StepFeatures(2048, 1, 0, 0, 2048 * 2049 / 2)
    assert roof.step_time_s(prefill) > 10 * roof.step_time_s(StepFeatures(0, 0, 1, 100, 0.0))  # compute-bound
    with pytest.raises(ValueError, match="--hardware"):
        roofline_profile("tpu", dict(get_preset("llama-3-8b").config), "x")


def test_step_noise_is_seeded(llama_dir: Path, tmp_path: Path) -> None:
    config = _config(llama_dir, num_kv_blocks=64)
    profile = _profile(config, 5.0, decode_rows=1.0)
    profile.noise_quantiles = [0.5 + i / 100 for i in range(201)]  # ratios 0.5 .. 2.5
    w = Workload([list(range(1, 30)), list(range(40, 70))], [8, 8], [0.0, 0.01])
    runs = [Simulator(profile, SimConfig(config, step_noise=True, seed=s)).run(w) for s in (1, 1, 2)]
    times = [[r.chunk_times_s for r in run.records] for run in runs]
    assert times[0] == times[1] and times[0] != times[2]
    loaded = StepProfile.load(profile.save(tmp_path / "noisy.json"))
    assert loaded.noise_quantiles == profile.noise_quantiles
    with pytest.raises(ValueError, match="no measured noise"):
        Simulator(_profile(config, 5.0), SimConfig(config, step_noise=True))


def test_step_noise_draws_have_mean_one(llama_dir: Path) -> None:
    """The noise spreads steps around the model, not above it: ratios 0.5 .. 2.5 (mean 1.5) are drawn scaled to mean
    1 (20,000 draws: standard error ~0.003; judged at 0.01), their shape kept (ranks: the same quantile)."""
    config = _config(llama_dir, num_kv_blocks=64)
    profile = _profile(config, 5.0, decode_rows=1.0)
    profile.noise_quantiles = [0.5 + i / 100 for i in range(201)]
    draw = profile.noise_sampler(7)
    assert draw is not None
    xs = [draw() for _ in range(20_000)]
    assert abs(sum(xs) / len(xs) - 1.0) < 0.01
    assert min(xs) >= 0.5 / 1.5 - 1e-12 and max(xs) <= 2.5 / 1.5 + 1e-12
    doc = profile.to_dict()
    for bad in ([-1.0, 2.0], [0.0, 0.0], [1.0, float("nan")]):  # a hand-edited step model
        doc["noise"]["ratio_quantiles"] = bad
        with pytest.raises(ValueError, match="noise.ratio_quantiles"):
            StepProfile.from_dict(doc)


# ---- prefill/decode disaggregation ---------------------------------------------------------------------------


def test_disaggregated_request_hand_checked(llama_dir: Path) -> None:
    """1P1D, t = 10 ms + 0.1 ms/prefill token + 1 ms/decode row, ingress 1 ms, egress 2 ms, a pull 0.5 ms + 0.25
    ms per block (16-token blocks). A 100-token prompt, 3 tokens, sent at 0:

        prefill replica  [1, 21]      prefill 100 tokens: 10 + 10       → token 1 at 23 (TTFT), handoff at 23
        decode replica   24           the handoff lands (ingress): 7 blocks (ceil(100 / 16)) to pull
                         [24, 26.25]  the pull: 0.5 + 7 x 0.25; the lease is freed
                         [26.25, 37.25] decode (the first token's KV): 10 + 1  → token 2 at 39.25
                         [37.25, 48.25] decode                        → token 3 at 50.25 (done)
    """
    config = _config(llama_dir, num_kv_blocks=64, block_size=16)
    profile = _profile(config, 10.0, prefill_tokens=0.1, decode_rows=1.0)
    profile.overheads = Overheads(ingress_s=0.001, egress_s=0.002, core_step_overhead_s=0.0)
    sim = SimConfig(config, disaggregation="1P1D", kv_transfer_latency_s=0.0005, kv_transfer_block_s=0.00025,
                    record_steps=True)  # fmt: skip
    result = Simulator(profile, sim).run(Workload([list(range(1, 101))], [3], [0.0]))
    (a,) = result.records
    assert a.success and a.num_output_tokens == 3
    assert a.chunk_times_s == pytest.approx([0.023, 0.03925, 0.05025])
    assert [s.replica for s in result.steps] == [0, 1, 1]
    assert [x for s in result.steps for x in (s.start_s, s.end_s)] == pytest.approx(
        [0.001, 0.021, 0.02625, 0.03725, 0.03725, 0.04825]
    )
    stats = result.stats_dict()
    assert stats["roles"] == ["prefill", "decode"] and stats["kv_blocks_pulled"] == 7
    assert stats["requests_per_replica"] == [1, 1]


def test_disaggregated_decode_replica_never_runs_a_prompt_and_hits_its_own_cache(llama_dir: Path) -> None:
    """Requests sharing a 48-token prefix through 1P1D: the decode replica's steps are decode rows only; a later
    request finds the shared blocks in the decode replica's own prefix cache and pulls only the rest."""
    config = _config(llama_dir, num_kv_blocks=256, block_size=16)
    profile = _profile(config, 10.0, prefill_tokens=0.1, decode_rows=1.0)
    shared = list(range(1, 49))
    prompts = [shared + list(range(100 + 40 * i, 140 + 40 * i)) for i in range(4)]  # 88 tokens: 6 blocks each
    arrivals = [0.0, 0.5, 1.0, 1.5]  # one after the other: each finished before the next
    sim = SimConfig(config, disaggregation="1P1D", record_steps=True)
    result = Simulator(profile, sim).run(Workload(prompts, [4] * 4, arrivals))
    assert all(r.success and r.num_output_tokens == 4 for r in result.records)
    decode_steps = [s for s in result.steps if s.replica == 1]
    assert decode_steps and all(n == 1 for s in decode_steps for _, _, n in s.scheduled)
    prefill_steps = [s for s in result.steps if s.replica == 0]
    assert all(n > 1 for s in prefill_steps for _, _, n in s.scheduled)  # no decode row on the prefill side
    stats = result.stats_dict()
    assert stats["kv_blocks_hit_on_decode"] == 3 * 3  # requests 2-4 find the 3 shared blocks
    assert stats["kv_blocks_pulled"] == 6 + 3 * 3


def test_a_prefill_replica_that_idled_for_leased_blocks_steps_again_when_they_free(llama_dir: Path) -> None:
    """1P1D on a pool of 8 blocks and two 6-block prompts at once: the prefill replica prefills the first, whose
    lease holds its blocks, and idles (no room for the second); when the decode replica's pull ends the lease, the
    freed blocks must restart it (it had stopped: the run used to end with the second request in flight)."""
    config = _config(llama_dir, num_kv_blocks=8, block_size=16, max_model_len=128)
    profile = _profile(config, 10.0, prefill_tokens=0.1, decode_rows=1.0)
    prompts = [list(range(100 + 88 * i, 188 + 88 * i)) for i in range(2)]  # 88 tokens: 6 blocks each
    sim = SimConfig(config, disaggregation="1P1D", record_steps=True)
    result = Simulator(profile, sim).run(Workload(prompts, [4, 4], [0.0, 0.0]))
    assert all(r.success and r.num_output_tokens == 4 for r in result.records)
    prefill_steps = [s for s in result.steps if s.replica == 0]
    assert [s.admitted for s in prefill_steps] == [["0"], ["1"]]  # one prompt a step: no room for both at once
    assert prefill_steps[1].start_s > result.records[0].chunk_times_s[0]  # after the first's handoff


def test_disaggregated_tokens_and_records_match_colocated(llama_dir: Path) -> None:
    """2P2D and colocated DP=1 on the same Poisson workload: every request succeeds with its tokens; the prefill
    replicas share the prompts, the decode replicas the handoffs, and no lease or pull is left (the simulator
    asserts it at the end)."""
    config = _config(llama_dir, num_kv_blocks=512, block_size=16)
    profile = _profile(config, 2.0, prefill_tokens=0.05, decode_rows=0.5)
    tok = load_tokenizer(config.tokenizer)
    w = build_workload(DatasetConfig(num_requests=60, input_len=64, output_len=8, seed=3), tok, 40.0, prompts="fast")
    colocated = Simulator(profile, SimConfig(config)).run(w)
    pd = Simulator(profile, SimConfig(config, disaggregation="2P2D")).run(w)
    assert [r.num_output_tokens for r in pd.records] == [r.num_output_tokens for r in colocated.records]
    assert all(r.success for r in pd.records)
    per = pd.stats_dict()["requests_per_replica"]
    assert sum(per[:2]) == sum(per[2:]) == 60 and min(per) > 0


def test_the_kv_transfer_cost_comes_from_the_flags_then_the_step_model_then_the_defaults(llama_dir: Path) -> None:
    from lmserve.sim.kv_transfer_timing import measure_kv_transfer
    from lmserve.sim.sim_config import DEFAULT_KV_TRANSFER_BLOCK_S, DEFAULT_KV_TRANSFER_LATENCY_S, kv_transfer_cost

    config = _config(llama_dir, num_kv_blocks=64, block_size=16)
    profile = _profile(config, 10.0, prefill_tokens=0.1, decode_rows=1.0)
    pd = SimConfig(config, disaggregation="1P1D")
    assert kv_transfer_cost(pd, profile.overheads) == (DEFAULT_KV_TRANSFER_LATENCY_S, DEFAULT_KV_TRANSFER_BLOCK_S)
    latency, block = measure_kv_transfer(config, repeats=2)  # the real transport on this machine's KV geometry
    assert latency >= 0 and block >= 0 and latency + 32 * block > 0
    profile.overheads = Overheads(kv_transfer_latency_s=latency, kv_transfer_block_s=block)
    assert kv_transfer_cost(pd, profile.overheads) == (latency, block)
    flagged = SimConfig(config, disaggregation="1P1D", kv_transfer_block_s=1e-3)
    assert kv_transfer_cost(flagged, profile.overheads) == (latency, 1e-3)
    with pytest.raises(ValueError, match="kv_transfer_block_s"):
        Overheads(kv_transfer_block_s=-1.0)
