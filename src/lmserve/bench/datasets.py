"""Benchmark prompt sets, all offline: random, prefix (shared prefix groups), sharegpt (local file), jsonl.

PromptBuilder makes prompts of exact token lengths (counting the tokenizer's special tokens), every request a
different prompt; build_requests / add_dataset_args / dataset_config_from_args are the entry points.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATASET_NAMES = ("random", "prefix", "sharegpt", "jsonl")
_WORD_RE = re.compile(r" [A-Za-z]+")


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_token_ids: list[int]  # as the benchmark tokenizer encodes `prompt` (special tokens included)
    output_len: int  # max_tokens to ask for

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class DatasetConfig:
    name: str = "random"
    num_requests: int = 100
    input_len: int = 128  # random: prompt tokens; prefix: tokens after the shared prefix
    output_len: int = 128
    range_ratio: float = 0.0  # lengths uniform in [len·(1−r), len·(1+r)]
    prefix_len: int = 0  # prefix: shared prefix tokens per group
    num_prefix_groups: int = 1
    dataset_path: str | None = None  # sharegpt / jsonl file
    sharegpt_output_len: int | None = None  # override the reference answer's length
    max_prompt_len: int = 1024  # sharegpt filter
    max_total_len: int = 2048  # sharegpt filter: prompt + output
    seed: int = 0

    def validate(self) -> None:
        if self.name not in DATASET_NAMES:
            raise ValueError(f"--dataset must be one of {list(DATASET_NAMES)}, got {self.name!r}")
        if self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.name in ("random", "prefix"):
            if self.input_len < 1:
                raise ValueError(f"--input-len must be >= 1, got {self.input_len}")
            if self.output_len < 1:
                raise ValueError(f"--output-len must be >= 1, got {self.output_len}")
        if self.name == "prefix":
            if self.prefix_len < 1:
                raise ValueError(f"--prefix-len must be >= 1 for the prefix dataset, got {self.prefix_len}")
            if self.num_prefix_groups < 1:
                raise ValueError(f"--num-prefix-groups must be >= 1, got {self.num_prefix_groups}")
        if self.name in ("sharegpt", "jsonl"):
            if not self.dataset_path:
                raise ValueError(f"--dataset-path is required for the {self.name} dataset")
            if not Path(self.dataset_path).is_file():
                raise ValueError(f"--dataset-path: no such file: {self.dataset_path}")
        if self.sharegpt_output_len is not None and self.sharegpt_output_len < 1:
            raise ValueError(f"--sharegpt-output-len must be >= 1, got {self.sharegpt_output_len}")


def load_tokenizer(path: str) -> Any:
    from lmserve.checkpoint.tokenizer import load_tokenizer as load_model_tokenizer

    try:
        return load_model_tokenizer(path)
    except Exception as e:  # noqa: BLE001 - any loader failure is a bad flag value
        raise ValueError(f"--tokenizer: cannot load a tokenizer from {path!r}: {e}") from None


class PromptBuilder:
    """Makes text prompts of an exact token count from single-token " word" pieces of the vocabulary.

    The byte-level pre-tokenizer splits text at those pieces, so their concatenation encodes to one token per piece.
    """

    def __init__(self, tokenizer: Any, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        probe = "hello world"
        self.num_special_tokens = len(tokenizer.encode(probe)) - len(
            tokenizer.encode(probe, add_special_tokens=False)
        )
        vocab_size = len(tokenizer)
        texts = tokenizer.batch_decode([[i] for i in range(vocab_size)])
        candidates = [i for i, s in enumerate(texts) if _WORD_RE.fullmatch(s)]
        encoded = (
            tokenizer([texts[i] for i in candidates], add_special_tokens=False)["input_ids"]
            if candidates
            else []
        )
        self.words = [texts[i] for i, e in zip(candidates, encoded, strict=True) if e == [i]]
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._fallback_ids = [i for i in range(vocab_size) if i not in special]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def content_len(self, total_len: int, flag: str) -> int:
        n = total_len - self.num_special_tokens
        if n < 1:
            raise ValueError(
                f"{flag}={total_len} leaves no room for text: the tokenizer adds {self.num_special_tokens} "
                f"special token(s)"
            )
        return n

    def text(self, num_tokens: int) -> str:
        """Text that encodes (without special tokens) to exactly num_tokens tokens."""
        if len(self.words) >= 2:
            return "".join(self.rng.choice(self.words) for _ in range(num_tokens))
        return self._fallback_text(num_tokens)

    def _fallback_text(self, num_tokens: int) -> str:
        # tokenizers without single-token " word" pieces (e.g. SentencePiece): decode random ids, re-encode,
        # trim or extend until the count is right
        tok = self.tokenizer
        text = tok.decode([self.rng.choice(self._fallback_ids) for _ in range(num_tokens)])
        for _ in range(50):
            ids = tok.encode(text, add_special_tokens=False)
            if len(ids) == num_tokens:
                return text
            if len(ids) > num_tokens:
                text = tok.decode(ids[:num_tokens])
            else:
                text += tok.decode(
                    [self.rng.choice(self._fallback_ids) for _ in range(num_tokens - len(ids))]
                )
        raise ValueError(f"could not build a prompt of exactly {num_tokens} tokens with this tokenizer")


def _lengths(rng: random.Random, n: int, length: int, ratio: float) -> list[int]:
    lo, hi = max(1, math.floor(length * (1 - ratio))), max(1, math.ceil(length * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def _unique_texts(
    builder: PromptBuilder, lengths: list[int], prefix: str = "", seen: set[str] | None = None
) -> list[str]:
    seen = set() if seen is None else seen
    out = []
    for n in lengths:
        for _ in range(100):
            text = prefix + builder.text(n)
            if text not in seen:
                break
        else:
            raise ValueError(
                f"--input-len: cannot make {len(lengths)} different prompts of {n} tokens from the "
                f"tokenizer's {len(builder.words)} single-token words; raise --input-len"
            )
        seen.add(text)
        out.append(text)
    return out


def random_requests(cfg: DatasetConfig, tokenizer: Any) -> list[BenchRequest]:
    builder = PromptBuilder(tokenizer, cfg.seed)
    rng = random.Random(cfg.seed + 1)
    in_lens = _lengths(rng, cfg.num_requests, cfg.input_len, cfg.range_ratio)
    out_lens = _lengths(rng, cfg.num_requests, cfg.output_len, cfg.range_ratio)
    content = [builder.content_len(n, "--input-len") for n in in_lens]
    texts = _unique_texts(builder, content)
    return [BenchRequest(t, builder.encode(t), o) for t, o in zip(texts, out_lens, strict=True)]


def prefix_requests(cfg: DatasetConfig, tokenizer: Any) -> list[BenchRequest]:
    """num_prefix_groups shared prefixes of prefix_len tokens; request i uses prefix i % groups and a unique
    suffix of input_len tokens (± range_ratio). The prompt length is prefix + suffix (+ special tokens)."""
    builder = PromptBuilder(tokenizer, cfg.seed)
    rng = random.Random(cfg.seed + 1)
    prefix_content = builder.content_len(cfg.prefix_len, "--prefix-len")
    prefixes = _unique_texts(builder, [prefix_content] * cfg.num_prefix_groups)
    in_lens = _lengths(rng, cfg.num_requests, cfg.input_len, cfg.range_ratio)
    out_lens = _lengths(rng, cfg.num_requests, cfg.output_len, cfg.range_ratio)
    seen: set[str] = set()
    out = []
    for i, (n, o) in enumerate(zip(in_lens, out_lens, strict=True)):
        (text,) = _unique_texts(builder, [n], prefixes[i % len(prefixes)], seen)
        out.append(BenchRequest(text, builder.encode(text), o))
    return out


def sharegpt_requests(cfg: DatasetConfig, tokenizer: Any) -> list[BenchRequest]:
    """First human turn as the prompt, the next turn's token count as the output length (vLLM's recipe:
    skip pairs under 4 tokens either side, or over max_prompt_len / max_total_len)."""
    assert cfg.dataset_path is not None
    try:
        data = json.loads(Path(cfg.dataset_path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--dataset-path: cannot read ShareGPT JSON from {cfg.dataset_path}: {e}") from None
    if not isinstance(data, list):
        raise ValueError("--dataset-path: a ShareGPT file is a JSON list of {'conversations': [...]} objects")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        prompt, answer = (t.get("value") if isinstance(t, dict) else None for t in turns[:2])
        if isinstance(prompt, str) and isinstance(answer, str):
            pairs.append((prompt, answer))
    random.Random(cfg.seed).shuffle(pairs)
    out: list[BenchRequest] = []
    seen: set[str] = set()
    for prompt, answer in pairs:
        if prompt in seen:
            continue
        ids = list(tokenizer.encode(prompt))
        out_len = cfg.sharegpt_output_len or len(tokenizer.encode(answer, add_special_tokens=False))
        if (
            len(ids) < 4
            or out_len < 4
            or len(ids) > cfg.max_prompt_len
            or len(ids) + out_len > cfg.max_total_len
        ):
            continue
        seen.add(prompt)
        out.append(BenchRequest(prompt, ids, out_len))
        if len(out) == cfg.num_requests:
            return out
    raise ValueError(
        f"--num-requests={cfg.num_requests}: {cfg.dataset_path} has only {len(out)} usable distinct "
        f"conversations (prompt and answer >= 4 tokens, prompt <= {cfg.max_prompt_len}, "
        f"total <= {cfg.max_total_len})"
    )


def jsonl_requests(cfg: DatasetConfig, tokenizer: Any) -> list[BenchRequest]:
    """One JSON object a line: {"prompt": str, "max_tokens": int} ("output_len" is accepted too)."""
    assert cfg.dataset_path is not None
    out: list[BenchRequest] = []
    with open(cfg.dataset_path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                prompt = obj["prompt"]
                max_tokens = obj.get("max_tokens", obj.get("output_len"))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                where = f"{cfg.dataset_path}:{lineno}"
                raise ValueError(
                    f'--dataset-path: {where}: expected {{"prompt": str, "max_tokens": int}}'
                ) from None
            if not isinstance(prompt, str) or not isinstance(max_tokens, int) or max_tokens < 1:
                where = f"{cfg.dataset_path}:{lineno}"
                raise ValueError(
                    f"--dataset-path: {where}: prompt must be a string and max_tokens an int >= 1"
                )
            out.append(BenchRequest(prompt, list(tokenizer.encode(prompt)), max_tokens))
            if len(out) == cfg.num_requests:
                return out
    raise ValueError(f"--num-requests={cfg.num_requests}: {cfg.dataset_path} has only {len(out)} requests")


def build_requests(cfg: DatasetConfig, tokenizer: Any) -> list[BenchRequest]:
    cfg.validate()
    builders = {
        "random": random_requests,
        "prefix": prefix_requests,
        "sharegpt": sharegpt_requests,
        "jsonl": jsonl_requests,
    }
    return builders[cfg.name](cfg, tokenizer)


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset", default="random", choices=DATASET_NAMES)
    g.add_argument("--num-requests", type=int, default=100)
    g.add_argument(
        "--input-len", type=int, default=128, help="random: prompt tokens; prefix: tokens after it"
    )
    g.add_argument("--output-len", type=int, default=128, help="max_tokens (random / prefix)")
    g.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len·[1−r, 1+r]")
    g.add_argument("--prefix-len", type=int, default=256, help="prefix: shared prefix tokens")
    g.add_argument("--num-prefix-groups", type=int, default=1, help="prefix: number of distinct prefixes")
    g.add_argument("--dataset-path", default=None, help="sharegpt JSON / jsonl file")
    g.add_argument("--sharegpt-output-len", type=int, default=None)


def dataset_config_from_args(args: argparse.Namespace, num_requests: int | None = None) -> DatasetConfig:
    return DatasetConfig(
        name=args.dataset,
        num_requests=args.num_requests if num_requests is None else num_requests,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        prefix_len=args.prefix_len,
        num_prefix_groups=args.num_prefix_groups,
        dataset_path=args.dataset_path,
        sharegpt_output_len=args.sharegpt_output_len,
        seed=args.seed,
    )


def parse_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of requests per second or 'inf', got {text!r}"
        ) from None
    return value
