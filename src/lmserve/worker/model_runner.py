"""SchedulerOutput → flat input tensors + attention metadata → model → logits → sampled tokens."""

from __future__ import annotations

import logging
import os

import torch

from lmserve import kernels
from lmserve.config.engine import EngineConfig
from lmserve.config.kv_budget import available_ram_bytes
from lmserve.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from lmserve.model.attention import MAX_DECODE_RUN, AttentionMetadata, PrefillSegment, long_tensor
from lmserve.model.kv_cache import KVCache
from lmserve.model.kv_pool import KVPoolMemory, pool_tensors
from lmserve.model.layers import (
    choose_small_m_paths,
    pack_linear_weights,
    pack_w4a8_weights,
    quantize_linear_weights,
    round_linear_weights_to_bf16,
)
from lmserve.model.linear_attention import step_metadata as linear_step_metadata
from lmserve.model.loader import load_model
from lmserve.model.parallel import Collectives, TPShard, local_only, parallelize
from lmserve.model.parallel import quantize_linear_weights as quantize_sharded_weights
from lmserve.sample.rejection_sampler import verify
from lmserve.sample.sampler import Sampler, SamplingMetadata, token_logprobs
from lmserve.sample.structured_output import fill_bitmasks
from lmserve.spec_decode.proposer import cut_at_grammar, make_proposer, proposal_inputs
from lmserve.worker.host_memory import release_freed_memory, tune_malloc_for_tensors
from lmserve.worker.lora_slots import LoRASlotPool
from lmserve.worker.pooler import pool_step
from lmserve.worker.state_cache import StateCache

logger = logging.getLogger(__name__)

PROMPT_LOGPROBS_SLICE_ELEMENTS = 1 << 22
"""Prompt logprobs are computed over at most this many logits (rows × vocab) at once: 16 MiB of float32."""


def _log_quantized_kernels(method: str, w4a8_layers: int = 0, lm_head: str | None = None) -> None:
    """Which instructions the quantized path uses on this CPU (flags from /proc/cpuinfo); w4a8_layers: Linears
    packed for the W4A8 kernels (int4_compute=w4a8: int4, int5 and GGUF Q8_0 blocks, GGUF Q4_K / Q5_K)."""
    flags = kernels.cpu_flags()
    relevant = sorted(flags & {"avx512_vnni", "avx_vnni", "amx_int8", "amx_bf16", "avx512_bf16", "avx512bw", "avx2"})
    if w4a8_layers:
        what = "int4 weights and the 8-bit LM head" if method == "int4" and lm_head == "int8w" else "int4 weights"
        if method == "gguf":
            what = "GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks and Q4_K / Q5_K projections"
        logger.info("%s: W4A8 in %d Linear layers, every row count: %s (activations int8 per block of 32, "
                    "int4_compute=w4a8; %s=%s); CPU flags %s", what, w4a8_layers,
                    kernels.w4a8_isa_name(kernels.w4a8_isa()), kernels.W4A8_ISA_ENV,
                    os.environ.get(kernels.W4A8_ISA_ENV, "auto"), relevant or "none")  # fmt: skip
    # GGUF blocks: Q4_0/Q4_1, Q5_0/Q5_1, Q8_0, K-quants; int4's LM head: int8w
    gguf_layouts = ("int4", "int5", "int8w", "kquant")
    layouts = gguf_layouts if method == "gguf" else tuple(dict.fromkeys((method, lm_head or method)))
    for layout in layouts:
        if w4a8_layers and layout in ("int4", "int5", "int8w") and method in ("int4", "gguf"):
            continue
        if not kernels.available():
            decode = "PyTorch ops (no C kernels)"
        elif layout == "kquant":
            decode = kernels.kquant_kernel_name()
        elif layout == "int5":  # (weight-only: no few-row kernel, every row count dequantizes tiles)
            decode = "none (dequantized tiles)"
        else:
            decode = kernels.quantized_kernel_names()[layout]
        batched = "dequantize + float32 GEMM"
        if layout == "int8":  # (no VNNI: exact float32 GEMMs of the int8 codes, model/quantization.int8_mm)
            on_int_mm = not kernels.available() or kernels.int8_dot_instructions()
            batched = "torch._int_mm (oneDNN int8)" if on_int_mm else "float32 GEMMs of the int8 codes (exact)"
        rows = kernels.i8_kernel_rows() if layout == "int8" else kernels.I4_MAX_ROWS
        logger.info("%s weights: 1-%d row kernel %s; batched rows %s; CPU flags %s", layout, rows, decode, batched,
                    relevant or "none")
    if method == "int8" and not flags & {"avx512_vnni", "avx_vnni"}:
        loop = kernels.quantized_kernel_names()["int8"] if kernels.available() else "PyTorch ops"
        logger.warning("int8: this CPU has no VNNI instructions; the int8 kernels run %s", loop)


