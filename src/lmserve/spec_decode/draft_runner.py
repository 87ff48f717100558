"""The draft model: its own weights and paged KV cache, proposing k tokens per request in one call
(DraftModelProposer). See docs/speculative_decoding.md.
"""

from __future__ import annotations

from typing import Any

import torch

from lmserve.config.engine import EngineConfig
from lmserve.config.kv_budget import available_ram_bytes
from lmserve.model.attention import MAX_DECODE_RUN, AttentionMetadata, PrefillSegment
from lmserve.model.kv_cache import KVCache
from lmserve.model.layers import pack_linear_weights
from lmserve.model.loader import load_model
from lmserve.sample.sampler import _SAMPLING_EPS, apply_token_bitmask
from lmserve.sample.structured_output import fill_bitmasks
from lmserve.spec_decode.proposal import ProposalInput


def _ended(item: ProposalInput) -> bool:
    """The grammar is complete after the proposals so far: the request ends there, nothing to add."""
    grammar = item.request.structured_output
    return grammar is not None and grammar.is_terminated


class DraftModelProposer:
    """Proposes with the draft model on KV tensors of the target's block geometry, so the scheduler's block tables
    serve both models; request.num_draft_computed_tokens counts the positions whose draft KV is valid.

    One call feeds each request its catch-up chunk (its draft prefill after admission or preemption, usually the
    last one or two tokens) to get d_1, then n - 1 batched decode forwards. It never trusts another request's
    prefix-cache blocks: after a prefix hit it computes its own prefill, writing the same values.
    """

    def __init__(self, config: EngineConfig) -> None:
        spec = config.speculative
        assert spec is not None and spec.draft is not None, "the draft-model proposer needs a draft ModelConfig"
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.vocab_size = config.model.vocab_size
        dc = spec.draft
        self.model = load_model(dc, config.scheduler.max_model_len, config.device)
        if self.device.type == "cpu":
            pack_linear_weights(self.model, available_ram_bytes() // 16)
        self.kv_caches: list[KVCache] = [  # in the draft's dtype (its KV is recomputable and small)
            KVCache.allocate(
                config.cache.num_blocks, self.block_size, dc.num_kv_heads, dc.head_dim, dc.dtype, self.device
            )
            for _ in range(dc.num_layers)
        ]

    @torch.inference_mode()
    def propose(self, inputs: list[ProposalInput]) -> tuple[dict[str, list[int]], dict[str, Any]]:
        grammars = [it.request.structured_output for it in inputs if it.request.structured_output is not None]
        for item in inputs:  # a constrained request drafts from the grammar state after this step's tokens
            if item.request.structured_output is not None:
                item.request.structured_output.advance_tentatively(item.new_token_ids)
        try:
            return self._propose(inputs)
        finally:
            for grammar in grammars:
                grammar.rollback_tentative()

    def _propose(self, inputs: list[ProposalInput]) -> tuple[dict[str, list[int]], dict[str, Any]]:
        tokens: dict[str, list[int]] = {}
        probs: dict[str, list[torch.Tensor]] = {}
        # forward 1: each request's catch-up chunk, ending with its newest token
        chunks = []
        for item in inputs:
            req = item.request
            end = len(item.token_ids)
            start = min(req.num_draft_computed_tokens, end - 1)
            chunks.append((item.token_ids[start:end], start, item.block_ids))
            req.num_draft_computed_tokens = end
            tokens[req.request_id], probs[req.request_id] = [], []
        active = list(inputs)
        while True:
            logits = self._forward(chunks)
            self._mask_by_grammar(logits, active)
            for item, row in zip(active, logits, strict=True):
                token, q = self._sample(row, item)
                tokens[item.request.request_id].append(token)
                if q is not None:
                    probs[item.request.request_id].append(q)
                if item.request.structured_output is not None:
                    item.request.structured_output.advance_tentatively([token])
            active = [it for it in active if len(tokens[it.request.request_id]) < it.num_proposals and not _ended(it)]
            if not active:
                break
            chunks = []
            for item in active:  # decode: feed the last proposal at the next position
                req = item.request
                chunks.append(([tokens[req.request_id][-1]], req.num_draft_computed_tokens, item.block_ids))
                req.num_draft_computed_tokens += 1
        draft_probs = {rid: torch.stack(qs) for rid, qs in probs.items() if qs}
        return tokens, draft_probs

    def _mask_by_grammar(self, logits: torch.Tensor, active: list[ProposalInput]) -> None:
        """Constrained rows draft only tokens their grammar allows (from the state after the tokens so far):
        q is then the masked distribution, so rejection sampling stays exact and no proposal is wasted."""
        rows = [i for i, it in enumerate(active) if it.request.structured_output is not None]
        if rows:
            grammars = [active[i].request.structured_output for i in rows]
            apply_token_bitmask(logits, fill_bitmasks(rows, grammars, self.vocab_size))

    def _sample(self, logits: torch.Tensor, item: ProposalInput) -> tuple[int, torch.Tensor | None]:
        """Greedy requests take the draft's argmax (q one-hot, not stored); sampled ones draw from the draft's
        temperature-scaled softmax, q kept for the rejection sampler."""
        params = item.request.sampling_params
        if params.temperature < _SAMPLING_EPS:
            return int(logits.argmax()), None
        q = torch.softmax(logits.float() / params.temperature, dim=-1)
        return int(torch.multinomial(q, 1, generator=item.request.generator)), q

    def _forward(self, chunks: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """chunks: (token ids, first position, block table) per request → logits of each chunk's last token.
        A chunk of at most MAX_DECODE_RUN tokens (the usual catch-up: the last proposal and the bonus token) runs as
        that many decode rows, each a query over its own prefix, as the target's verification run does: the
        decode kernels and the one-call stack take it. Longer chunks (a prefill) are prefill segments."""
        bs, dev = self.block_size, self.device
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i][0]) > MAX_DECODE_RUN)  # decode rows first
        ids, pos, slots, last_rows = [], [], [], [0] * len(chunks)
        lens, tables, prefills = [], [], []
        for i in order:
            toks, start, table = chunks[i]
            row0 = len(ids)
            p = list(range(start, start + len(toks)))
            ids += toks
            pos += p
            slots += [table[x // bs] * bs + x % bs for x in p]
            last_rows[i] = len(ids) - 1
            if len(toks) > MAX_DECODE_RUN:
                prefills.append((row0, toks, start, table))
            else:
                lens += [x + 1 for x in p]
                tables += [table] * len(toks)
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev))
        if lens:
            meta.set_decodes(lens, tables, bs)
        for row0, toks, start, table in prefills:
            meta.prefills.append(PrefillSegment.for_chunk(row0, len(toks), start, table, bs, dev))
        hidden = self.model(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
        )
        if len(last_rows) != len(ids):
            hidden = hidden[torch.tensor(last_rows, device=dev)]
        return self.model.compute_logits(hidden)
