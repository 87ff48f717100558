"""KV-cache memory ledger: how many bytes the weights and the KV cache take, and how many requests fit in a budget.

Pure arithmetic (no torch): the engine sizes its block pool with it and `lmserve memory` answers "will it fit?"
without a GPU. Shapes: checkpoint/shape.py; units: memory/units.py; the report: memory/report.py. Its conventions
(KV bytes, paging, tensor parallel, sliding windows) are in docs/memory.md.
"""

from __future__ import annotations

import math
from typing import Any

from lmserve.checkpoint.shape import HEAD_LAYOUTS, ModelShape, load_model_shape, model_shape_from_hf_config
from lmserve.memory.units import format_bytes, parse_bytes

__all__ = [
    "DTYPE_BYTES",
    "ModelShape",
    "dtype_bytes",
    "format_bytes",
    "kv_bytes_per_token",
    "kv_blocks_held",
    "kv_bytes_per_token_per_layer",
    "kv_committed_bytes",
    "kv_cache_bytes_per_token",
    "kv_scale_bytes_per_token",
    "kv_heads_per_rank",
    "hybrid_pool_split",
    "state_snapshot_split",
    "linear_state_bytes_per_sequence",
    "max_concurrent_sequences",
    "load_model_shape",
    "max_concurrent_requests",
    "max_num_kv_blocks",
    "model_shape_from_hf_config",
    "expert_bytes",
    "expert_projection_shapes_per_rank",
    "num_active_parameters",
    "num_parameters",
    "num_parameters_per_rank",
    "parse_bytes",
    "projection_shapes_per_rank",
    "quantized_projection_bytes",
    "weight_bytes_per_rank",
]


DTYPE_BYTES: dict[str, float] = {
    "fp32": 4,
    "float32": 4,
    "float": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "float8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}


def dtype_bytes(name: str) -> float:
    """Bytes per element of a dtype name (case-insensitive; a ``torch.`` prefix is accepted,
    so an HF config's ``torch_dtype`` works)."""
    if not isinstance(name, str):
        raise ValueError(f"dtype must be a string, got {name!r}")
    key = name.strip().lower().removeprefix("torch.")
    try:
        return DTYPE_BYTES[key]
    except KeyError:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise ValueError(f"unknown dtype {name!r}; known dtypes: {known}") from None


# ---------------------------------------------------------------------------------------------
# Counting
# ---------------------------------------------------------------------------------------------


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _positive_bytes(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"dtype_bytes must be a positive number, got {value!r}")
    return value


def kv_bytes_per_token_per_layer(num_kv_heads: int, head_dim: int, dtype_bytes: float) -> int:
    """K and V for one token in one layer: 2 * kv_heads * head_dim * bytes."""
    _positive("num_kv_heads", num_kv_heads)
    _positive("head_dim", head_dim)
    return math.ceil(2 * num_kv_heads * head_dim * _positive_bytes(dtype_bytes))


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float) -> int:
    """K and V for one token across all layers: 2 * layers * kv_heads * head_dim * bytes."""
    _positive("num_layers", num_layers)
    return num_layers * kv_bytes_per_token_per_layer(num_kv_heads, head_dim, dtype_bytes)


QUANTIZED_KV_DTYPES = frozenset({"int8", "fp8", "float8", "fp8_e4m3", "fp8_e5m2"})
KV_SCALE_BYTES = 4  # one float32 scale per (token, KV head) for K and one for V


