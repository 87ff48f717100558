"""Beam search on top of the engine, as vLLM's `LLM.beam_search` (beam_search, BeamSearchParams).

Every step re-submits each live beam as a one-token greedy request for its top logprobs, all beams of all prompts
together (prefix caching spares their cached blocks). Selection follows HF's `_beam_search` exactly (float32 scores),
reproducing `generate(num_beams=k, do_sample=False, ...)` token for token; the rules are in docs/serving.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from lmserve.lora.request import LoRARequest
from lmserve.request import FinishReason
from lmserve.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from lmserve.engine.input_processor import Prompt
    from lmserve.engine.llm_engine import LLMEngine

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2
"""Each beam asks for its top 2 * beam_width logprobs, and logprobs are capped at MAX_LOGPROBS."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class BeamSearchParams:
    """Options of one beam search (vLLM's names; `early_stopping` as HF's).

    `early_stopping`: False (HF's default) stops once the best live beam cannot beat the finished ones at
    the current length; True stops as soon as beam_width hypotheses are finished; "never" assumes the live
    beams may still grow to max_tokens (when length_penalty > 0).
    """

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False
    early_stopping: bool | Literal["never"] = False

    def __post_init__(self) -> None:
        if not _is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        lp = self.length_penalty
        if not (_is_int(lp) or isinstance(lp, float)) or not math.isfinite(lp):
            raise ValueError(f"length_penalty must be a finite number, got {lp!r}")
        self.length_penalty = float(lp)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")


@dataclass
class BeamSearchSequence:
    """One finished hypothesis. `token_ids` are the generated tokens only (an ending EOS included, as HF)."""

    token_ids: list[int]
    text: str
    cumulative_logprob: float  # sum of the tokens' logprobs
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty (HF's sequences_scores)
    finish_reason: FinishReason  # stop (ended with EOS) or length
    logprobs: list[float] = field(default_factory=list)  # per generated token


@dataclass
class BeamSearchOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]  # best score first; beam_width of them


@dataclass
class _Beam:
    tokens: list[int]
    logprobs: list[float]
    score: torch.Tensor  # 0-d float32 cumulative logprob


@dataclass
class _Hypothesis:
    tokens: list[int]
    logprobs: list[float]
    cum: torch.Tensor  # 0-d float32
    score: torch.Tensor  # 0-d float32, length-penalised


@dataclass
class _PromptState:
    prompt: str | None
    prompt_ids: list[int]
    max_tokens: int
    beams: list[_Beam]
    finished: list[_Hypothesis] = field(default_factory=list)
    done: bool = False


