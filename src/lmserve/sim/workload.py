"""The simulated requests: prompts with token ids, fixed output lengths (ignore_eos), and arrival times.

build_workload draws prompts from the bench datasets with the model's tokenizer (fast_prompts above
EXACT_PROMPTS_MAX_REQUESTS) and arrivals from the load generator; trace_workload replays a `bench serve` JSON.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lmserve.bench.datasets import DatasetConfig, PromptBuilder, _lengths, build_requests
from lmserve.bench.loadgen import arrival_offsets_s

EXACT_PROMPTS_MAX_REQUESTS = 2000
PROMPT_MODES = ("auto", "exact", "fast")


@dataclass
class Workload:
    """Request i: prompt_token_ids[i] (a list or an int32 array), output_lens[i] tokens, arriving at arrivals_s[i]
    seconds from the start (sorted)."""

    prompt_token_ids: list[Any]
    output_lens: list[int]
    arrivals_s: list[float]
    description: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.prompt_token_ids)
        assert len(self.output_lens) == n and len(self.arrivals_s) == n, "workload columns differ in length"
        assert all(a <= b for a, b in zip(self.arrivals_s, self.arrivals_s[1:], strict=False)), "arrivals unsorted"

    def __len__(self) -> int:
        return len(self.prompt_token_ids)


def special_token_ids(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer adds before and after a text (BOS, EOS-as-suffix...)."""
    probe = "hello world"
    full = list(tokenizer.encode(probe))
    plain = list(tokenizer.encode(probe, add_special_tokens=False))
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i], full[i + len(plain) :]
    return [], []


def fast_prompts(cfg: DatasetConfig, tokenizer: Any) -> tuple[list[np.ndarray], list[int]] | None:
    """random / prefix prompts as bench builds them (same lengths, same prefix groups), ids drawn with numpy;
    None when the tokenizer has no single-token words (the harness's fallback path)."""
    builder = PromptBuilder(tokenizer, cfg.seed)
    if len(builder.words) < 2:
        return None
    word_ids = np.array(
        [ids[0] for ids in tokenizer(builder.words, add_special_tokens=False)["input_ids"]], dtype=np.int32
    )
    head, tail = (np.array(x, dtype=np.int32) for x in special_token_ids(tokenizer))
    num_special = len(head) + len(tail)
    rng = random.Random(cfg.seed + 1)  # bench's length sequence, identical
    in_lens = _lengths(rng, cfg.num_requests, cfg.input_len, cfg.range_ratio)
    out_lens = _lengths(rng, cfg.num_requests, cfg.output_len, cfg.range_ratio)
    draw = np.random.default_rng(cfg.seed)
    if cfg.name == "random":
        content = [builder.content_len(n, "--input-len") for n in in_lens]
        prefixes = [np.zeros(0, dtype=np.int32)]
    else:
        content = list(in_lens)  # prefix: the suffix is input_len words (the prefix carries the special tokens)
        prefix_content = builder.content_len(cfg.prefix_len, "--prefix-len")
        prefixes = [word_ids[draw.integers(0, len(word_ids), prefix_content)] for _ in range(cfg.num_prefix_groups)]
    flat = word_ids[draw.integers(0, len(word_ids), sum(content))]
    prompts = []
    pos = 0
    for i, n in enumerate(content):
        prompts.append(np.concatenate([head, prefixes[i % len(prefixes)], flat[pos : pos + n], tail]))
        pos += n
    assert cfg.name != "random" or all(len(p) == n for p, n in zip(prompts, in_lens, strict=True)), (
        f"fast prompts: lengths differ from the requested ones ({num_special} special tokens)"
    )
    return prompts, out_lens


def dataset_prompts(cfg: DatasetConfig, tokenizer: Any, mode: str = "auto") -> tuple[list[Any], list[int], str]:
    """(prompt token ids, output lengths, how they were made) for a bench dataset."""
    if mode not in PROMPT_MODES:
        raise ValueError(f"--prompts must be one of {list(PROMPT_MODES)}, got {mode!r}")
    cfg.validate()
    fast = mode == "fast" or (mode == "auto" and cfg.num_requests > EXACT_PROMPTS_MAX_REQUESTS)
    if fast and cfg.name in ("random", "prefix"):
        made = fast_prompts(cfg, tokenizer)
        if made is not None:
            return made[0], made[1], "fast (numpy draws from bench's word vocabulary; bench's lengths)"
    reqs = build_requests(cfg, tokenizer)
    return [r.prompt_token_ids for r in reqs], [r.output_len for r in reqs], "exact (bench/datasets.py)"


