"""Frozen configuration, built once from user arguments and the model's config.json.

Every user-facing value is validated here; a bad one raises ValueError naming the field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULING_POLICIES = ("continuous", "static")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> RopeConfig:
        # transformers >= 5 writes `rope_parameters` (theta inside); 4.x writes `rope_theta` + `rope_scaling`.
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
            )
        kwargs: dict[str, Any] = {"theta": theta, "rope_type": rope_type}
        if rope_type in ("linear", "llama3"):
            if "factor" not in params:
                raise ValueError(f"rope_scaling of type {rope_type!r} needs 'factor'")
            kwargs["factor"] = float(params["factor"])
        if rope_type == "llama3":
            for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                if key not in params:
                    raise ValueError(f"rope_scaling of type 'llama3' needs {key!r}")
                kwargs[key] = params[key]
        return RopeConfig(**kwargs)


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape and family flags, read from an HF config.json."""

    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2
    qk_norm: bool  # Qwen3
    sliding_window: int | None
    dtype: str  # resolved: float32 | bfloat16 | float16
    eos_token_ids: tuple[int, ...]

    @staticmethod
    def from_hf(path: str | os.PathLike, dtype: str = "auto", device: str = "cpu") -> ModelConfig:
        from lmserve.memory import model_shape_from_hf_config
        from lmserve.model.registry import resolve_architecture

        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"model: {str(path)!r} has no config.json (expected an HF model directory)")
        cfg = json.loads(cfg_file.read_text())
        family = resolve_architecture(cfg.get("architectures"))
        try:
            shape = model_shape_from_hf_config(cfg)  # the ledger's parser: one reading of the shape fields
        except ValueError as e:
            raise ValueError(f"model config {cfg_file}: {e}") from None
        if shape.o_bias or shape.mlp_bias:
            raise ValueError(
                f"model config {cfg_file}: biases on o_proj / the MLP (attention_bias / mlp_bias) are not supported"
            )
        sliding_window = cfg.get("sliding_window")
        if family.name == "qwen" and not cfg.get("use_sliding_window", False):
            sliding_window = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelConfig(
            path=str(path),
            architecture=family.architecture_of(cfg["architectures"]),
            vocab_size=shape.vocab_size,
            hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size,
            num_layers=shape.num_layers,
            num_heads=shape.num_attention_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=shape.tie_word_embeddings,
            qkv_bias=family.qkv_bias or shape.qkv_bias,
            qk_norm=family.qk_norm,
            sliding_window=int(sliding_window) if sliding_window else None,
            dtype=resolve_dtype(dtype, cfg, device),
            eos_token_ids=eos_ids,
        )


