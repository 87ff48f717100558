"""Who proposes, for whom and how many: each step's proposal inputs, the n-gram proposer, and the choice of proposer.

After a step's verification the model runner asks the configured proposer for up to k tokens per request that
sampled (`proposal_inputs`); the scheduler schedules them next step as tentatively appended tokens. Imports no
torch (the draft model's proposer lives in draft_runner.py; what both take and return, in proposal.py).
"""

from __future__ import annotations

from typing import Any

from lmserve.config.speculative import SpeculativeConfig
from lmserve.core.outputs import ScheduledRequest
from lmserve.spec_decode.acceptance import AcceptanceTracker
from lmserve.spec_decode.proposal import ProposalInput, Proposer


def proposal_inputs(
    config: SpeculativeConfig,
    sampled: list[tuple[ScheduledRequest, list[int]]],
    num_scheduled: int,
    block_size: int,
) -> list[ProposalInput]:
    """Who gets proposals after this step: nobody when the step scheduled more than disable_by_batch_size
    requests; else every request that sampled, with k set by its recent acceptance (AcceptanceTracker; 0 while
    it backs off), capped so that proposals plus the token their verification adds stay within max_tokens, and
    so that a draft's KV writes stay in the block table."""
    if num_scheduled > config.disable_by_batch_size:
        return []
    out = []
    for s, new_tokens in sampled:
        req = s.request
        token_ids = req.all_token_ids + new_tokens
        remaining = req.max_tokens - (req.num_output_tokens + len(new_tokens))
        if remaining <= 1:
            continue
        if req.spec_acceptance is None:
            req.spec_acceptance = AcceptanceTracker()
        n = min(req.spec_acceptance.num_proposals(config.num_speculative_tokens, config.adaptive_threshold),
                remaining - 1)  # fmt: skip
        if config.num_lookahead_tokens:
            # the draft writes positions len(token_ids) - 1 ... len(token_ids) + n - 2
            n = min(n, len(s.block_ids) * block_size - len(token_ids) + 1)
        if n >= 1:
            out.append(ProposalInput(req, token_ids, s.block_ids, n))
    return out


def cut_at_grammar(inputs: list[ProposalInput], proposals: dict[str, list[int]]) -> None:
    """In place: a constrained request's proposals end before the first token its grammar refuses (after this
    step's new tokens), so verification can mask every verified position. Exact for n-gram lookup and greedy
    drafts, whose proposals are a function of the tokens alone; a sampling draft draws from the grammar-masked
    distribution, so it never proposes a refused token and nothing is cut."""
    for item in inputs:
        grammar = item.request.structured_output
        rid = item.request.request_id
        if grammar is not None and proposals.get(rid):
            proposals[rid] = grammar.valid_proposals(item.new_token_ids, proposals[rid])


class NgramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the request's last n tokens (n from
    prompt_lookup_max down to prompt_lookup_min) in its own tokens and propose what followed it."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, inputs: list[ProposalInput]) -> tuple[dict[str, list[int]], dict[str, Any]]:
        found = {}
        for item in inputs:
            tokens = ngram_lookup(item.token_ids, self.min_n, self.max_n, item.num_proposals)
            if tokens:
                found[item.request.request_id] = tokens
        return found, {}


def ngram_lookup(token_ids: list[int], min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """Up to num_tokens tokens that followed the latest earlier match of the longest suffix n-gram
    (min_n <= n <= max_n); [] when none matches."""
    length = len(token_ids)
    last = token_ids[-1]
    # candidate ends of an earlier match: positions e < length - 1 holding the last token
    ends = [e for e in range(length - 2, -1, -1) if token_ids[e] == last]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n :]
        for e in ends:
            start = e - n + 1
            if start >= 0 and token_ids[start : e + 1] == suffix:
                return token_ids[e + 1 : e + 1 + num_tokens]
    return []


def make_proposer(config: Any) -> Proposer | None:
    """The proposer an EngineConfig asks for (None without speculative decoding)."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec)
    from lmserve.spec_decode.draft_runner import DraftModelProposer

    return DraftModelProposer(config)
