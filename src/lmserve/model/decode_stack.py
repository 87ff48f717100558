"""The whole decoder stack of a small pure-decode step in one C call (kernels.decode_stack), bit-identical to the
module path: the same kernels in the same order, without the Python between them.

DecodeStack.supports: which models (Llama's pre-norm layout, gpt-oss's sinks too, or a hybrid's layers,
model/hybrid_stack.py; every projection on its C kernel); .applies: which steps (all decodes, at most max_rows).
TP all-reduce and LoRA deltas run from C. See docs/cpu_kernels.md."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from lmserve import kernels
from lmserve.distributed.shm_allreduce import ShmAllReduce
from lmserve.model import hybrid_stack as hybrid
from lmserve.model.attention import AttentionMetadata
from lmserve.model.kv_cache import KVCache
from lmserve.model.layers import Linear
from lmserve.model.layers.moe import ROUTER_KERNEL_MAX_ROWS, SparseMoE
from lmserve.model.mxfp4 import Mxfp4Linear
from lmserve.model.stack_linear import W4A8_STACK_MAX_ROWS, LinearDesc, linear_desc, on_kernel, ptr

__all__ = ["W4A8_STACK_MAX_ROWS", "DecodeStack", "DecodeStackDispatch", "MoEDesc"]


class _Layer(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("in_norm", "post_norm", "k_cache", "v_cache", "k_scale", "v_scale")]
    _fields_ += [("window", ctypes.c_int64)] + [(n, LinearDesc) for n in ("qkv", "o", "gate_up", "down")]
    _fields_ += [("qk_norm", ctypes.c_int64)] + [(n, ctypes.c_void_p) for n in ("q_norm", "k_norm", "moe", "sinks")]
    _fields_ += [("mixer", ctypes.c_int64), ("gdn", ctypes.c_void_p)]  # hybrid_stack.ATTENTION / ...; a _GDN


class _MoE(ctypes.Structure):  # ls_moe: a layer's MoE block
    _fields_ = [(n, ctypes.c_int64) for n in ("num_experts", "top_k", "scoring", "renormalize", "inter", "shared")]
    _fields_ += [(n, ctypes.c_void_p) for n in ("router_w", "router_b", "shared_gate")]
    _fields_ += [(n, ctypes.POINTER(LinearDesc)) for n in ("gate_up", "down", "shared_gate_up", "shared_down")]
    _fields_ += [("counts", ctypes.c_void_p)]  # SparseMoE.stack_tokens (int64): the expert load the stack routed
    _fields_ += [("clamped", ctypes.c_int64), ("alpha", ctypes.c_double), ("limit", ctypes.c_double)]  # gpt-oss


class MoEDesc:
    """The C description of one SparseMoE (its experts' tensors must not move while it lives: built with the stack,
    rebuilt by reset_decode_stack). `rows`: the most rows its expert kernels take in one call."""

    def __init__(self, moe: SparseMoE) -> None:
        spec, experts = moe.spec, list(moe.experts)
        n = len(experts)
        descs = [(linear_desc(ex.gate_up_proj), linear_desc(ex.down_proj)) for ex in experts]
        self.gate_up = (LinearDesc * n)(*(g for (g, _), _ in descs))
        self.down = (LinearDesc * n)(*(d for _, (d, _) in descs))
        self.rows = min(r for pair in descs for _, r in pair)
        self.shared = None
        shared_inter = 0
        if moe.shared_expert is not None:
            (sg, r1), (sd, r2) = linear_desc(moe.shared_expert.gate_up_proj), linear_desc(moe.shared_expert.down_proj)
            self.shared = ((LinearDesc * 1)(sg), (LinearDesc * 1)(sd))
            self.rows, shared_inter = min(self.rows, r1, r2), moe.shared_expert.intermediate_size
        self.struct = _MoE(
            n, spec.top_k, kernels.MOE_SCORINGS[spec.scoring], int(spec.renormalize), experts[0].intermediate_size,
            shared_inter, ptr(moe.router.weight), ptr(moe.router.bias),
            ptr(moe.shared_expert_gate.weight) if self.shared else None, self.gate_up, self.down,
            *(self.shared or (None, None)), ptr(moe.stack_tokens), int(moe.shape.activation == "swiglu_clamped"),
            moe.shape.swiglu_alpha, moe.shape.swiglu_limit,
        )  # fmt: skip
        self._counts = moe.stack_tokens  # (kept alive with the pointer to it)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The block on x (B <= rows, hidden) in one C call (what the stack runs for the layer)."""
        assert 0 < x.shape[0] <= self.rows, f"{x.shape[0]} rows for expert kernels that take {self.rows}"
        return kernels.moe_block(ctypes.byref(self.struct), x)

    @staticmethod
    def supports(moe: torch.nn.Module) -> bool:
        """Whether the C block computes moe exactly as SparseMoE.forward does on few rows: SwiGLU / clamped SwiGLU
        experts (and shared expert) on their C kernels (MXFP4 ones on the MXFP4 x int8 kernel), float32 CPU router
        and gate."""
        if not isinstance(moe, SparseMoE) or not getattr(moe, "plain", False):
            return False
        gates = [moe.router.weight] + ([moe.shared_expert_gate.weight] if moe.shared_expert is not None else [])
        gates += [moe.router.bias] if moe.router.bias is not None else []
        if any(w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous() for w in gates):
            return False
        return all(isinstance(m, (Linear, Mxfp4Linear)) and on_kernel(m) for m in _moe_linears(moe))


