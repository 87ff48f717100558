"""ModelConfig: the model's shape and family flags as the engine runs it, read once from an HF config.json (or a
GGUF file's metadata) through the same parser as the memory ledger's ModelShape (model_shape.py) and the family
flags of checkpoint/registry/; with its rotary embedding (RopeConfig) and compute dtype. PoolerConfig: how an embedding
checkpoint pools (sentence-transformers' files) and which runner `--runner auto` picks."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmserve.checkpoint.registry.family import LayerSpec, kv_layer_count, layer_specs, text_config
from lmserve.checkpoint.registry.moe import MoEShape
from lmserve.checkpoint.shape import LinearAttentionShape
from lmserve.sampling_params import POOLING_TYPES, RUNNERS

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "proportional", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # longrope (Phi-3 "su"): per-pair frequency divisors below / beyond the original context, cos/sin scale
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    proportion: float = 1.0  # proportional (Gemma 4): the share of the rotary pairs that turn
    # yarn (gpt-oss): the ramp's bounds in rotations, and whether they are rounded to whole pairs
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    @staticmethod
    def from_hf(cfg: dict[str, Any], layer_type: str | None = None, default_theta: float = 10000.0) -> RopeConfig:
        # transformers >= 5 writes `rope_parameters` (theta inside; Gemma 3: one dict per layer type);
        # 4.x writes `rope_theta` + `rope_scaling`.
        raw = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if any(isinstance(v, dict) for v in raw.values()):  # per layer type
            params = dict(raw.get(layer_type or "full_attention") or {})
        elif layer_type == "sliding_attention":
            params = {}  # 4.x Gemma 3: local layers use rope_local_base_freq, unscaled
        else:
            params = dict(raw)
        fallback = default_theta if layer_type == "sliding_attention" else cfg.get("rope_theta", default_theta)
        theta = float(params.get("rope_theta", fallback))
        rope_type = params.get("rope_type", params.get("type", "default"))
        rope_type = "longrope" if rope_type == "su" else rope_type
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
        if rope_type == "longrope":
            kwargs.update(_longrope_kwargs(cfg, params))
        if rope_type == "proportional":
            kwargs["factor"] = float(params.get("factor", 1.0))
            kwargs["proportion"] = float(params.get("partial_rotary_factor", 1.0))
        if rope_type == "yarn":
            kwargs.update(_yarn_kwargs(cfg, params))
        return RopeConfig(**kwargs)


def _yarn_kwargs(cfg: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """HF's _compute_yarn_parameters: factor (else max / original context) and the cos/sin attention factor."""
    import math

    original = params.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    if original is None:
        raise ValueError("rope_scaling of type 'yarn' needs 'original_max_position_embeddings'")
    factor = params.get("factor") or cfg.get("max_position_embeddings", original) / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return {
        "factor": float(factor),
        "original_max_position_embeddings": int(original),
        "attention_factor": float(attention_factor),
        "beta_fast": float(params.get("beta_fast") or 32.0),
        "beta_slow": float(params.get("beta_slow") or 1.0),
        "truncate": bool(params.get("truncate", True)),
    }


