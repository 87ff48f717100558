"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention): the causal depthwise conv1d with its rolling window, the
chunked gated delta rule for prompt chunks and the recurrent form for decode tokens, each reading and writing a
request's state slot, and the token mixer that runs them over a step's flat batch (decodes first, then chunks).

State per request and layer: conv (conv_dim, kernel - 1), the last inputs of the window; ssm (v_heads, k_dim, v_dim).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from lmserve.kernels import gated_deltanet as gdn_kernels

CHUNK_SIZE = 64  # positions per block of the chunked delta rule (HF's and FLA's default)


@dataclass(frozen=True)
class LinearAttentionDims:
    """The sizes of one Gated DeltaNet layer, from the config's linear_* fields."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    rms_norm_eps: float = 1e-6

    @property
    def key_size(self) -> int:
        return self.num_k_heads * self.k_dim

    @property
    def value_size(self) -> int:
        return self.num_v_heads * self.v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_size + self.value_size

    @staticmethod
    def from_hf(cfg: dict) -> LinearAttentionDims:
        return LinearAttentionDims(
            hidden_size=int(cfg["hidden_size"]),
            num_k_heads=int(cfg["linear_num_key_heads"]),
            num_v_heads=int(cfg["linear_num_value_heads"]),
            k_dim=int(cfg["linear_key_head_dim"]),
            v_dim=int(cfg["linear_value_head_dim"]),
            conv_kernel=int(cfg["linear_conv_kernel_dim"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        )


@dataclass
class LinearAttentionMetadata:
    """Where each sequence of a step keeps its state: decode rows first (one token each), then prefill chunks."""

    decode_slots: torch.Tensor | None = None  # (num_decodes,) long
    num_decode_tokens: int = 0
    # (start, end, slot, fresh): a chunk's flat rows, its state slot, and whether it starts at position 0
    prefills: list[tuple[int, int, int, bool]] = field(default_factory=list)
    # slots of decode rows at position 0 (a one-token prompt): zeroed before the step reads them
    fresh_decode_slots: torch.Tensor | None = None
    # prefix caching: chunk index -> (its rows before a block boundary, snapshot slot): the state there is saved
    saves: dict[int, tuple[int, int]] = field(default_factory=dict)
    # prefix caching: (decode row, snapshot slot) of decode tokens that complete a block: the state after them
    decode_saves: list[tuple[int, int]] = field(default_factory=list)


def step_metadata(
    decodes: list, prefills: list, first_row: dict[str, int], device: torch.device
) -> LinearAttentionMetadata:
    """The step's state slots from its ScheduledRequests (decode rows first, then chunks at their first rows): a
    chunk starting at position 0 starts from a zero state (a new request, or one preempted and recomputed)."""
    slots = [s.request.state_slot for s in decodes]
    assert all(slot >= 0 for slot in slots), "a decode row of a request holding no state slot"
    fresh = [s.request.state_slot for s in decodes if s.start == 0]
    decode_saves = [(row, s.state_save.slot) for row, s in enumerate(decodes) if s.state_save is not None]
    chunks, saves = [], {}
    for s in prefills:
        row = first_row[s.request.request_id]
        assert s.request.state_slot >= 0, f"request {s.request.request_id} holds no state slot"
        save = s.state_save  # prefix caching: a StateSave (core/state_snapshots.py) at a block boundary
        if save is not None:
            assert s.start < save.position <= s.start + s.num_new_tokens, f"save at {save.position} outside the chunk"
            saves[len(chunks)] = (save.position - s.start, save.slot)
        chunks.append((row, row + s.num_new_tokens, s.request.state_slot, s.start == 0))
    decode_slots = torch.tensor(slots, dtype=torch.long, device=device) if slots else None
    fresh_slots = torch.tensor(fresh, dtype=torch.long, device=device) if fresh else None
    return LinearAttentionMetadata(decode_slots, len(slots), chunks, fresh_slots, saves, decode_saves)


# ---- the convolution ----------------------------------------------------------------------------------------------


def conv1d_chunk(x: torch.Tensor, conv_state: torch.Tensor | None, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One sequence's chunk x (n, C) after the window conv_state (C, W - 1) (None: zeros, a fresh sequence);
    weight (C, W). Returns (silu(conv) (n, C), the new window (C, W - 1)): the chunk's last W - 1 inputs."""
    n, channels = x.shape
    width = weight.shape[-1]
    if conv_state is None:
        conv_state = x.new_zeros(channels, width - 1)
    full = torch.cat([conv_state.to(x.dtype), x.t()], dim=1)  # (C, W - 1 + n)
    out = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1).to(x.dtype), groups=channels)[0]  # (C, n)
    return F.silu(out).t(), full[:, -(width - 1) :]


