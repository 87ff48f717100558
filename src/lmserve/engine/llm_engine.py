"""The synchronous engine: add_request / abort_request / step, one model execution per step. Requests come in
through the input processor and leave through the output processor (engine/input_processor.py, output_processor.py)."""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch

from lmserve.checkpoint.generation_defaults import sampling_defaults
from lmserve.config.engine import EngineArgs, EngineConfig
from lmserve.core.kv_cache_manager import KVCacheManager
from lmserve.core.lora_slots import LoRASlotTable
from lmserve.core.outputs import BlockMap, RequestOutput, SchedulerStats
from lmserve.core.prefix_shadow import SharedPrefixCounter
from lmserve.core.scheduler import Scheduler
from lmserve.core.state_pool import StateSlotPool
from lmserve.core.state_snapshots import StateSnapshotPool
from lmserve.engine.closing import check_open, close_engine
from lmserve.engine.counters import EngineCounters, config_metrics, spec_decode_metrics, step_metrics
from lmserve.engine.disaggregation import make_roles
from lmserve.engine.input_processor import InputProcessor, Prompt
from lmserve.engine.kv_tier import KVDiskTier
from lmserve.engine.kv_transfer import KVHandoff
from lmserve.engine.output_processor import OutputProcessor, ParentRequest
from lmserve.lora.request import LoRARequest
from lmserve.request import FinishReason, RequestMetrics
from lmserve.sample.structured_output import StructuredOutputManager
from lmserve.sampling_params import SamplingParams

