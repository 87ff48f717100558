"""Linear's few-row path chosen per CPU (layers.choose_small_m_paths): the C kernel, oneDNN / torch.mm or
torch._int_mm, measured per weight shape or forced by LMSERVE_SMALL_M_LINEAR; every choice computes the same
product to float32 rounding."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lmserve import LLM, kernels
from lmserve.model.layers import SMALL_M_ENV, Linear, choose_small_m_paths, small_m_mode
from tests.hf.test_model_vs_hf import PROMPTS, assert_greedy_matches_hf

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: kernels not built")


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.ModuleList([Linear(40, 96, bias=True), Linear(40, 96, bias=True), Linear(96, 64, bias=False)])
    for m in model:
        if kind == "bf16-stored":
            m.round_weights_to_bf16()
        if kind in ("float32", "bf16-stored"):
            m.pack_for_onednn()
        if kind == "int8":
            m.quantize("int8", None)
    return model


@pytest.mark.parametrize("kind", ["float32", "bf16-stored", "int8"])
@pytest.mark.parametrize("rows", [1, 2])
def test_every_small_m_path_gives_the_same_product(kind: str, rows: int) -> None:
    model = _model(kind)
    x = torch.randn(rows, 40)
    outs = {}
    for mode in ("kernel", "torch", "auto"):
        chosen = choose_small_m_paths(model, mode)
        assert set(chosen) == {(96, 40, kind), (64, 96, kind)}
        expected_paths = {"kernel": {"kernel", "int8_kernel"}, "torch": {"onednn", None, "int8_gemm"}}
        if mode in expected_paths:
            assert model[0].fast_path(x) in expected_paths[mode], (mode, model[0].fast_path(x))
        outs[mode] = model[0](x)
    ref = F.linear(x, model[0].dequantized_weight() if kind == "int8" else model[0].weight, model[0].bias)
    for mode, out in outs.items():
        # int8: both paths quantize the activations the same way and accumulate exactly in int32
        tol = dict(atol=5e-2, rtol=5e-2) if kind == "int8" else dict(atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, ref, **tol)
        torch.testing.assert_close(out, outs["kernel"], atol=1e-5, rtol=1e-5, msg=mode)


def test_auto_measures_each_shape_once_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    model = _model("float32")
    with caplog.at_level(logging.INFO, logger="lmserve.model.layers"):
        chosen = choose_small_m_paths(model, "auto", reps=2)
    assert set(chosen.values()) <= {"kernel", "onednn", "torch"}
    assert model[0]._small_m_path == model[1]._small_m_path, "one choice per weight shape"
    lines = [r.getMessage() for r in caplog.records if "few-row linear" in r.getMessage()]
    assert len(lines) == 2 and all("M=1 pass: kernel" in line for line in lines)


def test_env_var_forces_a_side_and_refuses_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model("float32")
    monkeypatch.setenv(SMALL_M_ENV, "torch")
    assert small_m_mode() == "torch"
    choose_small_m_paths(model)
    assert model[0].fast_path(torch.randn(1, 40)) == "onednn"
    assert model[0].fast_path(torch.randn(3, 40)) == "onednn", "more rows are unaffected"
    monkeypatch.setenv(SMALL_M_ENV, "Kernel ")
    choose_small_m_paths(model)
    assert model[0].fast_path(torch.randn(1, 40)) == "kernel"
    monkeypatch.setenv(SMALL_M_ENV, "fast")
    with pytest.raises(ValueError, match=f"{SMALL_M_ENV} must be one of"):
        small_m_mode()


@pytest.mark.parametrize("mode", ["torch", "auto"])
def test_engine_with_chosen_paths_matches_hf(llama_dir: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SMALL_M_ENV, mode)
    llm = LLM(str(llama_dir), num_kv_blocks=64)
    assert_greedy_matches_hf(llm, llama_dir, PROMPTS[:1], max_tokens=8)
    paths = {m._small_m_path for m in llm.engine.runner.model.modules() if isinstance(m, Linear)}
    assert mode == "auto" or paths <= {"onednn", "torch"}, paths