def _longrope_kwargs(cfg: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """HF's _compute_longrope_parameters: the attention factor follows from max / original context."""
    import math

    for key in ("short_factor", "long_factor"):
        if key not in params:
            raise ValueError(f"rope_scaling of type 'longrope' needs {key!r}")
    original = params.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    if original is None:
        raise ValueError("rope_scaling of type 'longrope' needs 'original_max_position_embeddings'")
    factor = params.get("factor") or cfg.get("max_position_embeddings", original) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {
        "factor": float(factor),
        "original_max_position_embeddings": int(original),
        "short_factor": tuple(float(x) for x in params["short_factor"]),
        "long_factor": tuple(float(x) for x in params["long_factor"]),
        "attention_factor": float(attention_factor),
    }


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
    # Family flags beyond Llama (defaults: Llama). See model/family.py and docs/adding_a_model.md.
    family: str = "llama"
    hidden_act: str = "silu"  # MLP gate activation: silu | gelu_tanh
    norm_weight_offset: float = 0.0  # Gemma 2/3: norms scale by (1 + weight); added to the weights at load
    norm_layout: str = "pre"  # pre | sandwich (Gemma) | post (OLMo 2/3): see model/decoder.DecoderLayer
    qk_norm_whole: bool = False  # OLMo 2: q/k norm over the whole projection, not per head
    v_norm: bool = False  # Gemma 4: a weightless RMSNorm per head on v
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_logit_softcap: float | None = None  # Gemma 2: tanh soft-capping of attention scores
    final_logit_softcap: float | None = None  # Gemma 2: tanh soft-capping of the LM head's logits
    layer_sliding_windows: tuple[int | None, ...] = ()  # per layer; () or None entries: full attention
    rope_local: RopeConfig | None = None  # the rotary of layers whose LayerSpec.rope is "local" (Gemma 3's sliding)
    rotary_dim: int | None = None  # None: head_dim; Phi-4-mini rotates only the first part of each head
    # hybrid models (Qwen3.5, Qwen3-Next): the Gated DeltaNet layers' shape and how many layers use it
    linear: LinearAttentionShape | None = None
    num_linear_layers: int = 0
    layers: tuple[LayerSpec, ...] = ()  # every layer's blocks (model/family.py); () = Llama layers, num_layers
    hidden_size_per_layer_input: int = 0  # Gemma 4: per-layer input width (0: none)
    vocab_size_per_layer_input: int = 0  # Gemma 4: the per-layer input table's rows
    checkpoint_renames: tuple[tuple[str, str], ...] = ()  # (prefix, replacement) of checkpoint tensor names
    checkpoint_skips: tuple[str, ...] = ()  # prefixes of checkpoint tensors not served (a vision tower)
    moe: MoEShape | None = None  # mixture of experts: the "moe" feed-forward layers' experts and router
    o_bias: bool = False  # a bias on o_proj (attention_bias: gpt-oss, Llama's option)
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in each softmax's denominator

    def __post_init__(self) -> None:
        if not self.layers:  # (a config built by hand: plain attention + dense layers, the windows as given)
            windows = self.layer_sliding_windows or (None,) * self.num_layers
            object.__setattr__(self, "layers", tuple(LayerSpec(sliding_window=w) for w in windows))
        assert len(self.layers) == self.num_layers, f"{len(self.layers)} layer specs for {self.num_layers} layers"

    @property
    def uniform_layers(self) -> bool:
        """Every layer of the model's shapes, with its own K/V (what tensor parallelism splits)."""
        over = any(s.head_dim or s.num_kv_heads or s.intermediate_size or s.kv_source is not None for s in self.layers)
        return not over and not self.hidden_size_per_layer_input

    @property
    def num_kv_layers(self) -> int:
        """The KV the layers hold, in layers of (num_kv_heads, head_dim), rounded up: num_layers unless layers share
        K/V or have their own head shapes (Gemma 4), or are linear attention (a hybrid's): what sizes the KV pool."""
        return kv_layer_count(self.layers, self.num_kv_heads, self.head_dim)

    @property
    def layer_kv_shapes(self) -> list[tuple[int, int] | int | None]:
        """Per layer, the (num_kv_heads, head_dim) of its own paged KV cache, the index of the earlier layer whose
        cache it reads (Gemma 4's KV sharing), or None (a linear-attention layer: its recurrent state instead)."""
        return [
            None if s.mixer == "linear_attention"
            else (s.num_kv_heads or self.num_kv_heads, s.head_dim or self.head_dim) if s.kv_source is None
            else s.kv_source
            for s in self.layers
        ]  # fmt: skip

    @property
    def kv_free_window(self) -> int | None:
        """The sliding window outside which KV blocks can be freed while a request runs: set only when every
        layer slides (a block holds all layers' K/V; one full-attention layer, as in Gemma 2/3, keeps them all)."""
        windows = self.layer_sliding_windows
        if not windows or any(w is None for w in windows):
            return None
        return max(w for w in windows if w is not None)

    @staticmethod
    def from_hf(path: str | os.PathLike, dtype: str = "auto", device: str = "cpu") -> ModelConfig:
        from lmserve.checkpoint.gguf import GGUFCheckpoint, find_gguf_file
        from lmserve.checkpoint.registry import resolve_architecture
        from lmserve.checkpoint.shape import model_shape_from_hf_config

        path = Path(path)
        cfg_file = path / "config.json"
        gguf_file = find_gguf_file(path)
        if gguf_file is not None:  # llama.cpp's format: the config comes from the file's metadata
            path = cfg_file = gguf_file
            cfg = GGUFCheckpoint(gguf_file).hf_config()
        elif not cfg_file.is_file():
            raise ValueError(
                f"model: {str(path)!r} has no config.json (expected an HF model directory or a .gguf file)"
            )
        else:
            cfg = json.loads(cfg_file.read_text())
        names = list(cfg.get("architectures") or [])
        # a base model saved without its LM head (Qwen3Model, ...: embedding checkpoints), or with a classifier
        # head instead (Qwen3ForSequenceClassification: a cross-encoder), is its causal LM's family
        as_lm = [_as_causal_lm(n) for n in names]
        family = resolve_architecture(as_lm)
        if cfg is not text_config(cfg):
            logger.info("%s: serving the text model of %s (the vision / audio towers are skipped)",
                        cfg_file, family.architecture_of(cfg["architectures"]))  # fmt: skip
        top, cfg = cfg, text_config(cfg)
        try:
            shape = model_shape_from_hf_config(cfg)  # the ledger's parser: one reading of the shape fields
            layers = layer_specs(family, cfg, shape.num_layers)
        except ValueError as e:
            raise ValueError(f"model config {cfg_file}: {e}") from None
        if shape.mlp_bias:
            raise ValueError(f"model config {cfg_file}: biases on the MLP (mlp_bias) are not supported")
        windows = tuple(s.sliding_window for s in layers) if any(s.sliding_window for s in layers) else ()
        sliding_window = max((w for w in windows if w), default=None)
        eos = cfg.get("eos_token_id", top.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelConfig(
            path=str(path),
            architecture=names[as_lm.index(family.architecture_of(as_lm))],
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
            linear=shape.linear,
            num_linear_layers=shape.num_linear_layers,
            layers=layers,
            moe=shape.moe,
            o_bias=shape.o_bias,
            attention_sinks=shape.attention_sinks,
            **family_fields(family, cfg, shape.head_dim, shape.hidden_size, windows, layers),
        )


def family_fields(
    family: Any,
    cfg: dict[str, Any],
    head_dim: int,
    hidden_size: int,
    windows: tuple[int | None, ...],
    layers: tuple[LayerSpec, ...] = (),
) -> dict[str, Any]:
    """ModelConfig's family fields from the registry flags and the config's values."""
    out: dict[str, Any] = {
        "family": family.name,
        "hidden_act": family.hidden_act,
        "norm_weight_offset": family.norm_weight_offset,
        "norm_layout": family.norm_layout,
        "qk_norm_whole": family.qk_norm_whole,
        "v_norm": family.v_norm,
        "layer_sliding_windows": windows,
        "attn_scale": family.attn_scale,
        "final_logit_softcap": cfg.get("final_logit_softcapping"),
        "hidden_size_per_layer_input": int(cfg.get("hidden_size_per_layer_input") or 0),
        "vocab_size_per_layer_input": int(cfg.get("vocab_size_per_layer_input") or 0),
        "checkpoint_renames": family.checkpoint_renames,
        "checkpoint_skips": family.checkpoint_skips,
    }
    if family.scaled_embeddings:
        out["embed_scale"] = float(hidden_size) ** 0.5
    if family.uses_query_pre_attn_scalar:
        out["attn_scale"] = float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5
        out["attn_logit_softcap"] = cfg.get("attn_logit_softcapping")
    if family.local_rope or any(s.rope == "local" for s in layers):
        out["rope_local"] = RopeConfig.from_hf(
            cfg, layer_type="sliding_attention", default_theta=float(cfg.get("rope_local_base_freq", 10000.0))
        )
    params = cfg.get("rope_parameters") or {}
    partial = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0) if params else 1.0)
    if partial != 1.0:
        out["rotary_dim"] = int(head_dim * partial)
    return out


