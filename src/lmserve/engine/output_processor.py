"""Requests out: each step's new tokens detokenized, stop strings and complete grammars applied, and one
RequestOutput per user request (its n / best_of sequences gathered: parallel sampling)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmserve.core.outputs import CompletionOutput, RequestOutput, SchedulerOutput
from lmserve.core.scheduler import Scheduler
from lmserve.request import FinishReason, Request, RequestMetrics
from lmserve.sampling_params import SamplingParams


@dataclass
class ParentRequest:
    """A user request; n > 1 fans out to n sequences that share its prompt (and its cached blocks)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    metrics: RequestMetrics
    params: SamplingParams
    texts: dict[str, str] = field(default_factory=dict)


class OutputProcessor:
    """The user requests in flight, by id and by sequence id; builds their outputs."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.parents: dict[str, ParentRequest] = {}
        self.child_to_parent: dict[str, str] = {}

    def add(self, parent: ParentRequest) -> None:
        self.parents[parent.request_id] = parent
        for child in parent.children:
            self.child_to_parent[child.request_id] = parent.request_id

    def pop(self, request_id: str) -> ParentRequest | None:
        """Forget a user request (finished, aborted or handed off); None if unknown."""
        parent = self.parents.pop(request_id, None)
        if parent is not None:
            for child in parent.children:
                self.child_to_parent.pop(child.request_id, None)
        return parent

    def parent_of(self, req: Request) -> ParentRequest:
        return self.parents[self.child_to_parent[req.request_id]]

    @staticmethod
    def record_prompt_logprobs(sched: SchedulerOutput, found: dict[str, tuple[int, list[Any]]]) -> None:
        for s in sched.scheduled:
            req = s.request
            if req.request_id in found:
                first, entries = found[req.request_id]
                # positions already recorded (a recompute after preemption) are not added twice
                req.prompt_logprobs.extend(entries[len(req.prompt_logprobs) - first :])

    def process_new_tokens(self, req: Request, logprobs: list[Any]) -> int:
        """Detokenize the step's new tokens (several when speculative proposals were accepted), one at a time so
        that a stop string ends the request at the token that completed it: tokens after it are dropped, as if
        never generated. The stop finishes the request here (its blocks freed now). A constrained request's
        matcher consumes the kept tokens (not the one the scheduler finished the request on: EOS or max_tokens,
        as without speculation); a complete grammar ends the run likewise. Returns the tokens kept."""
        new = req.output_token_ids[len(req.detokenizer.output_token_ids) :]
        stop_str, grammar_done = None, False
        for i, token in enumerate(new):
            update = req.detokenizer.update([token])
            req.delta_text += update.delta_text
            if req.structured_output is not None and not (req.is_finished and i == len(new) - 1):
                grammar_done = _advance_grammar(req, token)
            if update.stop_str is not None or grammar_done:
                stop_str = update.stop_str
                break
        num_kept = len(new) - (len(req.output_token_ids) - len(req.detokenizer.output_token_ids))
        del req.output_token_ids[len(req.detokenizer.output_token_ids) :]  # past a stop string / complete grammar
        del req.all_token_ids[req.num_prompt_tokens + req.num_output_tokens :]
        req.num_delta_tokens += num_kept
        if grammar_done:
            self._finish_request(req, FinishReason.STOP, None)
        if req.logprobs is not None:
            for lp in logprobs[:num_kept]:
                req.logprobs.append(lp)
                req.cumulative_logprob += lp.logprob
        self._finish_on_stop(req, stop_str)
        return num_kept

    def _finish_request(self, req: Request, reason: FinishReason, stop_reason: str | None) -> None:
        """Finish a request at its last kept token (the scheduler may have finished it at a later one)."""
        if req.is_finished:
            req.finish_reason, req.stop_reason = reason, stop_reason
        else:
            self.scheduler.finish_requests([req.request_id], reason, stop_reason)

    def _finish_on_stop(self, req: Request, stop_str: str | None) -> None:
        if stop_str is not None:
            self._finish_request(req, FinishReason.STOP, stop_str)
        elif req.is_finished:
            req.delta_text += req.detokenizer.flush()
            if req.detokenizer.stop_str is not None:  # the held-back tail completed a stop string
                req.finish_reason, req.stop_reason = FinishReason.STOP, req.detokenizer.stop_str

    def make_output(self, parent: ParentRequest) -> RequestOutput | None:
        """The parent's output for this step; with best_of > n, only once all sequences finished (the n
        with the highest cumulative logprob are returned). A finished parent is forgotten."""
        finished = all(c.is_finished for c in parent.children)
        params = parent.params
        children = parent.children
        if len(children) > params.n:
            if not finished:
                return None
            children = sorted(children, key=lambda c: c.cumulative_logprob, reverse=True)[: params.n]
        outputs = [_completion(i, child, params) for i, child in enumerate(children)]
        first = parent.children[0]
        m = parent.metrics
        m.first_scheduled_time = _min_time(c.metrics.first_scheduled_time for c in parent.children)
        m.first_token_time = _min_time(c.metrics.first_token_time for c in parent.children)
        m.last_token_time = max((c.metrics.last_token_time or 0.0) for c in parent.children) or None
        if finished:
            m.finished_time = max(c.metrics.finished_time or 0.0 for c in parent.children)
            self.pop(parent.request_id)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens,
            metrics=m,
            prompt_logprobs=None if first.prompt_logprobs is None else list(first.prompt_logprobs),
            pooled=first.pooled,
        )


def _completion(index: int, child: Request, params: SamplingParams) -> CompletionOutput:
    """One sequence's output; its step delta (text and tokens) is handed over and reset."""
    n_delta = child.num_delta_tokens
    keep_logprobs = child.logprobs is not None and params.logprobs is not None
    out = CompletionOutput(
        index=index,
        text=child.detokenizer.output_text,
        token_ids=list(child.output_token_ids),
        finish_reason=child.finish_reason,
        stop_reason=child.stop_reason,
        logprobs=list(child.logprobs) if keep_logprobs else None,
        cumulative_logprob=child.cumulative_logprob,
        delta_text=child.delta_text,
        delta_token_ids=child.output_token_ids[len(child.output_token_ids) - n_delta :],
    )
    child.delta_text, child.num_delta_tokens = "", 0
    return out


def _advance_grammar(req: Request, token: int) -> bool:
    """The matcher consumes a kept token; returns whether the grammar is complete (the sequence stops there,
    STOP, and later tokens of the run are dropped)."""
    grammar = req.structured_output
    assert grammar.accept_token(token), (
        f"request {req.request_id}: token {token} violates its grammar ({grammar.matcher.get_error()})"
    )
    return grammar.is_terminated


def _min_time(values) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None
