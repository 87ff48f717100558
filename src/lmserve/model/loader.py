"""config.json + *.safetensors (single or sharded), or a GGUF file → a CausalLM with its parameters filled."""

from __future__ import annotations

import json
import logging
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors import safe_open

from lmserve.config.engine import ModelConfig, QuantizationConfig
from lmserve.model.decoder import CausalLM
from lmserve.model.layers.moe import SparseMoE
from lmserve.model.parallel import TPShard, local_config, shard_tensor

if TYPE_CHECKING:
    from lmserve.checkpoint.gguf import GGUFCheckpoint

# HF checkpoint name fragment → (our fused parameter fragment, shard index within the fused output)
STACKED_PARAMS: tuple[tuple[str, str, int], ...] = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {str(path)!r}")
    return files


def load_model(
    cfg: ModelConfig,
    max_positions: int,
    device: str,
    quantization: QuantizationConfig | None = None,
    tp: TPShard | None = None,
) -> CausalLM:
    """The model with its checkpoint's tensors. A pre-quantized checkpoint (`quantization.prequantized`)
    fills the projections' quantized buffers directly (their float weights are never allocated). With tp, one
    tensor-parallel rank's shard (model/parallel.py): each tensor is sliced as it is read."""
    full_cfg = cfg
    if tp is not None:
        cfg = local_config(cfg, tp)
    dtype = TORCH_DTYPES[cfg.dtype]
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions)
    kept = None  # GGUF: HF weight name → the block-32 / K-quant tensor kept as it is
    gguf = _open_gguf(cfg)  # (parsed once for the blocks and the tensors: ~0.7 s a parse for a 49k vocabulary)
    if quantization is not None and quantization.method == "gguf":
        assert gguf is not None, f"GGUF quantization needs a .gguf checkpoint, got {cfg.path}"
        kept = _prepare_gguf_blocks(model, cfg, gguf)
    elif quantization is not None and quantization.prequantized:
        from lmserve.model.layers import quantizable_linears

        assert dtype == torch.float32, "quantized checkpoints compute in float32"
        for m, layout, group in quantizable_linears(model, quantization):
            m.prepare_quantized(layout, group)
    model = model.to_empty(device=device)
    # The rotary tables are buffers computed, not loaded: rebuild them on the real device.
    with torch.device(device):
        model.model.build_rotary(cfg, max_positions)
    if cfg.tie_word_embeddings and model.lm_head.quant_method is None:  # (a quantized head has its own copy)
        model.lm_head.weight = model.model.embed_tokens.weight
    embed = model.model.embed_tokens
    if cfg.tie_word_embeddings and embed.kq_type is not None:  # a K-quant tied head reads the embedding's bytes
        model.lm_head.set_kquant(embed.qweight, model.lm_head.kq_segments)
    if embed.head_rows:  # a block-32 tied embedding looks its rows up in the head's blocks
        embed.set_head(model.lm_head)
    if dtype != torch.float32:  # (float32 already; .to() would also turn float16 int4 scales into float32)
        model = model.to(dtype)
    params = dict(model.named_parameters())
    params.update((n, b) for n, b in model.named_buffers() if n.endswith((".qweight", ".scales", ".mins")))
    kquant = {f"{n}.qweight": m for n, m in model.named_modules() if _is_kquant(m)}  # GGUF K-quant modules
    loaded: set[str] = set()
    skipped = 0
    moe_blocks = _moe_blocks(model, cfg, quantization, tp)
    for file_name, name, tensor in _checkpoint_tensors(cfg, kept, gguf):
        if name.endswith(IGNORED_SUFFIXES) or (name == "score.weight" and cfg.architecture.endswith("Classification")):
            continue  # (a classifier head: the pooling runner loads it, worker/pooler.py)
        moe = _MOE_TENSOR.fullmatch(name)
        if moe is not None and int(moe.group(1)) in moe_blocks:  # experts: copied in place one by one as they come
            try:
                moe_blocks[int(moe.group(1))].load_tensor(moe.group(2), tensor)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r} in {file_name}: {e}") from None
            continue
        if name.startswith(cfg.checkpoint_skips or "\0"):  # (a vision / audio tower: not served)
            skipped += 1
            continue
        for prefix, replacement in cfg.checkpoint_renames:
            if name.startswith(prefix):
                name = replacement + name.removeprefix(prefix)
        target, shard = _map_name(name)
        if target not in params and f"model.{target}" in params:  # a base model's checkpoint (Qwen3Model, ...)
            target = f"model.{target}"
        if target not in params:
            if cfg.tie_word_embeddings and target == "lm_head.weight":
                continue  # some tied checkpoints still save the head
            raise ValueError(f"checkpoint tensor {name!r} in {file_name} has no place in {cfg.architecture}")
        if tp is not None:
            tensor = shard_tensor(target, tensor, shard, full_cfg, tp)
        sizes = [] if shard is None else _shard_sizes(target, model)
        try:
            if target in kquant:
                _copy_kquant(kquant[target], target, tensor, shard, sizes)
            else:
                _copy_into(params[target], target, tensor, shard, sizes)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r} in {file_name}: {e}") from None
        loaded.add(target if shard is None else f"{target}#{shard}")
    if skipped:
        logger.info("%s: %d checkpoint tensors of the vision / audio towers skipped", cfg.path, skipped)
    moe_params = tuple(f"model.layers.{i}.mlp." for i in moe_blocks)
    _check_complete({n: p for n, p in params.items() if not n.startswith(moe_params or "\0")}, loaded, cfg, model)
    for i, block in moe_blocks.items():
        try:
            block.check_loaded(f"model.layers.{i}.mlp.")
        except ValueError as e:
            raise ValueError(f"{cfg.path}: {e}") from None
    if quantization is not None and quantization.prequantized:
        _check_scales(model)
    if cfg.norm_weight_offset:
        _offset_norm_weights(model, cfg.norm_weight_offset)
    return model.eval()