def resolve_dtype(dtype: str, hf_config: dict[str, Any], device: str) -> str:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {list(SUPPORTED_DTYPES)}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    if not device.startswith("cuda"):
        return "float32"  # 16-bit compute is slow on most CPUs; weights are upcast at load
    saved = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    return saved if saved in ("bfloat16", "float16") else "float32"


# ---- how a checkpoint pools (the pooling runner) ------------------------------------------------------------

_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "last"
    normalize: bool = True
    matryoshka_dimensions: tuple[int, ...] = ()  # the `dimensions` the model was trained for (empty: any)
    score_tokens: tuple[str, ...] = ()  # a yes/no reranker: score = p(last of these) among them (e.g. no, yes)
    classifier: bool = False  # *ForSequenceClassification: the checkpoint's `score` head on the last token

    @property
    def is_scorer(self) -> bool:
        return bool(self.score_tokens) or self.classifier


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_sentence_transformers(path: str | Path) -> PoolerConfig | None:
    """The pooling a sentence-transformers checkpoint declares; None when `path` is not one."""
    root = Path(path)
    modules = _read_json(root / "modules.json") if root.is_dir() else None
    if not isinstance(modules, list):
        return None
    pooling, normalize = "last", False
    for m in modules:
        kind = str(m.get("type", "")) if isinstance(m, dict) else ""
        if kind.endswith(".Pooling"):
            cfg = _read_json(root / str(m.get("path", "")) / "config.json") or {}
            on = [mode for key, mode in _MODES.items() if cfg.get(key)]
            if len(on) != 1:
                raise ValueError(
                    f"{root}/{m.get('path')}/config.json: one of {sorted(_MODES)} must be true (supported: "
                    f"last token, mean, CLS), got {sorted(k for k, v in cfg.items() if v is True)}"
                )
            pooling = on[0]
        elif kind.endswith(".Normalize"):
            normalize = True
    return PoolerConfig(pooling, normalize, _matryoshka(root))