def _moe_linears(moe: SparseMoE) -> list[Linear]:
    out = [m for ex in moe.experts for m in (ex.gate_up_proj, ex.down_proj)]
    if moe.shared_expert is not None:
        out += [moe.shared_expert.gate_up_proj, moe.shared_expert.down_proj]
    return out


class _Model(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_int64)
        for n in ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "block_size", "kv_kind")
    ]
    _fields_ += [("eps", ctypes.c_double), ("scale", ctypes.c_double)]
    _fields_ += [("layers", ctypes.POINTER(_Layer)), ("final_norm", ctypes.c_void_p)]
    _fields_ += [("lora", ctypes.c_void_p)]  # NULL, or a _LoRA for a step with LoRA rows
    _fields_ += [("allreduce", ctypes.c_void_p)]  # NULL, or a tensor-parallel rank's ShmAllReduce.desc
    _fields_ += [("head", ctypes.c_void_p)]  # NULL, or a LinearDesc: the LM head run after the final norm
    _fields_ += [("rotary_dim", ctypes.c_int64), ("state_slots", ctypes.c_void_p)]  # cos / sin width; (B,) int64


class _LoRALinear(ctypes.Structure):  # ls_lora_linear: one projection's slot-stacked A, B and columns in use
    _fields_ = [(n, ctypes.c_void_p) for n in ("A", "B", "cols")] + [(n, ctypes.c_int64) for n in ("O", "K", "PR")]


class _LoRA(ctypes.Structure):  # struct ls_lora: the projections (4 a layer) and the step's (slot, start, end) runs
    _fields_ = [("linears", ctypes.POINTER(_LoRALinear)), ("groups", ctypes.c_void_p), ("num_groups", ctypes.c_int64)]


class _LoRADesc:
    """The C description of one LoRAHooks' slot weights (their tensors never move: set_slot copies in place)."""

    def __init__(self, hooks: Any, num_layers: int) -> None:
        # DecodeStack.layer_linears' order: ls_lora_add's projection index p
        names = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
        self.hooks = hooks
        self.max_loras = min((lora.A.shape[0] for lora in hooks.linears.values()), default=0)
        self.linears = (_LoRALinear * (4 * num_layers))()
        self.ok = True
        for layer in range(num_layers):
            for p, name in enumerate(names):
                lora = hooks.linears.get((layer, name))
                if lora is None:
                    continue
                a, b = lora.A, lora.B
                if not lora.kernel or not (a.is_contiguous() and b.is_contiguous()):
                    self.ok = False
                    return
                self.linears[4 * layer + p] = _LoRALinear(
                    a.data_ptr(), b.data_ptr(), lora.cols.data_ptr(), b.shape[1], a.shape[2], a.shape[1]
                )
        # a missing projection (none in LORA_MODULES today) would have cols NULL: refuse it rather than read it
        self.ok = all(self.linears[i].cols for i in range(4 * num_layers))
        self.struct = _LoRA(self.linears, None, 0)