def _log_bf16_compute() -> None:
    """dtype=bfloat16 on the CPU: matmuls run as oneDNN bf16 GEMMs, fast only with AVX512-BF16 / AMX-BF16."""
    flags = kernels.cpu_flags()
    native = sorted(flags & {"amx_bf16", "avx512_bf16"})
    if native:
        logger.info("bfloat16 compute: oneDNN bf16 GEMMs on this CPU's %s", " and ".join(native))
    else:
        logger.warning(
            "bfloat16 compute: this CPU has neither avx512_bf16 nor amx_bf16, so bf16 matmuls are emulated "
            "(converted to float32) and run slower than dtype=float32; prefer dtype float32, or "
            "weight_dtype=bfloat16 to halve the weight bytes a decode step reads"
        )


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: Collectives | None = None) -> None:
        """tp: this process's tensor-parallel group (worker/distributed.py): the runner holds its rank's shard
        (model/parallel.py); compute_logits answers on rank 0 only, which alone samples."""
        self.config = config
        self.tp = None if tp is None else TPShard.of(config.model, tp.rank, tp.size)
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            tune_malloc_for_tensors()
        self.block_size = config.cache.block_size
        mc = config.model
        self.model = load_model(mc, config.scheduler.max_model_len, config.device, config.quantization, self.tp)
        if self.tp is not None:
            parallelize(self.model, self.tp, tp)
        if config.quantization is not None:
            if not config.quantization.prequantized and tp is not None:
                quantize_sharded_weights(self.model, config.quantization, tp)
            elif not config.quantization.prequantized:
                quantize_linear_weights(self.model, config.quantization)
                if config.quantization.method == "int8":  # MXFP4 experts (gpt-oss): their exact 8-bit form
                    _mxfp4_experts_to_int8w(self.model)
            w4a8, on, method = 0, config.quantization.int4_compute == "w4a8", config.quantization.method
            if on and kernels.available():  # (GGUF: Q4_0 / Q4_1, Q5_0 / Q5_1 and Q8_0 blocks)
                w4a8 = pack_w4a8_weights(self.model, head=method == "int4", int8w=method == "gguf")
            _log_quantized_kernels(method, w4a8, config.quantization.lm_head)
            if self.device.type == "cpu":
                release_freed_memory()  # the load's and the repacking's temporary copies (the heap is never trimmed)
        self.packed_weight_bytes = 0
        if config.weight_dtype == "bfloat16":
            if not kernels.available():
                raise ValueError("weight_dtype='bfloat16' needs the CPU kernels (a C compiler); none could be built")
            round_linear_weights_to_bf16(self.model)
        if self.device.type == "cpu" and mc.dtype == "bfloat16":
            _log_bf16_compute()
        if self.device.type == "cpu":
            # oneDNN-packed copies of the projection weights, if they fit in a quarter of the free RAM.
            self.packed_weight_bytes = pack_linear_weights(self.model, available_ram_bytes() // 4)
            logger.info(
                "CPU fast paths: C kernels %s; oneDNN-packed weights %s; linear weights stored in %s",
                "on" if kernels.available() else "off (PyTorch ops)",
                f"{self.packed_weight_bytes / 2**20:.0f} MiB" if self.packed_weight_bytes else "off",
                config.weight_dtype or mc.dtype,
            )
            if config.quantization is not None and config.quantization.method == "gguf":
                embed = getattr(self.model.model.embed_tokens, "kq_type", None) or mc.dtype  # (K-quant: kept)
                logger.info("GGUF blocks kept as they are in %d Linear layers (token embedding: %s, norms: %s)",
                            sum(getattr(m, "quant_method", None) is not None for m in self.model.modules()), embed,
                            mc.dtype)
            elif config.quantization is not None:
                logger.info("projections quantized to %s (embeddings, LM head, norms: %s)",
                            config.quantization.method, mc.dtype)
        self.kv_caches: list[KVCache] = self._allocate_kv_caches()
        self.kv_pool = KVPoolMemory(config.cache.num_blocks, pool_tensors(self.kv_caches))  # committed as used
        # few-row linears: C kernel or oneDNN / torch.mm, measured before the first step, in the thread (and
        # OpenMP team) that runs the steps: `serve` loads the model with one thread
        self._small_m_pending = self.device.type == "cpu"
        self.sampler = Sampler()
        self.proposer = make_proposer(config)
        if hasattr(self.proposer, "kv_caches"):  # a draft model's KV: the same blocks, committed with the target's
            self.kv_pool.add(pool_tensors(self.proposer.kv_caches))
        self.lora = LoRASlotPool(self.model, config) if config.lora is not None else None

    def _allocate_kv_caches(self) -> list[KVCache]:
        mc, cc, sc = self.config.model, self.config.cache, self.config.scheduler
        caches: list[KVCache] = []
        states = iter(self._allocate_states())
        for shape in mc.layer_kv_shapes:  # (a layer reading an earlier layer's K/V shares its cache object)
            if shape is None:  # a hybrid's linear-attention layer: its recurrent state per slot, no KV
                caches.append(next(states))
                continue
            if isinstance(shape, int):
                caches.append(caches[shape])
                continue
            kv_heads = shape[0] if self.tp is None else self.tp.num_kv_heads
            caches.append(KVCache.allocate(cc.num_blocks, cc.block_size, kv_heads, shape[1], cc.kv_cache_dtype,
                                           self.device))  # fmt: skip
        scales = f", of which scales {cc.kv_scale_bytes_per_token} B" if cc.kv_scale_bytes_per_token else ""
        logger.info(
            "KV cache %s: %d blocks × %d = %d tokens, %.1f MiB (%d B/token%s, committed as blocks are first used); "
            "%d concurrent requests of max_model_len=%d",
            cc.kv_cache_dtype, cc.num_blocks, cc.block_size, cc.num_tokens, cc.pool_bytes / 2**20,
            cc.kv_bytes_per_token, scales, cc.max_concurrent_requests(sc.max_model_len), sc.max_model_len,
        )  # fmt: skip
        if cc.sliding_window is not None:
            logger.info("every layer slides (window %d): KV blocks outside the window are freed while requests run",
                        cc.sliding_window)
        return caches

    def _allocate_states(self) -> list:
        """A hybrid model's state tensors, one LayerState per linear-attention layer (worker/state_cache.py)."""
        mc, cc = self.config.model, self.config.cache
        self.state_cache: StateCache | None = None
        if not cc.num_state_slots:
            return []
        self.state_cache = StateCache(mc.linear, mc.num_linear_layers, cc.num_state_slots,
                                      getattr(torch, cc.state_cache_dtype), self.device, cc.num_state_snapshots)
        assert self.state_cache.nbytes == cc.num_state_slots * cc.state_bytes_per_sequence, "state bytes != ledger's"
        assert self.state_cache.snapshot_nbytes == cc.num_state_snapshots * cc.state_bytes_per_sequence, "snapshots"
        logger.info("recurrent state: %d slots x %d linear-attention layers, %.1f MiB (%d B a sequence, %s); "
                    "%d prefix-cache snapshots, %.1f MiB", cc.num_state_slots, mc.num_linear_layers,
                    self.state_cache.nbytes / 2**20, cc.state_bytes_per_sequence, cc.state_cache_dtype,
                    cc.num_state_snapshots,
                    self.state_cache.snapshot_nbytes / 2**20)  # fmt: skip
        return self.state_cache.layers

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if self._small_m_pending:
            self._small_m_pending = False
            with local_only(self.model):  # (tensor parallel: each rank times its own shard's projections)
                choose_small_m_paths(self.model)
        # Decode rows first, then prefill chunks: the attention backend batches the former. A verification run
        # (1 + k tokens) is k + 1 decode rows, each a query over its own prefix in the same blocks (its K/V rows
        # are all written before any query reads), so it takes the decode kernels and the one-call stack.
        decodes: list[ScheduledRequest] = []
        prefills: list[ScheduledRequest] = []
        for s in sched.scheduled:
            (decodes if s.num_new_tokens == 1 or self._verify_as_decodes(s) else prefills).append(s)
        if self.lora is not None:  # each adapter's rows in contiguous runs (lora/layers.py)
            decodes, prefills = self.lora.sort_rows(decodes), self.lora.sort_rows(prefills)
        ordered = decodes + prefills
        input_ids, positions, slots = [], [], []
        first_row: dict[str, int] = {}  # request id → its first token's row in the flat batch
        for s in ordered:
            first_row[s.request.request_id] = len(input_ids)
            ids, pos, sl = self._token_inputs(s)
            input_ids += ids
            positions += pos
            slots += sl
        dev = self.device
        meta = AttentionMetadata(slot_mapping=long_tensor(slots, dev))
        if decodes:
            lens = [s.start + 1 + i for s in decodes for i in range(s.num_new_tokens)]
            tables = [s.block_ids for s in decodes for _ in range(s.num_new_tokens)]
            meta.set_decodes(lens, tables, self.block_size)
        for s in prefills:
            row0 = first_row[s.request.request_id]
            meta.prefills.append(
                PrefillSegment.for_chunk(row0, s.num_new_tokens, s.start, s.block_ids, self.block_size, dev)
            )
        if self.config.cache.num_state_slots:  # a hybrid's linear-attention layers: each sequence's state slot
            meta.linear = linear_step_metadata(decodes, prefills, first_row, dev)
            restores = [(s.state_restore, s.request.state_slot) for s in ordered if s.state_restore >= 0]
            if restores:  # a prefix hit: the state at its last block, before any layer reads the slot
                assert self.state_cache is not None
                self.state_cache.restore(restores)
        if self.lora is not None:
            self.lora.begin_step(ordered)
        if ordered:  # the blocks this step writes, and (spec decode) its requests' lookahead tails
            self.kv_pool.ensure(max(max(slots) // self.block_size, max(s.block_ids[-1] for s in ordered)))
        hidden = self.model(long_tensor(input_ids, dev), long_tensor(positions, dev), self.kv_caches, meta)
        if self.lora is not None:
            self.lora.end_step()
        # Only the last token of each request that reaches the end of its known tokens is sampled; a request
        # with proposals has all 1 + k of its last rows scored (verified after the plain rows are sampled).
        prompt_logprobs = self._prompt_logprobs(ordered, first_row, hidden)
        pooled = pool_step(ordered, first_row, hidden, self.model) if self.config.runner == "pooling" else {}
        sampling = [s for s in sched.scheduled if s.samples and not s.num_spec_tokens]  # scheduled order
        verifying = [s for s in sched.scheduled if s.samples and s.num_spec_tokens]
        sample_rows = [first_row[s.request.request_id] + s.num_new_tokens - 1 for s in sampling]
        for s in verifying:
            last = first_row[s.request.request_id] + s.num_new_tokens
            sample_rows += range(last - s.num_spec_tokens - 1, last)
        if not sample_rows:
            return ModelRunnerOutput({}, prompt_logprobs=prompt_logprobs, pooled=pooled)
        every_row = sample_rows == list(range(hidden.shape[0]))  # (a decode step: no gather, no slice)
        all_logits = self.model.compute_logits(hidden if every_row else hidden[long_tensor(sample_rows, dev)])
        logits = all_logits if len(sampling) == len(sample_rows) else all_logits[: len(sampling)]
        out = ModelRunnerOutput({}, logits, prompt_logprobs=prompt_logprobs, pooled=pooled)
        if sampling:
            sampled = self.sampler(logits, self._sampling_metadata(sampling))
            ids = [s.request.request_id for s in sampling]
            out.sampled_token_ids = dict(zip(ids, sampled.sampled_token_ids, strict=True))
            if sampled.logprobs is not None:
                out.logprobs = {rid: lp for rid, lp in zip(ids, sampled.logprobs, strict=True) if lp is not None}
        if verifying:
            self._verify(verifying, all_logits[len(sampling) :], out)
        if self.proposer is not None:
            self._propose(sched, sampling + verifying, out)
        return out

    @staticmethod
    def _verify_as_decodes(s: ScheduledRequest) -> bool:
        """A run of one settled token and its proposals, short enough for the decode path's kernels."""
        return s.num_spec_tokens > 0 and s.num_new_tokens == s.num_spec_tokens + 1 <= MAX_DECODE_RUN

    def _verify(self, verifying: list[ScheduledRequest], logits: torch.Tensor, out: ModelRunnerOutput) -> None:
        for s, v in zip(verifying, verify(self.sampler, logits, verifying), strict=True):
            rid = s.request.request_id
            if s.request.spec_acceptance is not None:
                s.request.spec_acceptance.record(s.num_spec_tokens, len(v.token_ids) - 1)
            out.accepted_token_ids[rid], out.sampled_token_ids[rid] = v.token_ids[:-1], v.token_ids[-1]
            if v.logprobs is not None:
                out.accepted_logprobs[rid], out.logprobs[rid] = v.logprobs[:-1], v.logprobs[-1]

    def _propose(self, sched: SchedulerOutput, sampled: list[ScheduledRequest], out: ModelRunnerOutput) -> None:
        """Proposals for the next step, from the tokens this step produced (stop checks come later: the
        scheduler drops the proposals of requests that finish)."""
        assert self.proposer is not None and self.config.speculative is not None
        new_tokens = []
        for s in sampled:
            rid = s.request.request_id
            tokens = out.accepted_token_ids.get(rid, []) + [out.sampled_token_ids[rid]]
            new_tokens.append((s, tokens))
            # the draft's KV is valid only where the target's tokens are settled
            n_settled = s.request.num_tokens + len(tokens) - 1
            s.request.num_draft_computed_tokens = min(s.request.num_draft_computed_tokens, n_settled)
        inputs = proposal_inputs(self.config.speculative, new_tokens, len(sched.scheduled), self.block_size)
        if inputs:
            out.spec_token_ids, out.spec_draft_probs = self.proposer.propose(inputs)
            cut_at_grammar(inputs, out.spec_token_ids)

    def _prompt_logprobs(
        self, ordered: list[ScheduledRequest], first_row: dict[str, int], hidden: torch.Tensor
    ) -> dict[str, tuple[int, list]]:
        """For requests asking for prompt_logprobs: position p of this chunk scores prompt token p + 1.
        Returns request id → (first scored prompt position, TokenLogprobs per position)."""
        out = {}
        # A slice of rows at a time: a 2,000-token prompt's logits over a 49,152-token vocabulary are 393 MB of
        # float32, and log_softmax, the rank comparison and top-k each make another tensor of that shape.
        rows_per_slice = max(1, PROMPT_LOGPROBS_SLICE_ELEMENTS // self.config.model.vocab_size)
        for s in ordered:
            req = s.request
            k = req.sampling_params.prompt_logprobs
            if k is None:
                continue
            first, last = s.start, min(s.start + s.num_new_tokens, req.num_prompt_tokens - 1)
            if last <= first:
                continue
            row0 = first_row[req.request_id]
            targets = req.all_token_ids[first + 1 : last + 1]
            entries = []
            for a in range(0, last - first, rows_per_slice):
                b = min(a + rows_per_slice, last - first)
                logits = self.model.compute_logits(hidden[row0 + a : row0 + b])
                ids = torch.tensor(targets[a:b], dtype=torch.long, device=self.device)
                entries += token_logprobs(logits, ids, [k] * (b - a))
                del logits  # before the next slice's logits are allocated
            out[req.request_id] = (first + 1, entries)
        return out

    def _token_inputs(self, s: ScheduledRequest) -> tuple[list[int], list[int], list[int]]:
        start, end = s.start, s.start + s.num_new_tokens
        bs = self.block_size
        ids = s.request.all_token_ids[start:end]
        if s.num_spec_tokens:
            ids += s.request.spec_token_ids[: s.num_spec_tokens]
        pos = list(range(start, end))
        slots = [s.block_ids[p // bs] * bs + p % bs for p in pos]
        return ids, pos, slots

    def _sampling_metadata(self, sampling: list[ScheduledRequest]) -> SamplingMetadata:
        reqs = [s.request for s in sampling]
        constrained = [i for i, r in enumerate(reqs) if r.structured_output is not None]
        bitmask = None
        if constrained:
            vocab = self.config.model.vocab_size
            bitmask = fill_bitmasks(constrained, [reqs[i].structured_output for i in constrained], vocab)
        return SamplingMetadata(
            params=[r.sampling_params for r in reqs],
            generators=[r.generator for r in reqs],
            prompt_token_ids=[r.prompt_token_ids for r in reqs],
            output_token_ids=[r.output_token_ids for r in reqs],
            eos_token_ids=list(reqs[0].eos_token_ids),
            token_bitmask=bitmask,
        )


def _mxfp4_experts_to_int8w(model: torch.nn.Module) -> None:
    """--quantization int8 on a checkpoint with MXFP4 experts: each becomes its lossless int8w form (8-bit codes,
    float16 scales per 32) on the C int8w kernels, in place of dequantizing the 4-bit bytes on every call."""
    from lmserve.model.layers.moe import SparseMoE

    n = sum(m.mxfp4_to_int8w() for m in model.modules() if isinstance(m, SparseMoE))
    if n:
        logger.info("int8: %d MXFP4 expert projections held as int8w (their exact 8-bit form)", n)