def conv1d_decode(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One token per sequence: x (B, C), windows (B, C, W - 1), weight (C, W). Returns (silu(conv) (B, C),
    the new windows (B, C, W - 1))."""
    full = torch.cat([conv_states.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # (B, C, W)
    out = (full * weight.to(x.dtype)).sum(-1)
    return F.silu(out), full[:, :, 1:]


# ---- the delta rule -----------------------------------------------------------------------------------------------


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32, L2-normalised q (scaled by k_dim ** -0.5) and k, each key head repeated for its value heads."""
    groups = num_v_heads // q.shape[-2]
    q, k = l2norm(q.float()), l2norm(k.float())
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=-2), k.repeat_interleave(groups, dim=-2)
    return q * q.shape[-1] ** -0.5, k


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's chunk: q, k (n, Hk, K), v (n, Hv, V), g (log decay) and beta (n, Hv), state (Hv, K, V) or
    None (zeros). Returns (output (n, Hv, V) float32, the state after the chunk (Hv, K, V) float32).

    Within each block of chunk_size positions the delta updates are solved at once (the UT transform: a unit
    lower-triangular system), across blocks the state carries them, as in the DeltaNet paper."""
    n, num_heads, v_dim = v.shape
    q, k = _prepare(q, k, num_heads)
    v, g, beta = v.float(), g.float(), beta.float()
    pad = (-n) % chunk_size  # padded positions: g 0 and beta 0, so they change nothing
    # (H, blocks, C, .) layout
    q, k, v = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)).unflatten(1, (-1, chunk_size)) for t in (q, k, v))
    g, beta = (F.pad(t.t(), (0, pad)).unflatten(1, (-1, chunk_size)) for t in (g, beta))
    decay = g.cumsum(-1)  # (H, B, C): log of the decay from the block's start to each position
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    pair = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # i <- j
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * pair  # unit diagonal once the identity is added by the solver
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * decay.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * pair
    q_decayed = q * decay.exp().unsqueeze(-1)
    k_to_end = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    block_decay = decay[..., -1].exp()[..., None, None]  # (H, B, 1, 1)
    s = q.new_zeros(num_heads, q.shape[-1], v_dim) if state is None else state.float()
    out = torch.empty_like(v)
    for b in range(q.shape[1]):
        v_new = u[:, b] - w[:, b] @ s  # what the block writes, less what the state already predicts
        out[:, b] = q_decayed[:, b] @ s + attn[:, b] @ v_new
        s = s * block_decay[:, b] + k_to_end[:, b].transpose(-1, -2) @ v_new
    return out.flatten(1, 2)[:, :n].transpose(0, 1), s


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: q, k (B, Hk, K), v (B, Hv, V), g and beta (B, Hv), state (B, Hv, K, V). Returns
    (output (B, Hv, V) float32, the new states (B, Hv, K, V) float32)."""
    q, k = _prepare(q, k, v.shape[-2])
    s = state.float() * g.float().exp()[..., None, None]
    delta = (v.float() - torch.einsum("bhkv,bhk->bhv", s, k)) * beta.float().unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return torch.einsum("bhkv,bhk->bhv", s, q), s