def beam_search(
    engine: LLMEngine, prompts: Prompt | list[Prompt], params: BeamSearchParams, lora_request: LoRARequest | None = None
) -> list[BeamSearchOutput]:
    """Beam search for every prompt (outputs in input order), under one LoRA adapter if given. Drives `engine` until
    its own requests are done; run it on an engine with no other requests in flight (their outputs would not be
    returned)."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and _is_int(prompts[0])):
        prompts = [prompts]  # type: ignore[list-item]
    eos = () if params.ignore_eos else tuple(engine.eos_token_ids)
    width = params.beam_width
    num_candidates = max(2, 1 + len(eos)) * width
    if num_candidates > MAX_LOGPROBS:
        raise ValueError(
            f"beam_width must be <= {MAX_LOGPROBS // max(2, 1 + len(eos))} for a model with {len(eos)} EOS ids "
            f"(each step needs the top max(2, 1 + #EOS) * beam_width logprobs, at most {MAX_LOGPROBS}), "
            f"got {width}"
        )
    states: list[_PromptState] = []
    for i, prompt in enumerate(prompts):  # type: ignore[arg-type]
        try:
            text, ids = engine.tokenize(prompt)
            max_tokens = engine.validate(ids, SamplingParams(max_tokens=params.max_tokens))
        except ValueError as e:
            raise ValueError(f"prompts[{i}]: {e}") from None
        states.append(_PromptState(text, ids, max_tokens, [_Beam([], [], torch.zeros((), dtype=torch.float32))]))

    step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=num_candidates, ignore_eos=True)
    cur = 0  # tokens generated so far by the live beams
    while not all(s.done for s in states):
        live = [s for s in states if not s.done]
        top = _run_step(engine, [[s.prompt_ids + b.tokens for b in s.beams] for s in live], step_params, lora_request)
        cur += 1
        for state, beam_tops in zip(live, top, strict=True):
            _advance(state, beam_tops, cur, params, eos, num_candidates)

    tokenizer = engine.tokenizer
    outputs = []
    for s in states:
        seqs = []
        for h in s.finished:
            reason = FinishReason.STOP if h.tokens and h.tokens[-1] in eos else FinishReason.LENGTH
            seqs.append(
                BeamSearchSequence(
                    token_ids=h.tokens,
                    text=tokenizer.decode(h.tokens, skip_special_tokens=True),
                    cumulative_logprob=float(h.cum),
                    score=float(h.score),
                    finish_reason=reason,
                    logprobs=h.logprobs,
                )
            )
        outputs.append(BeamSearchOutput(s.prompt, s.prompt_ids, seqs))
    return outputs


def _run_step(
    engine: LLMEngine, sequences: list[list[list[int]]], params: SamplingParams, lora_request: LoRARequest | None = None
) -> list[list[list[tuple[int, float]]]]:
    """One token for every beam of every prompt, submitted together; returns each beam's top logprobs."""
    lora = {} if lora_request is None else {"lora_request": lora_request}
    ids = [[engine.add_request(None, seq, params, **lora) for seq in beams] for beams in sequences]
    pending = {rid for beams in ids for rid in beams}
    top: dict[str, list[tuple[int, float]]] = {}
    while pending:
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"beam search requests vanished from the engine: {sorted(pending)[:5]}")
        for out in engine.step():
            if out.finished and out.request_id in pending:
                pending.discard(out.request_id)
                top[out.request_id] = out.outputs[0].logprobs[0].top_logprobs  # type: ignore[index]
    return [[top[rid] for rid in beams] for beams in ids]


def _advance(
    s: _PromptState,
    beam_tops: list[list[tuple[int, float]]],
    cur: int,
    params: BeamSearchParams,
    eos: tuple[int, ...],
    k: int,
) -> None:
    """One HF beam-search iteration for one prompt, given each live beam's top-k next-token logprobs."""
    width, lp_pow = params.beam_width, params.length_penalty
    # Candidates: the top k of (beam score + token logprob) over all beams, in float32 as HF.
    sources, tokens, logprobs = [], [], []
    for b, tops in enumerate(beam_tops):
        for tok, lp in tops:
            sources.append(b)
            tokens.append(tok)
            logprobs.append(lp)
    token_lp = torch.tensor(logprobs, dtype=torch.float32)
    base = torch.stack([s.beams[b].score for b in sources])
    acc = token_lp + base
    order = torch.argsort(acc, descending=True, stable=True)[:k].tolist()

    ends = [tokens[j] in eos or cur >= s.max_tokens for j in order]
    cands = [(sources[j], tokens[j], logprobs[j], acc[j]) for j in order]

    # Finished hypotheses: only ended candidates among the first `width`. (HF also refuses new ones once its
    # early-stop conditions hold, but those end this prompt's search below, so it is never advanced again.)
    divisor = cur**lp_pow
    merged = list(s.finished)
    for rank, ((b, tok, lp, total), end) in enumerate(zip(cands, ends, strict=True)):
        if rank < width and end:
            beam = s.beams[b]
            merged.append(_Hypothesis(beam.tokens + [tok], beam.logprobs + [lp], total, total / divisor))
    merged.sort(key=lambda h: -float(h.score))  # stable: on a tie the older hypothesis stays ahead
    s.finished = merged[:width]

    # Next live beams: the best `width` candidates that did not end.
    s.beams = [
        _Beam(s.beams[b].tokens + [tok], s.beams[b].logprobs + [lp], total)
        for (b, tok, lp, total), end in zip(cands, ends, strict=True)
        if not end
    ][:width]

    if cur >= s.max_tokens or not s.beams:
        s.done = True
        return
    if params.early_stopping is True and len(s.finished) >= width:
        s.done = True
        return
    # HF's heuristic: can the best live beam still beat the worst kept hypothesis?
    if len(s.finished) >= width:
        length = s.max_tokens if (params.early_stopping == "never" and lp_pow > 0.0) else cur
        best_possible = s.beams[0].score / (length**lp_pow)
        worst = min(float(h.score) for h in s.finished)
        if not bool(best_possible > worst):
            s.done = True
