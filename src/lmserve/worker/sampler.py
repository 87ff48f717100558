"""Batched sampling on the logits of one step.

Contract (the model runner depends on it):
    sampler = Sampler()
    out = sampler(logits, metadata)   # logits: (num_rows, vocab) float32, one row per sampled request
    out.sampled_token_ids             # list[int], len == num_rows
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmserve.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Everything the sampler needs about the rows of one step's logits (row i = request i)."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]  # per-row seeded generator; None = global RNG
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]  # tokens generated so far (before this step)
    eos_token_ids: list[int]  # suppressed while len(output) < min_tokens (unless ignore_eos)

    @property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)


@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]


class Sampler:
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(metadata.params), "one logits row per request"
        logits = logits.float()
        if metadata.all_greedy:
            return SamplerOutput(logits.argmax(dim=-1).tolist())
        sampled: list[int] = []
        for i, params in enumerate(metadata.params):
            row = logits[i]
            if params.greedy:
                sampled.append(int(row.argmax()))
                continue
            probs = torch.softmax(row / params.temperature, dim=-1)
            # Exponential-race (Gumbel-max) sampling: argmax(p / E), E ~ Exp(1), with the row's own RNG.
            noise = torch.empty_like(probs).exponential_(generator=metadata.generators[i])
            sampled.append(int((probs / noise).argmax()))
        return SamplerOutput(sampled)
