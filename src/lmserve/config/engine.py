"""Frozen configuration, built once from user arguments and the model's config.json: EngineArgs (the flat user
arguments) → create_engine_config() → EngineConfig (the model's ModelConfig from model_config.py, and here the
KV cache, scheduler and quantization configs).

Every user-facing value is validated here; a bad one raises ValueError naming the field.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from lmserve.checkpoint.shape import HEAD_LAYOUTS
from lmserve.checkpoint.shape import layer_sliding_windows as layer_sliding_windows
from lmserve.config.checks import check_positive, check_tensor_parallel
from lmserve.config.kv_budget import default_kv_budget_bytes

# The model's own config and shape live below this module; their names stay importable from here.
from lmserve.config.model import SUPPORTED_DTYPES as SUPPORTED_DTYPES
from lmserve.config.model import ModelConfig
from lmserve.config.model import RopeConfig as RopeConfig

SCHEDULING_POLICIES = ("continuous", "static")
GENERATION_CONFIG_MODES = ("auto", "vllm")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3")  # auto: the model dtype
STATE_CACHE_DTYPES = ("float32", "bfloat16")  # a hybrid's linear-attention state
QUANTIZATION_METHODS = ("int8", "int4")
QUANTIZATION_FORMAT = "lmserve-v1"  # `quantization_config.format` of checkpoints `lmserve quantize` writes
# How int4 weights (lmserve int4, GGUF Q4_0 / Q4_1) are computed with: "w4a8" (activations quantized to int8 per
# block of 32 inside the step, integer dot products: llama.cpp's Q4_0 x Q8_0) or "weight-only" (float32 activations,
# each weight dequantized exactly: the more accurate, slower option). Not saved in checkpoints: the codes are the same.
INT4_COMPUTE_MODES = ("w4a8", "weight-only")
DEFAULT_KV_DISK_GIB = 16.0  # the disk tier's size when only its directory is given

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuantizationConfig:
    """Quantized projection weights (lmserve.model.quantization): "int8" W8A8 or "int4" weight-only, or
    "gguf": a GGUF file's block-32 tensors (Q8_0 / Q4_0 / Q4_1, group 32) and K-quants (Q4_K / Q5_K / Q6_K)
    kept as they are."""

    method: str
    group_size: int | None  # int4 / gguf: inputs per scale; None for int8 (one scale per output channel)
    prequantized: bool = False  # the checkpoint already holds the quantized tensors (`lmserve quantize`)
    # the LM head's layout: "int8" (method int8), "int8w" (method int4: 8-bit weight-only, group 32), or None
    # (float32: gguf, whose file decides, and int4 checkpoints written before the head was quantized)
    lm_head: str | None = None
    int4_compute: str = "w4a8"  # INT4_COMPUTE_MODES; an engine choice, not part of the checkpoint

    def to_hf(self) -> dict[str, Any]:
        """The `quantization_config` entry of a checkpoint's config.json."""
        return {"quant_method": "lmserve", "format": QUANTIZATION_FORMAT, "method": self.method,
                "group_size": self.group_size, "lm_head": self.lm_head}


def _gguf_quantization(model: ModelConfig, device: str, weight_dtype: str | None) -> QuantizationConfig | None:
    """A GGUF file with Q8_0 / Q4_0 / Q4_1 or Q4_K / Q5_K / Q6_K tensors keeps them as they are on the CPU float32
    path (else, and with quantization="none", every quantized tensor is dequantized at load, logged)."""
    from lmserve.checkpoint.gguf import KEPT_TYPES, GGUFCheckpoint

    if model.dtype != "float32" or not device.startswith("cpu") or weight_dtype is not None:
        return None
    if not set(GGUFCheckpoint(model.path).bytes_by_type()) & set(KEPT_TYPES):
        return None
    return QuantizationConfig("gguf", 32, prequantized=True)


