"""Verification of proposals: the target's distribution at every proposed position, then rejection sampling (verify).

Each emitted token is distributed exactly as the target's processed distribution p (Leviathan et al., 2023;
Chen et al., 2023); greedy requests accept while a proposal is the argmax. See docs/speculative_decoding.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmserve.core.outputs import ScheduledRequest
from lmserve.sample.sampler import _SAMPLING_EPS, Sampler, SamplingMetadata, TokenLogprobs, token_logprobs
from lmserve.sample.structured_output import fill_verification_bitmasks


@dataclass
class Verified:
    token_ids: list[int]  # accepted proposals, then the one sampled token (resampled or bonus)
    logprobs: list[TokenLogprobs] | None  # per token, under the raw target distribution, when asked for


def verify(sampler: Sampler, logits: torch.Tensor, scheduled: list[ScheduledRequest]) -> list[Verified]:
    """logits: (sum of 1 + num_spec_tokens, vocab) raw target rows, request by request in `scheduled` order.

    Row j predicts the token after proposals d_1..d_j; p_j applies the logits processors to the output plus
    d_1..d_j (and a constrained request's grammar mask after them), then the warpers. d_j is accepted with
    probability min(1, p_j(d_j) / q_j(d_j)); the first rejection draws from max(0, p_j - q_j) normalised, and when
    all are accepted a bonus token is drawn from p_{k+1}. Seeded requests draw from their own torch.Generator.
    """
    meta = _expanded_metadata(scheduled, logits.shape[1])
    assert logits.shape[0] == len(meta.params), "one logits row per verified position"
    raw = logits.float()
    processed = sampler.apply_logits_processors(raw, meta) if Sampler._needs_processing(meta) else raw
    greedy = [p.temperature < _SAMPLING_EPS for p in meta.params]
    argmax = processed.argmax(dim=-1).tolist()
    random_rows = [i for i, g in enumerate(greedy) if not g]
    probs = None
    if random_rows:
        idx = torch.tensor(random_rows, dtype=torch.long, device=raw.device)
        probs = torch.zeros_like(raw)
        probs[idx] = sampler._warp(processed[idx], [meta.params[i] for i in random_rows], [False] * len(idx))
    out = []
    row = 0
    for s in scheduled:
        req = s.request
        drafts = req.spec_token_ids[: s.num_spec_tokens]
        if greedy[row]:
            tokens = _greedy(drafts, argmax[row : row + len(drafts) + 1])
        else:
            assert probs is not None
            q = req.spec_draft_probs
            tokens = _rejection_sample(drafts, probs[row : row + len(drafts) + 1], q, req.generator)
        lps = None
        if req.sampling_params.logprobs is not None:
            chosen = torch.tensor(tokens, dtype=torch.long, device=raw.device)
            lps = token_logprobs(raw[row : row + len(tokens)], chosen, [req.sampling_params.logprobs] * len(tokens))
        out.append(Verified(tokens, lps))
        row += len(drafts) + 1
    return out


def _expanded_metadata(scheduled: list[ScheduledRequest], vocab_size: int) -> SamplingMetadata:
    """One sampler row per verified position; row j's output so far includes the proposals before it, and so
    does its grammar state (a constrained request's row j is masked as after d_1..d_j)."""
    params, gens, prompts, outputs = [], [], [], []
    constrained: list[tuple[int, ScheduledRequest]] = []
    for s in scheduled:
        req = s.request
        drafts = req.spec_token_ids[: s.num_spec_tokens]
        if req.structured_output is not None:
            constrained.append((len(params), s))
        for j in range(len(drafts) + 1):
            params.append(req.sampling_params)
            gens.append(req.generator)
            prompts.append(req.prompt_token_ids)
            outputs.append(req.output_token_ids + drafts[:j] if j else req.output_token_ids)
    eos = list(scheduled[0].request.eos_token_ids)
    bitmask = None
    if constrained:
        bitmask = fill_verification_bitmasks(
            [row for row, _ in constrained],
            [s.request.structured_output for _, s in constrained],
            [s.request.spec_token_ids[: s.num_spec_tokens] for _, s in constrained],
            vocab_size,
        )
    return SamplingMetadata(params, gens, prompts, outputs, eos, bitmask)


def _greedy(drafts: list[int], argmax: list[int]) -> list[int]:
    for j, d in enumerate(drafts):
        if d != argmax[j]:
            return drafts[:j] + [argmax[j]]
    return drafts + [argmax[len(drafts)]]


def _rejection_sample(
    drafts: list[int], p: torch.Tensor, q: torch.Tensor | None, generator: torch.Generator | None
) -> list[int]:
    """p: (k + 1, vocab) target distributions; q: (>= k, vocab) draft distributions, or None (one-hot)."""
    k = len(drafts)
    d = torch.tensor(drafts, dtype=torch.long, device=p.device)
    p_d = p[:k].gather(1, d[:, None]).squeeze(1).tolist()
    q_d = [1.0] * k if q is None else q[:k].gather(1, d[:, None]).squeeze(1).tolist()
    u = torch.rand(k, generator=generator, device=p.device).tolist()
    for j in range(k):
        if u[j] * q_d[j] < p_d[j]:  # accept with probability min(1, p/q)
            continue
        if q is None:
            residual = p[j].clone()
            residual[drafts[j]] = 0.0
        else:
            residual = (p[j] - q[j]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:
            residual = p[j]  # p <= q everywhere only when p == q up to rounding
        return drafts[:j] + [int(torch.multinomial(residual, 1, generator=generator))]
    return drafts + [int(torch.multinomial(p[k], 1, generator=generator))]
