"""model/layers/moe.py against HF transformers' own MoE modules on random tiny weights: the router's variants (ties
included), the grouped expert execution of every family, the shared expert, gpt-oss's biases and clamped SwiGLU,
MXFP4 experts, and bad weights (ValueError naming the tensor)."""

from __future__ import annotations

import pytest
import torch

from lmserve.checkpoint.registry.moe import moe_shape_from_hf_config
from lmserve.model.layers.moe import SparseMoE, group_by_expert, route
from lmserve.model.mxfp4 import Mxfp4Linear

H, I_EXPERT, E, K = 64, 32, 8, 3


def _hf_config(family: str, layers: int = 2, **extra):
    from transformers import GptOssConfig, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(hidden_size=H, num_experts_per_tok=K, num_hidden_layers=layers, num_attention_heads=4, vocab_size=64)
    if family == "qwen3_moe":
        cfg = Qwen3MoeConfig(num_experts=E, moe_intermediate_size=I_EXPERT, norm_topk_prob=True, **common)
    elif family == "qwen2_moe":
        cfg = Qwen2MoeConfig(num_experts=E, moe_intermediate_size=I_EXPERT, shared_expert_intermediate_size=64,
                             **common)  # fmt: skip
    elif family == "mixtral":
        cfg = MixtralConfig(num_local_experts=E, intermediate_size=I_EXPERT, **common)
    elif family == "olmoe":
        cfg = OlmoeConfig(num_experts=E, intermediate_size=I_EXPERT, **common)
    else:
        cfg = GptOssConfig(num_local_experts=E, intermediate_size=I_EXPERT, num_key_value_heads=2, **common)
    for k, v in extra.items():
        setattr(cfg, k, v)
    return cfg


def _hf_block(family: str, cfg):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cls = {"qwen3_moe": Qwen3MoeSparseMoeBlock, "qwen2_moe": Qwen2MoeSparseMoeBlock, "mixtral": MixtralSparseMoeBlock,
           "olmoe": OlmoeSparseMoeBlock, "gpt_oss": GptOssMLP}[family]  # fmt: skip
    block = cls(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return block


def _ours(family: str, cfg, hf, mxfp4: bool = False) -> SparseMoE:
    d = cfg.to_dict()
    ours = SparseMoE(H, moe_shape_from_hf_config(d, d["num_hidden_layers"]), mxfp4=mxfp4)
    if family == "gpt_oss":
        ours.set_router(hf.router.weight, hf.router.bias)
        if not mxfp4:
            ex = hf.experts
            ours.set_fused_experts(ex.gate_up_proj, ex.down_proj, ex.gate_up_proj_bias, ex.down_proj_bias)
        return ours
    ours.set_router(hf.gate.weight)
    ours.set_fused_experts(hf.experts.gate_up_proj, hf.experts.down_proj, layout="hf")
    if family == "qwen2_moe":
        s = hf.shared_expert
        ours.set_shared_expert(s.gate_proj.weight, s.up_proj.weight, s.down_proj.weight, hf.shared_expert_gate.weight)
    return ours


FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tokens", [1, 2, 37])
@torch.inference_mode()
def test_block_matches_hf(family: str, tokens: int) -> None:
    cfg = _hf_config(family)
    hf = _hf_block(family, cfg)
    ours = _ours(family, cfg, hf)
    x = torch.randn(1, tokens, H, generator=torch.Generator().manual_seed(tokens))
    want = hf(x)
    want = want[0] if isinstance(want, tuple) else want
    got = ours(x[0])
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)
    assert sum(ours.expert_counts) == tokens * K