def kv_scale_bytes_per_token(num_layers: int, num_kv_heads: int, kv_dtype: str) -> int:
    """Bytes of quantization scales per token across all layers: 2 * layers * kv_heads * 4 for the 8-bit
    KV dtypes (int8, fp8), 0 for the float ones (their values need no scale)."""
    _positive("num_layers", num_layers)
    _positive("num_kv_heads", num_kv_heads)
    dtype_bytes(kv_dtype)  # unknown names are an error here too
    if kv_dtype.strip().lower().removeprefix("torch.") not in QUANTIZED_KV_DTYPES:
        return 0
    return 2 * num_layers * num_kv_heads * KV_SCALE_BYTES


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """What one token costs in the paged KV pool stored as ``kv_dtype``: K and V values plus, for the
    8-bit dtypes, their scales. The engine sizes its pool with this."""
    values = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes(kv_dtype))
    return values + kv_scale_bytes_per_token(num_layers, num_kv_heads, kv_dtype)


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads one tensor-parallel rank stores: kv_heads / tp, or 1 (replicated) when there are
    fewer KV heads than ranks. Needs kv_heads % tp == 0 or tp % kv_heads == 0."""
    _positive("num_kv_heads", num_kv_heads)
    _positive("tp", tp)
    if num_kv_heads % tp == 0:
        return num_kv_heads // tp
    if tp % num_kv_heads == 0:
        return 1
    raise ValueError(f"tp ({tp}) must divide num_kv_heads ({num_kv_heads}) or be a multiple of it")


def _check_tp(shape: ModelShape, tp: int) -> None:
    _positive("tp", tp)
    if shape.num_attention_heads % tp != 0:
        raise ValueError(f"tp ({tp}) must divide num_attention_heads ({shape.num_attention_heads})")
    kv_heads_per_rank(shape.num_kv_heads, tp)


def num_parameters_per_rank(shape: ModelShape, tp: int = 1) -> int:
    """Parameters one tensor-parallel rank holds. Heads, MLP columns and the vocabulary are
    split (vocab rows rounded up, no padding beyond that), KV heads replicated when fewer than
    ranks, norms and row-parallel biases replicated. With tp=1 this is the full count. A MoE layer holds every
    expert's slice of the expert width (and of the shared expert's); router and shared-expert gate replicated."""
    return _count_parameters(shape, tp, active=False)


def num_parameters(shape: ModelShape) -> int:
    """Llama-family parameter count: embeddings, untied lm_head, per layer q/k/v/o (+biases),
    gate/up/down (or a MoE layer's experts, router and shared expert), two RMSNorm weights (+ q/k norms), and the
    final norm. Llama-2-7B -> 6,738,415,616; Llama-3-8B -> 8,030,261,248."""
    return num_parameters_per_rank(shape, 1)


def num_active_parameters(shape: ModelShape, embeddings: bool = True) -> int:
    """Parameters one token computes with: a MoE layer's router, top_k experts and shared expert instead of all
    experts (= num_parameters for a dense model). With embeddings=False the input embedding table is left out (a
    token reads one row of it): the weights a decode step streams per token, and gpt-oss's published "active"."""
    n = _count_parameters(shape, 1, active=True)
    return n if embeddings else n - shape.vocab_size * shape.hidden_size


def _count_parameters(shape: ModelShape, tp: int, active: bool) -> int:
    _check_tp(shape, tp)
    h, d = shape.hidden_size, shape.head_dim
    q_out = shape.num_attention_heads // tp * d
    kv_out = kv_heads_per_rank(shape.num_kv_heads, tp) * d
    vocab = math.ceil(shape.vocab_size / tp)

    attn = h * q_out * (2 if shape.attn_output_gate else 1) + 2 * h * kv_out + q_out * h
    if shape.qkv_bias:
        attn += q_out + 2 * kv_out
    if shape.o_bias:
        attn += h  # row-parallel bias: applied once after the all-reduce, kept on every rank
    if shape.qk_norm:
        attn += 2 * d
    if shape.attention_sinks:
        attn += shape.num_attention_heads // tp
    norms = 2 * h
    mlp_total = sum(_mlp_parameters(shape, tp, sparse, active) for sparse in _sparse_layers(shape))
    mixers = (shape.num_layers - shape.num_linear_layers) * attn  # every attention layer (shared K/V or not)
    if shape.linear is not None:  # tp is 1 here (the engine refuses tensor parallelism for hybrid models)
        mixers += shape.num_linear_layers * _linear_attention_parameters(shape)

    embeddings = vocab * h
    lm_head = 0 if shape.tie_word_embeddings else vocab * h
    final_norm = h
    return mixers + shape.num_layers * norms + mlp_total + embeddings + lm_head + final_norm + shape.extra_parameters


def _linear_attention_parameters(shape: ModelShape) -> int:
    """One Gated DeltaNet layer: in_proj_qkv / z / b / a, the depthwise conv, dt_bias, A_log, the gated norm and
    out_proj (HF's Qwen3_5GatedDeltaNet)."""
    lin, h = shape.linear, shape.hidden_size
    assert lin is not None, "not a linear-attention model"
    value_size = lin.num_v_heads * lin.v_dim
    projections = h * lin.conv_dim + h * value_size + 2 * h * lin.num_v_heads + value_size * h
    return projections + lin.conv_dim * lin.conv_kernel + 2 * lin.num_v_heads + lin.v_dim


def _sparse_layers(shape: ModelShape) -> tuple[bool, ...]:
    return shape.moe.sparse_layers if shape.moe is not None else (False,) * shape.num_layers


def _mlp_parameters(shape: ModelShape, tp: int, sparse: bool, active: bool) -> int:
    """One layer's feed-forward parameters on a rank: the dense MLP, or a MoE block (all experts, or with active
    the top_k a token runs)."""
    h = shape.hidden_size
    if not sparse:
        width = shape.moe.dense_intermediate_size if shape.moe is not None else shape.intermediate_size
        inter = math.ceil(width / tp)
        return 3 * h * inter + (2 * inter + h if shape.mlp_bias else 0)
    moe = shape.moe
    inter = math.ceil(moe.expert_intermediate_size / tp)
    expert = 3 * h * inter + (2 * inter + h if moe.expert_bias else 0)
    experts = moe.router.top_k if active else moe.router.num_experts
    router = moe.router.num_experts * (h + (1 if moe.router.bias else 0))
    shared = 0
    if moe.shared_expert_intermediate_size:
        shared = 3 * h * math.ceil(moe.shared_expert_intermediate_size / tp) + h  # + its sigmoid gate
    return experts * expert + router + shared


QUANTIZATION_METHODS = ("int8", "int4")
EXPERT_PRECISIONS = ("float32", "bfloat16", "int8", "int4", "mxfp4")


def projection_shapes_per_rank(shape: ModelShape, tp: int = 1) -> list[tuple[int, int]]:
    """(out_features, in_features) of one dense layer's projections on one rank: q, k, v, o, gate, up, down
    (what `--quantization` quantizes; fused or separate, per-row scales and groups come out the same). A MoE
    model's sparse layers: the attention's four here, their experts' in expert_projection_shapes_per_rank."""
    _check_tp(shape, tp)
    h, d = shape.hidden_size, shape.head_dim
    q_out = shape.num_attention_heads // tp * d
    kv_out = kv_heads_per_rank(shape.num_kv_heads, tp) * d
    width = shape.moe.dense_intermediate_size if shape.moe is not None else shape.intermediate_size
    inter = math.ceil(width / tp)
    return [(q_out, h), (kv_out, h), (kv_out, h), (h, q_out), (inter, h), (inter, h), (h, inter)]


def expert_projection_shapes_per_rank(shape: ModelShape, tp: int = 1) -> list[tuple[int, int]]:
    """(out, in) of every projection one sparse layer quantizes on a rank: each expert's gate, up and down, then
    the shared expert's (the router and the shared expert's gate stay float)."""
    moe, h = shape.moe, shape.hidden_size
    assert moe is not None, "a dense model has no experts"
    inter = math.ceil(moe.expert_intermediate_size / tp)
    out = [(inter, h), (inter, h), (h, inter)] * moe.router.num_experts
    if moe.shared_expert_intermediate_size:
        s = math.ceil(moe.shared_expert_intermediate_size / tp)
        out += [(s, h), (s, h), (h, s)]
    return out


def expert_bytes(shape: ModelShape, precision: str, tp: int = 1, group_size: int = 32) -> int:
    """Bytes of every routed expert's weights (all sparse layers, one rank) at `precision`: float32, bfloat16,
    int8 / int4 (the `--quantization` layouts), mxfp4 (gpt-oss's checkpoint: 4-bit values + a byte per 32)."""
    moe = shape.moe
    assert moe is not None, "a dense model has no experts"
    inter = math.ceil(moe.expert_intermediate_size / tp)
    h = shape.hidden_size
    shapes = [(2 * inter, h), (h, inter)]
    if precision in ("float32", "bfloat16"):
        per_expert = sum(o * k for o, k in shapes) * (4 if precision == "float32" else 2)
    elif precision == "mxfp4":
        per_expert = sum(o * k // 2 + o * k // 32 for o, k in shapes)
    elif precision in QUANTIZATION_METHODS:
        per_expert = sum(quantized_projection_bytes(o, k, precision, group_size) for o, k in shapes)
    else:
        raise ValueError(f"expert precision must be one of {list(EXPERT_PRECISIONS)}, got {precision!r}")
    return moe.num_sparse_layers * moe.router.num_experts * per_expert


def quantized_projection_bytes(out_features: int, in_features: int, method: str, group_size: int = 32) -> int:
    """Bytes one quantized projection holds in memory (lmserve.model.quantization's layouts):
    int8: 1 B per weight + a float32 scale and an int32 row sum (the VNNI kernel's correction) per output row;
    int4: 1/2 B per weight + a float16 scale per group of `group_size` inputs; int8w (the int4 method's LM head):
    1 B per weight + a float16 scale per 32 inputs."""
    if method == "int8":
        return out_features * in_features + 8 * out_features
    if method == "int8w":
        return out_features * in_features + 2 * out_features * (in_features // 32)
    if method != "int4":
        raise ValueError(f"quantization must be one of {list(QUANTIZATION_METHODS)}, got {method!r}")
    if group_size < 32 or group_size % 32 or in_features % group_size:
        raise ValueError(
            f"quantization_group_size {group_size} must be a multiple of 32 dividing the projection's "
            f"{in_features} inputs"
        )
    return out_features * in_features // 2 + 2 * out_features * (in_features // group_size)


def weight_bytes_per_rank(
    shape: ModelShape, weight_dtype_bytes: float, tp: int = 1, quantization: str | None = None, group_size: int = 32
) -> int:
    """Weight bytes on one rank: everything at `weight_dtype_bytes`, except that with `quantization` the
    projections are int8 / int4 (embeddings, norms and biases stay at `weight_dtype_bytes`). The LM head is
    quantized too (model_shape.HEAD_LAYOUTS: int8 as a projection, int4 at 8 bits weight-only): an untied head is
    replaced by it; a tied model keeps its embedding table for the token lookup and holds the quantized head as
    an extra copy. MoE: the experts (and the shared expert) are quantized, the router stays float; without
    quantization, a checkpoint's MXFP4 experts stay MXFP4."""
    params = num_parameters_per_rank(shape, tp)
    moe = shape.moe
    sparse = _sparse_layers(shape)
    if quantization is None:
        if moe is None or not moe.mxfp4:
            return math.ceil(params * weight_dtype_bytes)
        float_params = params - expert_bytes(shape, "float32", tp) // 4  # (the routed experts' weights)
        return math.ceil(float_params * weight_dtype_bytes) + expert_bytes(shape, "mxfp4", tp)
    if shape.linear is not None:
        raise ValueError(f"quantization={quantization!r}: the ledger does not count quantized hybrid models yet")
    dense = projection_shapes_per_rank(shape, tp)
    layers = [dense[:4] + expert_projection_shapes_per_rank(shape, tp) if s else dense for s in sparse]
    num_float_params = params - sum(o * k for projections in layers for o, k in projections)
    quantized = sum(quantized_projection_bytes(o, k, quantization, group_size) for ps in layers for o, k in ps)
    if quantization in HEAD_LAYOUTS:
        vocab = math.ceil(shape.vocab_size / tp)
        quantized += quantized_projection_bytes(vocab, shape.hidden_size, HEAD_LAYOUTS[quantization], group_size)
        if not shape.tie_word_embeddings:
            num_float_params -= vocab * shape.hidden_size
    return math.ceil(num_float_params * weight_dtype_bytes) + quantized


KV_DISK_HEADER_BYTES = 52  # a disk-tier block file's header (worker/kv_disk.py): magic, fingerprint, key, length, CRC


def kv_disk_blocks(disk_bytes: int, block_size: int, kv_bytes_per_token: int) -> int:
    """Full KV blocks the prefix cache's disk tier holds in `disk_bytes` (one file a block: header + the block)."""
    return disk_bytes // (KV_DISK_HEADER_BYTES + block_size * kv_bytes_per_token)


def max_num_kv_blocks(budget_bytes: int, block_size: int, kv_bytes_per_token: int) -> int:
    """Whole KV blocks of ``block_size`` tokens that fit in ``budget_bytes``."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"budget_bytes must be a non-negative integer, got {budget_bytes!r}")
    _positive("block_size", block_size)
    _positive("kv_bytes_per_token", kv_bytes_per_token)
    return budget_bytes // (block_size * kv_bytes_per_token)


KV_COMMIT_CHUNK_BYTES = 64 * 2**20
"""The engine commits its KV pool in chunks of this many bytes (over all layers), as blocks are first used."""


def kv_committed_bytes(num_blocks_used: int, num_blocks: int, block_bytes: int) -> int:
    """Bytes of a pool of ``num_blocks`` blocks (``block_bytes`` each, all layers) committed once
    ``num_blocks_used`` distinct blocks have been used: whole chunks of KV_COMMIT_CHUNK_BYTES, at most the pool.
    The pool hands never-used blocks out in id order, so these are blocks [0, n), rounded up to a chunk."""
    per_chunk = max(1, KV_COMMIT_CHUNK_BYTES // max(1, block_bytes))
    return min(num_blocks, -(-num_blocks_used // per_chunk) * per_chunk) * block_bytes


def blocks_per_request(seq_len: int, block_size: int) -> int:
    """Blocks one request of ``seq_len`` tokens occupies: ceil(seq_len / block_size)."""
    _positive("seq_len", seq_len)
    _positive("block_size", block_size)
    return -(-seq_len // block_size)


def kv_blocks_held(seq_len: int, block_size: int, sliding_window: int | None = None, num_new_tokens: int = 1) -> int:
    """Blocks a request of ``seq_len`` tokens holds at most while a step computes ``num_new_tokens`` of them
    (1: decoding). Without a freeing window: all of its blocks. When the engine frees KV blocks outside a
    sliding window W (every layer slides; core/kv_cache_manager.py), a step after c computed tokens holds the
    blocks from the one with position c - W + 1 to the one with position c + n - 1: at most
    ceil((W + block_size - 2 + n) / block_size), i.e. the window plus one block of slack when decoding."""
    full = blocks_per_request(seq_len, block_size)
    if sliding_window is None:
        return full
    _positive("sliding_window", sliding_window)
    _positive("num_new_tokens", num_new_tokens)
    return min(full, -(-(sliding_window + block_size - 2 + num_new_tokens) // block_size))


def max_concurrent_requests(
    kv_budget_bytes: int, seq_len: int, kv_bytes_per_token: int, block_size: int = 16, sliding_window: int | None = None
) -> int:
    """Requests of ``seq_len`` tokens whose KV fits in the budget at once. Each request holds
    whole blocks, so it costs ceil(seq_len / block_size) * block_size tokens of KV (with a freeing
    sliding window, only the blocks of kv_blocks_held)."""
    blocks = max_num_kv_blocks(kv_budget_bytes, block_size, kv_bytes_per_token)
    return blocks // kv_blocks_held(seq_len, block_size, sliding_window)


def linear_state_bytes_per_sequence(shape: ModelShape | Any, state_dtype_bytes: float = 4) -> int:
    """The recurrent state one sequence holds in a hybrid model: linear layers x (conv window + v_heads x k_dim x
    v_dim) at the state dtype (float32 by default); 0 for a model without linear-attention layers. `shape`: a
    ModelShape or the engine's ModelConfig (both carry linear and num_linear_layers). The engine's state tensors
    (worker/state_cache.py) hold exactly this per slot."""
    if shape.linear is None or not shape.num_linear_layers:
        return 0
    return math.ceil(shape.num_linear_layers * shape.linear.state_elements * _positive_bytes(state_dtype_bytes))


def hybrid_pool_split(
    budget_bytes: int, block_size: int, kv_bytes_per_token: int, state_bytes_per_sequence: int, max_num_seqs: int
) -> tuple[int, int]:
    """(KV blocks, state slots) a hybrid model's pool takes from one budget: a slot per sequence up to max_num_seqs,
    as many as leave each at least one KV block, then every byte left as KV blocks. The engine sizes its pools with
    this; `lmserve memory` reports it."""
    _positive("max_num_seqs", max_num_seqs)
    _positive("state_bytes_per_sequence", state_bytes_per_sequence)
    block_bytes = block_size * kv_bytes_per_token
    max_num_kv_blocks(budget_bytes, block_size, kv_bytes_per_token)  # validates the arguments
    num_slots = min(max_num_seqs, budget_bytes // (state_bytes_per_sequence + block_bytes))
    num_blocks = (budget_bytes - num_slots * state_bytes_per_sequence) // block_bytes
    return num_blocks, num_slots


DEFAULT_STATE_SNAPSHOT_SHARE = 8  # a hybrid's prefix-cache snapshots take 1/8 of the budget unless sized


def state_snapshot_split(budget_bytes: int, state_bytes_per_sequence: int, snapshot_bytes: int | None = None
                         ) -> tuple[int, int]:  # fmt: skip
    """(state snapshots, bytes left for hybrid_pool_split): a hybrid's prefix cache keeps its state at cached block
    boundaries, each snapshot state_bytes_per_sequence; snapshot_bytes of the budget (None: 1/8 of it) go to them."""
    _positive("state_bytes_per_sequence", state_bytes_per_sequence)
    if snapshot_bytes is None:
        snapshot_bytes = budget_bytes // DEFAULT_STATE_SNAPSHOT_SHARE
    num = min(snapshot_bytes, budget_bytes) // state_bytes_per_sequence
    return num, budget_bytes - num * state_bytes_per_sequence


def max_concurrent_sequences(
    budget_bytes: int, seq_len: int, kv_bytes_per_token: int, state_bytes_per_sequence: int, block_size: int = 16
) -> int:
    """Sequences of seq_len tokens a budget holds at once when each costs its KV blocks (full-attention layers) and
    its state: budget // (ceil(seq_len / block_size) x block_size x KV bytes per token + state bytes)."""
    _positive("kv_bytes_per_token", kv_bytes_per_token)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"budget_bytes must be a non-negative integer, got {budget_bytes!r}")
    per_sequence = blocks_per_request(seq_len, block_size) * block_size * kv_bytes_per_token
    return budget_bytes // (per_sequence + state_bytes_per_sequence)


def lora_slot_bytes(
    num_layers: int, hidden_size: int, q_size: int, kv_size: int, intermediate_size: int, max_loras: int,
    max_lora_rank: int, dtype_bytes: float,
) -> int:  # fmt: skip
    """The LoRA compute slots' stacked weights (lora/layers.LoRALinear): per layer and slot, A holds num_parts ·
    max_rank rows of each projection's input and B (block-diagonal) num_parts · max_rank columns of its output
    (q/k/v: 3 parts of the hidden input, o: 1 of q_size, gate/up: 2 of the hidden, down: 1 of the intermediate)."""
    r = max_lora_rank
    per_layer = (
        3 * r * hidden_size + (q_size + 2 * kv_size) * 3 * r  # qkv_proj
        + r * q_size + hidden_size * r  # o_proj
        + 2 * r * hidden_size + 2 * intermediate_size * 2 * r  # gate_up_proj
        + r * intermediate_size + hidden_size * r  # down_proj
    )  # fmt: skip
    return int(num_layers * max_loras * per_layer * dtype_bytes)