def checkpoint_quantization(model_dir: str | os.PathLike) -> QuantizationConfig | None:
    """The quantization a checkpoint was written with (its config.json's `quantization_config`), or None."""
    cfg_file = Path(model_dir) / "config.json"
    if not cfg_file.is_file():
        return None
    qc = json.loads(cfg_file.read_text()).get("quantization_config")
    if qc is None or qc.get("quant_method") == "mxfp4":  # (gpt-oss's MXFP4 experts: the MoE block keeps them)
        return None
    if qc.get("quant_method") != "lmserve" or qc.get("format") != QUANTIZATION_FORMAT:
        raise ValueError(
            f"model config {cfg_file}: quantization_config {qc.get('quant_method')!r} format {qc.get('format')!r} "
            f"is not supported; lmserve loads its own format {QUANTIZATION_FORMAT!r} (`lmserve quantize`)"
        )
    method, group = qc.get("method"), qc.get("group_size")
    # written before the key existed: int8 checkpoints already held an int8 head, int4 ones a float32 head
    head = qc.get("lm_head", "int8" if method == "int8" else None)
    if method not in QUANTIZATION_METHODS or (method == "int4" and (not isinstance(group, int) or group % 32)):
        raise ValueError(f"model config {cfg_file}: bad quantization_config {qc}")
    if head not in (None, HEAD_LAYOUTS[method]):
        raise ValueError(f"model config {cfg_file}: bad quantization_config {qc}: lm_head {head!r} with {method}")
    return QuantizationConfig(method, group if method == "int4" else None, prequantized=True, lm_head=head)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    kv_bytes_per_token: int  # values and (8-bit dtypes) scales, all layers: memory.kv_cache_bytes_per_token
    kv_cache_dtype: str = "float32"  # resolved: float32 | bfloat16 | float16 | int8 | fp8_e4m3
    kv_scale_bytes_per_token: int = 0  # the part of kv_bytes_per_token that is scales
    draft_kv_bytes_per_token: int = 0  # a speculative draft model's KV, kept in blocks of the same table
    sliding_window: int | None = None  # blocks outside this window are freed while a request runs (all layers slide)
    # hybrid models: a recurrent-state slot per running sequence (core/state_pool.py), each this many bytes
    num_state_slots: int = 0
    state_bytes_per_sequence: int = 0
    kv_disk_dir: str | None = None  # the prefix cache's disk tier (engine/kv_tier.py), at most kv_disk_bytes there
    kv_disk_bytes: int = 0
    # a hybrid's prefix cache: slots of its state snapshots at block boundaries (core/state_snapshots.py), each
    # state_bytes_per_sequence
    num_state_snapshots: int = 0
    state_cache_dtype: str = "float32"  # the recurrent state's (and its snapshots') dtype: float32 | bfloat16

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def pool_bytes(self) -> int:
        """Bytes of the K, V (and scale) tensors over all layers (the ledger's bytes per token × pool tokens), a
        speculative draft's included."""
        return self.num_tokens * (self.kv_bytes_per_token + self.draft_kv_bytes_per_token)

    def max_concurrent_requests(self, num_tokens: int) -> int:
        """Requests of num_tokens tokens whose blocks the pool holds at once (decoding, with a freeing sliding
        window: the window's blocks plus one)."""
        from lmserve.memory.ledger import kv_blocks_held

        return self.num_blocks // kv_blocks_held(num_tokens, self.block_size, self.sliding_window)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    scheduling_policy: str
    share_prefix_in_step: bool = True  # blocks being computed in a step are prefix hits for later requests in it


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (lora/, core/lora_slots.py): max_loras compute slots (adapters a step can mix),
    max_cpu_loras adapters kept loaded in RAM (LRU), ranks up to max_lora_rank."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1
    # the compute slots' stacked weights (memory.lora_slot_bytes at the model dtype), taken from the KV budget
    slot_bytes: int = 0


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str
    seed: int
    tokenizer: str
    weight_dtype: str | None = None  # None: the model dtype; "bfloat16": bf16-stored linears, fp32 compute (CPU)
    generation_config: str = "auto"  # "auto": the model's generation_config.json fills unset sampling fields
    quantization: QuantizationConfig | None = None  # quantized projections (CPU, float32 compute)
    speculative: Any = None  # spec_decode.config.SpeculativeConfig, or None
    # False: an object schema without "additionalProperties" closes after its declared properties (as xgrammar's
    # strict mode); True: JSON Schema's default, any further key (structured_output.close_objects)
    structured_outputs_allow_additional_properties: bool = False
    kv_transfer: Any = None  # kv_transfer_config.KVTransferConfig (prefill/decode disaggregation), or None
    lora: LoRAConfig | None = None  # None: LoRA disabled
    # ranks one model is split across (model/parallel.py, engine/tp_executor.py); the cache's sizes are per rank
    tensor_parallel_size: int = 1
    runner: str = "generate"  # resolved: "generate" | "pooling" (embeddings and scores; model_config.PoolerConfig)
    pooler: Any = None  # model_config.PoolerConfig with the pooling runner, else None