# ---- the token mixer ----------------------------------------------------------------------------------------------


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head, then times silu(gate) (HF's Qwen3_5RMSNormGated: the weight as it is)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x.to(dtype) * F.silu(gate.float())).to(dtype)


class _Conv1dWeight(nn.Module):
    """Holds the depthwise kernel under HF's name (conv1d.weight, (conv_dim, 1, kernel))."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, width))


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer of a Qwen3.5 / Qwen3-Next layer, with HF's parameter names: Qwen3.5's
    in_proj_qkv / z / b / a, or (fused=True) Qwen3-Next's in_proj_qkvz / in_proj_ba, whose rows are interleaved per
    key head and put in Qwen3.5's order by one gather (qwen3_next_row_order)."""

    def __init__(self, dims: LinearAttentionDims, linear_cls: type[nn.Module] = nn.Linear, fused: bool = False) -> None:
        super().__init__()
        self.dims = d = dims
        self.fused = fused
        if fused:
            self.in_proj_qkvz = linear_cls(d.hidden_size, d.conv_dim + d.value_size, bias=False)
            self.in_proj_ba = linear_cls(d.hidden_size, 2 * d.num_v_heads, bias=False)
            self._row_orders: tuple[torch.Tensor, torch.Tensor] | None = None  # (built on the weights' device)
        else:
            self.in_proj_qkv = linear_cls(d.hidden_size, d.conv_dim, bias=False)
            self.in_proj_z = linear_cls(d.hidden_size, d.value_size, bias=False)
            self.in_proj_b = linear_cls(d.hidden_size, d.num_v_heads, bias=False)
            self.in_proj_a = linear_cls(d.hidden_size, d.num_v_heads, bias=False)
        self.conv1d = _Conv1dWeight(d.conv_dim, d.conv_kernel)
        self.dt_bias = nn.Parameter(torch.ones(d.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(d.num_v_heads))
        self.norm = GatedRMSNorm(d.v_dim, d.rms_norm_eps)
        self.out_proj = linear_cls(d.value_size, d.hidden_size, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qkv (T, conv_dim), z (T, value_size), b, a (T, v_heads)) in Qwen3.5's layout."""
        d = self.dims
        if self.fused:
            if self._row_orders is None or self._row_orders[0].device != x.device:  # (not buffers: the loader
                # builds the model on the meta device and would leave them uninitialised)
                self._row_orders = tuple(torch.tensor(o, device=x.device) for o in qwen3_next_row_order(d))
            qkvz_order, ba_order = self._row_orders
            qkvz = self.in_proj_qkvz(x).index_select(-1, qkvz_order)
            ba = self.in_proj_ba(x).index_select(-1, ba_order)
            qkv, z = qkvz.split([d.conv_dim, d.value_size], dim=-1)
            b, a = ba.split([d.num_v_heads, d.num_v_heads], dim=-1)
            return qkv, z, b, a
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def forward(
        self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, meta: LinearAttentionMetadata,
        snapshots: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """x (T, hidden), the step's rows; conv_state (slots, conv_dim, kernel - 1) and ssm_state (slots, Hv, K, V)
        are this layer's state tensors, read and written at each sequence's slot; snapshots: the prefix cache's
        tensors of the same shapes, written where meta.saves says. Returns (T, hidden)."""
        d = self.dims
        n = x.shape[0]
        mixed, z, b, a = self.project(x)  # mixed: (T, conv_dim), q k v before the conv
        weight = self.conv1d.weight[:, 0]
        nd = meta.num_decode_tokens
        # float32 CPU operands: the decode rows' gates, conv, delta rule and gated norm in one C call (the decode
        # stack's), the gated norm of the rest on torch
        in_c = nd > 0 and self.c_decode(x, conv_state, ssm_state)
        decoded = None
        if in_c:
            decoded = self._decode_c(mixed[:nd], z[:nd], b[:nd], a[:nd], conv_state, ssm_state, meta)
            self._save_decodes(conv_state, ssm_state, meta, snapshots)
            if nd == n:
                return self.out_proj(decoded)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        core = torch.empty(n, d.num_v_heads, d.v_dim, dtype=torch.float32, device=x.device)
        if nd and not in_c:
            slots = self._decode_slots(conv_state, ssm_state, meta)
            core[:nd] = self._decode(mixed[:nd], g[:nd], beta[:nd], weight, conv_state, ssm_state, slots)
            self._save_decodes(conv_state, ssm_state, meta, snapshots)
        for i, (start, end, slot, fresh) in enumerate(meta.prefills):
            save = meta.saves.get(i)
            # a snapshot at a block boundary inside the chunk: the chunk runs as two pieces, the state saved between
            for a, b in ((start, end),) if save is None else ((start, start + save[0]), (start + save[0], end)):
                if a < b:
                    conv_out, conv_state[slot] = conv1d_chunk(mixed[a:b], None if fresh else conv_state[slot], weight)
                    q, k, v = self._split(conv_out)
                    state = None if fresh else ssm_state[slot]
                    core[a:b], ssm_state[slot] = chunk_gated_delta_rule(q, k, v, g[a:b], beta[a:b], state)
                    fresh = False
                if save is not None and b == start + save[0]:
                    assert snapshots is not None, "a state save without snapshot tensors"
                    snapshots[0][save[1]], snapshots[1][save[1]] = conv_state[slot], ssm_state[slot]
        first = nd if decoded is not None else 0  # (the C call normed the decode rows already)
        normed = self.norm(core[first:].to(x.dtype), z[first:].reshape(n - first, d.num_v_heads, d.v_dim))
        normed = normed.reshape(n - first, d.value_size)
        return self.out_proj(normed if decoded is None else torch.cat([decoded, normed]))

    def c_decode(self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> bool:
        """Whether decode rows take gdn_decode_f32: float32 CPU activations, parameters and states (a bfloat16 state
        cache or 16-bit compute keep the torch path), the kernels loaded."""
        params = (self.A_log, self.dt_bias, self.conv1d.weight, self.norm.weight)
        states = conv_state.is_contiguous() and ssm_state.is_contiguous()
        return states and gdn_kernels.usable(x, conv_state, ssm_state, *params)

    @staticmethod
    def _decode_slots(conv_state: torch.Tensor, ssm_state: torch.Tensor, meta: LinearAttentionMetadata) -> torch.Tensor:
        """The decode rows' state slots, those of sequences at their first token zeroed (not the slot's old state)."""
        slots = meta.decode_slots
        assert slots is not None and slots.shape[0] == meta.num_decode_tokens, "decode rows without their state slots"
        if meta.fresh_decode_slots is not None:
            conv_state[meta.fresh_decode_slots] = 0.0
            ssm_state[meta.fresh_decode_slots] = 0.0
        return slots

    @staticmethod
    def _save_decodes(
        conv_state: torch.Tensor, ssm_state: torch.Tensor, meta: LinearAttentionMetadata,
        snapshots: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:  # fmt: skip
        """The state after each decode token that completes a block, into its snapshot (meta.decode_saves)."""
        for row, snapshot in meta.decode_saves:
            assert snapshots is not None and meta.decode_slots is not None, "a state save without snapshot tensors"
            slot = int(meta.decode_slots[row])
            snapshots[0][snapshot], snapshots[1][snapshot] = conv_state[slot], ssm_state[slot]

    def _decode_c(
        self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_state: torch.Tensor,
        ssm_state: torch.Tensor, meta: LinearAttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        """The decode rows through gdn_decode_f32: (nd, value_size), the gated norm's output."""
        d = self.dims
        slots = self._decode_slots(conv_state, ssm_state, meta)
        return gdn_kernels.decode(
            mixed, z, b, a, self.A_log, self.dt_bias, self.conv1d.weight[:, 0], self.norm.weight, self.norm.eps,
            conv_state, ssm_state, slots, d.num_k_heads, d.k_dim,
        )  # fmt: skip

    def _decode(
        self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor,
        conv_state: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """One token per sequence on torch (16-bit compute or a bfloat16 state; else _decode_c)."""
        conv_out, window = conv1d_decode(mixed, conv_state[slots], weight)
        conv_state[slots] = window.to(conv_state.dtype)  # (16-bit compute: the state stays float32)
        q, k, v = self._split(conv_out)
        out, state = recurrent_gated_delta_rule(q, k, v, g, beta, ssm_state[slots])
        ssm_state[slots] = state.to(ssm_state.dtype)  # (a bfloat16 state cache: rounded as it is stored)
        return out

    def _split(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.dims
        q, k, v = conv_out.split([d.key_size, d.key_size, d.value_size], dim=-1)
        n = conv_out.shape[0]
        return q.view(n, d.num_k_heads, d.k_dim), k.view(n, d.num_k_heads, d.k_dim), v.view(n, d.num_v_heads, d.v_dim)


def qwen3_next_row_order(dims: LinearAttentionDims) -> tuple[list[int], list[int]]:
    """Rows of Qwen3-Next's in_proj_qkvz (per key head: q, k, then its value heads' v and z) and in_proj_ba (per key
    head: its value heads' b, then a) in Qwen3.5's order (q, k, v, z / b, a): HF's fix_query_key_value_ordering."""
    d = dims
    r = d.num_v_heads // d.num_k_heads
    width = 2 * d.k_dim + 2 * r * d.v_dim
    parts: dict[str, list[int]] = {"q": [], "k": [], "v": [], "z": [], "b": [], "a": []}
    for h in range(d.num_k_heads):
        base = h * width
        for name, offset, size in (("q", 0, d.k_dim), ("k", d.k_dim, d.k_dim), ("v", 2 * d.k_dim, r * d.v_dim),
                                   ("z", 2 * d.k_dim + r * d.v_dim, r * d.v_dim)):  # fmt: skip
            parts[name] += range(base + offset, base + offset + size)
        parts["b"] += range(h * 2 * r, h * 2 * r + r)
        parts["a"] += range(h * 2 * r + r, h * 2 * r + 2 * r)
    return parts["q"] + parts["k"] + parts["v"] + parts["z"], parts["b"] + parts["a"]
