"""The mixture-of-experts feed-forward block: `SparseMoE(hidden_size, MoEShape)` maps (T, hidden) → (T, hidden).

`route(logits, RouterSpec)` is every family's router (variants as data: model/registry/moe.py); experts are
`Expert`s of lmserve Linears or Mxfp4Linears, the router and shared-expert gate stay float32 nn.Linears.
MoEFeedForward is the decoder's "moe" feed-forward kind. See docs/moe.md.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from lmserve import kernels
from lmserve.checkpoint.registry.family import LayerSpec
from lmserve.checkpoint.registry.moe import MoEShape, RouterSpec
from lmserve.config.engine import ModelConfig
from lmserve.model.layers.linear import Linear
from lmserve.model.layers.mlp import SwiGLU
from lmserve.model.mxfp4 import Mxfp4Linear, check_mxfp4

ROUTER_KERNEL_MAX_ROWS = 64  # rows SparseMoE routes in C: the decode stack's most (decode_stack.W4A8_STACK_MAX_ROWS)


def route(logits: torch.Tensor, spec: RouterSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) router logits → (weights (T, k) float32, expert ids (T, k) int64), in float32 as HF computes them;
    ties go as torch.topk breaks them (HF's own call)."""
    logits = logits.float()
    if spec.scoring == "topk_softmax":  # gpt-oss: the k largest logits, softmax over those
        top, ids = torch.topk(logits, spec.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(T, k) expert ids → (token of each routed row, its flat (token, slot) index, rows per expert): the T·k
    routed rows sorted by expert (stable: token order within an expert), so each expert runs once on its rows."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order // ids.shape[1], order, counts


class Expert(nn.Module):
    """One routed expert: down(act(gate_up(x))) with gate rows first in gate_up_proj. act "silu": SwiGLU;
    "swiglu_clamped" (gpt-oss): gate ≤ limit, |up| ≤ limit, (up + 1) · gate · sigmoid(alpha · gate)."""

    def __init__(self, hidden_size: int, intermediate_size: int, shape: MoEShape, mxfp4: bool = False) -> None:
        super().__init__()
        make = Mxfp4Linear if mxfp4 else Linear
        self.intermediate_size = intermediate_size
        self.gate_up_proj = make(hidden_size, 2 * intermediate_size, bias=shape.expert_bias)
        self.down_proj = make(intermediate_size, hidden_size, bias=shape.expert_bias)
        self.act, self.alpha, self.limit = shape.activation, shape.swiglu_alpha, shape.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act == "silu" and kernels.usable(gate_up):
            return self.down_proj(kernels.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        if self.act == "silu":
            return self.down_proj(nn.functional.silu(gate) * up)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


class SparseMoE(nn.Module):
    """Router → the top-k experts of each token, run grouped by expert (one pass over each chosen expert's
    weights: a decode step reads only the chosen experts), weighted by the router and summed into each token's
    row; plus, when the shape has one, the shared expert scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE).
    `expert_counts` holds the last torch-path forward's rows per expert (a list of num_experts ints), `tokens_total`
    the rows of every call, the C decode stack's and prefill_block's included (the expert load /metrics shows)."""

    def __init__(self, hidden_size: int, shape: MoEShape, mxfp4: bool = False) -> None:
        super().__init__()
        self.shape, self.spec, self.hidden_size = shape, shape.router, hidden_size
        self.router = nn.Linear(hidden_size, self.spec.num_experts, bias=self.spec.bias)
        inter = shape.expert_intermediate_size
        self.experts = nn.ModuleList(Expert(hidden_size, inter, shape, mxfp4) for _ in range(self.spec.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if shape.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(hidden_size, shape.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.expert_counts: list[int] = [0] * self.spec.num_experts
        self._tokens_total: list[int] = [0] * self.spec.num_experts
        # rows per expert the C decode stack routed (its MoE block adds to them in place; not a parameter)
        self.stack_tokens = torch.zeros(self.spec.num_experts, dtype=torch.int64, device="cpu")  # (not meta)
        # tensor parallelism (model/parallel.py): this rank's slice of every expert's width is what load_tensor keeps
        self.tp_rank, self.tp_size = 0, 1
        # the decode stack's C description of this block (model/decode_stack.MoEDesc) while one is built: a prefill
        # of more than ROUTER_KERNEL_MAX_ROWS rows runs through it in runs of its rows (no Python per expert)
        self.prefill_block: Any = None

    def kernel_rows(self, x: torch.Tensor) -> bool:
        """Whether x's rows route through the C router (kernels.moe_route, the decode stack's MoE block's) and the
        shared gate through the C sigmoid: few float32 CPU rows (a decode), float32 CPU router weights."""
        w = self.router.weight
        return (
            0 < x.shape[0] <= ROUTER_KERNEL_MAX_ROWS and kernels.usable(x) and w.dtype == torch.float32
            and w.device.type == "cpu" and self.spec.top_k <= kernels.MOE_MAX_TOP_K
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dim() == 2 and x.shape[1] == self.hidden_size, f"MoE input {tuple(x.shape)}"
        block = self.prefill_block
        if block is not None and x.shape[0] > ROUTER_KERNEL_MAX_ROWS and kernels.usable(x):
            # (each row as the C block computes it alone: the router in C, as for the module path's few rows)
            return torch.cat([block.run(x[i : i + block.rows]) for i in range(0, x.shape[0], block.rows)])
        few = self.kernel_rows(x)
        if few:  # (C: the experts picked as torch.topk picks them, the weights within float32 rounding of route's)
            logits = kernels.linear(x, self.router.weight, self.router.bias)
            weights, ids = kernels.moe_route(logits, self.spec.top_k, self.spec.scoring, self.spec.renormalize)
        else:
            weights, ids = route(self.router(x), self.spec)
        # each token's experts in ascending id: its k outputs are then summed in the order HF's index_add_ adds them
        ids, perm = ids.sort(dim=1)
        weights = weights.gather(1, perm)
        tokens, flat, counts = group_by_expert(ids, self.spec.num_experts)
        w = weights.reshape(-1)[flat].to(x.dtype).unsqueeze(1)
        if x.shape[0] == 1:  # one token (a single stream's decode): no gather or scatter
            out, start = None, 0
            for e, n in enumerate(counts):
                if n:
                    y = self.experts[e](x) * w[start : start + 1]
                    out, start = (y if out is None else out + y), start + 1
        else:  # the k outputs of each token land in its (token, slot) row, one scatter for the whole block
            ys = x.new_empty(flat.numel(), x.shape[1])
            start = 0
            for e, n in enumerate(counts):
                if n:
                    ys[start : start + n] = self.experts[e](x[tokens[start : start + n]]) * w[start : start + n]
                    start += n
            slots = torch.empty_like(ys)
            slots[flat] = ys
            slots = slots.view(x.shape[0], -1, x.shape[1])
            out = slots[:, 0]
            for j in range(1, slots.shape[1]):
                out = out + slots[:, j]
        self.expert_counts = counts
        self._tokens_total = [a + b for a, b in zip(self._tokens_total, counts, strict=True)]
        if self.shared_expert is not None:
            g = self.shared_expert_gate
            gate = kernels.sigmoid(kernels.linear(x, g.weight)) if few else torch.sigmoid(g(x))
            out = out + gate * self.shared_expert(x)
        return out

    @property
    def tokens_total(self) -> list[int]:
        return [a + b for a, b in zip(self._tokens_total, self.stack_tokens.tolist(), strict=True)]

    # ---- weights from HF checkpoints' layouts ----------------------------------------------------------------

    def set_router(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        _copy("router.weight", self.router.weight, weight)
        if self.spec.bias:
            if bias is None:
                raise ValueError("router.bias: missing (the config's router has a bias)")
            _copy("router.bias", self.router.bias, bias)

    def set_expert(
        self,
        e: int,
        gate: torch.Tensor,
        up: torch.Tensor,
        down: torch.Tensor,
        gate_bias: torch.Tensor | None = None,
        up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
    ) -> None:
        """Expert e from separate (I, H) gate, (I, H) up and (H, I) down weights (Qwen / Mixtral / OLMoE per-expert
        tensors: w1 = gate, w3 = up, w2 = down), with biases when the shape has them."""
        if not 0 <= e < self.spec.num_experts:
            raise ValueError(f"expert {e}: the config has {self.spec.num_experts} experts (num_experts)")
        ex = self.experts[e]
        assert isinstance(ex.gate_up_proj, Linear), "set_expert: float experts (MXFP4 ones: set_mxfp4_experts)"
        inter = ex.intermediate_size
        _copy(f"experts.{e}.gate_proj", ex.gate_up_proj.weight[:inter], gate)
        _copy(f"experts.{e}.up_proj", ex.gate_up_proj.weight[inter:], up)
        _copy(f"experts.{e}.down_proj", ex.down_proj.weight, down)
        if self.shape.expert_bias:
            _copy(f"experts.{e}.gate_proj.bias", ex.gate_up_proj.bias[:inter], gate_bias)
            _copy(f"experts.{e}.up_proj.bias", ex.gate_up_proj.bias[inter:], up_bias)
            _copy(f"experts.{e}.down_proj.bias", ex.down_proj.bias, down_bias)

    def set_fused_experts(
        self,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        layout: str = "gpt_oss",
    ) -> None:
        """All experts from 3-D tensors. layout "gpt_oss": gate_up (E, H, 2I) input-major with gate / up
        interleaved (columns 0::2 / 1::2), down (E, I, H), biases (E, 2I) / (E, H); "hf": transformers' own
        (E, 2I, H) gate rows then up rows, down (E, H, I) (no biases)."""
        if layout == "gpt_oss":
            for name, t in (("gate_up_proj", gate_up), ("down_proj", down), ("gate_up_proj_bias", gate_up_bias),
                            ("down_proj_bias", down_bias)):  # fmt: skip
                if t is not None:
                    self.load_tensor(f"experts.{name}", t)
            return
        e_n, inter = self.spec.num_experts, self.shape.expert_intermediate_size
        if gate_up.dim() != 3 or gate_up.shape[0] != e_n:
            raise ValueError(f"experts.gate_up_proj: shape {tuple(gate_up.shape)}, the config has {e_n} experts")
        for e in range(e_n):
            self.set_expert(e, gate_up[e, :inter], gate_up[e, inter:], down[e])

    def set_mxfp4_experts(
        self,
        gate_up_blocks: torch.Tensor,
        gate_up_scales: torch.Tensor,
        down_blocks: torch.Tensor,
        down_scales: torch.Tensor,
        gate_up_bias: torch.Tensor,
        down_bias: torch.Tensor,
    ) -> None:
        """All experts from gpt-oss's MXFP4 tensors, kept in 4 bits: gate_up_proj_blocks (E, 2I, H/32, 16) with
        gate / up rows interleaved (reordered here, bytes unchanged), _scales (E, 2I, H/32); down_proj_blocks
        (E, H, I/32, 16), _scales (E, H, I/32); biases (E, 2I) interleaved and (E, H)."""
        for name, t in (("gate_up_proj_blocks", gate_up_blocks), ("gate_up_proj_scales", gate_up_scales),
                        ("down_proj_blocks", down_blocks), ("down_proj_scales", down_scales),
                        ("gate_up_proj_bias", gate_up_bias), ("down_proj_bias", down_bias)):  # fmt: skip
            self.load_tensor(f"experts.{name}", t)

    def load_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """One checkpoint tensor, named relative to the layer's MoE module (`model.layers.N.mlp.` or Mixtral's
        `.block_sparse_moe.` stripped), copied where it belongs as it arrives (expert by expert): per-expert
        `experts.E.{gate,up,down}_proj.weight` (Qwen / OLMoE) or `experts.E.{w1,w3,w2}.weight` (Mixtral); gpt-oss's
        fused `experts.{gate_up,down}_proj[_bias]` (3-D) or `_blocks` + `_scales` (MXFP4, applied once both came);
        the router `gate.weight` / `router.{weight,bias}`; `shared_expert.*`, `shared_expert_gate.weight`. An
        unknown name or a tensor that does not match the config: ValueError naming it. check_loaded() then says
        what is missing."""
        loaded = self.__dict__.setdefault("_loaded", set())
        m = re.fullmatch(
            r"(experts\.\d+|shared_expert)\.(gate_proj|up_proj|down_proj)\.(qweight|scales|mins|blocks)", name
        )
        if m:  # a GGUF file's quantized expert (or shared expert) projection, kept in its layout's buffers
            self._quantized_part(m.group(1), m.group(2), m.group(3), tensor, name)
            if m.group(3) in ("qweight", "blocks"):
                loaded.add(f"{m.group(1)}.{m.group(2)}.weight")
            return
        m = re.fullmatch(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.(weight|bias)", name)
        if m:
            e, proj, kind = int(m.group(1)), _PER_EXPERT[m.group(2)], m.group(3)
            if not 0 <= e < self.spec.num_experts:
                raise ValueError(f"{name}: expert {e}, the config has {self.spec.num_experts} (num_experts)")
            self._expert_part(e, proj, kind, tensor, name)
            loaded.add(name if m.group(2)[0] != "w" else f"experts.{e}.{proj}.{kind}")
            return
        m = re.fullmatch(r"experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?", name)
        if m and m.group(2) in ("_blocks", "_scales"):
            self._mxfp4_part(m.group(1), m.group(2), tensor)
        elif m:
            self._fused_part(m.group(1), m.group(2) or "", tensor, name)
        elif name in ("gate.weight", "router.weight", "router.bias"):
            dst = self.router.bias if name.endswith("bias") else self.router.weight
            if dst is None:
                raise ValueError(f"{name}: the config's router has no bias")
            _copy(name, dst, tensor)
            name = "router." + name.split(".")[1]
        elif name.startswith("shared_expert") and self.shared_expert is not None:
            m = re.fullmatch(r"shared_expert\.(gate_proj|up_proj|down_proj)\.weight|shared_expert_gate\.weight", name)
            if not m:
                raise ValueError(f"{name}: not a tensor of the shared expert")
            s = self.shape.shared_expert_intermediate_size
            if m.group(1) is None:  # the gate ((H,) in a GGUF file: llama.cpp's {n_embd} for the (1, H) weight)
                _copy(name, self.shared_expert_gate.weight, tensor.unsqueeze(0) if tensor.dim() == 1 else tensor)
            else:
                target = self.shared_expert.down_proj if m.group(1) == "down_proj" else self.shared_expert.gate_up_proj
                if target.weight is None:
                    raise ValueError(f"{name}: a float weight where the shared expert holds quantized blocks")
                w = target.weight
                dst = w if m.group(1) == "down_proj" else w[:s] if m.group(1) == "gate_proj" else w[s:]
                _copy(name, dst, self._tp_slice(m.group(1), "weight", tensor, s))
        else:
            raise ValueError(f"{name}: not a tensor of this MoE block ({self.spec.num_experts} experts)")
        loaded.add(name)

    def expected_tensors(self) -> set[str]:
        """The names load_tensor must have seen (Qwen / OLMoE spelling for per-expert ones) for a whole block: gpt-oss's
        fused tensors, unless the experts came one by one (a GGUF file's, with their biases)."""
        names = {"router.weight"} | ({"router.bias"} if self.spec.bias else set())
        mxfp4 = isinstance(self.experts[0].gate_up_proj, Mxfp4Linear)
        per_expert = any(re.match(r"experts\.\d", n) for n in self.__dict__.get("_loaded", ()))
        if (self.shape.expert_bias or mxfp4) and not per_expert:  # gpt-oss: fused tensors
            suffixes = ("_blocks", "_scales", "_bias") if mxfp4 else ("", "_bias")
            names |= {f"experts.{p}{x}" for p in ("gate_up_proj", "down_proj") for x in suffixes}
        else:
            kinds = ("weight", "bias") if self.shape.expert_bias else ("weight",)
            names |= {f"experts.{e}.{p}.{k}" for e in range(self.spec.num_experts) for p in _PER_EXPERT.values()
                      for k in kinds}  # fmt: skip
        if self.shared_expert is not None:
            names |= {f"shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
            names.add("shared_expert_gate.weight")
        return names

    def check_loaded(self, prefix: str = "") -> None:
        """ValueError naming the first tensors the checkpoint did not hold for this block."""
        missing = sorted(self.expected_tensors() - self.__dict__.get("_loaded", set()))
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise ValueError(f"checkpoint is missing {', '.join(prefix + n for n in missing[:3])}{more}")

    def _expert_part(self, e: int, proj: str, kind: str, tensor: torch.Tensor, name: str) -> None:
        ex, inter = self.experts[e], self.shape.expert_intermediate_size
        target = ex.down_proj if proj == "down_proj" else ex.gate_up_proj
        dst = target.weight if kind == "weight" else target.bias
        if dst is None:
            raise ValueError(f"{name}: the config's experts have no {kind} here")
        if proj != "down_proj":
            dst = dst[:inter] if proj == "gate_proj" else dst[inter:]
        _copy(name, dst, self._tp_slice(proj, kind, tensor, inter))

    def _quantized_part(self, owner: str, proj: str, buf: str, tensor: torch.Tensor, name: str) -> None:
        """One buffer of a GGUF-kept projection (block-32 `qweight` / `scales` / `mins`, K-quant `qweight` rows of
        super-blocks, MXFP4 `blocks` / `scales`) into its rows of the expert's (or shared expert's) fused module."""
        if self.tp_size > 1:
            raise ValueError(f"{name}: quantized experts from a GGUF file under tensor parallelism are not supported")
        module = self.shared_expert if owner == "shared_expert" else self.experts[int(owner.split(".")[1])]
        if module is None:
            raise ValueError(f"{name}: the config has no shared expert (shared_expert_intermediate_size)")
        target = module.down_proj if proj == "down_proj" else module.gate_up_proj
        inter = module.intermediate_size
        start, rows = (0, target.out_features) if proj == "down_proj" else (0 if proj == "gate_proj" else inter, inter)
        if getattr(target, "quant_method", None) == "kquant" and buf == "qweight":
            dst = target.kquant_rows(start, rows)
        else:
            dst = getattr(target, buf, None)
            if dst is None:
                raise ValueError(f"{name}: the expert's {proj} holds no {buf} (a type other than its siblings'?)")
            dst = dst[start : start + rows]
        if tensor.dtype != dst.dtype:
            raise ValueError(f"{name}: dtype {tensor.dtype} where the layout holds {dst.dtype}")
        _copy(name, dst, tensor)

    def _tp_slice(self, proj: str, kind: str, tensor: torch.Tensor, width: int) -> torch.Tensor:
        """This rank's part of a full expert tensor: `width` gate / up rows, down columns; the down bias on rank 0
        (the block's all-reduce adds it once)."""
        if self.tp_size == 1:
            return tensor
        if proj != "down_proj":
            return tensor.narrow(0, self.tp_rank * width, width)
        if kind == "bias":
            return tensor if self.tp_rank == 0 else torch.zeros_like(tensor)
        return tensor.narrow(1, self.tp_rank * width, width)

    def _fused_part(self, proj: str, suffix: str, tensor: torch.Tensor, name: str) -> None:
        """gpt-oss's float 3-D tensors: gate_up (E, H, 2I) with gate / up interleaved, down (E, I, H), biases."""
        e_n = self.spec.num_experts
        if tensor.dim() < 2 or tensor.shape[0] != e_n:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the config has {e_n} experts (num_experts)")
        if suffix == "_bias" and not self.shape.expert_bias:
            raise ValueError(f"{name}: the config's experts have no bias")
        for e in range(e_n):
            t = tensor[e] if suffix else tensor[e].t()  # (out, in) for weights
            if proj == "down_proj":
                self._expert_part(e, "down_proj", "bias" if suffix else "weight", t, f"{name}[{e}]")
            else:
                kind = "bias" if suffix else "weight"
                self._expert_part(e, "gate_proj", kind, t[0::2], f"{name}[{e}] (gate: even rows)")
                self._expert_part(e, "up_proj", kind, t[1::2], f"{name}[{e}] (up: odd rows)")

    def _mxfp4_part(self, proj: str, suffix: str, tensor: torch.Tensor) -> None:
        if not isinstance(self.experts[0].gate_up_proj, Mxfp4Linear):
            raise ValueError(f"experts.{proj}{suffix}: MXFP4 tensors, but the config has no mxfp4 quantization_config")
        pending = self.__dict__.setdefault("_mxfp4_pending", {})
        pending[(proj, suffix)] = tensor
        blocks, scales = pending.get((proj, "_blocks")), pending.get((proj, "_scales"))
        if blocks is None or scales is None:
            return
        e_n, inter = self.spec.num_experts, self.shape.expert_intermediate_size
        if blocks.dim() != 4 or blocks.shape[0] != e_n or scales.shape[0] != e_n:
            raise ValueError(f"experts.{proj}_blocks: shape {tuple(blocks.shape)}, the config has {e_n} experts")
        perm = torch.cat((torch.arange(0, 2 * inter, 2), torch.arange(1, 2 * inter, 2)))
        for e in range(e_n):
            target = getattr(self.experts[e], proj)
            check_mxfp4(f"experts.{e}.{proj}", blocks[e], scales[e], target.out_features, target.in_features)
            b, s = (blocks[e][perm], scales[e][perm]) if proj == "gate_up_proj" else (blocks[e], scales[e])
            target.set_mxfp4(b, s)
        del pending[(proj, "_blocks")], pending[(proj, "_scales")]

    def mxfp4_to_int8w(self) -> int:
        """Every MXFP4 expert projection becomes the same weights as an int8w Linear (8-bit codes, float16 scales
        per 32: the C int8w kernels; twice MXFP4's bytes); returns how many (one left as it is: a scale float16
        cannot hold)."""
        n = 0
        for ex in self.experts:
            for name in ("gate_up_proj", "down_proj"):
                old = getattr(ex, name)
                new = old.to_int8w() if isinstance(old, Mxfp4Linear) else None
                if new is not None:
                    setattr(ex, name, new)
                    n += 1
        return n

    def set_shared_expert(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, gate_w: torch.Tensor) -> None:
        """Qwen2-MoE's shared expert (gate / up (S, H), down (H, S)) and its (1, H) sigmoid gate."""
        if self.shared_expert is None:
            raise ValueError("shared_expert: the config has no shared expert (shared_expert_intermediate_size)")
        s = self.shape.shared_expert_intermediate_size
        _copy("shared_expert.gate_proj", self.shared_expert.gate_up_proj.weight[:s], gate)
        _copy("shared_expert.up_proj", self.shared_expert.gate_up_proj.weight[s:], up)
        _copy("shared_expert.down_proj", self.shared_expert.down_proj.weight, down)
        _copy("shared_expert_gate", self.shared_expert_gate.weight, gate_w)


class MoEFeedForward(SparseMoE):
    """The "moe" feed-forward block of a decoder layer (LayerSpec.feed_forward): SparseMoE over the config's
    MoEShape (ModelConfig.moe). `plain`: the C decode stack can run it (SwiGLU experts on lmserve Linears)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, layer_idx: int) -> None:
        assert cfg.moe is not None, f"layer {layer_idx}: a MoE feed-forward in a config without experts"
        super().__init__(cfg.hidden_size, cfg.moe, mxfp4=cfg.moe.mxfp4)
        # (DecodeStack.supports checks each expert's kernel path when it describes the model)
        self.plain = cfg.moe.activation == "silu" and not cfg.moe.mxfp4 and self.spec.top_k <= kernels.MOE_MAX_TOP_K


_PER_EXPERT = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj", "w1": "gate_proj",
               "w3": "up_proj", "w2": "down_proj"}  # fmt: skip


def _copy(name: str, dst: torch.Tensor, src: torch.Tensor | None) -> None:
    """dst ← src, or ValueError naming the tensor when it is missing or its shape does not match the config."""
    if src is None:
        raise ValueError(f"{name}: missing")
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"{name}: shape {tuple(src.shape)}, the config gives {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)
