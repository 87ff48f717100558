"""tests/scripted_model.py: the scripted model writes its script exactly, after any prompt, at any temperature."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmserve.llm import LLM
from lmserve.sampling_params import SamplingParams
from tests.scripted_model import build_scripted_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
SCRIPT = ["<think>", "Let me think it over.", "</think>", "\n\n", "The answer is 42.", " <tool_call>"]


def test_writes_the_script_then_stops(tmp_path: Path, tokenizer_dir: Path) -> None:
    path = build_scripted_model(tmp_path / "m", SCRIPT, TEMPLATE, tokenizer_dir=tokenizer_dir)
    llm = LLM(str(path), num_kv_blocks=64)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in ("hi", "a longer question about 42, with <think> in it")]  # fmt: skip
    for temperature in (0.0, 1.0):
        outs = llm.generate(prompts, SamplingParams(max_tokens=50, temperature=temperature, seed=3), use_tqdm=False)
        for out in outs:
            (c,) = out.outputs
            assert c.text == "".join(SCRIPT) and str(c.finish_reason) == "stop", c
            assert len(c.token_ids) == len(SCRIPT) + 1  # each item one token, then EOS
    # a prompt ending in item i continues at item i + 1
    (out,) = llm.generate(["x" + SCRIPT[1]], SamplingParams(max_tokens=50, temperature=0.0), use_tqdm=False)
    assert out.outputs[0].text == "".join(SCRIPT[2:])


def test_loop_and_special_items(tmp_path: Path, tokenizer_dir: Path) -> None:
    script = ["<|channel|>", "final", "<|message|>", "Hi."]
    path = build_scripted_model(tmp_path / "m", script, TEMPLATE, special=["<|channel|>", "<|message|>"],
                                end="loop", tokenizer_dir=tokenizer_dir)  # fmt: skip
    llm = LLM(str(path), num_kv_blocks=64)
    params = SamplingParams(max_tokens=9, temperature=0.0, skip_special_tokens=False)
    (out,) = llm.generate(["hello"], params, use_tqdm=False)
    assert out.outputs[0].text == "".join(script * 2) + script[0]
    assert str(out.outputs[0].finish_reason) == "length"
    (out,) = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert out.outputs[0].text == "finalHi."  # special items dropped from the text


def test_bad_scripts(tmp_path: Path, tokenizer_dir: Path) -> None:
    with pytest.raises(ValueError, match="distinct"):
        build_scripted_model(tmp_path / "a", ["x1", "x1"], None, tokenizer_dir=tokenizer_dir)
    with pytest.raises(ValueError, match="special"):
        build_scripted_model(tmp_path / "b", ["x1"], None, special=["y"], tokenizer_dir=tokenizer_dir)