_MOE_TENSOR = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(.+)")


def _moe_blocks(
    model: CausalLM, cfg: ModelConfig, quantization: QuantizationConfig | None, tp: TPShard | None
) -> dict[int, SparseMoE]:
    """Layer index → its MoE block (SparseMoE.load_tensor takes the block's checkpoint tensors); the combinations
    not served yet are a ValueError."""
    blocks = {i: layer.mlp for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoE)}
    for block in blocks.values() if tp is not None else ():  # each keeps its rank's slice of every expert
        block.tp_rank, block.tp_size = tp.rank, tp.size
    if blocks and quantization is not None and quantization.prequantized and quantization.method != "gguf":
        raise ValueError(f"{cfg.architecture}: pre-quantized (`lmserve quantize`) MoE checkpoints are not "
                         "supported; load the HF checkpoint with --quantization int8 | int4")  # fmt: skip
    return blocks


def _open_gguf(cfg: ModelConfig) -> GGUFCheckpoint | None:
    """The GGUF checkpoint of a .gguf model (model/gguf.GGUFCheckpoint), else None."""
    if not cfg.path.endswith(".gguf"):
        return None
    from lmserve.checkpoint.gguf import GGUFCheckpoint

    return GGUFCheckpoint(cfg.path)


def _prepare_gguf_blocks(model: CausalLM, cfg: ModelConfig, ckpt: GGUFCheckpoint) -> dict:
    """Give every module whose GGUF tensors are kept as blocks (gguf.kept_quantized) the empty buffers of its
    layout (Q8_0 → int8w, Q4_0 → int4, Q4_1 → int4 with mins, Q5_0 / Q5_1 → int5, group 32, or the layout of the
    type a fused mix is held as; Q4_K / Q5_K / Q6_K → kquant, the fused parts' types in their order); returns the
    kept tensors."""
    from lmserve.checkpoint.gguf import KQUANT_TYPES, held_block32_types, kept_quantized, log_kept
    from lmserve.model.gguf_blocks import GGUF_GROUP_SIZE, GGUF_LAYOUTS
    from lmserve.model.layers import Embedding

    assert TORCH_DTYPES[cfg.dtype] == torch.float32, "GGUF blocks compute in float32"
    kept = kept_quantized(ckpt, cfg.tie_word_embeddings)
    held = held_block32_types(kept)
    modules = dict(model.named_modules())
    kquant_parts: dict[str, list[tuple[int, str, int]]] = {}  # module → (shard, type, rows) of its parts
    for name, tensor in kept.items():
        target, shard = _map_name(name)
        module_name = target.removesuffix(".weight")
        if tensor.type_name in KQUANT_TYPES:
            kquant_parts.setdefault(module_name, []).append((shard or 0, tensor.type_name, tensor.shape[0]))
            continue
        if isinstance(modules[module_name], Embedding):  # tied, block-32: rows from the head's copy
            modules[module_name].prepare_head_rows()
            continue
        layout, mins = GGUF_LAYOUTS[held[name]]
        if modules[module_name].quant_method is None:  # (fused parts: the first one sets the layout they share)
            modules[module_name].prepare_quantized(layout, GGUF_GROUP_SIZE, mins)
    for module_name, parts in kquant_parts.items():
        module = modules[module_name]
        if isinstance(module, Embedding):
            module.prepare_kquant(parts[0][1])
        else:
            module.prepare_kquant([(type_name, rows) for _, type_name, rows in sorted(parts)])
    log_kept(kept)
    return kept