def resolve_dtype(dtype: str, hf_config: dict[str, Any], device: str) -> str:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {list(SUPPORTED_DTYPES)}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    if not device.startswith("cuda"):
        return "float32"  # 16-bit compute is slow on most CPUs; weights are upcast at load
    saved = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    return saved if saved in ("bfloat16", "float16") else "float32"


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    kv_bytes_per_token: int
    draft_kv_bytes_per_token: int = 0  # a speculative draft model's KV, kept in blocks of the same table

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def pool_bytes(self) -> int:
        """Bytes of K and V tensors over all layers (the ledger's bytes per token × pool tokens), a draft's
        included."""
        return self.num_tokens * (self.kv_bytes_per_token + self.draft_kv_bytes_per_token)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    scheduling_policy: str


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str
    seed: int
    tokenizer: str
    weight_dtype: str | None = None  # None: the model dtype; "bfloat16": bf16-stored linears, fp32 compute (CPU)
    speculative: Any = None  # spec_decode.config.SpeculativeConfig, or None


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
    device: str = "cpu"
    seed: int = 0
    speculative_config: dict[str, Any] | str | None = None  # vLLM's keys; see spec_decode/config.py

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine arguments {unknown}; known: {sorted(known - {'model'})}")
        return cls(model=model, **kwargs)

    def create_engine_config(self) -> EngineConfig:
        from lmserve import memory

        _check_positive("block_size", self.block_size)
        _check_positive("max_num_seqs", self.max_num_seqs)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {list(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )
        model = ModelConfig.from_hf(self.model, self.dtype, self.device)
        weight_dtype = self._weight_dtype(model.dtype)
        max_model_len = self.max_model_len or model.max_position_embeddings
        _check_positive("max_model_len", max_model_len)
        if max_model_len > model.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                f"{model.max_position_embeddings}"
            )
        if model.sliding_window is not None and max_model_len > model.sliding_window:
            raise ValueError(
                f"this model uses sliding-window attention (window {model.sliding_window}), which lmserve does "
                f"not implement yet; pass max_model_len <= {model.sliding_window} to run it exactly"
            )
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        _check_positive("max_num_batched_tokens", budget)
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"with enable_chunked_prefill=False, max_num_batched_tokens ({budget}) must be >= "
                f"max_model_len ({max_model_len}) so every prompt fits one step"
            )
        kv_bytes_per_token = memory.kv_bytes_per_token(
            model.num_layers, model.num_kv_heads, model.head_dim, memory.dtype_bytes(model.dtype)
        )
        spec = None
        if self.speculative_config is not None:
            from lmserve.spec_decode.config import SpeculativeConfig

            spec = SpeculativeConfig.from_dict(self.speculative_config, model, max_model_len, self.dtype, self.device)
        draft_bpt = spec.draft_kv_bytes_per_token if spec is not None else 0
        num_blocks = self._num_kv_blocks(kv_bytes_per_token + draft_bpt)
        cache = CacheConfig(self.block_size, num_blocks, self.enable_prefix_caching, kv_bytes_per_token, draft_bpt)
        if cache.num_tokens < max_model_len:
            if self.max_model_len is not None:
                raise ValueError(
                    f"max_model_len={max_model_len} does not fit the KV pool: {num_blocks} blocks x "
                    f"{self.block_size} tokens = {cache.num_tokens} tokens "
                    f"({memory.format_bytes(cache.num_tokens * kv_bytes_per_token)} at {kv_bytes_per_token} B/token); "
                    f"lower max_model_len or raise num_kv_blocks / kv_cache_memory_gib"
                )
            max_model_len = cache.num_tokens  # auto: the longest request the pool can hold
        sched = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            scheduling_policy=self.scheduling_policy,
        )
        return EngineConfig(
            model, cache, sched, self.device, self.seed, self.tokenizer or self.model, weight_dtype, spec
        )

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

    def _num_kv_blocks(self, kv_bytes_per_token: int) -> int:
        from lmserve import memory

        if self.num_kv_blocks is not None:
            _check_positive("num_kv_blocks", self.num_kv_blocks)
            return self.num_kv_blocks
        if self.kv_cache_memory_gib is not None:
            if self.kv_cache_memory_gib <= 0:
                raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
            budget_bytes = int(self.kv_cache_memory_gib * 2**30)
        else:
            budget_bytes = default_kv_budget_bytes(self.device)
        num_blocks = memory.max_num_kv_blocks(budget_bytes, self.block_size, kv_bytes_per_token)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_gib: {budget_bytes} bytes cannot hold one block of {self.block_size} tokens "
                f"({self.block_size * kv_bytes_per_token} bytes"
                + (", the speculative draft's KV included)" if self.speculative_config is not None else ")")
            )
        return num_blocks


DEFAULT_KV_FRACTION = 0.25
DEFAULT_KV_CAP_BYTES = 4 * 2**30


def default_kv_budget_bytes(device: str) -> int:
    """A quarter of the free memory of the device, capped at 4 GiB: enough to serve, safe to share."""
    if device.startswith("cuda"):
        import torch

        free_bytes, _ = torch.cuda.mem_get_info()
        return int(free_bytes * 0.5)  # weights are already loaded elsewhere; leave room for activations
    free_bytes = available_ram_bytes()
    return int(min(free_bytes * DEFAULT_KV_FRACTION, DEFAULT_KV_CAP_BYTES))


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
