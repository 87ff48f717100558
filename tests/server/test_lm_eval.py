"""lm-evaluation-harness against `lmserve serve`: its `local-completions` model (echo + logprobs 1 + max_tokens 1
over /v1/completions, token-id prompts in batches) and its own `hf` model on the same tiny checkpoint agree on
every choice's loglikelihood (1e-3), its is-greedy flag and the accuracies of a small local multiple-choice task
(tests/data/lm_eval_tiny_mc: a jsonl read by `datasets`' json loader, the tokenizer from the model's directory,
the hub and datasets offline: nothing is downloaded). Optional extra `eval`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import require_extra

require_extra("eval", "lm_eval")

from tests.server.test_server import MODEL_NAME, LiveServer  # noqa: E402

pytestmark = pytest.mark.slow  # lm-eval against the server: in `-m slow` (CI runs it), out of the default run

TASK_DIR = Path(__file__).resolve().parents[1] / "data" / "lm_eval_tiny_mc"
TASK = "lmserve_tiny_mc"


@pytest.fixture(scope="module")
def served(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    srv = LiveServer(llama_dir, tmp_path_factory.mktemp("lm-eval") / "server.log")
    try:
        srv.wait_healthy(180)
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Before lm_eval (and datasets) are imported: no hub, no dataset downloads, caches in tmp_path."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def task_config() -> dict[str, Any]:
    """The task's yaml with its jsonl's absolute path (the file names it relative to its folder)."""
    import yaml

    config = yaml.safe_load((TASK_DIR / "tiny_mc.yaml").read_text())
    files = config["dataset_kwargs"]["data_files"]
    files["test"] = str(TASK_DIR / files["test"])
    return config


def evaluate(model: str, model_args: dict[str, Any], batch_size: int) -> dict[str, Any]:
    import lm_eval

    out = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=[task_config()], batch_size=batch_size, log_samples=True,
        bootstrap_iters=0, random_seed=0,
    )  # fmt: skip
    assert out is not None
    return out


@pytest.mark.usefixtures("offline")
def test_local_completions_against_lmserve_equals_hf(served: LiveServer, llama_dir: Path) -> None:
    hf = evaluate("hf", {"pretrained": str(llama_dir), "dtype": "float32", "device": "cpu"}, batch_size=1)
    api_args = {
        "model": MODEL_NAME, "base_url": served.url + "/v1/completions", "tokenizer_backend": "huggingface",
        "tokenizer": str(llama_dir), "num_concurrent": 2, "max_retries": 1, "tokenized_requests": True,
    }  # fmt: skip
    api = evaluate("local-completions", api_args, batch_size=4)  # 4 prompts (token-id lists) per request

    by_doc = {s["doc_id"]: s for s in hf["samples"][TASK]}
    assert len(by_doc) == sum(1 for _ in (TASK_DIR / "tiny_mc.jsonl").open()) == len(api["samples"][TASK])
    for sample in api["samples"][TASK]:
        ref = by_doc[sample["doc_id"]]
        got, expected = [r[0] for r in sample["resps"]], [r[0] for r in ref["resps"]]  # per choice: (ll, greedy)
        assert len(got) == len(expected) == len(sample["doc"]["choices"])
        for (ll, greedy), (ref_ll, ref_greedy) in zip(got, expected, strict=True):
            assert ll == pytest.approx(ref_ll, abs=1e-3), f"doc {sample['doc_id']}: {got} vs {expected}"
            assert greedy == ref_greedy, f"doc {sample['doc_id']}"
    for metric in ("acc,none", "acc_norm,none"):
        assert api["results"][TASK][metric] == hf["results"][TASK][metric], metric
