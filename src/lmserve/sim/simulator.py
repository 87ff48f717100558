"""The event-driven simulator: the engine's own Scheduler / KVCacheManager per replica, a step-time model instead
of the model runner, the server's routing rule between replicas, the load generator's client in front.

Simulator runs a heap of timed events (no clock, no sleeping), including xPyD disaggregation; SimConfig configures
it, SimResult holds the bench RequestRecords. The event flow and what is not simulated are in docs/simulator.md.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import heapq
import math
import operator
import time
from collections import OrderedDict, deque
from collections.abc import Iterator

from lmserve.bench.metrics import RequestRecord
from lmserve.config.engine import EngineConfig
from lmserve.core.kv_cache_manager import KVCacheManager
from lmserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from lmserve.core.scheduler import Scheduler
from lmserve.engine.router import choose_core
from lmserve.request import Request, RequestStatus
from lmserve.sampling_params import SamplingParams
from lmserve.sim.lazy_pool import LazyBlockPool
from lmserve.sim.sim_config import SimConfig, check_disaggregation, kv_transfer_cost
from lmserve.sim.sim_result import ReplicaStats, SimResult, StepTrace
from lmserve.sim.step_features import Overheads, StepTimeFn
from lmserve.sim.step_model import StepProfile
from lmserve.sim.workload import Workload

# event kinds, in the order simultaneous events are handled: a step's end (its outputs, then the next step's
# start), requests reaching a core, client arrivals (not in the heap: a sorted list), then an idle core's wake-up,
# so that requests arriving together start together (the core drains every queued message before it steps)
# (disaggregation: a completed KV pull comes first, so the step starting at the same instant sees it; a handoff the
# API process routes, and its arrival at the decode replica, are deliveries)
# (a send's stall before a delivery or a wake-up at the same time: a step they start was not in progress at the send)
_PULL_DONE, _STEP_END, _STALL, _HANDOFF, _DELIVER_REMOTE, _DELIVER, _ARRIVE, _WAKE = 0, 1, 2, 3, 4, 5, 6, 7
FINISHED = RequestStatus.FINISHED
def sim_token(prompt_hash: int, position: int, vocab_size: int) -> int:
    """The token a simulated request 'samples' at `position`: a function of its prompt, as greedy decoding is."""
    return (prompt_hash + 7919 * position) % vocab_size


def step_features_and_tokens(
    sched: SchedulerOutput, prompt_hash: dict[str, int], vocab_size: int
) -> tuple[int, int, int, int, float, dict[str, int]]:
    """core.outputs.step_features of a step and, in the same pass, the token each request that samples after it
    gets (sim_token of its prompt's hash at its position, which the step does not move): the simulator's hot path,
    one loop where step_features and then its sampling list took two. tests/sim/test_simulator.py checks it against
    step_features and sim_token on a real scheduler's steps."""
    prefill = segments = rows = context = 0
    pairs = 0.0
    sampled: dict[str, int] = {}
    for s in sched.scheduled:
        req = s.request
        start, n = req.num_computed_tokens, s.num_new_tokens
        num_tokens = len(req.all_token_ids)
        if start >= num_tokens - 1:
            rows += 1
            context += start + n
        else:
            prefill += n
            segments += 1
            pairs += n * start + n * (n + 1) / 2
        if start + n == num_tokens:
            rid = req.request_id
            sampled[rid] = (prompt_hash[rid] + 7919 * num_tokens) % vocab_size  # sim_token, inlined
    return prefill, segments, rows, context, pairs, sampled


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic garbage collector off for a block: a simulation allocates millions of long-lived objects
    (requests, blocks, records, chunk times) and nothing cyclic that needs collecting; its full collections cost a
    fifth of a 64-replica run, and as much again in summarize() over the records afterwards.

    On the way out, what the block allocated and kept (the records) goes straight to the oldest generation
    (gc.freeze, then gc.unfreeze: no scan): re-enabled as it was, the collector's next young collection would scan
    every one of those objects first (1.2 s after 25,000 requests on 64 replicas; the young generation's count is
    what was allocated while paused). Nothing is kept from collection: a full collection scans them as it scans
    every old object. The simulation itself leaves no cycles behind (a replica's clock is not one of its bound
    methods), so its replicas, pools and requests are freed by reference counting when it returns."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.freeze()
            gc.unfreeze()
            gc.enable()


class _Replica:
    __slots__ = (
        "index", "kv", "scheduler", "inbox", "busy", "load", "kv_usage", "pending", "applied", "sched", "start_s",
        "stats", "now", "trace", "waking", "prev_prefill", "output", "remote_inbox", "pulling", "pulled", "leased",
        "lease_ended", "api_work", "end_s", "end_seq",
    )  # fmt: skip

    def __init__(self, index: int, config: EngineConfig) -> None:
        cc = config.cache
        self.index = index
        self.kv = KVCacheManager(1, cc.block_size, cc.enable_prefix_caching, cc.sliding_window)
        self.kv.pool = LazyBlockPool(cc.num_blocks, cc.enable_prefix_caching)  # the same order, built on first use
        # the replica's simulated time, the scheduler's clock: a C-level read of this list (no Python frame per
        # call, and no reference back to the replica, which would make a cycle of every replica)
        self.now = [0.0]
        self.scheduler = Scheduler(config.scheduler, self.kv, clock=functools.partial(operator.getitem, self.now, 0))
        self.scheduler.emit_block_ids = False  # no model runner reads them
        self.inbox: deque[Request] = deque()
        self.busy = False
        self.waking = False  # a wake-up is queued
        self.load = 0  # running + waiting at the latest step's end (the snapshot the router reads)
        self.kv_usage = 0.0
        self.pending = 0  # routed here, not yet acknowledged by a step's output
        self.applied = 0  # of those, added to the scheduler at the current step's start
        self.sched: SchedulerOutput | None = None
        self.start_s = 0.0
        self.end_s = 0.0  # the current step's end
        self.end_seq = -1  # the heap sequence number of its live _STEP_END event (a stalled step's older one is stale)
        self.stats = ReplicaStats()
        self.trace: StepTrace | None = None  # the current step's, when steps are recorded
        self.output = ModelRunnerOutput({})  # reused: the scheduler only reads it (its ids set at each step start)
        # disaggregation, decode role: handoffs not yet parked, pulls in flight (id → its missing blocks), done
        self.remote_inbox: deque[Request] = deque()
        self.pulling: dict[str, int] = {}
        self.pulled: list[Request] = []
        # prefill role: detached requests whose blocks are held (the lease), and those whose pull completed
        self.leased: dict[str, Request] = {}
        self.lease_ended: list[str] = []
        self.prev_prefill = False  # whether its latest step computed prompt tokens (the post-prefill decode term)
        self.api_work = 0.0  # API seconds of work that overlap this replica's current step (its next step's stretch)


class Simulator:
    """Simulate a workload on `config.data_parallel_size` replicas of the engine, timed by `profile`."""

    def __init__(self, profile: StepProfile, config: SimConfig, eos_token_ids: tuple[int, ...] = ()) -> None:
        profile.check_compatible(config.engine)
        self.profile = profile
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.step_time: StepTimeFn = profile.step_time_fn(config.tensor_parallel_size)
        self.post_prefill_s = profile.post_prefill_s(config.tensor_parallel_size)  # 0: a model without the term
        self.overheads: Overheads = profile.overheads
        self.noise = profile.noise_sampler(config.seed) if config.step_noise else None
        if config.step_noise and self.noise is None:
            raise ValueError(f"--step-noise: the step model {profile.source or ''} has no measured noise (a roofline "
                             "or an old profile); run without it")  # fmt: skip

    def run(self, workload: Workload) -> SimResult:
        """Simulate the workload to its end (the cyclic garbage collector paused: see paused_gc)."""
        with paused_gc():
            return self._run(workload)

    def _run(self, workload: Workload) -> SimResult:
        from lmserve.engine.input_processor import InputProcessor  # (the engine's modules load torch)

        wall0 = time.perf_counter()
        cfg = self.config
        engine = cfg.engine
        max_model_len = engine.scheduler.max_model_len
        vocab = engine.model.vocab_size
        block_size = engine.cache.block_size
        ov = self.overheads
        ingress, egress = ov.ingress_s, ov.egress_s
        core_overhead = ov.core_step_overhead_s
        # the API process as one FIFO server (Overheads.api_*): busy until api_free; its work stretches steps
        api_queue = ov.api_queue
        api_req, api_chunk = ov.api_request_s, ov.api_chunk_s
        api_first, api_last = ov.api_first_chunk_s, ov.api_last_chunk_s
        stretch = ov.api_step_stretch
        # a send stalls the step in progress (Overheads.api_arrival_stall_s; api_held_send_stall_s for one the
        # client's concurrency cap held until another finished)
        arrival_stall, held_stall = ov.api_arrival_stall_s, ov.api_held_send_stall_s
        api_free = 0.0
        step_time = self.step_time
        post_prefill = self.post_prefill_s
        noise = self.noise
        record_steps = cfg.record_steps
        inputs = InputProcessor(engine, tokenizer=None)  # validation only
        num_prefill, num_decode = (
            check_disaggregation(cfg.disaggregation) if cfg.disaggregation else (cfg.data_parallel_size, 0)
        )
        replicas = [_Replica(i, engine) for i in range(num_prefill + num_decode)]
        front = replicas[:num_prefill]  # where requests are routed: every replica, or the prefill ones
        # the replica a send stalls at once: the only front one; with several, the one a request is routed to
        stalled_at_send = front[0] if len(front) == 1 else None
        stall_of: dict[int, float] = {}  # a request's stall (several front replicas: applied at its delivery)
        decoders = replicas[num_prefill:]
        if decoders:
            for r in front:
                r.stats.role = "prefill"
            for r in decoders:
                r.stats.role = "decode"
        affinity: OrderedDict[int, int] = OrderedDict()
        decode_affinity: OrderedDict[int, int] = OrderedDict()
        handoffs: dict[int, tuple[Request, int]] = {}  # request index → (its prefill-side request, that replica)
        in_transit: dict[int, tuple[Request, int]] = {}  # → (its decode-side request, the replica it goes to)
        pull_target: dict[int, int] = {}  # request index → the decode replica pulling its blocks
        pull_latency, pull_block = kv_transfer_cost(cfg, self.overheads)
        n = len(workload)
        records = [
            RequestRecord(i, len(workload.prompt_token_ids[i]), workload.output_lens[i], workload.arrivals_s[i])
            for i in range(n)
        ]
        prompt_hash: dict[str, int] = {}
        ints = list(range(vocab))  # the shared int object of each token id (deliver)
        record_of: dict[str, RequestRecord] = {}  # requests in an engine → their records
        params_by_len: dict[int, SamplingParams] = {}
        steps: list[StepTrace] = []
        heap: list[tuple[float, int, int, int]] = []
        seq = 0
        cap = cfg.max_concurrency
        waiting_client: deque[int] = deque()
        in_flight = 0
        arrivals = workload.arrivals_s
        next_arrival = 0

        heappush = heapq.heappush

        def push(t: float, kind: int, payload: int) -> None:
            nonlocal seq
            heappush(heap, (t, kind, seq, payload))
            seq += 1

        def wake(rep: _Replica, t: float) -> None:
            """An idle replica with something new to do starts a step at t (after the other events of t)."""
            if not rep.busy and not rep.waking:
                rep.waking = True
                push(t, _WAKE, rep.index)

        def stall_step(rep: _Replica, stall: float) -> None:
            """The replica's step in progress runs `stall` longer: its end event moves (the old one goes stale)."""
            rep.end_s += stall
            rep.stats.step_s += stall
            if rep.trace is not None:
                rep.trace.end_s = rep.end_s
            rep.end_seq = seq  # (the number push gives the new event)
            push(rep.end_s, _STEP_END, rep.index)

        def send(i: int, t: float, stall: float) -> None:
            nonlocal in_flight, api_free
            in_flight += 1
            records[i].send_s = t
            if stall:
                stall_of[i] = stall
                if stalled_at_send is not None:  # (an event: a closed loop's next send is timed at a later chunk)
                    push(t, _STALL, i)
            if api_queue:  # the API process takes the request when it is free, then it travels on
                api_free = (api_free if api_free > t else t) + api_req
                push(api_free + ingress, _DELIVER, i)
            else:
                push(t + ingress, _DELIVER, i)

        def finish_client(i: int, t: float) -> None:
            nonlocal in_flight
            in_flight -= 1
            if waiting_client:
                send(waiting_client.popleft(), t, held_stall)

        def deliver(i: int, t: float) -> None:
            rec = records[i]
            stall = stall_of.pop(i, 0.0) if stall_of and stalled_at_send is None else 0.0
            # one shared int object per token id (not one per position, as tolist() makes): the requests of 64
            # replicas then fit the CPU caches much better (measured: 1.6x faster at 64 replicas)
            # (an int32 array's tolist() first: indexing with numpy scalars cost 40 µs a 256-token prompt)
            prompt = workload.prompt_token_ids[i]
            tolist = getattr(prompt, "tolist", None)
            raw = prompt if tolist is None else tolist()
            try:
                ids = list(map(ints.__getitem__, raw))
            except IndexError:  # an id past the vocabulary: the engine's validation refuses it below, with its message
                ids = list(raw)
            if raw and min(raw) < 0:  # (ints[-1] would read as a valid id): validate refuses it too
                ids = list(raw)
            out_len = workload.output_lens[i]
            params = params_by_len.get(out_len)
            if params is None:
                params = params_by_len[out_len] = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
            try:
                max_tokens = inputs.validate(ids, params)
            except ValueError as e:
                rec.error, rec.end_s = f"HTTP 400: {e}", t + egress
                finish_client(i, t + egress)
                return
            if len(front) == 1:
                rep = front[0]
            else:
                loads = {r.index: (r.load + r.pending, r.kv_usage) for r in front}
                rep = replicas[choose_core(loads, affinity, ids, block_size)]
            rid = str(i)
            req = Request(rid, ids, params, max_tokens, self.eos_token_ids, arrival_time=t)
            # (reduced mod the vocabulary once: sim_token's sum then stays a small int, the same token)
            prompt_hash[rid] = hash(tuple(ids)) % vocab
            record_of[rid] = rec
            rec.server_prompt_len = len(ids)
            rep.pending += 1
            rep.stats.num_requests += 1
            rep.inbox.append(req)
            if rep.busy:  # the API's work for it ran beside this step: the next one is stretched
                rep.api_work += api_req
                if stall:  # (several front replicas: the send's stall falls on this one's step)
                    stall_step(rep, stall)
            wake(rep, t)

        def hand_off(i: int, t: float) -> None:
            """The API process got a prefill replica's handoff: route it to a decode replica, where it lands
            ingress_s later (a new Request there, the first token replayed into it, as KVConsumer builds it)."""
            req, _ = handoffs[i]
            if len(decoders) == 1:
                rep = decoders[0]
            else:
                loads = {r.index: (r.load + r.pending, r.kv_usage) for r in decoders}
                rep = replicas[choose_core(loads, decode_affinity, req.prompt_token_ids, block_size)]
            remote = Request(req.request_id, req.prompt_token_ids, req.sampling_params, req.max_tokens,
                             self.eos_token_ids, arrival_time=req.arrival_time)  # fmt: skip
            for tok in req.output_token_ids:
                remote.append_output_token(tok)
            rep.pending += 1
            rep.stats.num_requests += 1
            in_transit[i] = (remote, rep.index)
            push(t + ingress, _DELIVER_REMOTE, i)

        def deliver_remote(i: int, t: float) -> None:
            remote, index = in_transit.pop(i)
            rep = replicas[index]
            rep.remote_inbox.append(remote)
            wake(rep, t)

        def free_leases(rep: _Replica) -> None:
            """Prefill replica, between steps: free the blocks of the leases whose pull completed."""
            for rid in rep.lease_ended:
                rep.kv.free(rep.leased.pop(rid))
            rep.lease_ended = []

        def end_lease(i: int, t: float) -> None:
            prefill = replicas[handoffs.pop(i)[1]]
            prefill.lease_ended.append(str(i))
            if not prefill.busy:  # an idle core frees it at once (it polls while it holds leases)
                free_leases(prefill)
                prefill.kv_usage = prefill.kv.usage
                if prefill.scheduler.waiting:  # it idled for want of the blocks the leases held: it steps again
                    wake(prefill, t)

        def resolve_remote(rep: _Replica, t: float) -> None:
            """Decode replica, between steps (KVConsumer.resolve): park new handoffs, let the completed pulls run,
            start the pulls there is room for (prefix hits first; only the missing blocks travel)."""
            sch, kv = rep.scheduler, rep.kv
            while rep.remote_inbox:
                sch.add_remote(rep.remote_inbox.popleft())
                rep.applied += 1

            def loaded(req: Request, num_hit_tokens: int) -> None:  # its prompt's KV is here: it decodes
                sch.remote_kv_loaded(req, num_hit_tokens)
                kv.cache_blocks(req)

            for rid in rep.pulled:
                loaded(sch.remote_kv[rid], rep.pulling.pop(rid))
            rep.pulled = []
            for req in list(sch.remote_kv.values()):
                rid = req.request_id
                if rid in rep.pulling:
                    continue
                if not sch.has_room_for_remote(len(rep.pulling)):
                    return
                num_tokens = req.num_tokens - 1
                hits, num_hit_tokens = kv.get_computed_blocks(req)
                if kv.allocate_slots(req, num_tokens - num_hit_tokens, hits) is None:
                    return  # no room in the pool: after the next step
                missing = -(-num_tokens // block_size) - len(hits)
                rep.stats.num_blocks_hit += len(hits)
                rep.stats.num_blocks_pulled += missing
                if missing == 0:  # all cached here: the lease is released, nothing travels
                    end_lease(int(rid), t)
                    loaded(req, num_hit_tokens)
                    continue
                rep.pulling[rid] = num_hit_tokens
                pull_target[int(rid)] = rep.index
                push(t + pull_latency + missing * pull_block, _PULL_DONE, int(rid))

        def pull_done(i: int, t: float) -> None:
            rep = replicas[pull_target.pop(i)]
            rep.pulled.append(str(i))
            end_lease(i, t)
            wake(rep, t)

        def start_step(rep: _Replica, t: float) -> None:
            sch = rep.scheduler
            rep.now[0] = t
            while rep.inbox:
                sch.add_request(rep.inbox.popleft())
                rep.applied += 1
            if rep.lease_ended:
                free_leases(rep)
            if sch.remote_kv or rep.remote_inbox:
                resolve_remote(rep, t)
            before = {r.request_id for r in sch.running} if record_steps else None
            sched = sch.schedule()
            if not sched.scheduled:
                rep.busy = False
                rep.api_work = 0.0
                assert not sch.running, f"replica {rep.index}: running requests but nothing scheduled"
                return
            # the step's features, and the tokens its sampling requests get at its end (read by update_from_output)
            prefill, segments, rows, context, pairs, rep.output.sampled_token_ids = step_features_and_tokens(
                sched, prompt_hash, vocab
            )
            dt = step_time(prefill, segments, rows, context, pairs)
            if post_prefill:  # the first pure decode after a prefill (POST_PREFILL_TERM)
                if rep.prev_prefill and not prefill and rows:
                    dt += post_prefill
                rep.prev_prefill = prefill > 0
            if noise is not None:
                dt *= noise()
            if rep.api_work:  # the API process took turns on this step's cores
                dt += stretch * rep.api_work
                rep.api_work = 0.0
            rep.stats.step_s += dt
            dt += core_overhead
            assert dt > 0, f"step time must be positive, got {dt} for features {(prefill, segments, rows, context)}"
            rep.busy = True
            rep.sched = sched
            rep.start_s = t
            rep.end_s = t + dt
            if before is not None:
                scheduled = [
                    (s.request.request_id, s.request.num_computed_tokens, s.num_new_tokens) for s in sched.scheduled
                ]
                admitted = [r for r, _, _ in scheduled if r not in before]
                rep.trace = StepTrace(
                    rep.index, rep.stats.num_steps, t, t + dt, scheduled, admitted, list(sched.preempted_ids), []
                )
                steps.append(rep.trace)
            nonlocal seq
            rep.end_seq = seq
            heappush(heap, (t + dt, _STEP_END, seq, rep.index))  # push(), inlined: every step
            seq += 1

        def finish_record(req: Request, rec: RequestRecord, end_s: float) -> None:
            rec.chunk_num_tokens = [1] * len(rec.chunk_times_s)
            rec.num_output_tokens = req.num_output_tokens
            rec.end_s = end_s
            rec.success = True
            rec.output_tokens_source = rec.chunk_tokens_source = "simulator"
            del prompt_hash[req.request_id]

        def end_step(rep: _Replica, t: float) -> None:
            sched = rep.sched
            assert sched is not None, f"replica {rep.index}: a step ended that never started"
            rep.now[0] = t
            sch = rep.scheduler
            updated = sch.update_from_output(sched, rep.output, max_model_len)  # its tokens: set at the step's start
            nonlocal api_free
            chunk_s = t + egress
            finished = []
            finished_s: list[float] | None = None  # with the API queue: each finished request's last chunk time
            if api_queue and updated:  # the API process streams the step's chunks one after another, in order
                finished_s = []
                if api_free < t:
                    api_free = t
                busy_from = api_free
                for req in updated:
                    rec = record_of[req.request_id]
                    api_free += api_chunk
                    if not rec.chunk_times_s:
                        api_free += api_first
                    if req.status is FINISHED:
                        api_free += api_last
                        rec.chunk_times_s.append(api_free + egress)
                        finish_record(req, rec, api_free + egress)
                        finished.append(req.request_id)
                        finished_s.append(api_free + egress)
                    else:
                        rec.chunk_times_s.append(api_free + egress)
                rep.api_work += api_free - busy_from  # that work runs beside the next step
            else:  # (the hot path of a run without API costs: as it was before they existed)
                for req in updated:
                    rec = record_of[req.request_id]
                    rec.chunk_times_s.append(chunk_s)
                    if req.status is FINISHED:
                        finish_record(req, rec, chunk_s)
                        finished.append(req.request_id)
            if decoders and rep.index < num_prefill:  # a prefill replica: hand off what got its first token
                for req in updated:
                    if req.status is not FINISHED:
                        sch.detach(req)
                        rep.leased[req.request_id] = req
                        handoffs[int(req.request_id)] = (req, rep.index)
                        push(record_of[req.request_id].chunk_times_s[-1], _HANDOFF, int(req.request_id))
            st = rep.stats
            st.num_steps += 1
            st.busy_s += t - rep.start_s
            num_running = len(sch.running) + len(finished)
            if num_running > st.max_running:
                st.max_running = num_running
            if rep.trace is not None:
                rep.trace.finished = finished
            rep.load = len(sch.running) + len(sch.waiting) + len(sch.remote_kv)
            rep.kv_usage = rep.kv.pool.usage
            rep.pending -= rep.applied
            rep.applied = 0
            rep.sched = None
            for k, rid in enumerate(finished):
                del record_of[rid]
                finish_client(int(rid), chunk_s if finished_s is None else finished_s[k])
            start_step(rep, t)

        heappop = heapq.heappop
        next_t = arrivals[0] if n else math.inf  # the next client arrival's time
        while next_arrival < n or heap:
            if next_arrival < n and (
                not heap or next_t < (top := heap[0])[0] or (next_t == top[0] and top[1] > _ARRIVE)
            ):
                i = next_arrival
                next_arrival += 1
                if next_arrival < n:
                    next_t = arrivals[next_arrival]
                if cap is not None and in_flight >= cap:
                    waiting_client.append(i)
                else:
                    send(i, arrivals[i], arrival_stall)
                continue
            t, kind, number, payload = heappop(heap)
            if kind == _STEP_END:
                rep = replicas[payload]
                if number == rep.end_seq:  # (else a stalled step's stale end)
                    end_step(rep, t)
            elif kind == _DELIVER:
                deliver(payload, t)
            elif kind == _HANDOFF:
                hand_off(payload, t)
            elif kind == _DELIVER_REMOTE:
                deliver_remote(payload, t)
            elif kind == _PULL_DONE:
                pull_done(payload, t)
            elif kind == _STALL:  # (one front replica; payload: the request sent)
                stall = stall_of.pop(payload)
                assert stalled_at_send is not None, "a stall event needs the one front replica"
                if stalled_at_send.busy:  # a step is in progress at the send
                    stall_step(stalled_at_send, stall)
            else:
                rep = replicas[payload]
                rep.waking = False
                if not rep.busy:
                    start_step(rep, t)

        assert not waiting_client and in_flight == 0, f"{in_flight} requests still in flight at the end"
        assert not handoffs, f"{len(handoffs)} KV handoffs never pulled"
        for rep in replicas:
            sch = rep.scheduler
            assert not sch.has_unfinished_requests(), f"replica {rep.index}: requests left unfinished"
            assert not rep.leased and not rep.pulling, f"replica {rep.index}: KV leases or pulls left at the end"
            rep.stats.num_preemptions = sch.num_preemptions_total
            rep.stats.prefix_cache_queries = sch.prefix_cache_queries_total
            rep.stats.prefix_cache_hits = sch.prefix_cache_hits_total
        duration = max((r.end_s or 0.0 for r in records), default=0.0)
        if cfg.record_steps:
            steps.sort(key=lambda s: (s.start_s, s.replica))
        return SimResult(records, duration, [r.stats for r in replicas], time.perf_counter() - wall0, steps)