def build_workload(
    cfg: DatasetConfig,
    tokenizer: Any,
    request_rate_rps: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
    prompts: str = "auto",
) -> Workload:
    if not request_rate_rps > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate_rps}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"--burstiness must be a positive number, got {burstiness}")
    ids, out_lens, how = dataset_prompts(cfg, tokenizer, prompts)
    arrivals = arrival_offsets_s(len(ids), request_rate_rps, burstiness, seed)
    desc = {"dataset": cfg.name, "prompts": how, "request_rate_rps": request_rate_rps, "burstiness": burstiness}
    return Workload(ids, out_lens, arrivals, desc)


def trace_workload(path: str | Path, tokenizer: Any) -> Workload:
    """A recorded `lmserve bench serve` JSON: each request's scheduled arrival (`scheduled_s`), prompt length and
    output length (what the server produced when it succeeded, else what was asked). The prompts are rebuilt
    from the run's dataset arguments when they reproduce the recorded lengths (same dataset, same seed: the
    same token ids), else drawn as unique random ids of the recorded lengths (said in the description)."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--trace: cannot read {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--trace: {path} is not JSON: {e}") from None
    records = doc.get("requests") if isinstance(doc, dict) else None
    if not isinstance(records, list) or not records:
        raise ValueError(f"--trace: {path} has no 'requests' list (expected an `lmserve bench serve` JSON)")
    try:
        records = sorted(records, key=lambda r: (float(r["scheduled_s"]), int(r["index"])))
        arrivals = [float(r["scheduled_s"]) for r in records]
        prompt_lens = [int(r.get("server_prompt_len") or r["prompt_len"]) for r in records]
        out_lens = [
            int(r["num_output_tokens"])
            if r.get("success") and r.get("num_output_tokens")
            else int(r["requested_output_len"])
            for r in records
        ]
        indices = [int(r["index"]) for r in records]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"--trace: {path}: a request lacks scheduled_s / prompt_len / requested_output_len ({e})"
        ) from None
    ids = _trace_prompts(doc.get("args") or {}, tokenizer, indices, prompt_lens)
    how = "rebuilt from the run's dataset arguments"
    if ids is None:
        rng = np.random.default_rng(0)
        ids = [rng.integers(1, len(tokenizer), n, dtype=np.int32) for n in prompt_lens]
        how = "synthetic unique ids of the recorded lengths (the run's dataset could not be rebuilt)"
    start = arrivals[0]
    desc = {"trace": str(path), "prompts": how, "num_requests": len(records)}
    return Workload(ids, out_lens, [a - start for a in arrivals], desc)


def _trace_prompts(args: dict[str, Any], tokenizer: Any, indices: list[int], lens: list[int]) -> list[Any] | None:
    if args.get("dataset") not in ("random", "prefix") or "num_requests" not in args:
        return None
    warmup = int(args.get("warmup_requests") or 0)
    try:
        cfg = DatasetConfig(
            name=args["dataset"],
            num_requests=int(args["num_requests"]) + warmup,
            input_len=int(args["input_len"]),
            output_len=int(args["output_len"]),
            range_ratio=float(args.get("range_ratio") or 0.0),
            prefix_len=int(args.get("prefix_len") or 0),
            num_prefix_groups=int(args.get("num_prefix_groups") or 1),
            seed=int(args.get("seed") or 0),
        )
        reqs = build_requests(cfg, tokenizer)[warmup:]
    except (KeyError, TypeError, ValueError):
        return None
    if len(reqs) <= max(indices) or any(reqs[i].prompt_len != n for i, n in zip(indices, lens, strict=True)):
        return None
    return [reqs[i].prompt_token_ids for i in indices]
