"""The bundled default models load in HF transformers and match their documented shape."""

from __future__ import annotations

import json
import os

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from lmserve.default_model import MODEL_NAMES, default_model_path  # noqa: E402

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
MAX_SHIPPED_BYTES = 30 * 1000 * 1000


def _dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(path) for f in fs)


@pytest.fixture(scope="module", params=MODEL_NAMES)
def name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    return {n: transformers.AutoTokenizer.from_pretrained(default_model_path(n)) for n in MODEL_NAMES}


@pytest.fixture(scope="module")
def models() -> dict:
    return {n: transformers.LlamaForCausalLM.from_pretrained(default_model_path(n)) for n in MODEL_NAMES}


def test_path_helper():
    assert os.path.isabs(default_model_path())
    assert default_model_path() == default_model_path("target")
    assert default_model_path("draft") != default_model_path("target")
    with pytest.raises(ValueError):
        default_model_path("nope")


def test_files_present(name):
    path = default_model_path(name)
    for fname in REQUIRED_FILES:
        assert os.path.isfile(os.path.join(path, fname)), fname


def test_config(name):
    with open(os.path.join(default_model_path(name), "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["tie_word_embeddings"] is True
    assert cfg["max_position_embeddings"] == 1024
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA


def test_tokenizer_roundtrip(name, tokenizers):
    tok = tokenizers[name]
    for text in ["ROMEO:\nBut, soft! what light through yonder window breaks?", "To be, or not to be",
                 "床前明月光，疑是地上霜。", "mixed 中文 and English, 123 ✓\n\n"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    # nothing is added automatically (no BOS, no EOS)
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False)


def test_tokenizer_special_tokens(name, tokenizers):
    tok = tokenizers[name]
    assert tok.eos_token == "<|endoftext|>"
    assert tok.eos_token_id is not None
    assert tok.pad_token_id is not None
    assert tok.model_max_length == 1024
    assert tok.chat_template
    messages = [{"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    for special in ("<|im_start|>", "<|im_end|>"):
        assert len(tok.encode(special, add_special_tokens=False)) == 1


def test_tokenizer_matches_config(name, tokenizers, models):
    tok, model = tokenizers[name], models[name]
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.bos_token_id in (None, tok.bos_token_id)
    assert model.config.vocab_size == len(tok)


def test_tokenizers_identical():
    contents = []
    for n in MODEL_NAMES:
        with open(os.path.join(default_model_path(n), "tokenizer.json"), "rb") as f:
            contents.append(f.read())
    assert all(c == contents[0] for c in contents)


def test_parameter_counts(models):
    counts = {n: sum(p.numel() for p in m.parameters()) for n, m in models.items()}
    assert 5_000_000 <= counts["target"] <= 15_000_000
    assert counts["draft"] * 3 <= counts["target"]


def test_weights_are_bfloat16():
    from safetensors import safe_open

    for n in MODEL_NAMES:
        with safe_open(os.path.join(default_model_path(n), "model.safetensors"), framework="pt") as f:
            for key in f.keys():
                assert f.get_slice(key).get_dtype() == "BF16", key


def test_forward_runs(name, tokenizers, models):
    tok, model = tokenizers[name], models[name]
    ids = torch.tensor([tok.encode("ROMEO:\n")])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()


def test_shipped_size():
    root = os.path.dirname(default_model_path())
    assert _dir_size(root) <= MAX_SHIPPED_BYTES
    assert os.path.isfile(os.path.join(root, "README.md"))
