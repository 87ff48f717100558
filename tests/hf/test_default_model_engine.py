"""The bundled default model through lmserve: found with no arguments, equal to HF greedy, clean text."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lmserve import LLM, SamplingParams
from lmserve.default_model import default_model_path
from tests.hf_reference import hf_greedy

PROMPTS = ["ROMEO:", "To be, or not", "床前明月光"]


@pytest.fixture(scope="module")
def default_llm() -> LLM:
    return LLM(num_kv_blocks=64)


def test_llm_without_model_uses_the_bundled_target(default_llm: LLM) -> None:
    assert Path(default_llm.engine.config.model.path) == Path(default_model_path("target"))
    assert default_llm.engine.config.model.dtype == "float32", "bf16 weights are upcast on CPU"


@pytest.mark.parametrize("name", ["target", "draft"])
def test_bundled_models_greedy_equals_hf(name: str) -> None:
    model_dir = Path(default_model_path(name))
    llm = LLM(str(model_dir), num_kv_blocks=64)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(model_dir, out.prompt_token_ids, 32), out.prompt


def test_chinese_prompt_continues_in_chinese_without_broken_bytes(default_llm: LLM) -> None:
    out = default_llm.generate(["床前明月光"], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0]
    text = out.outputs[0].text
    assert "\ufffd" not in text
    assert sum("\u4e00" <= ch <= "\u9fff" for ch in text) >= 4, text


def test_generate_cli_runs_with_no_arguments() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lmserve.entrypoints.cli", "generate", "--max-tokens", "16", "--seed", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ROMEO:" in proc.stdout and "床前明月光" in proc.stdout
    assert "\ufffd" not in proc.stdout


def test_min_tokens_holds_back_stop_strings(default_llm: LLM) -> None:
    """The soak's reproduction: a "\n" among the first min_tokens tokens no longer ends the output."""
    params = SamplingParams(max_tokens=40, temperature=0, min_tokens=30)
    free = default_llm.generate(["ROMEO:"], params, use_tqdm=False)[0].outputs[0]
    boundary = len(default_llm.get_tokenizer().decode(free.token_ids[:30]))
    assert "\n" in free.text[:boundary] and "\n" in free.text[boundary:], "the case is exercised"
    params = SamplingParams(max_tokens=40, temperature=0, min_tokens=30, stop=["\n"])
    out = default_llm.generate(["ROMEO:"], params, use_tqdm=False)[0].outputs[0]
    cut = free.text.index("\n", boundary)
    assert len(out.token_ids) > 30 and out.finish_reason == "stop" and out.stop_reason == "\n"
    assert out.text == free.text[:cut] and out.token_ids == free.token_ids[: len(out.token_ids)]
