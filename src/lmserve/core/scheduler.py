"""Iteration-level scheduling with a token budget (Scheduler). Imports no torch.

Running requests first, then waiting ones FCFS while the budget, max_num_seqs and free blocks allow; out of blocks,
the most recently admitted running request is preempted by recompute. `static` admits a batch and lets nothing join
until it drains. Speculative proposals are tentatively appended tokens, rolled back when rejected.
"""

from __future__ import annotations

from collections import deque

from lmserve.config.engine import SchedulerConfig
from lmserve.core.block_pool import DISK_BLOCK_ID
from lmserve.core.kv_cache_manager import KVCacheManager
from lmserve.core.lora_slots import NO_SLOT, LoRASlotTable
from lmserve.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput, SchedulerStats
from lmserve.core.state_pool import NO_STATE_SLOT, StateSlotPool
from lmserve.core.state_snapshots import NO_SNAPSHOT, StateSnapshotPool, plan_decode_save, plan_save
from lmserve.request import FinishReason, Request, RequestStatus

FINISHED = RequestStatus.FINISHED


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, clock=None, num_lookahead_tokens: int = 0,
        lora_slots: LoRASlotTable | None = None, state_slots: StateSlotPool | None = None,
        state_snapshots: StateSnapshotPool | None = None,
    ) -> None:  # fmt: skip
        import time

        self.config = config
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # prefill/decode disaggregation, decode side: requests whose prompt KV another engine computed and this one
        # is pulling (status WAITING_FOR_REMOTE_KV; the engine resolves them between steps, engine/disaggregation.py)
        self.remote_kv: dict[str, Request] = {}
        self.clock = clock or time.time
        self.num_preemptions_total = 0
        self.prefix_cache_queries_total = 0
        self.prefix_cache_hits_total = 0
        self.prefix_cache_disk_hits_total = 0
        self._last_num_batched_tokens = 0
        self._last_num_decode_tokens = 0
        self.num_lookahead_tokens = num_lookahead_tokens
        self.spec_num_drafts_total = 0
        self.spec_num_draft_tokens_total = 0
        self.spec_num_accepted_tokens_total = 0
        # ScheduledRequest.block_ids for the model runner; the simulator (lmserve.sim), which runs no model, turns
        # them off (no decision reads them; building them touches every block of every running request per step)
        self.emit_block_ids = True
        self.lora_slots = lora_slots  # LoRA compute slots (None: LoRA disabled): a request's adapter must hold one
        # a hybrid model's recurrent-state slots (None: no linear-attention layers): a running request holds one
        self.state_slots = state_slots
        # a hybrid's prefix cache: its state at cached block boundaries (None: hits are not taken for a hybrid)
        self.state_snapshots = state_snapshots

    # ---- queue management -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id!r}"
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(
        self, request_ids: list[str], reason: FinishReason, stop_reason: int | str | None = None
    ) -> list[Request]:
        """Finish requests from outside the step (abort, a stop string): free their blocks now."""
        finished = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                del self.remote_kv[rid]
            else:
                self.waiting.remove(request)
            request.finish_reason, request.stop_reason = reason, stop_reason
            self._finish(request)
            finished.append(request)
        return finished

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        return self.finish_requests(request_ids, FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.remote_kv)

    # ---- prefill/decode disaggregation (engine/disaggregation.py drives these between steps) -----------

    def detach(self, request: Request) -> None:
        """Prefill side: the request leaves this scheduler after its first token with its blocks still held (its
        KV is handed to a decode engine); the caller frees them with KVCacheManager.free when the lease ends."""
        assert request.status == RequestStatus.RUNNING, f"detach of {request.request_id} in {request.status}"
        self._release_state_slot(request)
        self.running.remove(request)
        del self.requests[request.request_id]

    def add_remote(self, request: Request) -> None:
        """Decode side: a request whose prompt KV (and first token) come from a prefill engine; it waits, holding
        no blocks yet, until remote_kv_loaded / remote_kv_failed."""
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id!r}"
        assert self.state_slots is None, "a hybrid model's state is not transferred (config refuses kv_transfer)"
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.remote_kv[request.request_id] = request

    def has_room_for_remote(self, num_in_flight: int) -> bool:
        """Whether another remote request may start loading: loaded ones join `running` directly."""
        return len(self.running) + num_in_flight < self.config.max_num_seqs

    def remote_kv_loaded(self, request: Request, num_hit_tokens: int) -> None:
        """Its blocks (allocated by the engine, prefix hits first) now hold the prompt's KV: it runs, decoding."""
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KV, f"{request.request_id} is {request.status}"
        del self.remote_kv[request.request_id]
        request.num_computed_tokens = request.num_tokens - 1  # the first token, sampled remotely, is not computed
        self.prefix_cache_queries_total += request.num_computed_tokens
        self.prefix_cache_hits_total += num_hit_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def remote_kv_recompute(self, request: Request) -> None:
        """The transfer failed (kv_load_failure_policy recompute): free what it holds and prefill here, as after a
        preemption (the output token stays, so the recompute covers it)."""
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KV, f"{request.request_id} is {request.status}"
        del self.remote_kv[request.request_id]
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        max_num_batched_tokens = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        budget, num_decode = self._schedule_running(max_num_batched_tokens, scheduled, preempted)
        if not preempted and self.waiting:
            budget, num_waiting_decode = self._schedule_waiting(budget, scheduled)
            num_decode += num_waiting_decode
        now = self.clock()
        for s in scheduled:
            metrics = s.request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        assert budget >= 0, "token budget exceeded"
        num_tokens = max_num_batched_tokens - budget  # every scheduled token was taken from the budget
        self._last_num_batched_tokens, self._last_num_decode_tokens = num_tokens, num_decode
        out = SchedulerOutput(scheduled, num_tokens, preempted, num_decode)
        if self.kv.disk is not None:
            out.kv_loads, out.kv_saves = self.kv.take_transfers()
        return out

    def _schedule_running(
        self, budget: int, scheduled: list[ScheduledRequest], preempted: list[str]
    ) -> tuple[int, int]:
        """Schedule the running requests in order; returns (budget left, decode tokens scheduled). A request is
        decoding when its step starts at its last token (at most one unverified token, as step_features counts).
        The hot path of the simulator (lmserve.sim runs millions of steps): the loop reads what it needs once."""
        i = 0
        chunked = self.config.enable_chunked_prefill
        share = self.config.share_prefix_in_step
        block_size = self.kv.block_size
        allocate_slots = self.kv.allocate_slots
        emit_block_ids = self.emit_block_ids
        num_lookahead = self.num_lookahead_tokens
        num_decode = 0
        running = self.running
        snapshots = self.state_snapshots  # a hybrid's prefix cache: chunks save their state at a block boundary
        while i < len(running) and budget > 0:
            request = running[i]
            computed = request.num_computed_tokens
            num_unverified = len(request.all_token_ids) - computed
            spec = request.spec_token_ids
            if spec:
                num_new = min(num_unverified + len(spec), budget)
                del spec[max(0, num_new - num_unverified) :]  # proposals past the budget
            else:
                num_new = num_unverified if num_unverified < budget else budget
            if not chunked and num_new < num_unverified:
                break  # whole prompt must fit one step: wait for a step with budget
            assert num_new > 0, f"running request {request.request_id} has nothing to compute"
            num_slots = num_new + self._num_lookahead(request, num_new) if num_lookahead else num_new
            table = allocate_slots(request, num_slots)
            while table is None:
                victim = running.pop()  # the most recently admitted (never one scheduled before it in this step)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    assert running, (
                        f"request {request.request_id} alone needs more KV blocks than the pool has "
                        "(the engine's validation should have refused it)"
                    )
                    break
                table = allocate_slots(request, num_slots)
            if table is None:
                break
            ids = [b.block_id for b in table] if emit_block_ids else []
            scheduled.append(ScheduledRequest(request, num_new, ids, len(spec)))
            if snapshots is not None:
                scheduled[-1].state_save = (
                    plan_save(snapshots, request, num_new, block_size) if num_new > 1
                    else plan_decode_save(snapshots, request, block_size)
                )  # fmt: skip
            # _share_in_step has something to do only for a step that completes a block (most decodes do not)
            if share and (computed + num_new) // block_size > computed // block_size:
                self._share_in_step(request, num_new)
            if num_unverified <= 1:
                num_decode += num_new
            budget -= num_new
            i += 1
        return budget, num_decode

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> tuple[int, int]:
        """Admit waiting requests FCFS; returns (budget left, decode tokens scheduled: a recomputed request whose
        prefix hits cover all but its last token decodes)."""
        static = self.config.scheduling_policy == "static"
        num_decode = 0
        if static and self.running:
            return budget, num_decode  # a static batch admits no newcomers until it has drained
        # grammar not ready yet, or its LoRA adapter has no compute slot: stay queued, in order, without blocking others
        compiling: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if self.state_slots is not None and not self.state_slots.can_allocate():
                break  # every state slot is held by a running request
            request = self.waiting[0]
            if not request.is_grammar_ready or not request.is_kv_ready or not self._lora_slot_ready(request):
                compiling.append(self.waiting.popleft())
                continue
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            restore = NO_SNAPSHOT
            if hits and self.state_slots is not None:  # a hybrid: only as far as a state snapshot reaches
                hits, num_hit_tokens, restore = self._snapshot_hit(hits)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if not self.config.enable_chunked_prefill and num_new < request.num_tokens - num_hit_tokens:
                break
            table = self.kv.allocate_slots(request, num_new, hits)
            if table is None:
                break
            self._admit(request, num_hit_tokens, hits)
            ids = [b.block_id for b in table] if self.emit_block_ids else []
            scheduled.append(ScheduledRequest(request, num_new, ids, state_restore=restore))
            if self.state_snapshots is not None:
                self.state_snapshots.num_restores_total += restore != NO_SNAPSHOT
                if num_new > 1:
                    scheduled[-1].state_save = plan_save(self.state_snapshots, request, num_new, self.kv.block_size)
            self._share_in_step(request, num_new)
            if num_hit_tokens >= request.num_tokens - 1:
                num_decode += num_new
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))
        if static:
            # The rest of the batch joins now, without computing yet: admitted together, finished together.
            # Each holds its prefix-cache hits as it joins, so both policies see the same cache.
            while self.waiting and len(self.running) < self.config.max_num_seqs:
                request = self.waiting[0]
                if not request.is_grammar_ready or not request.is_kv_ready or not self._lora_slot_ready(request):
                    break
                if self.state_slots is not None and not self.state_slots.can_allocate():
                    break
                hits, num_hit_tokens = self.kv.get_computed_blocks(request)
                if self.state_slots is not None:  # a hybrid joins from a zero state (a snapshot is not pinned)
                    hits, num_hit_tokens = [], 0
                if not self.kv.can_allocate(request.num_tokens + 1, hits):
                    break
                table = self.kv.allocate_slots(request, 0, hits)
                assert table is not None, f"request {request.request_id}: its prefix hits could not be held"
                self._admit(request, num_hit_tokens, hits)
        return budget, num_decode

    def _admit(self, request: Request, num_hit_tokens: int, hits: list | None = None) -> None:
        """Move the head of the waiting queue to running, its first num_hit_tokens found in the prefix cache (hits:
        the blocks, those of the disk tier counted apart)."""
        assert request is self.waiting[0], "requests are admitted in FCFS order"
        self.waiting.popleft()
        self.prefix_cache_queries_total += request.num_tokens
        self.prefix_cache_hits_total += num_hit_tokens
        if hits and self.kv.disk is not None:
            self.prefix_cache_disk_hits_total += self.kv.block_size * sum(b.block_id == DISK_BLOCK_ID for b in hits)
        if request.status == RequestStatus.WAITING:
            request.num_cached_tokens = num_hit_tokens
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.RUNNING
        if request.lora_request is not None and self.lora_slots is not None:
            request.lora_slot = self.lora_slots.acquire(request.lora_int_id)
        if self.state_slots is not None:
            request.state_slot = self.state_slots.allocate(request.request_id)
        self.running.append(request)

    def _snapshot_hit(self, hits: list) -> tuple[list, int, int]:
        """A hybrid's prefix hits cut to the longest whose state snapshot is kept: (hits, tokens, snapshot slot)."""
        if self.state_snapshots is None:
            return [], 0, NO_SNAPSHOT
        n, slot = self.state_snapshots.longest_hit(hits)
        return hits[:n], n * self.kv.block_size, slot

    def _lora_slot_ready(self, request: Request) -> bool:
        return (
            request.lora_request is None or self.lora_slots is None or self.lora_slots.can_acquire(request.lora_int_id)
        )

    def _release_lora_slot(self, request: Request) -> None:
        if request.lora_slot != NO_SLOT and self.lora_slots is not None:
            self.lora_slots.release(request.lora_slot)
            request.lora_slot = NO_SLOT

    def _release_state_slot(self, request: Request) -> None:
        """Finished, aborted or preempted: the state is dropped (a preempted request recomputes it on resume)."""
        if self.state_slots is not None:
            self.state_slots.free(request.request_id)
            request.state_slot = NO_STATE_SLOT

    def _share_in_step(self, request: Request, num_new: int) -> None:
        """Make the blocks this step fills findable now, so requests scheduled after it in the same step
        (a burst sharing a system prompt) hit them instead of computing the prefix again."""
        if self.config.share_prefix_in_step:  # known tokens only: speculative proposals may be rejected
            end = min(request.num_computed_tokens + num_new, len(request.all_token_ids))
            # every full block of the computed tokens is registered already (update_from_output caches them after
            # each step), so only a step that completes a block has something to share: most decode steps do not
            if end // self.kv.block_size > request.num_computed_tokens // self.kv.block_size:
                self.kv.cache_blocks(request, end)

    def _num_lookahead(self, request: Request, num_new: int) -> int:
        """Slots past this step that a draft model writes while proposing after it: only for a step that
        reaches the end of the request's tokens, never past the longest the request can get."""
        if not self.num_lookahead_tokens:
            return 0
        end = request.num_computed_tokens + num_new
        if end < request.num_tokens + len(request.spec_token_ids):
            return 0
        return max(0, min(self.num_lookahead_tokens, request.num_prompt_tokens + request.max_tokens - end))

    def _preempt(self, request: Request) -> None:
        request.spec_token_ids, request.spec_draft_probs = [], None
        request.num_draft_computed_tokens = 0
        self.kv.free(request)
        self._release_lora_slot(request)
        self._release_state_slot(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    # ---- after the model ran ----------------------------------------------------------------

    def update_from_output(
        self, sched: SchedulerOutput, output: ModelRunnerOutput, max_model_len: int
    ) -> list[Request]:
        """Advance counters, append sampled tokens, finish what is done. Returns the requests that
        got a new token (finished ones included) and those that finished without one (max_tokens 0)."""
        updated: list[Request] = []
        now = self.clock()
        sampled_token_ids = output.sampled_token_ids
        kv = self.kv
        if self.state_snapshots is not None:
            self.state_snapshots.commit()  # the step wrote its planned snapshots
        for s in sched.scheduled:
            request = s.request
            if request.status is FINISHED:
                continue  # aborted while the step ran
            rid = request.request_id
            num_spec = s.num_spec_tokens
            if num_spec:
                accepted = output.accepted_token_ids.get(rid, [])
                # Rejected proposals are rolled back: their positions do not count as computed.
                request.num_computed_tokens += s.num_new_tokens - (num_spec - len(accepted))
            else:
                request.num_computed_tokens += s.num_new_tokens
            if request.spec_token_ids or request.spec_draft_probs is not None:
                request.spec_token_ids, request.spec_draft_probs = [], None
            token = sampled_token_ids.get(rid)
            if token is None:
                kv.cache_blocks(request)
                # max_tokens 0 (scoring): the prompt is computed and nothing is generated, so it is done
                if request.max_tokens == 0 and request.num_computed_tokens == request.num_tokens:
                    request.finish_reason = FinishReason.LENGTH
                    self.running.remove(request)
                    self._finish(request)
                    updated.append(request)
                continue  # else a prefill chunk that did not reach the end of the prompt
            if num_spec:
                self._count_spec(num_spec, len(accepted))
                stopped = self._append_tokens(request, accepted + [token], max_model_len)
            else:  # _append_tokens of the one sampled token (every step of every request: the hot path)
                request.append_output_token(token)
                stopped = request.check_stop(max_model_len)
                if stopped:
                    request.num_computed_tokens = min(request.num_computed_tokens, len(request.all_token_ids) - 1)
            kv.cache_blocks(request)
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            if stopped:
                self.running.remove(request)
                self._finish(request)
            else:
                if output.spec_token_ids:
                    request.spec_token_ids = list(output.spec_token_ids.get(rid, []))
                    request.spec_draft_probs = output.spec_draft_probs.get(rid)
                kv.trim(request, len(request.all_token_ids) + len(request.spec_token_ids))
            updated.append(request)
        return updated

    @staticmethod
    def _append_tokens(request: Request, token_ids: list[int], max_model_len: int) -> bool:
        """Append a step's tokens (accepted proposals, then the sampled one) up to the first that stops the
        request; nothing after a stop is kept. Returns whether the request stopped."""
        for t in token_ids:
            request.append_output_token(t)
            if request.check_stop(max_model_len):
                # tokens past the stop were computed but are not the request's: never count them
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
                return True
        return False

    def _count_spec(self, num_draft: int, num_accepted: int) -> None:
        self.spec_num_drafts_total += 1
        self.spec_num_draft_tokens_total += num_draft
        self.spec_num_accepted_tokens_total += num_accepted

    def _finish(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED
        request.metrics.finished_time = self.clock()
        self.kv.free(request)
        self._release_lora_slot(request)
        self._release_state_slot(request)
        del self.requests[request.request_id]

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.remote_kv),
            num_batched_tokens=self._last_num_batched_tokens,
            kv_cache_usage=self.kv.usage,
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queries_total=self.prefix_cache_queries_total,
            prefix_cache_hits_total=self.prefix_cache_hits_total,
            spec_num_drafts_total=self.spec_num_drafts_total,
            spec_num_draft_tokens_total=self.spec_num_draft_tokens_total,
            spec_num_accepted_tokens_total=self.spec_num_accepted_tokens_total,
            num_prefill_tokens=self._last_num_batched_tokens - self._last_num_decode_tokens,
            num_decode_tokens=self._last_num_decode_tokens,
            prefix_cache_disk_hits_total=self.prefix_cache_disk_hits_total,
        )
