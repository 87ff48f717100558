"""DisaggregatedClient: `lmserve serve --disaggregation NPmD`, EngineCoreClient over P prefill and D decode cores.

A request goes to a prefill core and its handoff to a decode core (each by router.choose_core among the live cores
of its role), which pulls the missing blocks from the prefill core's KV server; both feed one stream, one ordinary
response per request. Aborts and dead cores: docs/disaggregation.md.
"""

from __future__ import annotations

import dataclasses
import re
from collections import OrderedDict
from typing import Any

from lmserve.config.engine import EngineConfig
from lmserve.config.kv_transfer import KVTransferConfig
from lmserve.engine.core_client import EngineCoreClient
from lmserve.engine.core_handles import CoreView
from lmserve.engine.kv_transfer import KVHandoff
from lmserve.engine.messages import AbortRequests, AddRequest, StepOutputs
from lmserve.engine.router import choose_core
from lmserve.engine.snapshot import dead_snapshot
from lmserve.engine.streams import EngineDeadError
from lmserve.sampling_params import SamplingParams

_SHAPE = re.compile(r"^(\d+)P(\d+)D$", re.IGNORECASE)


def parse_disaggregation(value: str) -> tuple[int, int]:
    """'1P1D' → (1, 1); 'NPmD' with N, m >= 1. ValueError naming the flag otherwise."""
    m = _SHAPE.match(value.strip())
    if m is None or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"disaggregation must look like 1P1D, 2P1D, 1P2D (NPmD, N, m >= 1), got {value!r}")
    return int(m.group(1)), int(m.group(2))


