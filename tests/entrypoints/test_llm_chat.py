"""LLM.chat (entrypoints/llm.py): a conversation through the chat template, its reasoning and tool calls parsed as
the server does, on a scripted model (tests/scripted_model.py) with a Qwen3-style template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmserve.llm import LLM
from lmserve.sampling_params import SamplingParams
from tests.scripted_model import build_scripted_model
from tests.server.test_reasoning import ANSWER, CALLS, FAMILIES, MSG, THOUGHT, TOOLS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_chat_splits_reasoning_and_calls(tmp_path: Path, tokenizer_dir: Path) -> None:
    fam = FAMILIES["qwen3+hermes"]
    llm = LLM(str(build_scripted_model(tmp_path / "m", fam.script, fam.template, tokenizer_dir=tokenizer_dir)),
              num_kv_blocks=64)  # fmt: skip
    params = SamplingParams(max_tokens=40, temperature=0.0)
    (out,) = llm.chat(MSG, params, use_tqdm=False, tools=TOOLS)
    (c,) = out.outputs
    assert (c.reasoning_content, c.text) == (THOUGHT, ANSWER)
    assert [(t.name, json.loads(t.arguments)) for t in c.tool_calls] == CALLS
    # two conversations; thinking switched off in the template; no tools: the calls stay text
    outs = llm.chat([MSG, MSG], params, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    for out in outs:
        (c,) = out.outputs
        assert c.reasoning_content is None and c.text.startswith(ANSWER + "\n<tool_call>") and c.tool_calls == []
    (out,) = llm.chat(MSG, params, use_tqdm=False, reasoning_parser="none")
    assert out.outputs[0].text.startswith("<think>") and out.outputs[0].reasoning_content is None
