"""A PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) → validated tensors per lmserve Linear.

load_adapter maps each PEFT target onto its rows of lmserve's fused projections (module_parts: qkv_proj,
gate_up_proj), folds the scaling into B, and refuses what the batched path cannot reproduce, naming the field
(LoRAAdapter). The accepted and refused adapter features are listed in docs/lora.md.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lmserve.config.engine import ModelConfig
from lmserve.lora.request import LoRARequest

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# PEFT module name → (lmserve's module under the layer, part index within it)
PEFT_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "qkv_proj": ("self_attn.qkv_proj", -1),  # already fused (Phi-3): every row
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "gate_up_proj": ("mlp.gate_up_proj", -1),
    "down_proj": ("mlp.down_proj", 0),
}
LORA_MODULES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
REFUSED_TARGETS = ("embed_tokens", "lm_head", "wte", "embed")
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


def module_parts(cfg: ModelConfig) -> dict[str, tuple[int, list[tuple[int, int]]]]:
    """lmserve LoRA module → (in_features, its parts' output row ranges)."""
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {
        "self_attn.qkv_proj": (cfg.hidden_size, [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]),
        "self_attn.o_proj": (q, [(0, cfg.hidden_size)]),
        "mlp.gate_up_proj": (cfg.hidden_size, [(0, inter), (inter, 2 * inter)]),
        "mlp.down_proj": (inter, [(0, cfg.hidden_size)]),
    }


@dataclass
class LoRAAdapter:
    """One adapter's tensors, float32 on the CPU: weights[(layer, module)][part] = (A (r, in), B·scaling (rows, r));
    part -1 means the module's every row (a checkpoint that fused it already)."""

    request: LoRARequest
    rank: int
    scaling: float
    weights: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for parts in self.weights.values() for a, b in parts.values())  # fmt: skip


def _refuse(path: str, what: str) -> ValueError:
    return ValueError(f"LoRA adapter {path!r}: {what}")


def read_adapter_config(path: str) -> dict:
    """adapter_config.json, with the fields the batched path cannot honour refused (ValueError naming them)."""
    cfg_file = Path(path) / ADAPTER_CONFIG
    if not Path(path).is_dir():
        raise _refuse(path, "lora_path is not a directory")
    if not cfg_file.is_file():
        raise _refuse(path, f"no {ADAPTER_CONFIG} (a PEFT adapter directory has it and {ADAPTER_WEIGHTS})")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise _refuse(path, f"{ADAPTER_CONFIG} is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise _refuse(path, f"{ADAPTER_CONFIG} must hold a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _refuse(path, f"peft_type {peft_type!r} is not supported (only LORA)")
    if cfg.get("modules_to_save"):
        raise _refuse(path, f"modules_to_save {cfg['modules_to_save']} is not supported (whole trained copies of "
                            "modules; only LoRA deltas are served)")  # fmt: skip
    if cfg.get("use_dora"):
        raise _refuse(path, "use_dora: DoRA adapters are not supported")
    if cfg.get("bias", "none") != "none":
        raise _refuse(path, f"bias {cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("fan_in_fan_out"):
        raise _refuse(path, "fan_in_fan_out is not supported (Conv1D layers)")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise _refuse(path, f"{key} is not supported (one r and lora_alpha for every module)")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    bad = [t for t in targets if any(r in t for r in REFUSED_TARGETS)]
    if bad:
        raise _refuse(path, f"target_modules {bad}: embedding and LM-head LoRA are not supported")
    for key in ("r", "lora_alpha"):
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise _refuse(path, f"{key} must be a positive number, got {value!r}")
    return cfg


def load_adapter(request: LoRARequest, model: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """Read and validate request.lora_path against the base model's shapes; ValueError names the field or tensor."""
    from safetensors import safe_open

    path = request.lora_path
    cfg = read_adapter_config(path)
    rank = int(cfg["r"])
    if rank > max_lora_rank:
        raise _refuse(path, f"r={rank} exceeds max_lora_rank={max_lora_rank} (raise --max-lora-rank)")
    scaling = cfg["lora_alpha"] / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    weights_file = Path(path) / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        raise _refuse(path, f"no {ADAPTER_WEIGHTS} (adapter_model.bin is not read: save with safe_serialization)")
    tensors: dict[tuple[int, str, int], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            for key in f.keys():
                tensors_key = _parse_key(path, key, model)
                tensors.setdefault(tensors_key[:3], {})[tensors_key[3]] = f.get_tensor(key).float()
    except ValueError:
        raise
    except Exception as e:  # a truncated or foreign file
        raise _refuse(path, f"{ADAPTER_WEIGHTS} is not readable safetensors ({type(e).__name__}: {e})") from None
    if not tensors:
        raise _refuse(path, f"{ADAPTER_WEIGHTS} holds no LoRA tensors")
    adapter = LoRAAdapter(request, rank, float(scaling))
    parts_of = module_parts(model)
    for (layer, module, part), ab in sorted(tensors.items()):
        if set(ab) != {"A", "B"}:
            raise _refuse(path, f"layer {layer} {module} part {part}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]
        in_features, ranges = parts_of[module]
        rows = ranges[-1][1] if part == -1 else ranges[part][1] - ranges[part][0]
        if a.dim() != 2 or b.dim() != 2 or a.shape != (rank, in_features) or b.shape != (rows, rank):
            raise _refuse(path, f"base model mismatch: layer {layer} {module} part {part} has lora_A "
                                f"{tuple(a.shape)} and lora_B {tuple(b.shape)}, the base model needs "
                                f"({rank}, {in_features}) and ({rows}, {rank})")  # fmt: skip
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise _refuse(path, f"layer {layer} {module}: non-finite LoRA weights")
        adapter.weights.setdefault((layer, module), {})[part] = (a.contiguous(), (b * scaling).contiguous())
    return adapter


def _parse_key(path: str, key: str, model: ModelConfig) -> tuple[int, str, int, str]:
    """A safetensors key → (layer, lmserve module, part, "A" | "B"); anything else refused, naming the key."""
    if "lora_magnitude_vector" in key:
        raise _refuse(path, f"use_dora: tensor {key!r} is a DoRA magnitude (not supported)")
    if "lora_embedding" in key or any(f".{t}." in key for t in REFUSED_TARGETS):
        raise _refuse(path, f"tensor {key!r}: embedding and LM-head LoRA are not supported")
    if "modules_to_save" in key or ".original_module." in key:
        raise _refuse(path, f"modules_to_save: tensor {key!r} is not supported")
    m = _KEY.match(key)
    if m is None or m.group(2) not in PEFT_MODULES:
        raise _refuse(path, f"tensor {key!r} is not a LoRA weight of q/k/v/o/gate/up/down_proj")
    layer = int(m.group(1))
    if layer >= model.num_layers:
        raise _refuse(path, f"base model mismatch: tensor {key!r} is for layer {layer}, the base model has "
                            f"{model.num_layers} layers")  # fmt: skip
    module, part = PEFT_MODULES[m.group(2)]
    return layer, module, part, m.group(3)