class DisaggregatedClient(EngineCoreClient):
    """EngineCoreClient whose first num_prefill cores prefill and the others decode."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        num_prefill: int = 1,
        num_decode: int = 1,
        kv_lease_s: float | None = None,
        kv_load_failure_policy: str = "fail",
        kv_transfer_timeout_s: float | None = None,
        **kwargs: Any,
    ) -> None:
        if num_prefill < 1 or num_decode < 1:
            raise ValueError(f"disaggregation needs >= 1 prefill and >= 1 decode core, got {num_prefill}P{num_decode}D")
        if config.cache.kv_disk_dir is not None:
            raise ValueError("kv_cache_disk_dir: the KV disk tier is not supported with prefill/decode disaggregation")
        if config.kv_transfer is not None:
            raise ValueError("kv_transfer_config: --disaggregation sets the roles itself; pass one or the other")
        if config.cache.sliding_window is not None:
            raise ValueError("disaggregation: a model whose every layer slides (KV outside the window is freed) "
                             "cannot hand its KV off yet; serve it colocated")  # fmt: skip
        if config.lora is not None:
            raise ValueError("--disaggregation with --enable-lora: LoRA adapters are not served with prefill/decode "
                             "disaggregation yet (the decode core would need the request's adapter)")  # fmt: skip
        kwargs.pop("data_parallel_size", None)
        super().__init__(config, data_parallel_size=num_prefill + num_decode, **kwargs)
        self.num_prefill, self.num_decode = num_prefill, num_decode
        self._kv: dict[str, Any] = {"kv_load_failure_policy": kv_load_failure_policy}
        if kv_lease_s is not None:
            self._kv["kv_lease_s"] = kv_lease_s
        if kv_transfer_timeout_s is not None:
            self._kv["kv_transfer_timeout_s"] = kv_transfer_timeout_s
        KVTransferConfig("kv_consumer", **self._kv)  # checks the values now, not in a core
        self._requests: dict[str, tuple[SamplingParams, float, int]] = {}  # params, arrival, prefill core
        self._in_transfer: dict[str, int] = {}  # handed off, no decode output yet → its prefill core
        self._decode_affinity: OrderedDict[int, int] = OrderedDict()
        self._prompt_logprobs: dict[str, list[Any]] = {}  # computed on the prefill side, put on the final output

    def role(self, index: int) -> str:
        return "prefill" if index < self.num_prefill else "decode"

    def _core_name(self, index: int) -> str:
        return f"engine core {index} ({self.role(index)})"

    # ---- the hooks of EngineCoreClient --------------------------------------------------------------

    def _core_config(self, index: int, host: str | None) -> EngineConfig:
        if index < self.num_prefill:
            where = {"kv_ip": host} if host is not None else {"kv_address": f"ipc://{self._ipc_dir}/kv-{index}"}
            kv = KVTransferConfig("kv_producer", **where, **self._kv)
        else:
            kv = KVTransferConfig("kv_consumer", **self._kv)
        return dataclasses.replace(self.config, kv_transfer=kv)

    def _route(self, prompt_ids: list[int], lora_int_id: int = 0) -> CoreView:
        assert lora_int_id == 0, "LoRA is refused with disaggregation (DisaggregatedClient.__init__)"
        return self._route_role(prompt_ids, "prefill", self._affinity)

    def _route_role(self, prompt_ids: list[int], role: str, affinity: OrderedDict[int, int]) -> CoreView:
        loads = {c.index: c.load() for c in self._cores if c.alive and self.role(c.index) == role}
        if not loads:
            raise EngineDeadError(f"no live {role} engine core")
        return self._cores[choose_core(loads, affinity, prompt_ids, self.config.cache.block_size)]

    def _add_message(self, request_id: str, prompt_ids: list[int], params: SamplingParams, arrival: float) -> Any:
        with self._lock:
            self._requests[request_id] = (params, arrival, self._streams[request_id].core.index)
        return AddRequest(request_id, prompt_ids, params, arrival, do_remote_decode=True)

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        with self._lock:
            self._requests.pop(request_id, None)
            self._in_transfer.pop(request_id, None)
            self._prompt_logprobs.pop(request_id, None)

    def _on_step(self, core: CoreView, msg: StepOutputs) -> None:
        if self.role(core.index) == "decode":
            with self._lock:
                for out in msg.outputs:
                    self._in_transfer.pop(out.request_id, None)
                    if out.finished and out.request_id in self._prompt_logprobs:
                        out.prompt_logprobs = self._prompt_logprobs.pop(out.request_id)
                for f in msg.failed:
                    self._in_transfer.pop(f.request_id, None)
                    self._prompt_logprobs.pop(f.request_id, None)
        super()._on_step(core, msg)
        for handoff in msg.handoffs:
            self._hand_to_decode(core, handoff)
        if self.role(core.index) == "decode":
            with self._lock:
                for out in msg.outputs:
                    if out.finished:
                        self._requests.pop(out.request_id, None)
                for f in msg.failed:
                    self._requests.pop(f.request_id, None)

    def _hand_to_decode(self, prefill: CoreView, handoff: KVHandoff) -> None:
        rid = handoff.request_id
        with self._lock:
            entry = self._streams.get(rid)
            info = self._requests.get(rid)
            decode = None
            if entry is not None and info is not None:
                try:
                    decode = self._route_role(entry.prompt_token_ids, "decode", self._decode_affinity)
                except EngineDeadError as e:
                    self._streams.pop(rid)
                    prefill.streams.discard(rid)
                    self._fail([entry.stream], e)
                else:
                    prefill.streams.discard(rid)
                    entry.core = decode
                    decode.streams.add(rid)
                    self._in_transfer[rid] = prefill.index
                    # the decode core's logprobs cross as tails from its own start (the first token included)
                    prompt_lps = self._tails._joined.get(rid, {}).get(-1)
                    if prompt_lps is not None:
                        self._prompt_logprobs[rid] = prompt_lps
                    self._tails.forget(rid)
                    params, arrival, _ = info
                    if params.prompt_logprobs is not None:  # computed on the prefill side; the decode side reads
                        params = dataclasses.replace(params, prompt_logprobs=None)  # the cached KV
                    handoff = dataclasses.replace(handoff, first_token_delivered=True)  # the producer's output had it
                    # sent under the lock: an abort from now on goes to the decode core, after this add
                    self._send(decode, AddRequest(rid, entry.prompt_token_ids, params, arrival, remote_kv=handoff))
        if decode is None:  # aborted meanwhile (or no decode core): the prefill core ends the lease
            self._send(prefill, AbortRequests([rid]))

    def _watch(self, core: CoreView) -> None:
        super()._watch(core)
        if self._stopping:
            return
        role = self.role(core.index)
        with self._lock:  # a role with no live core left: no request can be served any more
            if self._dead is None and not any(c.alive for c in self._cores if self.role(c.index) == role):
                self._dead = EngineDeadError(f"no live {role} engine core: {self._core_name(core.index)} died: "
                                             f"{core.error}")  # fmt: skip
        if role != "prefill":
            return
        with self._lock:  # requests whose KV a decode core still waits for from the dead producer
            lost = [rid for rid, p in self._in_transfer.items() if p == core.index]
            victims = []
            for rid in lost:
                del self._in_transfer[rid]
                entry = self._streams.pop(rid, None)
                if entry is not None:
                    entry.core.streams.discard(rid)
                    victims.append(entry)
            if victims and core.snapshot is not None:  # failed with the dead core: counted there
                core.snapshot = dead_snapshot(core.snapshot, len(victims))
        for entry in victims:
            self._send(entry.core, AbortRequests([entry.stream.request_id]))
        error = EngineDeadError(f"{self._core_name(core.index)} died before its KV was pulled")
        self._fail([v.stream for v in victims], error)
