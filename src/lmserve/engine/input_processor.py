"""Requests in: a prompt tokenized, checked against the engine's limits (ValueError with the numbers), and fanned
out to its sequences (n, best_of) with their detokenizers, generators and grammar matchers."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lmserve.checkpoint.generation_defaults import generation_eos_ids, read_generation_config
from lmserve.config.engine import EngineConfig
from lmserve.engine.detokenizer import IncrementalDetokenizer
from lmserve.lora.request import LoRARequest
from lmserve.memory.ledger import kv_blocks_held
from lmserve.request import Request
from lmserve.sampling_params import SamplingParams, check_runner

Prompt = str | list[int]


def resolve_eos(config: EngineConfig, tokenizer: Any) -> tuple[int, ...]:
    """The ids that end a sequence: the config's, generation_config.json's, else the tokenizer's."""
    eos = set(config.model.eos_token_ids)
    eos.update(generation_eos_ids(read_generation_config(config.model.path)))
    if not eos and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return tuple(sorted(eos))


class InputProcessor:
    """What an engine, its core client and the simulator share to accept a request (no weights needed)."""

    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        """tokenizer None: validation of token ids only (the simulator)."""
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = () if tokenizer is None else resolve_eos(config, tokenizer)

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            try:
                return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
            except Exception as e:  # e.g. a lone UTF-16 surrogate, which no UTF-8 tokenizer can take
                raise ValueError(f"prompt: the tokenizer cannot encode it ({type(e).__name__}: {e})") from None
        if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt must be a string or a list of token ids (ints)")
        return None, list(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request can ever run; returns its resolved max_tokens. Raises ValueError with numbers."""
        sc, cc = self.config.scheduler, self.config.cache
        if params.use_beam_search:
            raise ValueError(
                "use_beam_search: beam search runs through LLM.beam_search(prompts, BeamSearchParams(...)), "
                "not through generate / add_request"
            )
        check_runner(self.config.runner, params.pooling)
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty: at least one token is needed")
        vocab = self.config.model.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:  # (in C: the simulator validates 100,000s)
            bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        scoring_only = params.max_tokens == 0  # nothing generated: the prompt alone may fill max_model_len
        if n > sc.max_model_len or (n == sc.max_model_len and not scoring_only):
            raise ValueError(
                f"prompt is {n} tokens, but max_model_len is {sc.max_model_len} "
                f"(the prompt plus at least one generated token must fit)"
            )
        room = sc.max_model_len - n
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        # blocks outside a sliding window are freed as steps advance
        num_blocks = kv_blocks_held(n + max_tokens, cc.block_size, cc.sliding_window, sc.max_num_batched_tokens)
        if num_blocks > cc.num_blocks:
            raise ValueError(
                f"request needs up to {n + max_tokens} tokens ({n} prompt + {max_tokens} max_tokens) = "
                f"{num_blocks} KV blocks of {cc.block_size}, but the KV pool holds only {cc.num_blocks} blocks "
                f"({cc.num_tokens} tokens); lower max_tokens or raise num_kv_blocks / kv_cache_memory_gib"
            )
        return max_tokens

    def make_sequences(
        self,
        request_id: str,
        text: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        arrival: float,
        lora_request: LoRARequest | None,
        new_grammar: Any = None,
    ) -> list[Request]:
        """The request's sequences: one, or n / best_of sharing its prompt (ids `request_id#i`).
        new_grammar: a callable giving each sequence its own grammar matcher (None: unconstrained)."""
        num_seqs = params.actual_best_of
        # best_of > n ranks sequences by cumulative logprob: have the sampler report the chosen token's.
        child_params = params
        if num_seqs > params.n and params.logprobs is None:
            child_params = dataclasses.replace(params, logprobs=0)
        # Only the first sequence scores the prompt (the output's prompt_logprobs are its): the others read the
        # prompt's KV from the prefix cache (a prompt_logprobs sequence computes every prompt position itself).
        other_params = child_params
        if params.prompt_logprobs is not None and num_seqs > 1:
            other_params = dataclasses.replace(child_params, prompt_logprobs=None)
        children = []
        for i in range(num_seqs):
            child = Request(
                request_id=request_id if num_seqs == 1 else f"{request_id}#{i}",
                prompt_token_ids=prompt_ids,
                sampling_params=child_params if i == 0 else other_params,
                max_tokens=max_tokens,
                eos_token_ids=self.eos_token_ids,
                prompt=text,
                arrival_time=arrival,
            )
            child.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params)
            child.lora_request = lora_request
            if child_params.logprobs is not None:
                child.logprobs, child.cumulative_logprob = [], 0.0
            if i == 0 and params.prompt_logprobs is not None:
                child.prompt_logprobs = [None]  # the first prompt token has no logprob
            if new_grammar is not None:
                child.structured_output = new_grammar()
            if params.seed is not None:
                child.generator = torch.Generator(device=self.config.device).manual_seed(params.seed + i)
            children.append(child)
        return children
