"""The model's generation_config.json fills the sampling fields a request leaves unset (vLLM's
`--generation-config auto`); `generation_config="vllm"` ignores it."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import pytest

from lmserve import LLM, SamplingParams
from lmserve.checkpoint.generation_defaults import sampling_defaults
from lmserve.config.engine import EngineArgs
from lmserve.engine.async_engine import AsyncEngine
from lmserve.engine.llm_engine import LLMEngine
from lmserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, to_sampling_params
from lmserve.entrypoints.openai.server import build_app
from tests.hf_reference import hf_greedy

GEN_CONFIG = {"temperature": 0.0, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.0, "eos_token_id": [0, 7]}


@pytest.fixture(scope="module")
def gen_model(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gen") / "model"
    shutil.copytree(llama_dir, out)
    (out / "generation_config.json").write_text(json.dumps(GEN_CONFIG))
    return out


def test_defaults_read_and_opt_out(gen_model: Path, tmp_path: Path) -> None:
    assert sampling_defaults(gen_model, "auto") == {
        "temperature": 0.0,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.0,
    }
    assert sampling_defaults(gen_model, "vllm") == {}
    assert sampling_defaults(tmp_path, "auto") == {}, "no file, no defaults"
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    with pytest.raises(ValueError, match=r"generation_config.json: top_p must be in \(0, 1\]"):
        sampling_defaults(tmp_path, "auto")
    with pytest.raises(ValueError, match="generation_config must be one of"):
        EngineArgs.from_kwargs(str(gen_model), generation_config="hf").create_engine_config()


def test_protocol_fills_only_unset_fields() -> None:
    defaults = {"temperature": 0.0, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1}
    unset = to_sampling_params(CompletionRequest(prompt="x"), defaults)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.repetition_penalty) == (0.0, 0.8, 20, 1.1)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], temperature=0.7, top_k=5)
    explicit = to_sampling_params(chat, defaults)
    assert (explicit.temperature, explicit.top_p, explicit.top_k, explicit.repetition_penalty) == (0.7, 0.8, 5, 1.1)
    plain = to_sampling_params(CompletionRequest(prompt="x"))
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)


def test_offline_generate_without_params_uses_model_defaults(gen_model: Path) -> None:
    llm = LLM(str(gen_model), num_kv_blocks=32)
    assert llm.engine.eos_token_ids == (0, 7), "generation_config eos ids count"
    default = llm.engine.default_sampling_params()
    assert (default.temperature, default.top_p, default.top_k) == (0.0, 0.8, 20)
    # temperature 0 from the file: greedy, equal to HF's argmax decoding up to the first EOS
    out = llm.generate(["def fib(n):"], use_tqdm=False)[0]
    expected = hf_greedy(gen_model, out.prompt_token_ids, 16)
    got = out.outputs[0].token_ids
    assert got == expected[: len(got)]
    assert len(got) == 16 or got[-1] in (0, 7)
    # an explicit SamplingParams is taken as given (vLLM semantics): temperature 1.0 samples
    assert llm.generate(["a"], SamplingParams(max_tokens=1, seed=3), use_tqdm=False)[0].outputs[0].token_ids

    opted_out = LLM(str(gen_model), num_kv_blocks=32, generation_config="vllm")
    assert opted_out.engine.default_sampling_params().temperature == 1.0
    assert opted_out.engine.eos_token_ids == (0, 7), "eos ids are part of the model, not a sampling default"


@pytest.mark.usefixtures("one_torch_thread")
def test_server_request_without_temperature_is_greedy(gen_model: Path) -> None:
    engine = AsyncEngine(LLMEngine.from_engine_args(EngineArgs.from_kwargs(str(gen_model), num_kv_blocks=32)))
    app = build_app(engine, served_model_name="tiny")

    async def run() -> list[dict]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
            body = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "ignore_eos": True}
            return [(await c.post("/v1/completions", json=body)).json() for _ in range(2)]

    try:
        first, second = asyncio.run(run())
    finally:
        engine.shutdown()
    tok = engine.tokenizer
    assert (
        first["choices"][0]["text"] == second["choices"][0]["text"] == tok.decode(hf_greedy(gen_model, [5, 6, 7, 8], 6))
    )