@dataclass
class EngineArgs:
    """Flat user-facing engine arguments (the names of vLLM's where they exist)."""

    model: str
    tokenizer: str | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "continuous"
    dtype: str = "auto"
    weight_dtype: str | None = None
    kv_cache_dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    revision: str | None = None  # Hub revision (branch, tag or commit) when `model` is a Hub id
    generation_config: str = "auto"  # "auto" | "vllm" (ignore the model's generation_config.json)
    share_prefix_in_step: bool = True  # False: a burst's shared prefix is computed once per request (bench A/B)
    # "int8" | "int4"; a checkpoint written by `lmserve quantize` needs none; a GGUF file's Q8_0 / Q4_0 / Q4_1
    # tensors are kept as they are unless "none" (dequantized at load)
    quantization: str | None = None
    quantization_group_size: int = 32  # int4: inputs sharing one scale
    int4_compute: str = "w4a8"  # int4 / GGUF Q4_*, Q5_*, Q8_0: "w4a8" (int8 activations) or "weight-only" (float32)
    speculative_config: dict[str, Any] | str | None = None  # vLLM's keys; see spec_decode/config.py
    structured_outputs_allow_additional_properties: bool = False  # see EngineConfig
    kv_transfer_config: dict[str, Any] | str | None = None  # vLLM's keys; see kv_transfer_config.py
    enable_lora: bool = False  # LoRA adapters per request (LoRARequest); the four below apply only then
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    tensor_parallel_size: int = 1  # ranks (processes) one model is split across, Megatron-style
    runner: str = "auto"  # generate | pooling | auto (pooling for an embedding checkpoint)
    pooler_config: dict[str, Any] | str | None = None  # pooling_type / normalize / score_tokens over the checkpoint's
    kv_cache_disk_dir: str | None = None  # the prefix cache's disk tier: evicted blocks saved here, read back on a hit
    kv_cache_disk_gib: float | None = None  # its size (LRU within it); default DEFAULT_KV_DISK_GIB
    # a hybrid model's prefix cache: GiB of state snapshots at block boundaries (None: 1/8 of the budget, or one per
    # max_num_seqs beside num_kv_blocks; 0: no prefix caching for a hybrid)
    state_snapshot_memory_gib: float | None = None
    state_cache_dtype: str = "float32"  # a hybrid's recurrent state: float32 | bfloat16 (vLLM's mamba_ssm_cache_dtype)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine arguments {unknown}; known: {sorted(known - {'model'})}")
        return cls(model=model, **kwargs)

    def create_engine_config(self) -> EngineConfig:
        from lmserve.memory import ledger as memory
        check_positive("block_size", self.block_size)
        check_positive("max_num_seqs", self.max_num_seqs)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {list(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )
        if self.state_cache_dtype not in STATE_CACHE_DTYPES:
            raise ValueError(
                f"state_cache_dtype must be one of {list(STATE_CACHE_DTYPES)}, got {self.state_cache_dtype!r}"
            )
        if self.generation_config not in GENERATION_CONFIG_MODES:
            raise ValueError(
                f"generation_config must be one of {list(GENERATION_CONFIG_MODES)}, got {self.generation_config!r}"
            )
        from lmserve.checkpoint.hub import is_repo_id, resolve_model_path

        model_dir = resolve_model_path(self.model, self.revision)
        tokenizer_dir = model_dir
        if self.tokenizer is not None:  # a directory or Hub id like the model; other names go to AutoTokenizer
            tokenizer_dir = self.tokenizer if not is_repo_id(self.tokenizer) else resolve_model_path(self.tokenizer)
        model = ModelConfig.from_hf(model_dir, self.dtype, self.device)
        if model.linear is not None:  # (before the features' own checks: the combination is what is refused)
            self._check_hybrid(model)
        weight_dtype = self._weight_dtype(model.dtype)
        quantization = self._quantization(model, weight_dtype)
        max_model_len = self.max_model_len or model.max_position_embeddings
        check_positive("max_model_len", max_model_len)
        if max_model_len > model.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                f"{model.max_position_embeddings}"
            )
        if self.max_num_batched_tokens is not None:
            check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        kv_dtype = self._kv_cache_dtype(model.dtype)
        tp = self.tensor_parallel_size
        check_tensor_parallel(tp, model, quantization, self.device)
        kv_heads = memory.kv_heads_per_rank(model.num_kv_heads, tp)  # the pool is sized per rank (the ledger's)
        kv_layers = model.num_kv_layers  # a hybrid's linear-attention layers keep no KV
        kv_bytes_per_token = memory.kv_cache_bytes_per_token(kv_layers, kv_heads, model.head_dim, kv_dtype)
        spec = None
        if self.speculative_config is not None:
            from lmserve.config.speculative import SpeculativeConfig

            spec = SpeculativeConfig.from_dict(self.speculative_config, model, max_model_len, self.dtype, self.device)
        if tp > 1 and spec is not None and spec.draft is not None:
            raise ValueError(f"tensor_parallel_size={tp} with a draft model (speculative_config): not supported; "
                             "n-gram speculation works")
        draft_bpt = spec.draft_kv_bytes_per_token if spec is not None else 0
        lora = self._lora(spec, model)
        state_bytes = memory.linear_state_bytes_per_sequence(model, memory.dtype_bytes(self.state_cache_dtype))
        if state_bytes:
            num_blocks, num_slots, num_snapshots = self._hybrid_pools(kv_bytes_per_token, state_bytes)
        else:
            num_slots = num_snapshots = 0
            num_blocks = self._num_kv_blocks(kv_bytes_per_token + draft_bpt, lora.slot_bytes if lora else 0)
        # a draft model's KV shares the block tables and may attend to everything: no freeing beside one
        free_window = model.kv_free_window if spec is None or spec.draft is None else None
        prefix_caching = self.enable_prefix_caching
        if state_bytes and prefix_caching and not num_snapshots:
            logger.info("prefix caching is off for %s: state_snapshot_memory_gib holds no snapshot of its "
                        "linear-attention state (%s each)", model.architecture, memory.format_bytes(state_bytes))
            prefix_caching = False
        elif state_bytes and prefix_caching:
            logger.info("prefix caching for %s: %d state snapshots at block boundaries, %s", model.architecture,
                        num_snapshots, memory.format_bytes(num_snapshots * state_bytes))  # fmt: skip
        disk_dir, disk_bytes = self._kv_disk(prefix_caching, free_window, state_bytes)
        cache = CacheConfig(
            self.block_size, num_blocks, prefix_caching, kv_bytes_per_token, kv_dtype,
            memory.kv_scale_bytes_per_token(kv_layers, kv_heads, kv_dtype), draft_bpt,
            free_window, num_slots, state_bytes, disk_dir, disk_bytes, num_snapshots if prefix_caching else 0,
            self.state_cache_dtype,
        )  # fmt: skip
        fitted = ""
        # the pool must hold a whole request, unless blocks outside the window are freed as a chunked prefill goes
        # and the window plus one chunk fit
        chunk = min(self.max_num_batched_tokens or 2048, max_model_len)
        frees = (
            free_window is not None
            and self.enable_chunked_prefill
            and memory.kv_blocks_held(max_model_len, self.block_size, free_window, chunk) <= num_blocks
        )
        if not frees and cache.num_tokens < max_model_len:
            if self.max_model_len is not None:
                raise ValueError(
                    f"max_model_len={max_model_len} does not fit the KV pool: {num_blocks} blocks x "
                    f"{self.block_size} tokens = {cache.num_tokens} tokens "
                    f"({memory.format_bytes(cache.num_tokens * kv_bytes_per_token)} at {kv_bytes_per_token} B/token); "
                    f"lower max_model_len or raise num_kv_blocks / kv_cache_memory_gib"
                )
            max_model_len = cache.num_tokens  # auto: the longest request the pool can hold
            fitted = f", what the KV pool's {num_blocks} blocks x {self.block_size} tokens hold"
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        if not self.enable_chunked_prefill and budget < max_model_len:  # the final max_model_len, pool-sized
            raise ValueError(
                f"with enable_chunked_prefill=False, max_num_batched_tokens ({budget}) must be >= "
                f"max_model_len ({max_model_len}{fitted}) so every prompt fits one step"
            )
        max_num_seqs = self.max_num_seqs
        if state_bytes and num_slots < max_num_seqs:
            logger.info("max_num_seqs %d capped to %d: the state slots the budget holds (%s each)", max_num_seqs,
                        num_slots, memory.format_bytes(state_bytes))  # fmt: skip
            max_num_seqs = num_slots
        sched = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            scheduling_policy=self.scheduling_policy,
            share_prefix_in_step=self.share_prefix_in_step,
        )
        kv_transfer = None
        if self.kv_transfer_config is not None:
            from lmserve.config.kv_transfer import KVTransferConfig

            kv_transfer = KVTransferConfig.from_value(self.kv_transfer_config)
            if free_window is not None:
                raise ValueError(
                    "kv_transfer_config: a model whose every layer slides (KV outside the window is freed while a "
                    "request runs) cannot hand its KV off yet; serve it colocated"
                )
            if self.enable_lora:
                raise ValueError("kv_transfer_config with enable_lora: LoRA adapters are not served with "
                                 "prefill/decode disaggregation yet (the decode side would need the adapter)")
        if tp > 1 and (self.enable_lora or kv_transfer is not None):
            what = "enable_lora (adapters on sharded projections)" if self.enable_lora else "kv_transfer_config"
            raise ValueError(f"tensor_parallel_size={tp} with {what}: not supported yet")
        config = EngineConfig(
            model, cache, sched, self.device, self.seed, tokenizer_dir, weight_dtype, self.generation_config,
            quantization, spec, bool(self.structured_outputs_allow_additional_properties), kv_transfer, lora, tp,
        )  # fmt: skip
        return self._with_runner(config)

    def _with_runner(self, config: EngineConfig) -> EngineConfig:
        from lmserve.config.model import resolve_runner

        overrides = self.pooler_config
        if isinstance(overrides, str):
            try:
                overrides = json.loads(overrides)
            except ValueError as e:
                raise ValueError(f"pooler_config: not valid JSON ({e})") from None
        if overrides is not None and not isinstance(overrides, dict):
            raise ValueError(f"pooler_config must be a JSON object, got {overrides!r}")
        pooler = resolve_runner(self.runner, config.model.path, config.model.architecture, overrides)
        if pooler is None:
            return config
        if config.speculative is not None:
            raise ValueError("runner: the pooling runner does not take speculative_config (nothing is generated)")
        return replace(config, runner="pooling", pooler=pooler)

    def _kv_disk(self, prefix_caching: bool, free_window: int | None, state_bytes: int) -> tuple[str | None, int]:
        """The disk tier's directory and bytes, or (None, 0); a ValueError naming what it cannot serve with."""
        if self.kv_cache_disk_dir is None:
            if self.kv_cache_disk_gib is not None:
                raise ValueError("kv_cache_disk_gib is set without kv_cache_disk_dir (the directory of the disk tier)")
            return None, 0
        gib = DEFAULT_KV_DISK_GIB if self.kv_cache_disk_gib is None else self.kv_cache_disk_gib
        if not isinstance(gib, int | float) or isinstance(gib, bool) or not 0 < gib < math.inf:
            raise ValueError(f"kv_cache_disk_gib must be > 0 and finite, got {gib!r}")
        refused = {
            "enable_prefix_caching=False": not self.enable_prefix_caching,
            "a hybrid model (its linear-attention state snapshots are kept in RAM only)": state_bytes > 0,
            "a model whose every layer slides (its blocks are freed while it runs)": free_window is not None,
            "kv_transfer_config (prefill/decode disaggregation)": self.kv_transfer_config is not None,
            "tensor_parallel_size > 1 (each rank holds a shard of every block)": self.tensor_parallel_size > 1,
        }
        named = [name for name, on in refused.items() if on]
        if named or not prefix_caching:
            raise ValueError(f"kv_cache_disk_dir: the disk tier extends the prefix cache; not supported with "
                             f"{', '.join(named) or 'prefix caching off'}")  # fmt: skip
        path = Path(self.kv_cache_disk_dir).expanduser()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_cache_disk_dir: cannot create {path} ({e})") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"kv_cache_disk_dir: {path} is not writable")
        return str(path), int(gib * 2**30)

    def _check_hybrid(self, model: ModelConfig) -> None:
        """The features that cannot hold a linear-attention layer's per-sequence state yet: a ValueError naming them."""
        refused = {
            "speculative_config": self.speculative_config is not None,  # rejected drafts would need state rollback
            "kv_transfer_config": self.kv_transfer_config is not None,  # the state is not shipped with the KV
            "enable_lora": self.enable_lora,
            "tensor_parallel_size > 1": self.tensor_parallel_size > 1,
        }
        named = [name for name, on in refused.items() if on]
        if named:
            raise ValueError(
                f"{', '.join(named)}: not supported with {model.architecture}, a hybrid model whose linear-attention "
                "layers keep a per-sequence state (serve it without them)"
            )

    def _hybrid_pools(self, kv_bytes_per_token: int, state_bytes: int) -> tuple[int, int, int]:
        """(KV blocks, state slots, state snapshots): num_kv_blocks as given with a slot per max_num_seqs and the
        snapshots on top (by default 1/8 of the three), else all from the budget (memory.state_snapshot_split, then
        hybrid_pool_split, as `lmserve memory` reports)."""
        from lmserve.memory import ledger as memory
        gib = self.state_snapshot_memory_gib
        if gib is not None and (isinstance(gib, bool) or not isinstance(gib, int | float) or not 0 <= gib < math.inf):
            raise ValueError(f"state_snapshot_memory_gib must be >= 0 and finite, got {gib!r}")
        snapshot_bytes = 0 if not self.enable_prefix_caching else None if gib is None else int(gib * 2**30)
        if gib and snapshot_bytes is not None and snapshot_bytes < state_bytes:
            raise ValueError(f"state_snapshot_memory_gib={gib} cannot hold one state snapshot ({state_bytes} bytes)")
        if self.num_kv_blocks is not None:
            check_positive("num_kv_blocks", self.num_kv_blocks)
            if snapshot_bytes is None:  # 1/8 of all three pools, as from a budget
                pools = self.num_kv_blocks * self.block_size * kv_bytes_per_token + self.max_num_seqs * state_bytes
                snapshot_bytes = max(state_bytes, pools // (memory.DEFAULT_STATE_SNAPSHOT_SHARE - 1))
            return self.num_kv_blocks, self.max_num_seqs, snapshot_bytes // state_bytes
        budget_bytes = self._budget_bytes()
        num_snapshots, left = memory.state_snapshot_split(budget_bytes, state_bytes, snapshot_bytes)
        num_blocks, num_slots = memory.hybrid_pool_split(
            left, self.block_size, kv_bytes_per_token, state_bytes, self.max_num_seqs
        )
        if num_slots < 1:
            raise ValueError(
                f"kv_cache_memory_gib: {budget_bytes} bytes cannot hold one sequence's state ({state_bytes} bytes) "
                f"and one block of {self.block_size} tokens ({self.block_size * kv_bytes_per_token} bytes)"
                + (f" beside {num_snapshots} state snapshots (state_snapshot_memory_gib)" if num_snapshots else "")
            )
        return num_blocks, num_slots, num_snapshots

    def _budget_bytes(self) -> int:
        if self.kv_cache_memory_gib is not None:
            if self.kv_cache_memory_gib <= 0:
                raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
            return int(self.kv_cache_memory_gib * 2**30)
        return default_kv_budget_bytes(self.device)

    def _lora(self, spec: Any, model: ModelConfig) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        check_positive("max_loras", self.max_loras)
        check_positive("max_lora_rank", self.max_lora_rank)
        cpu = self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
        check_positive("max_cpu_loras", cpu)
        if cpu < self.max_loras:
            raise ValueError(f"max_cpu_loras ({cpu}) must be >= max_loras ({self.max_loras})")
        if model.moe is not None:
            raise ValueError(f"enable_lora: LoRA adapters on {model.architecture}'s mixture-of-experts layers are not "
                             "supported (no per-expert LoRA); serve the model without enable_lora")
        if spec is not None:
            raise ValueError("speculative_config: speculative decoding with enable_lora is not supported (the draft "
                             "and the verification would need the adapter's weights); turn one of them off")
        from lmserve.memory import ledger as memory
        slot_bytes = memory.lora_slot_bytes(
            model.num_layers, model.hidden_size, model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim,
            model.intermediate_size, self.max_loras, self.max_lora_rank, memory.dtype_bytes(model.dtype),
        )  # fmt: skip
        return LoRAConfig(self.max_loras, self.max_lora_rank, cpu, slot_bytes)

    def _quantization(self, model: ModelConfig, weight_dtype: str | None) -> QuantizationConfig | None:
        """The checkpoint's quantization, else the requested one, validated against the model's shapes, with
        int4_compute."""
        if self.int4_compute not in INT4_COMPUTE_MODES:
            raise ValueError(f"int4_compute must be one of {list(INT4_COMPUTE_MODES)}, got {self.int4_compute!r}")
        q = self._quantization_method(model, weight_dtype)
        return None if q is None else replace(q, int4_compute=self.int4_compute)

    def _quantization_method(self, model: ModelConfig, weight_dtype: str | None) -> QuantizationConfig | None:
        saved = checkpoint_quantization(model.path)
        if self.quantization is not None and self.quantization not in (*QUANTIZATION_METHODS, "none"):
            raise ValueError(
                f"quantization must be one of {[*QUANTIZATION_METHODS, 'none']}, got {self.quantization!r}"
            )
        check_positive("quantization_group_size", self.quantization_group_size)
        if self.quantization == "none":
            if saved is not None:
                raise ValueError(f"quantization='none' but {self.model!r} is an {saved.method} checkpoint")
            return None
        if self.quantization is None and model.path.endswith(".gguf"):
            return _gguf_quantization(model, self.device, weight_dtype)
        if saved is not None:
            if self.quantization is not None and self.quantization != saved.method:
                raise ValueError(
                    f"quantization={self.quantization!r} but {self.model!r} is an {saved.method} checkpoint"
                )
        method = saved.method if saved is not None else self.quantization
        if method is None:
            return None
        if model.dtype != "float32" or not self.device.startswith("cpu") or weight_dtype is not None:
            raise ValueError(
                f"quantization={method!r} is the CPU float32 path (dtype 'float32' or 'auto', no weight_dtype); "
                f"got dtype={model.dtype!r}, weight_dtype={weight_dtype!r}, device={self.device!r}"
            )
        if saved is not None:
            return saved  # its group size is the one it was written with
        if method == "int8":
            return QuantizationConfig("int8", None, lm_head=HEAD_LAYOUTS["int8"])
        group = self.quantization_group_size
        in_features = {
            "hidden_size": model.hidden_size,
            "num_heads * head_dim": model.num_heads * model.head_dim,
            "intermediate_size": model.intermediate_size,
        }
        bad = {k: v for k, v in in_features.items() if v % group}
        if group % 32 or bad:
            raise ValueError(
                f"quantization_group_size must be a multiple of 32 that divides every projection's inputs "
                f"{in_features}, got {group}"
            )
        return QuantizationConfig("int4", group, lm_head=HEAD_LAYOUTS["int4"])

    def _weight_dtype(self, model_dtype: str) -> str | None:
        """None (weights in the model dtype) or "bfloat16": the linear layers' weights rounded to and stored
        in bfloat16, computed in float32 by the CPU kernels (halves the bytes a decode step reads)."""
        if self.weight_dtype is None or self.weight_dtype == model_dtype:
            return None
        if self.weight_dtype != "bfloat16":
            raise ValueError(f"weight_dtype must be None, the model dtype or 'bfloat16', got {self.weight_dtype!r}")
        if model_dtype != "float32" or not self.device.startswith("cpu"):
            raise ValueError(
                f"weight_dtype='bfloat16' is the CPU float32 path (bf16 weights, fp32 compute); with "
                f"dtype={model_dtype!r} on device {self.device!r} pass dtype='bfloat16' instead"
            )
        return "bfloat16"

    def _kv_cache_dtype(self, model_dtype: str) -> str:
        """The dtype K and V are stored in: auto → the model dtype; int8 / fp8_e4m3 carry a float32 scale
        per (token, KV head), written with the values."""
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        return model_dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def _num_kv_blocks(self, kv_bytes_per_token: int, lora_slot_bytes: int = 0) -> int:
        """The pool's blocks: num_kv_blocks as given, else what the budget (kv_cache_memory_gib, or the default)
        holds once the LoRA compute slots' bytes are taken from it (the pool plus the slots fit the budget)."""
        from lmserve.memory import ledger as memory
        if self.num_kv_blocks is not None:
            check_positive("num_kv_blocks", self.num_kv_blocks)
            return self.num_kv_blocks
        budget_bytes = self._budget_bytes()
        num_blocks = memory.max_num_kv_blocks(max(0, budget_bytes - lora_slot_bytes), self.block_size,
                                              kv_bytes_per_token)  # fmt: skip
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_gib: {budget_bytes} bytes cannot hold one block of {self.block_size} tokens "
                f"({self.block_size * kv_bytes_per_token} bytes"
                + (", the speculative draft's KV included" if self.speculative_config is not None else "")
                + (f") beside the LoRA slots' {lora_slot_bytes} bytes (lower max_loras / max_lora_rank)"
                   if lora_slot_bytes else ")")
            )
        return num_blocks