__all__ = ["LLMEngine", "EngineCounters", "Prompt", "spec_decode_metrics"]


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
        self.inputs = InputProcessor(config, self.tokenizer)
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
        # and its prefix cache's state snapshots at block boundaries (core/state_snapshots.py)
        snapshots = StateSnapshotPool(config.cache.num_state_snapshots) if config.cache.num_state_snapshots else None
        self.scheduler = Scheduler(config.scheduler, self.kv, num_lookahead_tokens=lookahead, lora_slots=lora_slots,
                                   state_slots=state_slots, state_snapshots=snapshots)  # fmt: skip
        self.structured = StructuredOutputManager(
            self.tokenizer, config.model.vocab_size, self.eos_token_ids,
            allow_additional_properties=config.structured_outputs_allow_additional_properties,
        )  # fmt: skip
        self._grammar_pending: list[ParentRequest] = []  # parents whose grammar is still compiling
        self.counters = EngineCounters()
        self.shared_prefix = SharedPrefixCounter(config.cache.block_size, max(4 * config.cache.num_blocks, 4096))
        self.outputs = OutputProcessor(self.scheduler)  # the user requests in flight
        self._ids = itertools.count()
        self._moe_layers: list | None = None  # a mixture-of-experts model's MoE blocks (found at first metrics)
        self.kv_producer, self.kv_consumer = make_roles(self)  # prefill/decode disaggregation (None, None: colocated)
        self.closed = False

    def close(self) -> None:
        """End the processes and threads the engine started and free its model and KV pool (engine/closing.py);
        the engine raises EngineClosedError after; a second close does nothing."""
        close_engine(self)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.inputs.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: tuple[int, ...]) -> None:
        self.inputs.eos_token_ids = ids

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation defaults (what a request without params gets)."""
        return SamplingParams(**self.generation_defaults)

    # ---- requests ---------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        return self.inputs.tokenize(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request can ever run; returns its resolved max_tokens. Raises ValueError with numbers."""
        return self.inputs.validate(prompt_token_ids, params)

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
        if request_id in self.outputs.parents or (self.kv_producer is not None and self.kv_producer.holds(request_id)):
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
        new_grammar = None if grammar is None else lambda: self.structured.new_request(params.structured_outputs)
        children = self.inputs.make_sequences(
            request_id, text, prompt_ids, params, max_tokens, arrival, lora_request, new_grammar
        )
        parent = ParentRequest(request_id, text, prompt_ids, children, RequestMetrics(arrival), params)
        self.outputs.add(parent)
        if grammar is not None and not grammar.done():
            self._grammar_pending.append(parent)
        if self.kv_disk is not None and remote_kv is None:
            self.kv_disk.prefetch(children, self.kv)  # (before queueing: the scheduler sees it reading)
        if remote_kv is None:
            for child in children:
                self.scheduler.add_request(child)
        else:
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
            parent = self.outputs.pop(rid)
            if parent is None:
                continue
            if self.kv_consumer is not None:
                self.kv_consumer.forget([c.request_id for c in parent.children])
            aborted = self.scheduler.abort_requests([c.request_id for c in parent.children])
            self.counters.num_finished_by_reason[FinishReason.ABORT.value] += len(aborted)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self, include_disk: bool = False) -> None:
        """Forget every cached prefix (vLLM's reset_prefix_cache, SGLang's flush_cache): a request added after this
        computes its whole prompt. Running requests keep their blocks; only the index forgets them. include_disk: the
        disk tier's blocks are deleted too (without it a prompt evicted there still hits)."""
        self.kv.pool.reset_prefix_cache()
        if self.scheduler.state_snapshots is not None:
            self.scheduler.state_snapshots.reset()
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
        self.outputs.record_prompt_logprobs(sched, runner_out.prompt_logprobs)
        for s in sched.scheduled:  # a pooling request's output, the step its prompt is computed
            if s.request.request_id in runner_out.pooled:
                s.request.pooled = runner_out.pooled[s.request.request_id]
        parents: dict[str, ParentRequest] = {}
        for req in updated:
            rid = req.request_id
            logprobs = runner_out.accepted_logprobs.get(rid, []) + [runner_out.logprobs.get(rid)]
            self.counters.generation_tokens_total += self.outputs.process_new_tokens(req, logprobs)
            parent = self.outputs.parent_of(req)
            parents[parent.request_id] = parent
            if req.is_finished:
                self.counters.num_finished_by_reason[req.finish_reason.value] += 1
        outputs = [self.outputs.make_output(p) for p in parents.values()]
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
            if grammar.error is None or parent.request_id not in self.outputs.parents:
                continue
            ids = [c.request_id for c in parent.children]
            for req in self.scheduler.finish_requests(ids, FinishReason.ABORT, grammar.error):
                self.counters.num_finished_by_reason[FinishReason.ABORT.value] += 1
                req.delta_text += req.detokenizer.flush()
            out = self.outputs.make_output(parent)
            if out is not None:
                outputs.append(out)
        return outputs

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
            **self._expert_metrics(),
            **spec_decode_metrics(s),
            **step_metrics(s, c),
            **config_metrics(self.config),
            **(role.metrics() if (role := self.kv_producer or self.kv_consumer) is not None else {}),
        }

    def _expert_metrics(self) -> dict[str, Any]:
        """A mixture-of-experts model's tokens per expert, by group of layers (worker/expert_load.py)."""
        from lmserve.worker.expert_load import expert_load, moe_layers

        if self._moe_layers is None:
            self._moe_layers = moe_layers(self.runner.model)
        return {"moe_expert_tokens_total": expert_load(self._moe_layers)} if self._moe_layers else {}

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
        out = {"num_state_slots_used": pool.num_used, "num_state_slots": pool.num_slots,
               "state_bytes_per_sequence": self.config.cache.state_bytes_per_sequence}  # fmt: skip
        snapshots = self.scheduler.state_snapshots
        if snapshots is not None:  # the prefix cache's state snapshots
            out.update(num_state_snapshots=snapshots.num_slots, num_state_snapshots_cached=snapshots.num_cached,
                       state_snapshot_saves_total=snapshots.num_saves_total,
                       state_snapshot_restores_total=snapshots.num_restores_total)  # fmt: skip
        return out

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
