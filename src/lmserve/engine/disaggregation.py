"""Prefill/decode disaggregation inside one LLMEngine: the producer (KVProducer) and the consumer role (KVConsumer).

The producer hands a request off after its first token, its KV under a lease; the consumer continues it, resolving
it between steps from its prefix cache plus a pull of the missing blocks (kv_load_failure_policy on failure). The
engine is passed in, duck-typed (no import of llm_engine). The flow: docs/disaggregation.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from lmserve.config.kv_transfer import KVTransferConfig
from lmserve.engine.kv_transfer import (
    ChildHandoff,
    KVHandoff,
    KVLeases,
    KVPuller,
    KVServer,
    geometry_mismatch,
    import_blocks,
    kv_geometry,
)
from lmserve.request import FinishReason, RequestStatus

logger = logging.getLogger(__name__)


class KVTransferError(RuntimeError):
    """A request's KV could not be loaded from its prefill engine (kv_load_failure_policy fail): a 503."""


class KVProducer:
    """The prefill side of one engine."""

    def __init__(self, engine: Any, config: KVTransferConfig) -> None:
        self.engine = engine
        self.config = config
        self.leases = KVLeases(config.kv_lease_s)
        self.server = KVServer(config.bind_address, self.leases, engine.runner.kv_caches, kv_geometry(engine.config))
        self.address = self.server.start()
        self.handoffs: list[KVHandoff] = []  # taken by the engine core (or a test) after each step
        self._parents: dict[str, dict[int, ChildHandoff]] = {}  # do_remote_decode parent → sequences recorded
        self._num_seqs: dict[str, int] = {}  # its sequence count (the engine may forget the parent first)
        self._child_parent: dict[str, str] = {}
        self._leased: dict[str, list[str]] = {}  # handed-off parent → its sequences' leases
        self.num_handoffs_total = 0

    def watch(self, parent: Any) -> None:
        """A request added with do_remote_decode: hand it off after its first token."""
        self._parents[parent.request_id] = {}
        self._num_seqs[parent.request_id] = len(parent.children)
        for child in parent.children:
            self._child_parent[child.request_id] = parent.request_id

    def holds(self, request_id: str) -> bool:
        """Whether a request of this id is still being prefilled for handoff or holds leases."""
        return request_id in self._parents or request_id in self._leased

    def hand_off(self, updated: list[Any]) -> None:
        """After a step's outputs were made: detach the sequences that got their first token."""
        done: dict[str, None] = {}  # each parent once, however many of its sequences completed it this step
        for req in updated:
            pid = self._child_parent.pop(req.request_id, None)
            if pid is None:
                continue
            recorded = self._parents[pid]
            ch = recorded[_index(req.request_id)] = self._record(req)
            if ch.block_ids:
                self._leased.setdefault(pid, []).append(req.request_id)
            # counted against watch()'s number: when every sequence finished here, the engine forgot the parent
            if len(recorded) == self._num_seqs[pid]:
                done[pid] = None
        for pid in done:
            self._finish(pid)

    def _record(self, req: Any) -> ChildHandoff:
        logprobs = None if req.logprobs is None else list(req.logprobs)
        ch = ChildHandoff(_index(req.request_id), list(req.output_token_ids), logprobs=logprobs,
                          cumulative_logprob=req.cumulative_logprob, lease_id=req.request_id)  # fmt: skip
        if req.is_finished:
            ch.finish_reason = req.finish_reason.value
            ch.stop_reason = req.stop_reason
            return ch
        assert req.num_computed_tokens == req.num_tokens - 1, f"{req.request_id}: handoff before its first token"
        self.engine.scheduler.detach(req)
        num_blocks = -(-req.num_computed_tokens // self.engine.config.cache.block_size)
        ch.block_ids = self.engine.kv.block_ids(req)[:num_blocks]
        self.leases.grant(req, ch.block_ids)
        if req.generator is not None:
            ch.generator_state = bytes(req.generator.get_state().numpy())
        return ch

    def _finish(self, pid: str) -> None:
        children = self._parents.pop(pid)
        del self._num_seqs[pid]
        parent = self.engine.outputs.pop(pid)
        if parent is None or not any(c.block_ids for c in children.values()):
            assert pid not in self._leased, f"{pid}: leases held, but no sequence to hand off"
            return  # every sequence finished on this side: its output was final, nothing to hand off
        first = parent.children[0]
        cc = self.engine.config.cache
        self.handoffs.append(
            KVHandoff(
                pid, self.address, first.num_prompt_tokens,
                [children[i] for i in sorted(children)], cc.block_size, cc.kv_cache_dtype,
                num_cached_tokens=first.num_cached_tokens,
                first_scheduled_time=parent.metrics.first_scheduled_time,
                first_token_time=parent.metrics.first_token_time,
            )
        )  # fmt: skip
        self.num_handoffs_total += 1

    def take_handoffs(self) -> list[KVHandoff]:
        out, self.handoffs = self.handoffs, []
        return out

    def abort(self, request_id: str) -> int:
        """The client aborted: a request still prefilling is aborted by the engine; a handed-off one's leases end.
        Returns the sequences that ended here under a lease (no decode engine has them: this side counts them)."""
        children = self._parents.pop(request_id, None)
        self._num_seqs.pop(request_id, None)
        if children is not None:
            for child_id in [c for c, p in self._child_parent.items() if p == request_id]:
                del self._child_parent[child_id]
        leased = self._leased.pop(request_id, [])
        for child_id in leased:
            self.leases.release(child_id)
        self.collect()
        return len(leased)

    def collect(self) -> int:
        """Free the blocks of every ended (pulled, released) or expired lease; the engine loop calls this often."""
        if self.leases.idle:
            return 0

        def free(request: Any) -> None:
            self.engine.kv.free(request)
            pid = request.request_id.rsplit("#", 1)[0] if request.request_id not in self._leased else request.request_id
            ids = self._leased.get(pid, [])
            if request.request_id in ids:
                ids.remove(request.request_id)
            if not ids:
                self._leased.pop(pid, None)

        return self.leases.collect(free)

    @property
    def has_leases(self) -> bool:
        return len(self.leases) > 0

    def metrics(self) -> dict[str, Any]:
        return {
            "kv_role": "kv_producer",
            "kv_transfer_handoffs_total": self.num_handoffs_total,
            "kv_transfer_leases": len(self.leases),
            "kv_transfer_leases_expired_total": self.leases.num_expired_total,
            "kv_transfer_leases_pulled_total": self.leases.num_pulled_total,
        }

    def shutdown(self) -> None:
        self.server.stop()


@dataclass
class _Remote:
    """A decode-side sequence waiting for its KV."""

    request: Any
    handoff: KVHandoff
    parent_id: str  # this engine's id of the request (the producer's, handoff.request_id, may differ)
    ticket: int | None = None  # the pull in flight
    num_hit_tokens: int = 0
    local_ids: list[int] = field(default_factory=list)

    @property
    def lease_id(self) -> str:
        return self.handoff.children[_index(self.request.request_id)].lease_id


class KVConsumer:
    """The decode side of one engine."""

    def __init__(self, engine: Any, config: KVTransferConfig) -> None:
        self.engine = engine
        self.config = config
        self.puller = KVPuller(config.kv_transfer_timeout_s)
        self.geometry = kv_geometry(engine.config)
        self._remote: dict[str, _Remote] = {}  # child id → its state, in arrival order
        self._tickets: dict[int, str] = {}
        self._announce: list[Any] = []  # adopted parents whose first token(s) go out with the next step
        self.failures: list[tuple[str, str]] = []  # (parent request id, error): requests ended by policy `fail`
        self.num_blocks_pulled_total = 0
        self.num_blocks_hit_total = 0
        self.num_bytes_pulled_total = 0
        self.num_recomputes_total = 0
        self.num_failures_total = 0

    def adopt(self, parent: Any, handoff: KVHandoff) -> None:
        """Continue `parent` (built by add_request) from the producer's state; its live sequences wait for KV."""
        cc = self.engine.config.cache
        if handoff.block_size != cc.block_size or handoff.kv_cache_dtype != cc.kv_cache_dtype:
            raise ValueError(
                f"kv_transfer_params: the producer's block_size {handoff.block_size} / kv_cache_dtype "
                f"{handoff.kv_cache_dtype!r} differ from this engine's {cc.block_size} / {cc.kv_cache_dtype!r}"
            )
        if len(handoff.children) != len(parent.children):
            raise ValueError(
                f"kv_transfer_params: {len(handoff.children)} sequences handed off, the request has "
                f"{len(parent.children)} (n / best_of differ)"
            )
        for child, ch in zip(parent.children, handoff.children, strict=True):
            self._replay(child, ch, handoff)
            if ch.finish_reason is not None:
                child.status = RequestStatus.FINISHED
                child.finish_reason, child.stop_reason = FinishReason(ch.finish_reason), ch.stop_reason
                child.metrics.finished_time = handoff.first_token_time
                continue
            assert ch.block_ids, f"{child.request_id}: a live sequence handed off without blocks"
            self.engine.scheduler.add_remote(child)
            self._remote[child.request_id] = _Remote(child, handoff, parent.request_id)
        if not handoff.first_token_delivered:
            self._announce.append(parent)

    def _replay(self, child: Any, ch: ChildHandoff, handoff: KVHandoff) -> None:
        """The sequence as the producer left it: its first token(s) in tokens, text, grammar, logprobs, RNG."""
        for token in ch.output_token_ids:
            child.append_output_token(token)
            child.detokenizer.update([token])
            if child.structured_output is not None and ch.finish_reason is None:
                child.structured_output._future.result()  # compiled here too (cached in the API process's)
                assert child.structured_output.accept_token(token), f"{child.request_id}: first token off grammar"
        if ch.finish_reason is not None:
            child.detokenizer.flush()
        if child.logprobs is not None and ch.logprobs is not None:
            child.logprobs.extend(ch.logprobs)
            child.cumulative_logprob = ch.cumulative_logprob
        if child.generator is not None and ch.generator_state is not None:
            child.generator.set_state(torch.frombuffer(bytearray(ch.generator_state), dtype=torch.uint8))
        child.num_cached_tokens = handoff.num_cached_tokens
        child.metrics.first_scheduled_time = handoff.first_scheduled_time
        child.metrics.first_token_time = child.metrics.last_token_time = handoff.first_token_time
        if handoff.first_token_delivered:
            child.delta_text, child.num_delta_tokens = "", 0  # the client has had the first token already
        else:  # two servers: this side's client has not seen it; the next output (at once) carries it
            child.num_delta_tokens = len(ch.output_token_ids)
            child.delta_text = child.detokenizer.output_text

    def resolve(self) -> list[Any]:
        """Between steps: finish the pulls that answered, start the ones there is room for. Returns the outputs
        of requests that ended here (policy fail)."""
        outs = self.engine.outputs
        announced = [outs.make_output(p) for p in self._announce if p.request_id in outs.parents]
        self._announce = []
        if not self._remote:
            return [o for o in announced if o is not None]
        idle = not self.engine.scheduler.running and not self.engine.scheduler.waiting
        ended: list[str] = []
        for result in self.puller.poll(5 if idle and self.puller.num_in_flight else 0):
            rid = self._tickets.pop(result.ticket, None)
            remote = self._remote.get(rid) if rid is not None else None
            if remote is None:
                continue
            error = result.error
            if result.frames is not None and (error := geometry_mismatch(self.geometry, result.geometry)) is None:
                if remote.local_ids:  # committed (worker/kv_pool.py) before they are written
                    self.engine.runner.kv_pool.ensure(max(remote.local_ids))
                import_blocks(self.engine.runner.kv_caches, remote.local_ids, result.frames)
                self.num_bytes_pulled_total += sum(memoryview(f).nbytes for f in result.frames)
                self._loaded(remote)
            else:
                ended.extend(self._failed(remote, error))
        self._start_pulls()
        ended_outputs = [out for pid in dict.fromkeys(ended) if (out := self._end(pid)) is not None]
        return [o for o in announced if o is not None] + ended_outputs

    def _start_pulls(self) -> None:
        sched, kv = self.engine.scheduler, self.engine.kv
        pulling = {r.parent_id for r in self._remote.values() if r.ticket is not None}
        for remote in list(self._remote.values()):
            if remote.ticket is not None or remote.parent_id in pulling:
                continue  # n > 1: a sequence waits for its sibling's pull, then finds the prompt's blocks cached
            if not sched.has_room_for_remote(len(self._tickets)):
                return
            req, block_size = remote.request, self.engine.config.cache.block_size
            num_tokens = req.num_tokens - 1
            hits, num_hit_tokens = kv.get_computed_blocks(req)
            table = kv.allocate_slots(req, num_tokens - num_hit_tokens, hits)
            if table is None:
                return  # no room in the pool yet: try again after the next step
            ch = remote.handoff.children[_index(req.request_id)]
            missing = range(len(hits), -(-num_tokens // block_size))
            remote.num_hit_tokens = num_hit_tokens
            remote.local_ids = [table[i].block_id for i in missing]
            self.num_blocks_hit_total += len(hits)
            if not remote.local_ids:  # all in the local prefix cache: nothing to pull
                self.puller.release(remote.handoff.producer_address, ch.lease_id)
                self._loaded(remote)
                continue
            remote.ticket = self.puller.pull(
                remote.handoff.producer_address, ch.lease_id, [ch.block_ids[i] for i in missing]
            )
            self._tickets[remote.ticket] = req.request_id
            pulling.add(remote.parent_id)

    def _loaded(self, remote: _Remote) -> None:
        req = remote.request
        del self._remote[req.request_id]
        self.num_blocks_pulled_total += len(remote.local_ids)
        self.engine.scheduler.remote_kv_loaded(req, remote.num_hit_tokens)
        self.engine.kv.cache_blocks(req)

    def _failed(self, remote: _Remote, error: str) -> list[str]:
        req = remote.request
        logger.warning("KV transfer of %s from %s failed: %s (policy %s)", req.request_id,
                       remote.handoff.producer_address, error, self.config.kv_load_failure_policy)  # fmt: skip
        self.num_failures_total += 1
        self.puller.release(remote.handoff.producer_address, remote.lease_id)  # if the producer still holds it
        if self.config.kv_load_failure_policy == "recompute":
            del self._remote[req.request_id]
            self.num_recomputes_total += 1
            self.engine.scheduler.remote_kv_recompute(req)
            return []
        self.failures.append((remote.parent_id, f"KV transfer failed: {error}"))
        return [remote.parent_id]

    def _end(self, pid: str) -> Any:
        """Policy fail: every sequence of the request ends (ABORT); its output is the request's last."""
        parent = self.engine.outputs.parents.get(pid)
        if parent is None:
            return None
        self.forget([c.request_id for c in parent.children])
        ended = self.engine.scheduler.finish_requests([c.request_id for c in parent.children], FinishReason.ABORT)
        self.engine.counters.num_finished_by_reason[FinishReason.ABORT.value] += len(ended)
        return self.engine.outputs.make_output(parent)

    def forget(self, child_ids: list[str]) -> None:
        """The sequences ended (aborted or failed): cancel their pulls, release the producer's leases."""
        for cid in child_ids:
            remote = self._remote.pop(cid, None)
            if remote is None:
                continue
            if remote.ticket is not None:
                self.puller.cancel(remote.ticket)
                self._tickets.pop(remote.ticket, None)
            self.puller.release(remote.handoff.producer_address, remote.lease_id)

    def take_failures(self) -> list[tuple[str, str]]:
        out, self.failures = self.failures, []
        return out

    def metrics(self) -> dict[str, Any]:
        return {
            "kv_role": "kv_consumer",
            "kv_transfer_waiting": len(self._remote),
            "kv_transfer_blocks_pulled_total": self.num_blocks_pulled_total,
            "kv_transfer_blocks_hit_total": self.num_blocks_hit_total,
            "kv_transfer_bytes_pulled_total": self.num_bytes_pulled_total,
            "kv_transfer_failures_total": self.num_failures_total,
            "kv_transfer_recomputes_total": self.num_recomputes_total,
        }

    def shutdown(self) -> None:
        self.puller.close()


def _index(child_id: str) -> int:
    """A sequence's index in its request (LLMEngine names the sequences of n > 1 `parent#i`)."""
    return int(child_id.rsplit("#", 1)[1]) if "#" in child_id else 0


def make_roles(engine: Any) -> tuple[KVProducer | None, KVConsumer | None]:
    """The engine's role objects from its config.kv_transfer (None, None: colocated)."""
    cfg = engine.config.kv_transfer
    if cfg is None:
        return None, None
    if engine.config.cache.sliding_window is not None:
        raise ValueError(
            "kv_transfer_config: a model whose every layer slides (KV outside the window is freed while a request "
            "runs) cannot hand its KV off yet; serve it colocated"
        )
    if cfg.is_producer:
        return KVProducer(engine, cfg), None
    return None, KVConsumer(engine, cfg)