def _row_tables(model: torch.nn.Module) -> tuple[Any, Any, Any] | None:
    """numpy views of model's (a DecoderModel) token embedding and rotary cos / sin tables, when a decode step's
    rows are plain copies of their rows (float32 CPU tables, no embedding scale, no quantized embedding, no hook on
    the embedding: a tensor-parallel rank's is a vocabulary slice, all-reduced by one)."""
    e, r = model.embed_tokens, model.rotary
    if model.embed_scale is not None or e.kq_type is not None or e._head is not None or e.weight is None:
        return None
    if model.tensor_parallel_size != 1 or e._forward_hooks or e._forward_pre_hooks:  # (TP: a vocabulary slice)
        return None
    tables = (e.weight, r.cos, r.sin)
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tables):
        return None
    return tuple(t.detach().numpy() for t in tables)


def _first_attention(model: torch.nn.Module) -> torch.nn.Module | None:
    """The first attention mixer of model's layers (a hybrid's first layers are linear attention), else None."""
    return next((layer.mixer for layer in model.layers if hybrid.mixer_kind(layer) != hybrid.LINEAR), None)


class DecodeStack:
    """The C description of one model's layers over one set of KV caches (built once, reused every step)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[KVCache],
        all_reduce: ShmAllReduce | None = None,
        head: Linear | None = None,
    ) -> None:
        """model: a DecoderModel for which supports() holds. all_reduce: a tensor-parallel rank's shared-memory
        group (its C description set: the kernels are loaded), whose sum the stack takes after o and down.
        head: the LM head (one rank's whole vocabulary, no soft-capping), which run(..., with_logits=True) also
        applies to the final norm in the same call, when its few-row input runs through its C kernel (the same
        kernel on the same arguments as Linear.forward: the same logits) and the step has at most head_rows rows."""
        layers = list(model.layers)
        attn = _first_attention(model)
        self._layers = (_Layer * len(layers))()
        self._moes: list[MoEDesc] = []  # (kept alive with the pointers to them)
        self._gdns: list[hybrid.GDNDesc] = []  # a hybrid's Gated DeltaNet layers, likewise
        self.max_rows = max(kernels.I4_MAX_ROWS, W4A8_STACK_MAX_ROWS)
        for i, (layer, cache) in enumerate(zip(layers, kv_caches, strict=True)):
            kind, gdn, a = hybrid.mixer_kind(layer), None, layer.mixer
            if kind == hybrid.LINEAR:  # (no qkv / o, no KV cache: the layer's own description holds its state)
                self._gdns.append(hybrid.GDNDesc(a, cache))
                gdn = ctypes.addressof(self._gdns[-1].struct)
                descs = [(LinearDesc(), self._gdns[-1].rows)] * 2
            else:
                descs = [linear_desc(m) for m in (a.qkv_proj, a.o_proj)]
            moe = None
            if isinstance(layer.mlp, SparseMoE):  # (no gate_up / down: zeroed descriptions the C never reads)
                self._moes.append(MoEDesc(layer.mlp))
                moe = ctypes.addressof(self._moes[-1].struct)
                if self._moes[-1].rows >= ROUTER_KERNEL_MAX_ROWS:  # (long prefills run through it: SparseMoE.forward)
                    layer.mlp.prefill_block = self._moes[-1]
                descs += [(LinearDesc(), self._moes[-1].rows)] * 2
            else:
                descs += [linear_desc(layer.mlp.gate_up_proj), linear_desc(layer.mlp.down_proj)]
            self.max_rows = min(self.max_rows, *(rows for _, rows in descs))
            qk = 0 if gdn else 1 if a.qk_norm else 2 if a.qk_norm_whole else 0
            kv = (None,) * 4 if gdn else (ptr(cache.k), ptr(cache.v), ptr(cache.k_scale), ptr(cache.v_scale))
            self._layers[i] = _Layer(
                ptr(layer.input_layernorm.weight), ptr(layer.post_attention_layernorm.weight), *kv,
                0 if gdn else a.sliding_window or 0, *(d for d, _ in descs), qk,
                ptr(a.q_norm.weight) if qk else None, ptr(a.k_norm.weight) if qk else None, moe,
                None if gdn else ptr(getattr(a, "sinks", None)), kind, gdn,
            )  # fmt: skip
        cache = next(c for c in kv_caches if isinstance(c, KVCache))
        dense = [layer.mlp for layer in layers if not isinstance(layer.mlp, SparseMoE)]
        inter = max((mlp.intermediate_size for mlp in dense), default=0)  # (DenseMLP.plain: one width)
        self._model = _Model(
            len(layers), model.norm.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim,
            inter, cache.block_size, kernels.KV_CACHE_DTYPES[cache.k.dtype],
            model.norm.eps, attn.head_dim**-0.5 if attn.scale is None else attn.scale, self._layers,
            ptr(model.norm.weight), None, None, None, model.rotary.cos.shape[-1],
        )  # fmt: skip
        self._kv_caches = kv_caches  # the pointers above stay valid while these live
        self._all_reduce = all_reduce
        if all_reduce is not None:
            assert all_reduce.desc is not None, "a shared-memory all-reduce without its C description"
            self._all_reduce_desc = all_reduce.desc  # (kept alive with the pointer to it)
            self._model.allreduce = ctypes.addressof(all_reduce.desc)
        self._lora: _LoRADesc | None = None
        self._tables = _row_tables(model)
        self.step_logits: tuple[torch.Tensor, torch.Tensor] | None = None  # (out, logits) of the last run's head
        self.head_rows = 0  # steps of up to this many rows can have the LM head's logits too (0: none)
        if head is not None and on_kernel(head):
            self._head, rows = linear_desc(head)
            self.head_rows, self._vocab = min(rows, self.max_rows), head.out_features
            self._model.head = ctypes.addressof(self._head)

    @staticmethod
    def cache_key(kv_caches: list[Any]) -> tuple[int, ...]:
        return tuple(c.k.data_ptr() if isinstance(c, KVCache) else c.conv.data_ptr() for c in kv_caches)

    @staticmethod
    def layer_linears(layer: torch.nn.Module) -> tuple[Linear, ...]:
        """qkv, o (a Gated DeltaNet layer: its input projections and out_proj), and the dense MLP's gate_up, down (a
        MoE layer: none; its block is a MoEDesc)."""
        mixer, mlp = hybrid.mixer_linears(layer.mixer), layer.mlp
        return mixer if isinstance(mlp, SparseMoE) else (*mixer, mlp.gate_up_proj, mlp.down_proj)

    @staticmethod
    def supports_layout(model: torch.nn.Module) -> bool:
        """Whether model (a DecoderModel) has the plain pre-norm layout the C stack computes, kernels loaded: every
        layer Llama's or a hybrid's gated / linear attention one (DecoderLayer.stack_plain, .stack_hybrid; a block
        kind with no C path keeps the whole model on torch)."""
        if not kernels.available() or model.rotary_local is not None or len(model.layers) == 0:
            return False
        if not all(layer.stack_plain or layer.stack_hybrid for layer in model.layers):
            return False
        hybrid_model = any(layer.stack_hybrid for layer in model.layers)
        if hybrid_model and model.tensor_parallel_size > 1:  # (the engine refuses it: the state is not sharded)
            return False
        attn, rotary = _first_attention(model), model.rotary.cos.shape[-1]
        if attn is None or attn.num_heads > kernels.MAX_HEADS or attn.head_dim % 2 or rotary % 2:
            return False
        if model.norm.weight.dtype != torch.float32 or rotary > attn.head_dim:
            return False
        for layer in model.layers:
            a = layer.mixer
            norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            # (a Gated DeltaNet layer's tensors: hybrid.supports_linear_attention; a whole-projection q/k norm spans
            # the heads of every rank)
            if hybrid.mixer_kind(layer) != hybrid.LINEAR and (a.qk_norm or a.qk_norm_whole):
                if a.qk_norm_whole and model.tensor_parallel_size > 1:
                    return False
                norms += [a.q_norm.weight, a.k_norm.weight]
            if getattr(a, "sinks", None) is not None:  # (gpt-oss: the attention kernel reads them beside the scores)
                norms.append(a.sinks)
            if any(w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous() for w in norms):
                return False
        return True

    @staticmethod
    def supports(model: torch.nn.Module, kv_caches: list[KVCache]) -> bool:
        """Whether the C stack computes every layer of model (a DecoderModel) over kv_caches exactly as the
        modules do: the layout, a cache the kernels read, and every projection on its C kernel."""
        if not DecodeStack.supports_layout(model):
            return False
        for layer, cache in zip(model.layers, kv_caches, strict=True):
            if hybrid.mixer_kind(layer) == hybrid.LINEAR:
                if not hybrid.supports_linear_attention(layer.mixer, cache):
                    return False
            elif not isinstance(cache, KVCache) or cache.k.dtype not in kernels.KV_CACHE_DTYPES:
                return False
            elif cache.k.device.type != "cpu":
                return False
            if not all(on_kernel(m) for m in DecodeStack.layer_linears(layer)):
                return False
            if isinstance(layer.mlp, SparseMoE) and not MoEDesc.supports(layer.mlp):
                return False
        return True

    def takes(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """Whether a step of num_tokens tokens with this metadata is a pure decode of at most max_rows tokens (a
        hybrid's: every row on its own state slot, no state snapshot saved)."""
        decode = not meta.prefills and meta.num_decode_tokens == num_tokens and 0 < num_tokens <= self.max_rows
        return decode and (not self._gdns or hybrid.takes_step(meta, num_tokens))

    def applies(self, h: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step (embeddings h, its metadata) is a pure decode of at most max_rows tokens."""
        return self.takes(h.shape[0], meta) and h.dtype == torch.float32 and h.device.type == "cpu"

    def table_rows(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The step's embeddings and (B, head_dim) cos / sin rows, copied out of the tables by numpy: the values
        embed_tokens and rotary return, without their three torch indexing ops (~130 µs a step with the caches
        cold, as a decode step leaves them). None unless the tables are plain float32 CPU tensors (no embedding
        scale, no quantized embedding)."""
        if self._tables is None or input_ids.device.type != "cpu":
            return None
        w, cos, sin = self._tables
        ids, pos = input_ids.numpy(), positions.numpy()
        return torch.from_numpy(w[ids]), torch.from_numpy(cos[pos]), torch.from_numpy(sin[pos])

    def _lora_desc(self, hooks: Any) -> _LoRADesc:
        if self._lora is None or self._lora.hooks is not hooks:
            self._lora = _LoRADesc(hooks, self._model.num_layers)
        return self._lora

    def takes_lora(self, hooks: Any) -> bool:
        """Whether the stack adds the LoRA deltas of hooks (a lora.layers.LoRAHooks) itself, with the hooks'
        arithmetic: float32 CPU slots on the C kernel (LoRALinear.kernel) and runs the kernel takes."""
        runs_fit = all(end - start <= kernels.LORA_MAX_ROWS for _, start, end in hooks.groups)
        return runs_fit and not self._gdns and self._lora_desc(hooks).ok  # (no LoRA for hybrids: the engine refuses)

    def run(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        lora: Any = None,
        with_logits: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final norm of the residual stream after every layer, (B, hidden): what DecoderModel.forward
        returns on the module path; and with with_logits (B <= head_rows) the LM head's (B, vocab) float32 logits
        of it, else None. cos, sin: (B, head_dim) rows of the step's positions. lora: the installed
        LoRAHooks (takes_lora holds), whose groups' rows get their slot's delta after each projection, as the
        hooks add it; None: no LoRA (the model's lora pointer stays NULL)."""
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None, "decode metadata"
        h, cos, sin = h.contiguous(), cos.contiguous(), sin.contiguous()
        out = torch.empty_like(h)
        logits = self.step_logits = None
        if with_logits:
            assert 0 < h.shape[0] <= self.head_rows, f"{h.shape[0]} rows for a head that takes {self.head_rows}"
            logits = torch.empty(h.shape[0], self._vocab, dtype=torch.float32)
        groups = None
        if lora is not None and lora.groups:
            desc = self._lora_desc(lora)
            assert desc.ok, "the stack does not take these LoRA slots (check takes_lora)"
            groups = torch.tensor(lora.groups, dtype=torch.int64)
            assert groups.shape[1] == 3 and int(groups[:, 2].max()) <= h.shape[0], "LoRA runs within the step's rows"
            assert 0 <= int(groups[:, 0].min()) and int(groups[:, 0].max()) < desc.max_loras, "LoRA slots in range"
            desc.struct.groups, desc.struct.num_groups = groups.data_ptr(), groups.shape[0]
            self._model.lora = ctypes.addressof(desc.struct)
        state_slots = hybrid.begin_step(meta, self._gdns) if self._gdns else None
        self._model.state_slots = None if state_slots is None else state_slots.data_ptr()
        try:
            rc = kernels.decode_stack(
                ctypes.byref(self._model), h, out, cos, sin, meta.slot_mapping, meta.decode_block_tables,
                meta.decode_context_lens, logits,
            )  # fmt: skip
        finally:
            self._model.lora = self._model.state_slots = None
        if state_slots is not None and rc == 0:
            hybrid.end_step(meta, self._gdns)
        assert rc != -1, "decode_stack: out of memory for its scratch buffers"
        if rc != 0:
            assert self._all_reduce is not None, f"decode_stack: return {rc} without an all-reduce"
            self._all_reduce.raise_for(rc)  # a peer died or never came: the reason, raised
        if logits is not None:
            self.step_logits = (out, logits)
        return out, logits


class DecodeStackDispatch:
    """The decoder's side of the C stack (DecoderModel mixes it in): whether a step takes it, its description kept
    per set of KV caches, the LM head's logits it may compute in the same call."""

    _decode_stack: DecodeStack | None = None
    lora_active = False  # LoRA hooks on the projections (lora/layers.py); the C stack adds their deltas itself
    lora_hooks: Any = None  # the installed lora.layers.LoRAHooks (its linears and the step's groups), else None
    tensor_parallel_size = 1  # > 1 (model/parallel.py): the decode stack only with a shared-memory all-reduce
    tp_all_reduce: Any = None  # that all-reduce (worker/shm_allreduce.ShmAllReduce, its C description set)
    _decode_stack_checked: tuple | None = None  # the KV caches supports() was last asked about
    _decode_stack_caches: list[KVCache] | None = None  # the list they came in (its caches are not replaced)
    # (the LM head,) the stack may run after the final norm (CausalLM sets it; a tuple, so not a submodule here)
    stack_head: tuple[Linear] | None = None

    def decode_stack(self, kv_caches: list[KVCache]) -> DecodeStack | None:
        """The C description of this decoder over kv_caches, when DecodeStack.supports it (built once per
        set of caches; reset_decode_stack() after changing weights or their kernel paths). A tensor-parallel
        rank has one when its group's all-reduce is the shared memory's, which the C stack calls itself."""
        if not self._stack_possible() or not all(isinstance(c, KVCache) or hybrid.is_state(c) for c in kv_caches):
            return None
        if kv_caches is self._decode_stack_caches:  # (the runner passes the same list every step)
            return self._decode_stack
        self._decode_stack_caches = kv_caches
        key = DecodeStack.cache_key(kv_caches)
        if key != self._decode_stack_checked:
            self._decode_stack_checked = key
            ok = DecodeStack.supports(self, kv_caches)
            head = self.stack_head[0] if self.stack_head is not None and self.tensor_parallel_size == 1 else None
            self._decode_stack = DecodeStack(self, kv_caches, self.tp_all_reduce, head) if ok else None
        return self._decode_stack

    def stack_for_step(
        self, input_ids: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> tuple[DecodeStack | None, Any]:
        """(the stack, the LoRA hooks it adds) when it takes this step's row count and LoRA rows, else (None, _);
        whether the embeddings qualify too is the stack's applies()."""
        stack = self.decode_stack(kv_caches)
        lora = self.lora_hooks if self.lora_active else None
        takes = stack is not None and stack.takes(input_ids.shape[0], meta) and (lora is None or stack.takes_lora(lora))
        return (stack if takes else None), lora

    def _stack_possible(self) -> bool:
        """One rank, or a tensor-parallel rank whose all-reduce C can call."""
        if self.tensor_parallel_size == 1:
            return True
        return self.tp_all_reduce is not None and self.tp_all_reduce.desc is not None

    def stack_linears(self) -> list[Linear]:
        """The projections a decode stack would run when they take their C kernels ([] if the layout has none)."""
        if not self._stack_possible() or not DecodeStack.supports_layout(self):
            return []
        linears = [m for layer in self.layers for m in DecodeStack.layer_linears(layer)]
        moes = [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]
        return linears + [m for moe in moes for m in _moe_linears(moe)]

    def _run_stack(self, stack: DecodeStack, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   meta: AttentionMetadata, lora: Any) -> torch.Tensor:
        """The stack's hidden states; when it takes the LM head for these rows, it computes their logits in the
        same call (kept for take_logits: no second crossing into C for the head, no Python around it)."""
        return stack.run(h, cos, sin, meta, lora, with_logits=h.shape[0] <= stack.head_rows)[0]

    def take_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The LM head's logits of hidden when the decode stack computed them with it (hidden is that step's
        output tensor itself, every row), else None."""
        stack = self._decode_stack
        step = None if stack is None else stack.step_logits
        if step is None or step[0] is not hidden:
            return None
        stack.step_logits = None
        return step[1]

    def reset_decode_stack(self) -> None:
        self._decode_stack = self._decode_stack_checked = self._decode_stack_caches = None
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.prefill_block = None