def _matryoshka(root: Path) -> tuple[int, ...]:
    dims = (_read_json(root / "config.json") or {}).get("matryoshka_dimensions") or ()
    return tuple(int(d) for d in dims)


HEADLESS_SUFFIXES = ("Model", "ForSequenceClassification")  # architectures without an LM head


def _as_causal_lm(name: str) -> str:
    for suffix in HEADLESS_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)] + "ForCausalLM"
    return name


def resolve_runner(runner: str, path: str, architecture: str, overrides: dict[str, Any] | None) -> PoolerConfig | None:
    """The pooler of the engine (None: the generate runner). `overrides` (--pooler-config) set pooling_type,
    normalize or score_tokens over what the checkpoint declares."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {list(RUNNERS)}, got {runner!r}")
    declared = read_sentence_transformers(path)
    headless = architecture.endswith(HEADLESS_SUFFIXES)  # Qwen3Model, ...: saved without an LM head
    if runner == "generate":
        if headless:
            raise ValueError(f"runner: {architecture} has no LM head to generate with; use --runner pooling")
        return None
    if runner == "auto" and declared is None and not headless and not overrides:
        return None
    if architecture.endswith("ForSequenceClassification"):  # a cross-encoder: its classifier on the last token
        if overrides:
            raise ValueError(f"pooler_config: {architecture} scores with its classifier head; give no overrides")
        return PoolerConfig("last", normalize=False, classifier=True)
    base = declared or PoolerConfig(matryoshka_dimensions=_matryoshka(Path(path)) if Path(path).is_dir() else ())
    if not overrides:
        return base
    unknown = sorted(set(overrides) - {"pooling_type", "normalize", "score_tokens"})
    if unknown:
        raise ValueError(f"pooler_config: unknown keys {unknown}; known: pooling_type, normalize, score_tokens")
    kind = overrides.get("pooling_type", base.pooling_type)
    if kind not in POOLING_TYPES:
        raise ValueError(f"pooler_config.pooling_type must be one of {list(POOLING_TYPES)}, got {kind!r}")
    tokens = tuple(overrides.get("score_tokens", base.score_tokens))
    if tokens and (len(tokens) < 2 or not all(isinstance(t, str) for t in tokens)):
        raise ValueError(f"pooler_config.score_tokens must be two or more token strings, got {list(tokens)}")
    normalize = bool(overrides.get("normalize", base.normalize and not tokens))
    return PoolerConfig(kind, normalize, base.matryoshka_dimensions, tokens)
