"""Scripted models: tiny one-layer Llamas that write an exact text, for testing what a server does with a model's
output (reasoning and tool-call parsers, Responses / Anthropic / Ollama APIs) without real weights.

    path = build_scripted_model(tmp / "m", ["<think>", "I should greet.", "</think>", "Hello!"], TEMPLATE)

Each script item becomes one added token; the model's attention and MLP write nothing (output weights zero), so
the next token depends only on the current one, and the embedding and LM head chain the items: a prompt whose
last token is not in the script starts it at item 0, item i is followed by item i + 1, the last item by the EOS
token (`end="eos"`) or item 0 again (`end="loop"`: a request that runs until max_tokens or an abort). The chain
holds at any temperature (the next token's logit leads by ~10·sqrt(hidden_size)). A prompt ending in item i
(e.g. a template's generation prompt that opens "<think>" when "<think>" is item 0) continues at item i + 1.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch

from tests.helpers import train_tokenizer

LOGIT_SCALE = 10.0  # the next token's logit is this × sqrt(hidden_size); every other logit is 0


def build_scripted_model(
    out_dir: Path,
    script: Sequence[str],
    chat_template: str | None,
    *,
    special: Sequence[str] = (),
    end: Literal["eos", "loop"] = "eos",
    tokenizer_dir: Path | None = None,
) -> Path:
    """Save a model (and its tokenizer, with `chat_template`) to `out_dir` that writes `"".join(script)` after any
    prompt, then stops (end="eos") or starts over (end="loop"); returns `out_dir`.

    script: distinct, non-empty strings, one token each (added to the tokenizer, or the vocabulary's own token
      when a string already is one). Added tokens are matched whole when text is tokenized, so a prompt that
      quotes an item holds that token.
    special: the script items added as special tokens (dropped from the text with skip_special_tokens, as real
      tokenizers mark gpt-oss's <|channel|> or Mistral's [TOOL_CALLS]); the others are plain added tokens.
    tokenizer_dir: the base tokenizer (tests/helpers.train_tokenizer's byte-level BPE; trained into
      out_dir/"base-tokenizer" when not given: ~1 s). Its EOS token ends the script.
    """
    from tokenizers import AddedToken
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    items = list(script)
    if not items or any(not isinstance(s, str) or not s for s in items):
        raise ValueError("script: give a non-empty list of non-empty strings")
    if len(set(items)) != len(items):
        dup = next(s for s in items if items.count(s) > 1)
        raise ValueError(
            f"script: items must be distinct (the next token depends only on the current), {dup!r} repeats"
        )
    unknown = set(special) - set(items)
    if unknown:
        raise ValueError(f"special: {sorted(unknown)} are not script items")
    if end not in ("eos", "loop"):
        raise ValueError(f"end must be 'eos' or 'loop', got {end!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        tokenizer_dir = out_dir / "base-tokenizer"
        tokenizer_dir.mkdir(exist_ok=True)
        train_tokenizer(tokenizer_dir)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    vocab = tok.get_vocab()
    plain = [s for s in items if s not in special and s not in vocab]
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in plain])
    if special:
        tok.add_tokens([AddedToken(s, special=True, normalized=False) for s in special], special_tokens=True)
    ids = [tok.convert_tokens_to_ids(s) for s in items]
    for s, i in zip(items, ids, strict=True):
        assert tok.decode([i], skip_special_tokens=False) == s, f"script item {s!r} is not one token ({i})"
    eos = tok.eos_token_id
    assert eos is not None and eos not in ids, "the base tokenizer's EOS ends the script; it cannot be an item"
    tok.chat_template = chat_template
    tok.save_pretrained(out_dir)

    # directions: 0 for every token outside the script, i + 1 for item i
    hidden = max(16, -(-(len(items) + 2) // 8) * 8)
    vocab_size = -(-len(tok) // 64) * 64
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096, eos_token_id=eos,
        bos_token_id=None, pad_token_id=None, tie_word_embeddings=False, rms_norm_eps=1e-6,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        emb = torch.zeros(vocab_size, hidden)
        emb[:, 0] = 1.0
        head = torch.zeros(vocab_size, hidden)
        nxt = [*ids[1:], ids[0] if end == "loop" else eos]
        head[ids[0], 0] = LOGIT_SCALE
        for k, (cur, after) in enumerate(zip(ids, nxt, strict=True)):
            emb[cur] = 0.0
            emb[cur, k + 1] = 1.0
            head[after, k + 1] = LOGIT_SCALE
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(head)
    model.save_pretrained(out_dir, safe_serialization=True)
    if (out_dir / "base-tokenizer").exists() and tokenizer_dir == out_dir / "base-tokenizer":
        shutil.rmtree(tokenizer_dir)
    return out_dir
