"""The synchronous engine: add_request / abort_request / step, one model execution per step."""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from lmserve.checkpoint.generation_defaults import generation_eos_ids, read_generation_config, sampling_defaults
from lmserve.config.engine import EngineArgs, EngineConfig
from lmserve.core.kv_cache_manager import KVCacheManager
from lmserve.core.lora_slots import LoRASlotTable
from lmserve.core.outputs import BlockMap, CompletionOutput, RequestOutput, SchedulerOutput, SchedulerStats
from lmserve.core.prefix_shadow import SharedPrefixCounter
from lmserve.core.scheduler import Scheduler
from lmserve.core.state_pool import StateSlotPool
from lmserve.engine.closing import check_open, close_engine
from lmserve.engine.detokenizer import IncrementalDetokenizer
from lmserve.engine.disaggregation import make_roles
from lmserve.engine.kv_tier import KVDiskTier
from lmserve.engine.kv_transfer import KVHandoff
from lmserve.lora.request import LoRARequest
from lmserve.request import FinishReason, Request, RequestMetrics
from lmserve.sample.structured_output import StructuredOutputManager
from lmserve.sampling_params import SamplingParams, check_runner

Prompt = str | list[int]


@dataclass
class _ParentRequest:
    """A user request; n > 1 fans out to n sequences that share its prompt (and its cached blocks)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    metrics: RequestMetrics
    params: SamplingParams
    texts: dict[str, str] = field(default_factory=dict)


@dataclass
class EngineCounters:
    num_requests_total: int = 0
    num_finished_by_reason: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in FinishReason})
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_steps_total: int = 0
    # what the diagnosis (lmserve.observability.diagnose) reads: tokens by kind, and model-step wall time split by the
    # step's mix (decode-only steps vs steps computing prompt tokens beside decodes)
    prefill_tokens_total: int = 0
    decode_tokens_total: int = 0
    step_time_s_total: float = 0.0
    num_decode_steps_total: int = 0  # steps with only decode tokens
    decode_step_time_s_total: float = 0.0
    decode_step_seqs_total: int = 0  # sequences in those steps (their mean batch size)
    decode_step_time_min_s: float = 0.0  # the fastest decode-only step so far: the step's idle figure
    num_mixed_steps_total: int = 0  # steps with prompt tokens and decode tokens
    mixed_step_time_s_total: float = 0.0
    mixed_step_prefill_tokens_total: int = 0
    prefix_shareable_tokens_total: int = 0  # prompt tokens an earlier prompt had (SharedPrefixCounter)

    def count_step(self, sched: SchedulerOutput, elapsed_s: float) -> None:
        self.num_steps_total += 1
        self.step_time_s_total += elapsed_s
        self.prefill_tokens_total += sched.num_prefill_tokens
        self.decode_tokens_total += sched.num_decode_tokens
        if not sched.num_decode_tokens:
            return
        if not sched.num_prefill_tokens:
            self.num_decode_steps_total += 1
            self.decode_step_time_s_total += elapsed_s
            self.decode_step_seqs_total += len(sched.scheduled)
            best = self.decode_step_time_min_s
            self.decode_step_time_min_s = elapsed_s if best == 0.0 else min(best, elapsed_s)
        else:
            self.num_mixed_steps_total += 1
            self.mixed_step_time_s_total += elapsed_s
            self.mixed_step_prefill_tokens_total += sched.num_prefill_tokens


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        tp_threads: int | None = None,
        tp_cpus: tuple[int, ...] | None = None,
        tp_backend: str = "mp",
    ) -> None:
        """tp_threads / tp_cpus: a tensor-parallel group's threads and CPUs, split between its ranks; tp_backend:
        its workers as subprocesses ("mp") or Ray actors ("ray")."""
        from lmserve.checkpoint.tokenizer import load_tokenizer
        from lmserve.worker.model_runner import ModelRunner

        self.config = config
        torch.manual_seed(config.seed)
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.eos_token_ids = self._resolve_eos()
        # the model's generation_config.json sampling fields, for requests that leave them unset
        self.generation_defaults = sampling_defaults(config.model.path, config.generation_config)
        self.executor = None  # tensor parallel: the worker processes rank 0 drives (engine/tp_executor.py)
        if config.tensor_parallel_size > 1:
            from lmserve.engine.tp_executor import TPExecutor

            self.executor = TPExecutor(config, tp_threads, tp_cpus, tp_backend)
            self.runner = self.executor.runner
        else:
            self.runner = ModelRunner(config)
        self.kv_disk = KVDiskTier(config, self.runner) if config.cache.kv_disk_dir is not None else None
        self.kv = KVCacheManager(
            config.cache.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
            config.cache.sliding_window, self.kv_disk,
            b"" if self.kv_disk is None else self.kv_disk.fingerprint,
        )  # fmt: skip
        lookahead = config.speculative.num_lookahead_tokens if config.speculative is not None else 0
        lora_slots = LoRASlotTable(config.lora.max_loras) if config.lora is not None else None
        # a hybrid model's per-sequence recurrent state: one slot per running request (core/state_pool.py)
        state_slots = StateSlotPool(config.cache.num_state_slots) if config.cache.num_state_slots else None
        self.scheduler = Scheduler(config.scheduler, self.kv, num_lookahead_tokens=lookahead, lora_slots=lora_slots,
                                   state_slots=state_slots)  # fmt: skip
        self.structured = StructuredOutputManager(
            self.tokenizer, config.model.vocab_size, self.eos_token_ids,
            allow_additional_properties=config.structured_outputs_allow_additional_properties,
        )  # fmt: skip
        self._grammar_pending: list[_ParentRequest] = []  # parents whose grammar is still compiling
        self.counters = EngineCounters()
        self.shared_prefix = SharedPrefixCounter(config.cache.block_size, max(4 * config.cache.num_blocks, 4096))
        self._parents: dict[str, _ParentRequest] = {}
        self._child_to_parent: dict[str, str] = {}
        self._ids = itertools.count()
        self.kv_producer, self.kv_consumer = make_roles(self)  # prefill/decode disaggregation (None, None: colocated)
        self.closed = False

    def close(self) -> None:
        """End the processes and threads the engine started and free its model and KV pool (engine/closing.py);
        the engine raises EngineClosedError after; a second close does nothing."""
        close_engine(self)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def _resolve_eos(self) -> tuple[int, ...]:
        eos = set(self.config.model.eos_token_ids)
        eos.update(generation_eos_ids(read_generation_config(self.config.model.path)))
        if not eos and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        return tuple(sorted(eos))

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation defaults (what a request without params gets)."""
        return SamplingParams(**self.generation_defaults)

    # ---- requests ---------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return str(next(self._ids))

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
        num_blocks = self.kv.num_blocks_held(n + max_tokens, sc.max_num_batched_tokens)  # freed out of a window
        if num_blocks > cc.num_blocks:
            raise ValueError(
                f"request needs up to {n + max_tokens} tokens ({n} prompt + {max_tokens} max_tokens) = "
                f"{num_blocks} KV blocks of {cc.block_size}, but the KV pool holds only {cc.num_blocks} blocks "
                f"({cc.num_tokens} tokens); lower max_tokens or raise num_kv_blocks / kv_cache_memory_gib"
            )
        return max_tokens

    def add_request(
        self,
        request_id: str | None,
        prompt: Prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        *,
        do_remote_decode: bool = False,
        remote_kv: KVHandoff | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """do_remote_decode (a kv_producer engine): stop after the first token and hand the KV off
        (kv_producer.take_handoffs()); remote_kv (a kv_consumer engine): continue from such a handoff."""
        check_open(self)
        params = params or self.default_sampling_params()
        request_id = self.new_request_id() if request_id is None else request_id
        if request_id in self._parents or (self.kv_producer is not None and self.kv_producer.holds(request_id)):
            raise ValueError(f"request_id {request_id!r} is already in use")
        if do_remote_decode and self.kv_producer is None:
            raise ValueError("kv_transfer_params.do_remote_decode: this engine's kv_role is not kv_producer")
        if remote_kv is not None and (self.kv_consumer is None or params.prompt_logprobs is not None):
            raise ValueError("kv_transfer_params: a handoff needs kv_role kv_consumer, and no prompt_logprobs")
        text, prompt_ids = self.tokenize(prompt)
        max_tokens = self.validate(prompt_ids, params)
        if lora_request is not None:
            self.add_lora(lora_request)  # loaded (validated) now: a broken adapter is refused before queueing
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.structured.compile(params.structured_outputs)
            if grammar.done() and grammar.exception() is not None:
                raise grammar.exception()  # GrammarError (a ValueError naming the field), known already
        arrival = time.time() if arrival_time is None else arrival_time
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
            child_id = request_id if num_seqs == 1 else f"{request_id}#{i}"
            child = Request(
                request_id=child_id,
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
            if grammar is not None:
                child.structured_output = self.structured.new_request(params.structured_outputs)
            if params.seed is not None:
                child.generator = torch.Generator(device=self.config.device).manual_seed(params.seed + i)
            children.append(child)
        parent = _ParentRequest(request_id, text, prompt_ids, children, RequestMetrics(arrival), params)
        self._parents[request_id] = parent
        if grammar is not None and not grammar.done():
            self._grammar_pending.append(parent)
        if self.kv_disk is not None and remote_kv is None:
            self.kv_disk.prefetch(children, self.kv)  # (before queueing: the scheduler sees it reading)
        for child in children:
            self._child_to_parent[child.request_id] = request_id
            if remote_kv is None:
                self.scheduler.add_request(child)
        if remote_kv is not None:
            self.kv_consumer.adopt(parent, remote_kv)
        if do_remote_decode:
            self.kv_producer.watch(parent)
        self.counters.num_requests_total += 1
        if remote_kv is None:  # a handed-off request's prompt was counted where it was prefilled
            self.counters.prompt_tokens_total += len(prompt_ids)
        self.counters.prefix_shareable_tokens_total += self.shared_prefix.observe(prompt_ids)
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        for rid in ids:
            if self.kv_producer is not None:  # sequences handed off (or about to be) end under their leases
                self.counters.num_finished_by_reason[FinishReason.ABORT.value] += self.kv_producer.abort(rid)
            parent = self._parents.get(rid)
            if parent is None:
                continue
            if self.kv_consumer is not None:
                self.kv_consumer.forget([c.request_id for c in parent.children])
            aborted = self.scheduler.abort_requests([c.request_id for c in parent.children])
            self.counters.num_finished_by_reason[FinishReason.ABORT.value] += len(aborted)
            for child in parent.children:
                self._child_to_parent.pop(child.request_id, None)
            del self._parents[rid]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self, include_disk: bool = False) -> None:
        """Forget every cached prefix (vLLM's reset_prefix_cache, SGLang's flush_cache): a request added after this
        computes its whole prompt. Running requests keep their blocks; only the index forgets them. include_disk: the
        disk tier's blocks are deleted too (without it a prompt evicted there still hits)."""
        self.kv.pool.reset_prefix_cache()
        if include_disk and self.kv_disk is not None:
            self.kv_disk.clear()

    # ---- LoRA adapters ----------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into RAM (validated: ValueError naming the field or path). True if newly loaded."""
        if self.runner.lora is None:
            raise ValueError("lora_request: LoRA is not enabled (enable_lora=True / --enable-lora)")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        known = lora_request.lora_int_id in self.runner.lora.cpu
        self.runner.lora.add_adapter(lora_request)
        return not known

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter; refused (ValueError) while a request of it is queued or running."""
        if self.runner.lora is None:
            raise ValueError("LoRA is not enabled")
        users = [r.request_id for r in self.scheduler.requests.values() if r.lora_int_id == lora_int_id]
        if users:
            raise ValueError(f"lora adapter {lora_int_id} is in use by {len(users)} requests; unload it when they end")
        assert self.scheduler.lora_slots is not None
        self.scheduler.lora_slots.forget(lora_int_id)
        return self.runner.lora.remove_adapter(lora_int_id)

    def list_loras(self) -> list[int]:
        return [] if self.runner.lora is None else self.runner.lora.list_adapters()

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        check_open(self)
        refused = self._finish_refused_grammars() if self._grammar_pending else []
        if self.kv_producer is not None or self.kv_consumer is not None:
            refused += self._resolve_kv_transfer()
        sched = self.scheduler.schedule()
        if self.kv_disk is not None and (sched.kv_saves or sched.kv_loads):
            self.kv_disk.apply(sched.kv_saves, sched.kv_loads)
        if sched.is_empty:
            if self.kv_disk is not None and not refused and self.kv_disk.wait_prefetch():
                return refused  # only requests whose prefix is being read from disk: waited for one, do not spin
            if self._grammar_pending and not refused:  # only compiling requests: wait for one, do not spin
                self.structured.wait_any([c.structured_output for p in self._grammar_pending for c in p.children])
            return refused
        start = time.perf_counter()
        runner_out = self.runner.execute(sched)
        updated = self.scheduler.update_from_output(sched, runner_out, self.config.scheduler.max_model_len)
        self.counters.count_step(sched, time.perf_counter() - start)
        self._record_prompt_logprobs(sched, runner_out.prompt_logprobs)
        for s in sched.scheduled:  # a pooling request's output, the step its prompt is computed
            if s.request.request_id in runner_out.pooled:
                s.request.pooled = runner_out.pooled[s.request.request_id]
        parents: dict[str, _ParentRequest] = {}
        for req in updated:
            rid = req.request_id
            logprobs = runner_out.accepted_logprobs.get(rid, []) + [runner_out.logprobs.get(rid)]
            self.counters.generation_tokens_total += self._process_new_tokens(req, logprobs)
            parent = self._parents[self._child_to_parent[req.request_id]]
            parents[parent.request_id] = parent
            if req.is_finished:
                self.counters.num_finished_by_reason[req.finish_reason.value] += 1
        outputs = [self._make_output(p) for p in parents.values()]
        if self.kv_producer is not None:
            self.kv_producer.hand_off(updated)  # sequences with their first token leave, their KV under a lease
        return refused + [o for o in outputs if o is not None]

    def _resolve_kv_transfer(self) -> list[RequestOutput]:
        """Between steps: free ended KV leases (producer); finish and start KV pulls (consumer)."""
        if self.kv_producer is not None:
            self.kv_producer.collect()
        return self.kv_consumer.resolve() if self.kv_consumer is not None else []

    def _finish_refused_grammars(self) -> list[RequestOutput]:
        """Requests whose grammar failed to compile in the background finish as aborted, the library's reason
        as stop_reason (the server compiles before queueing, so its clients get a 400 instead)."""
        outputs = []
        for parent in list(self._grammar_pending):
            grammar = parent.children[0].structured_output
            if grammar.is_compiling:
                continue
            self._grammar_pending.remove(parent)
            if grammar.error is None or parent.request_id not in self._parents:
                continue
            ids = [c.request_id for c in parent.children]
            for req in self.scheduler.finish_requests(ids, FinishReason.ABORT, grammar.error):
                self.counters.num_finished_by_reason[FinishReason.ABORT.value] += 1
                req.delta_text += req.detokenizer.flush()
            out = self._make_output(parent)
            if out is not None:
                outputs.append(out)
        return outputs

    @staticmethod
    def _record_prompt_logprobs(sched: SchedulerOutput, found: dict[str, tuple[int, list[Any]]]) -> None:
        for s in sched.scheduled:
            req = s.request
            if req.request_id in found:
                first, entries = found[req.request_id]
                # positions already recorded (a recompute after preemption) are not added twice
                req.prompt_logprobs.extend(entries[len(req.prompt_logprobs) - first :])

    def _process_new_tokens(self, req: Request, logprobs: list[Any]) -> int:
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
                grammar_done = self._advance_grammar(req, token)
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

    @staticmethod
    def _advance_grammar(req: Request, token: int) -> bool:
        """The matcher consumes a kept token; returns whether the grammar is complete (the sequence stops
        there, STOP, and later tokens of the run are dropped)."""
        grammar = req.structured_output
        assert grammar.accept_token(token), (
            f"request {req.request_id}: token {token} violates its grammar ({grammar.matcher.get_error()})"
        )
        return grammar.is_terminated

    def _make_output(self, parent: _ParentRequest) -> RequestOutput | None:
        """The parent's output for this step; with best_of > n, only once all sequences finished (the n
        with the highest cumulative logprob are returned)."""
        finished = all(c.is_finished for c in parent.children)
        params = parent.params
        children = parent.children
        if len(children) > params.n:
            if not finished:
                return None
            children = sorted(children, key=lambda c: c.cumulative_logprob, reverse=True)[: params.n]
        outputs = []
        for i, child in enumerate(children):
            n_delta = child.num_delta_tokens
            keep_logprobs = child.logprobs is not None and params.logprobs is not None
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=child.detokenizer.output_text,
                    token_ids=list(child.output_token_ids),
                    finish_reason=child.finish_reason,
                    stop_reason=child.stop_reason,
                    logprobs=list(child.logprobs) if keep_logprobs else None,
                    cumulative_logprob=child.cumulative_logprob,
                    delta_text=child.delta_text,
                    delta_token_ids=child.output_token_ids[len(child.output_token_ids) - n_delta :],
                )
            )
            child.delta_text, child.num_delta_tokens = "", 0
        first = parent.children[0]
        m = parent.metrics
        m.first_scheduled_time = _min_time(c.metrics.first_scheduled_time for c in parent.children)
        m.first_token_time = _min_time(c.metrics.first_token_time for c in parent.children)
        m.last_token_time = max((c.metrics.last_token_time or 0.0) for c in parent.children) or None
        if finished:
            m.finished_time = max(c.metrics.finished_time or 0.0 for c in parent.children)
            del self._parents[parent.request_id]
            for c in parent.children:
                self._child_to_parent.pop(c.request_id, None)
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

    # ---- observability ----------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def block_map(self) -> BlockMap:
        """The KV pool's blocks: owner (a sequence id; `parent#i` for n > 1), ref count, cached (the dashboard)."""
        return self.kv.block_map()

    def get_metrics(self) -> dict[str, Any]:
        check_open(self)
        s = self.scheduler.stats()
        c = self.counters
        return {
            "num_requests_total": c.num_requests_total,
            "num_requests_running": s.num_running,
            "num_requests_waiting": s.num_waiting,
            "num_steps_total": c.num_steps_total,
            "prompt_tokens_total": c.prompt_tokens_total,
            "generation_tokens_total": c.generation_tokens_total,
            "num_preemptions_total": s.num_preemptions_total,
            "prefix_cache_queries_total": s.prefix_cache_queries_total,
            "prefix_cache_hits_total": s.prefix_cache_hits_total,
            **self._kv_disk_metrics(s),
            "kv_cache_usage": s.kv_cache_usage,
            "num_kv_blocks": self.config.cache.num_blocks,
            "kv_cache_capacity_tokens": self.config.cache.num_tokens,
            "kv_cache_bytes_per_token": self.config.cache.kv_bytes_per_token,
            "kv_cache_capacity_bytes": self.config.cache.pool_bytes,
            "kv_cache_committed_bytes": self.runner.kv_pool.committed_bytes,  # (blocks first used so far)
            "kv_cache_dtype": self.config.cache.kv_cache_dtype,
            "kv_cache_scale_bytes_per_token": self.config.cache.kv_scale_bytes_per_token,
            "kv_cache_max_concurrent_requests": self.config.cache.max_concurrent_requests(
                self.config.scheduler.max_model_len
            ),  # of max_model_len tokens each: the concurrency the pool buys
            "finished_requests_by_reason": dict(c.num_finished_by_reason),
            **self._lora_metrics(),
            **self._state_slot_metrics(),
            **spec_decode_metrics(s),
            **step_metrics(s, c),
            **config_metrics(self.config),
            **(role.metrics() if (role := self.kv_producer or self.kv_consumer) is not None else {}),
        }

    def _kv_disk_metrics(self, s: SchedulerStats) -> dict[str, Any]:
        """The disk tier's counters (engine/kv_tier.py) and the prefix-cache hits it served."""
        if self.kv_disk is None:
            return {}
        return {"prefix_cache_disk_hits_total": s.prefix_cache_disk_hits_total, **self.kv_disk.metrics(),
                "kv_disk_blocks_read_sync_total": self.kv.num_disk_sync_reads_total}  # fmt: skip

    def _state_slot_metrics(self) -> dict[str, Any]:
        """A hybrid model's state slots: held by running requests, in all, and the bytes of one."""
        pool = self.scheduler.state_slots
        if pool is None:
            return {}
        return {"num_state_slots_used": pool.num_used, "num_state_slots": pool.num_slots,
                "state_bytes_per_sequence": self.config.cache.state_bytes_per_sequence}  # fmt: skip

    def _lora_metrics(self) -> dict[str, Any]:
        """Running requests per adapter name (the base model's under ""), the slots' bytes (the ledger's LoRA line)."""
        pool = self.runner.lora
        if pool is None:
            return {}
        running: dict[str, int] = {}
        for r in self.scheduler.running:
            name = "" if r.lora_request is None else r.lora_request.lora_name
            running[name] = running.get(name, 0) + 1
        slots = self.scheduler.lora_slots
        assert slots is not None
        return {
            "lora_num_requests_running_by_adapter": running,
            "lora_slot_bytes": pool.num_bytes,
            "lora_cpu_bytes": pool.cpu_bytes,
            "lora_max_loras": slots.max_loras,
            "lora_num_active_slots": slots.num_active,
            "lora_num_slot_loads_total": pool.num_slot_loads_total,
            "lora_num_slot_evictions_total": slots.num_evictions_total,
        }