def _checkpoint_tensors(
    cfg: ModelConfig, kept: dict | None, ckpt: GGUFCheckpoint | None
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(file name, HF tensor name, tensor) for every tensor of the checkpoint, read lazily. GGUF tensors in
    `kept` come as their layout's buffers (`<name>.qweight`, `.scales`, `.mins`) instead of `<name>.weight`
    (K-quants: `<name>.qweight`, the file's (rows, row bytes) block view itself, copied once into the model)."""
    if cfg.path.endswith(".gguf"):
        from lmserve.checkpoint.gguf import KQUANT_TYPES, held_block32_types, iter_hf_tensors
        from lmserve.checkpoint.gguf_moe import mxfp4_to_hf
        from lmserve.model.gguf_blocks import GGUF_LAYOUTS, gguf_block32_tensors

        assert ckpt is not None, f"{cfg.path}: the GGUF checkpoint load_model opened (_open_gguf)"
        file_name = Path(cfg.path).name
        dtype_bytes = TORCH_DTYPES[cfg.dtype].itemsize
        kept = kept or {}
        claimed = {t.gguf_name for name, t in kept.items() if name == t.hf_name}  # (not the tied head's copy)
        mxfp4 = _gguf_mxfp4_experts(cfg, ckpt)
        claimed |= {t.gguf_name for t in mxfp4}
        held = held_block32_types(kept)
        why = "the token embedding's lookup table, or a fused part of another type" if kept else None
        tensors = iter_hf_tensors(
            ckpt, cfg.dtype, dtype_bytes, lambda _, t: t.gguf_name in claimed, *([why] if why else [])
        )
        for name, array in tensors:
            yield file_name, name, torch.from_numpy(np.array(array))  # a copy: the file map is read-only
        for t in mxfp4:  # an expert's MXFP4 projection, as HF's blocks and scales (4 bits, the file's values)
            blocks, scales = mxfp4_to_hf(t.raw, *t.shape)
            prefix = t.hf_name.removesuffix(".weight")
            yield file_name, f"{prefix}.blocks", torch.from_numpy(blocks)
            yield file_name, f"{prefix}.scales", torch.from_numpy(scales)
        for name, t in kept.items():
            if t.type_name in KQUANT_TYPES:
                if name != t.hf_name and t.gguf_name in claimed:
                    continue  # a tied head sharing the embedding's bytes
                with warnings.catch_warnings():  # the map is read-only; the loader only reads it
                    warnings.simplefilter("ignore", UserWarning)
                    yield file_name, f"{name.removesuffix('.weight')}.qweight", torch.from_numpy(t.blocks())
                continue
            if name == "model.embed_tokens.weight":
                continue  # a tied block-32 embedding: looked up in the head's blocks, which are loaded once
            layout = GGUF_LAYOUTS[held[name]][0]
            for suffix, tensor in gguf_block32_tensors(t.type_name, t.blocks(), layout).items():
                yield file_name, f"{name.removesuffix('.weight')}.{suffix}", tensor
        return
    for file in checkpoint_files(Path(cfg.path)):
        with _open_checkpoint(file) as f:
            for name in f.keys():
                yield file.name, name, f.get_tensor(name)


def _gguf_mxfp4_experts(cfg: ModelConfig, ckpt: GGUFCheckpoint) -> list:
    """The MXFP4 expert projections of a GGUF file whose experts are all MXFP4 (kept in 4 bits: the MoE block's
    MXFP4 experts, whatever the quantization), logged; else [] (gguf dequantizes MXFP4 tensors with the rest)."""
    if cfg.moe is None or not cfg.moe.mxfp4:
        return []
    tensors = [t for t in ckpt.tensors() if t.type_name == "MXFP4"]
    logger.info("GGUF: %d MXFP4 expert projections kept in 4 bits as they are in the file: %.1f MiB",
                len(tensors), sum(t.num_bytes for t in tensors) / 2**20)  # fmt: skip
    return tensors


def _offset_norm_weights(model: CausalLM, offset: float) -> None:
    """Gemma's RMSNorm scales by (1 + weight): fold the 1 into the weights once, so every norm (and its
    fused kernels) stays `weight * normalized`."""
    from lmserve.model.layers import RMSNorm

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.add_(offset)


def _open_checkpoint(file: Path):  # noqa: ANN202 (safetensors' handle type is private)
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # safetensors raises its own error types for a truncated or garbled header
        raise ValueError(f"checkpoint file {str(file)!r} cannot be read (corrupt or truncated?): {e}") from None


def _check_scales(model: CausalLM) -> None:
    from lmserve.model import gguf_blocks
    from lmserve.model.layers import Linear

    for name, m in model.named_modules():
        if _is_kquant(m):
            for s in m.kq_segments:
                scales = gguf_blocks.kquant_scales(s.type_name, m.kquant_rows(s.start, s.rows))
                if not bool(torch.isfinite(scales).all()):
                    raise ValueError(f"checkpoint tensor {name} holds non-finite {s.type_name} scales (corrupt file?)")
        elif isinstance(m, Linear) and m.quant_method is not None and not bool(torch.isfinite(m.scales).all()):
            raise ValueError(f"checkpoint tensor {name}.scales holds non-finite scales (corrupt file?)")


def _map_name(name: str) -> tuple[str, int | None]:
    for fused, part, shard in STACKED_PARAMS:
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard
    return name, None


def _copy_into(
    param: torch.Tensor, target: str, tensor: torch.Tensor, shard: int | None, sizes: list[int]
) -> None:
    quantized = target.endswith((".qweight", ".scales"))
    if (quantized or not tensor.is_floating_point()) and tensor.dtype != param.dtype:
        raise ValueError(f"dtype {tensor.dtype} where {target} needs {param.dtype} (a mismatched quantized file?)")
    with torch.no_grad():
        if shard is None:
            if param.shape != tensor.shape:
                raise ValueError(
                    f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(tensor.shape)}"
                )
            param.copy_(tensor)
            return
        start = sum(sizes[:shard])
        dst = param.narrow(0, start, sizes[shard])
        if dst.shape != tensor.shape:
            raise ValueError(
                f"shape mismatch: fused shard {tuple(dst.shape)} vs checkpoint {tuple(tensor.shape)}"
            )
        dst.copy_(tensor)


def _is_kquant(m: torch.nn.Module) -> bool:
    from lmserve.model.layers import Embedding, Linear

    return isinstance(m, Linear) and m.quant_method == "kquant" or isinstance(m, Embedding) and m.kq_type is not None


def _copy_kquant(
    module: torch.nn.Module, target: str, blocks: torch.Tensor, shard: int | None, sizes: list[int]
) -> None:
    """A K-quant part's (rows, row bytes) blocks into the rows of module's kquant bytes it covers."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise ValueError(
            f"{target} needs (rows, row bytes) uint8 K-quant blocks, got {blocks.dtype} {tuple(blocks.shape)}"
        )
    start = 0 if shard is None else sum(sizes[:shard])
    dst = module.kquant_rows(start, blocks.shape[0])
    if dst.shape != blocks.shape:
        raise ValueError(f"shape mismatch: K-quant rows {tuple(dst.shape)} vs checkpoint {tuple(blocks.shape)}")
    with torch.no_grad():
        dst.copy_(blocks)


def _shard_sizes(fused_name: str, model: torch.nn.Module) -> list[int]:
    """The output rows of each checkpoint part of a fused projection (the module's shard_sizes: q, k, v / gate, up)."""
    sizes = getattr(model.get_submodule(fused_name.rsplit(".", 1)[0]), "shard_sizes", None)
    assert sizes is not None, f"no shard layout for {fused_name}"
    return list(sizes)


def _check_complete(
    params: dict[str, torch.Tensor], loaded: set[str], cfg: ModelConfig, model: torch.nn.Module
) -> None:
    missing = []
    for name in params:
        fused = next((f for f, _, _ in STACKED_PARAMS if f".{f}." in name), None)
        if fused is None:
            headless = cfg.architecture.endswith(("Model", "ForSequenceClassification"))  # (the pooling runner's)
            ok = name in loaded or ((cfg.tie_word_embeddings or headless) and name == "lm_head.weight")
        else:  # in parts (HF), or fused (Phi-3 checkpoints, `lmserve quantize`)
            n = len(_shard_sizes(name, model))
            ok = name in loaded or all(f"{name}#{i}" in loaded for i in range(n))
        if not ok:
            missing.append(name)
    if missing:
        raise ValueError(
            f"checkpoint in {cfg.path!r} lacks parameters: {missing[:8]}{'...' if len(missing) > 8 else ''}"
        )
