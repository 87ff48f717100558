"""worker/expert_load.py: tokens per expert by layer group, from an engine serving a tiny Qwen3-MoE, through
/metrics' families (observability/prometheus.py) and the diagnosis (observability/diagnose.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lmserve import LLM, SamplingParams
from lmserve.engine.snapshot import aggregate_snapshots
from lmserve.observability.diagnose import diagnose
from lmserve.observability.prometheus import Metrics, imbalance
from lmserve.observability.window import Window
from tests.hf.test_moe_models import build_moe_model
from tests.observability.test_prometheus import _snapshot


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    # 3 layers, layer 1 dense: MoE blocks on layers 0 and 2, 8 experts, top-3
    return build_moe_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe", tokenizer_dir)


def test_engine_counts_every_routed_token_by_layer_and_expert(moe_dir: Path) -> None:
    llm = LLM(str(moe_dir), num_kv_blocks=64, max_num_batched_tokens=8, enable_prefix_caching=False)
    try:
        assert llm.engine.get_metrics()["moe_expert_tokens_total"] == {f"{g}:{e}": 0 for g in ("0-0", "2-2")
                                                                      for e in range(8)}  # fmt: skip
        llm.generate(["The capital of France is", "def fib(n):"], SamplingParams(max_tokens=5, ignore_eos=True),
                     use_tqdm=False)  # fmt: skip
        m = llm.engine.get_metrics()
    finally:
        llm.close()
    load = m["moe_expert_tokens_total"]
    computed = m["prefill_tokens_total"] + m["decode_tokens_total"]
    for group in ("0-0", "2-2"):  # each computed token goes to top-k = 3 distinct experts in each MoE layer
        assert sum(n for k, n in load.items() if k.startswith(group + ":")) == 3 * computed
    assert all(n <= computed for n in load.values())  # an expert sees a token at most once per layer


def test_layer_groups_and_imbalance() -> None:
    from lmserve.worker.expert_load import expert_load

    class Block:
        def __init__(self, tokens: list[int]) -> None:
            self.tokens_total = tokens

    layers = [(i, Block([i, 1, 0])) for i in (0, 1, 3, 4, 5, 7)]  # six MoE layers (2 and 6 dense) in 4 groups of 2
    load = expert_load(layers)  # type: ignore[arg-type]
    assert load == {"0-1:0": 1, "0-1:1": 2, "0-1:2": 0, "3-4:0": 7, "3-4:1": 2, "3-4:2": 0,
                    "5-7:0": 12, "5-7:1": 2, "5-7:2": 0}  # fmt: skip
    assert imbalance(load) == {"0-1": pytest.approx(2.0), "3-4": pytest.approx(7 / 3), "5-7": pytest.approx(36 / 14)}
    assert imbalance({"0-0:0": 0, "0-0:1": 0}) == {"0-0": 0.0}


def test_metrics_and_diagnosis_show_the_imbalance() -> None:
    load = {"0-1:0": 30, "0-1:1": 10, "0-1:2": 20, "2-3:0": 5, "2-3:1": 55, "2-3:2": 0}
    snap = aggregate_snapshots([_snapshot(moe_expert_tokens_total=load)] * 2)  # two DP cores: the counts add up
    body, _ = Metrics("m", lambda: snap).render()
    samples = {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for f in text_string_to_metric_families(body.decode())
        for s in f.samples
    }
    assert samples[("lmserve:moe_expert_tokens_total", (("expert", "1"), ("layer_group", "2-3")))] == 110
    assert samples[("lmserve:moe_expert_load_imbalance", (("layer_group", "0-1"),))] == pytest.approx(1.5)
    assert samples[("lmserve:moe_expert_load_imbalance_max", ())] == pytest.approx(55 * 3 / 60)
    rules = {f.rule for f in diagnose(Window(duration_s=1.0, gauges={"moe_imbalance": 2.75})).findings}
    assert "moe_expert_imbalance" in rules
    assert not diagnose(Window(duration_s=1.0, gauges={"moe_imbalance": 1.2})).findings