def spec_decode_metrics(s: SchedulerStats) -> dict[str, float]:
    """Speculative decoding counters, acceptance rate (accepted / proposed) and mean accepted length (tokens a
    verification step emits: accepted proposals + the one the target samples; 0 before any verification)."""
    drafts, proposed = s.spec_num_drafts_total, s.spec_num_draft_tokens_total
    accepted = s.spec_num_accepted_tokens_total
    return {
        "spec_decode_num_drafts_total": drafts,
        "spec_decode_num_draft_tokens_total": proposed,
        "spec_decode_num_accepted_tokens_total": accepted,
        "spec_decode_acceptance_rate": accepted / proposed if proposed else 0.0,
        "spec_decode_mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
    }


def step_metrics(s: SchedulerStats, c: EngineCounters) -> dict[str, float]:
    """The latest step's token split and the step-time counters the diagnosis reads."""
    return {
        "num_prefill_tokens_step": s.num_prefill_tokens,
        "num_decode_tokens_step": s.num_decode_tokens,
        "prefill_tokens_total": c.prefill_tokens_total,
        "decode_tokens_total": c.decode_tokens_total,
        "step_time_s_total": c.step_time_s_total,
        "num_decode_steps_total": c.num_decode_steps_total,
        "decode_step_time_s_total": c.decode_step_time_s_total,
        "decode_step_seqs_total": c.decode_step_seqs_total,
        "decode_step_time_min_s": c.decode_step_time_min_s,
        "num_mixed_steps_total": c.num_mixed_steps_total,
        "mixed_step_time_s_total": c.mixed_step_time_s_total,
        "mixed_step_prefill_tokens_total": c.mixed_step_prefill_tokens_total,
        "prefix_shareable_tokens_total": c.prefix_shareable_tokens_total,
    }


def config_metrics(config: EngineConfig) -> dict[str, Any]:
    """The settings a diagnosis names (scheduler, cache, the KV ledger's model shape)."""
    sc, cc, mc = config.scheduler, config.cache, config.model
    return {
        "scheduling_policy": sc.scheduling_policy,
        "enable_chunked_prefill": sc.enable_chunked_prefill,
        "enable_prefix_caching": cc.enable_prefix_caching,
        "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "max_model_len": sc.max_model_len,
        "block_size": cc.block_size,
        "num_layers": mc.num_layers,
        "num_kv_heads": mc.num_kv_heads,
        "head_dim": mc.head_dim,
    }


def _min_time(values) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None