@pytest.mark.parametrize("norm", [True, False])
def test_qwen_norm_topk_prob_is_read(norm: bool) -> None:
    cfg = _hf_config("qwen3_moe", norm_topk_prob=norm)
    hf = _hf_block("qwen3_moe", cfg)
    ours = _ours("qwen3_moe", cfg, hf)
    assert ours.spec.renormalize is norm
    x = torch.randn(5, H)
    with torch.inference_mode():
        torch.testing.assert_close(ours(x), hf(x[None])[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_router_ties_as_hf(family: str) -> None:
    """Logits with many exact ties (small integers): the same experts and weights as HF's router module, whose
    projection is the identity here (hidden = the logits)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cls = {"qwen3_moe": Qwen3MoeTopKRouter, "qwen2_moe": Qwen2MoeTopKRouter, "mixtral": MixtralTopKRouter,
           "olmoe": OlmoeTopKRouter, "gpt_oss": GptOssTopKRouter}[family]  # fmt: skip
    cfg = _hf_config(family)
    cfg.hidden_size = E
    hf = cls(cfg)
    with torch.no_grad():
        hf.weight.copy_(torch.eye(E))
        if family == "gpt_oss":
            hf.bias.zero_()
    logits = torch.randint(0, 3, (200, E), generator=torch.Generator().manual_seed(1)).float()
    _, want_w, want_ids = hf(logits)
    d = cfg.to_dict()
    spec = moe_shape_from_hf_config(d, d["num_hidden_layers"]).router
    w, ids = route(logits, spec)
    assert torch.equal(ids, want_ids)
    assert torch.equal(w, want_w)
    assert (logits.sort(dim=-1, descending=True).values[:, K - 1 : K + 1].diff(dim=-1) == 0).any(), "no tie at k"


def test_group_by_expert() -> None:
    ids = torch.tensor([[2, 0], [0, 1], [2, 1]])
    tokens, flat, counts = group_by_expert(ids, 4)
    assert counts == [2, 2, 2, 0]
    assert tokens.tolist() == [0, 1, 1, 2, 0, 2]
    assert flat.tolist() == [1, 2, 3, 5, 0, 4]


def test_decode_runs_only_the_chosen_experts() -> None:
    cfg = _hf_config("qwen3_moe")
    hf = _hf_block("qwen3_moe", cfg)
    ours = _ours("qwen3_moe", cfg, hf)
    ran: list[int] = []
    for e, ex in enumerate(ours.experts):
        ex.register_forward_hook(lambda m, i, o, e=e: ran.append(e))
    x = torch.randn(1, H)
    with torch.inference_mode():
        chosen = route(ours.router(x), ours.spec)[1][0].tolist()
        ours(x)
    assert sorted(ran) == sorted(chosen) and len(ran) == K


def test_mxfp4_dequantize_matches_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from lmserve.model.mxfp4 import dequantize_mxfp4

    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 256, (3, 10, 4), dtype=torch.uint8, generator=g)  # every e8m0, inf included
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2).contiguous()
    got = dequantize_mxfp4(blocks, scales)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("tokens", [1, 9])
@torch.inference_mode()
def test_mxfp4_experts_match_hf_dequantized(tokens: int) -> None:
    """gpt-oss experts kept as MXFP4 bytes against HF's GptOssMLP holding transformers' dequantization of them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cfg = _hf_config("gpt_oss")
    hf = _hf_block("gpt_oss", cfg)
    g = torch.Generator().manual_seed(4)
    gu_b = torch.randint(0, 256, (E, 2 * I_EXPERT, H // 32, 16), dtype=torch.uint8, generator=g)
    gu_s = torch.randint(119, 126, (E, 2 * I_EXPERT, H // 32), dtype=torch.uint8, generator=g)
    dn_b = torch.randint(0, 256, (E, H, I_EXPERT // 32, 16), dtype=torch.uint8, generator=g)
    dn_s = torch.randint(119, 126, (E, H, I_EXPERT // 32), dtype=torch.uint8, generator=g)
    hf.experts.gate_up_proj.copy_(convert_moe_packed_tensors(gu_b, gu_s, dtype=torch.float32))
    hf.experts.down_proj.copy_(convert_moe_packed_tensors(dn_b, dn_s, dtype=torch.float32))
    ours = _ours("gpt_oss", cfg, hf, mxfp4=True)
    ex = hf.experts
    ours.set_mxfp4_experts(gu_b, gu_s, dn_b, dn_s, ex.gate_up_proj_bias, ex.down_proj_bias)
    assert ours.experts[0].gate_up_proj.blocks.dtype == torch.uint8  # still 4 bits a weight
    for m in ours.modules():  # float activations, as HF's (the int8 kernel: the test below)
        if isinstance(m, Mxfp4Linear):
            m.compute = "weight-only"
    x = torch.randn(1, tokens, H, generator=g)
    torch.testing.assert_close(ours(x[0]), hf(x)[0][0], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("tokens", [1, 9])
@torch.inference_mode()
def test_mxfp4_experts_run_the_int8_kernel_for_few_rows(tokens: int) -> None:
    """Experts given at most 8 rows take the MXFP4 x int8 C kernel (activations int8 per block of 32): the block
    equals its weight-only self whose few-row projections see their inputs rounded to that grid."""
    from lmserve import kernels
    from lmserve.model import quantization as Q

    if not kernels.available():
        pytest.skip("the MXFP4 kernel needs the C kernels")
    cfg = _hf_config("gpt_oss")
    hf = _hf_block("gpt_oss", cfg)
    g = torch.Generator().manual_seed(6)
    blocks = [torch.randint(0, 256, (E, r, c // 32, 16), dtype=torch.uint8, generator=g) for r, c in
              ((2 * I_EXPERT, H), (H, I_EXPERT))]  # fmt: skip
    scales = [torch.randint(119, 126, b.shape[:3], dtype=torch.uint8, generator=g) for b in blocks]
    fast, ref = (_ours("gpt_oss", cfg, hf, mxfp4=True) for _ in range(2))
    for block in (fast, ref):
        block.set_mxfp4_experts(blocks[0], scales[0], blocks[1], scales[1], hf.experts.gate_up_proj_bias,
                                hf.experts.down_proj_bias)  # fmt: skip
    calls: list[int] = []
    for m in fast.modules():
        if isinstance(m, Mxfp4Linear):
            m.register_forward_pre_hook(lambda mod, args: calls.append(mod.fast_path(args[0]) == "mxfp4_kernel"))

    def on_the_grid(mod: Mxfp4Linear, args: tuple) -> tuple:
        (x,) = args
        return (Q.fake_quantize_activation_blocks(x),) if x.shape[0] <= kernels.MXFP4_MAX_ROWS else None

    for m in ref.modules():
        if isinstance(m, Mxfp4Linear):
            m.compute = "weight-only"
            m.register_forward_pre_hook(on_the_grid)
    x = torch.randn(tokens, H, generator=g)
    torch.testing.assert_close(fast(x), ref(x), rtol=1e-4, atol=1e-4)
    assert any(calls), "the few-row experts ran on the kernel"


def test_bad_expert_tensors_name_the_field() -> None:
    cfg = _hf_config("mixtral")
    hf = _hf_block("mixtral", cfg)
    d = cfg.to_dict()
    ours = SparseMoE(H, moe_shape_from_hf_config(d, 2))
    with pytest.raises(ValueError, match=r"experts\.3\.down_proj: shape"):
        ours.set_expert(3, hf.experts.gate_up_proj[3, :I_EXPERT], hf.experts.gate_up_proj[3, I_EXPERT:],
                        torch.zeros(H, I_EXPERT + 1))  # fmt: skip
    with pytest.raises(ValueError, match="expert 8: the config has 8 experts"):
        ours.set_expert(8, *(torch.zeros(1),) * 3)
    with pytest.raises(ValueError, match="gate_up_proj: shape"):
        ours.set_fused_experts(hf.experts.gate_up_proj[:5], hf.experts.down_proj, layout="hf")
    with pytest.raises(ValueError, match="shared_expert"):
        ours.set_shared_expert(*(torch.zeros(1),) * 4)


def _reference_quantized(block: SparseMoE, x: torch.Tensor, act_grid) -> torch.Tensor:
    """The block recomputed token by token from its experts' dequantized weights, the activations on `act_grid`
    (what the int8 / W4A8 kernels multiply), the router in float32 from its own weights."""
    import torch.nn.functional as F

    weights, ids = route(F.linear(x, block.router.weight, block.router.bias), block.spec)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            ex = block.experts[e]
            gu = act_grid(x[t : t + 1]) @ ex.gate_up_proj.dequantized_weight().t()
            gate, up = gu.split(ex.intermediate_size, dim=-1)
            out[t] += w * (act_grid(F.silu(gate) * up) @ ex.down_proj.dequantized_weight().t())[0]
    if block.shared_expert is not None:
        s = block.shared_expert
        gu = act_grid(x) @ s.gate_up_proj.dequantized_weight().t()
        gate, up = gu.split(s.intermediate_size, dim=-1)
        shared = act_grid(F.silu(gate) * up) @ s.down_proj.dequantized_weight().t()
        out += torch.sigmoid(F.linear(x, block.shared_expert_gate.weight)) * shared
    return out


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
@pytest.mark.parametrize("tokens", [1, 12])
@torch.inference_mode()
def test_quantized_experts(method: str, family: str, tokens: int) -> None:
    """--quantization quantizes the experts (and the shared expert) with the usual calls; the router and the shared
    expert's gate stay float32; int4 experts run the W4A8 kernels for every row count."""
    from lmserve import kernels
    from lmserve.config.engine import QuantizationConfig
    from lmserve.model import quantization as Q
    from lmserve.model.layers import pack_w4a8_weights, quantize_linear_weights

    cfg = _hf_config(family)
    ours = _ours(family, cfg, _hf_block(family, cfg))
    quantize_linear_weights(ours, QuantizationConfig(method, None if method == "int8" else 32))
    assert ours.router.weight.dtype == torch.float32 and not hasattr(ours.router, "quant_method")
    assert all(ex.gate_up_proj.quant_method == method and ex.down_proj.weight is None for ex in ours.experts)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(5))
    if method == "int8":
        grid = Q.fake_quantize_activations
    else:
        if not kernels.available():
            pytest.skip("W4A8 needs the C kernels")
        assert pack_w4a8_weights(ours) == 2 * E + (2 if family == "qwen2_moe" else 0)
        assert ours.experts[0].gate_up_proj.fast_path(x) == "w4a8"
        grid = Q.fake_quantize_activation_blocks
    torch.testing.assert_close(ours(x), _reference_quantized(ours, x, grid), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "family",
    ["qwen3_moe", "gpt_oss", *(pytest.param(f, marks=pytest.mark.slow) for f in ("qwen2_moe", "mixtral", "olmoe"))],
)
@torch.inference_mode()
def test_loads_the_checkpoint_tensors_as_saved(tmp_path, family: str) -> None:
    """A tiny HF model saved by transformers (per-expert tensors for Qwen / OLMoE / Mixtral, gpt-oss's fused 3-D
    ones): its first layer's MoE tensors through load_tensor, one at a time, give HF's own block output."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    cfg = _hf_config(family, layers=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(tmp_path)
    d = cfg.to_dict()
    ours = SparseMoE(H, moe_shape_from_hf_config(d, 1))
    prefix = "model.layers.0.block_sparse_moe." if family == "mixtral" else "model.layers.0.mlp."
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = [k for k in f.keys() if k.startswith(prefix)]
        for k in names[:-1]:
            ours.load_tensor(k.removeprefix(prefix), f.get_tensor(k))
        with pytest.raises(ValueError, match="checkpoint is missing model.layers.0"):
            ours.check_loaded(prefix)
        ours.load_tensor(names[-1].removeprefix(prefix), f.get_tensor(names[-1]))
    ours.check_loaded(prefix)
    x = torch.randn(1, 6, H)
    want = model.model.layers[0].mlp(x)
    torch.testing.assert_close(ours(x[0]), (want[0] if isinstance(want, tuple) else want)[0], rtol=1e-5, atol=1e-5)


def test_load_tensor_rejects_what_the_config_does_not_hold() -> None:
    cfg = _hf_config("qwen3_moe")
    ours = SparseMoE(H, moe_shape_from_hf_config(cfg.to_dict(), 2))
    with pytest.raises(ValueError, match=r"experts\.8\.gate_proj\.weight: expert 8, the config has 8"):
        ours.load_tensor("experts.8.gate_proj.weight", torch.zeros(I_EXPERT, H))
    with pytest.raises(ValueError, match=r"experts\.1\.up_proj\.weight: shape \(16, 64\)"):
        ours.load_tensor("experts.1.up_proj.weight", torch.zeros(16, H))
    with pytest.raises(ValueError, match="router.bias: the config's router has no bias"):
        ours.load_tensor("router.bias", torch.zeros(E))
    with pytest.raises(ValueError, match="not a tensor of this MoE block"):
        ours.load_tensor("experts.1.fc.weight", torch.zeros(1))
    with pytest.raises(ValueError, match="MXFP4 tensors, but the config has no mxfp4"):
        ours.load_tensor("experts.down_proj_blocks", torch.zeros(E, H, 1, 16, dtype=torch.uint8))
