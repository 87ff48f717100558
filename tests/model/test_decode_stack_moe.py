"""The decode stack's MoE layers (model/decode_stack.MoEDesc, cpu_kernels.c: ls_moe_run, moe_route_f32) and q/k
norms: the C router picks the experts torch.topk picks (ties included); the C block is bit-identical to
SparseMoE's few-row forward; MoE models decode through the one-call stack bit-identically to the module path and
greedy-identical to HF transformers, float32 and int8 experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmserve import LLM, SamplingParams, kernels
from lmserve.checkpoint.registry.moe import RouterSpec
from lmserve.model.decode_stack import MoEDesc
from lmserve.model.layers.moe import ROUTER_KERNEL_MAX_ROWS, SparseMoE, route
from tests.hf_reference import hf_greedy
from tests.model.test_decode_stack import compared  # noqa: F401 (the fixture)
from tests.model.test_moe import _hf_block, _hf_config, _ours

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: kernels not built")

# (experts, top k): nth_element (k * 64 > E) and partial_sort (k * 64 <= E), as torch.topk's CPU kernel chooses
ROUTES = [(8, 3), (8, 2), (32, 4), (60, 4), (64, 8), (128, 2), (512, 8), (8, 1)]


@pytest.mark.parametrize(("experts", "k"), ROUTES)
@pytest.mark.parametrize("scoring", ["softmax_topk", "softmax_topk_renorm", "topk_softmax"])
def test_c_router_picks_torchs_experts(experts: int, k: int, scoring: str) -> None:
    """Logits full of exact ties (small integers) and random ones: the same experts as route() (torch.topk), each
    row's in ascending id, weights within float32 rounding."""
    g = torch.Generator().manual_seed(experts * 100 + k)
    ties = torch.randint(0, 3, (300, experts), generator=g).float()
    logits = torch.cat([ties, torch.randn(100, experts, generator=g) * 3])
    spec = RouterSpec(experts, k, scoring.removesuffix("_renorm"), renormalize=scoring.endswith("_renorm"))
    want_w, want_ids = route(logits, spec)
    want_ids, perm = want_ids.sort(dim=1)
    w, ids = kernels.moe_route(logits, k, spec.scoring, spec.renormalize)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w.gather(1, perm), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
@pytest.mark.parametrize("quant", [None, "int8"])
@torch.inference_mode()
def test_c_block_is_sparse_moe_bit_for_bit(family: str, quant: str | None) -> None:
    """kernels.moe_block on the block's MoEDesc (what the stack runs) equals SparseMoE.forward on 1-4 rows exactly,
    and HF's block within float32 tolerance (float32 experts)."""
    cfg = _hf_config(family)
    hf = _hf_block(family, cfg)
    ours = _ours(family, cfg, hf)
    ours.plain = True  # (a MoEFeedForward sets it from the config)
    if quant:
        linears = [m for ex in ours.experts for m in (ex.gate_up_proj, ex.down_proj)]
        if ours.shared_expert is not None:
            linears += [ours.shared_expert.gate_up_proj, ours.shared_expert.down_proj]
        for m in linears:
            m.quantize(quant, None)
    assert MoEDesc.supports(ours)
    desc = MoEDesc(ours)
    for rows in range(1, min(4, desc.rows) + 1):
        x = torch.randn(rows, cfg.hidden_size, generator=torch.Generator().manual_seed(rows))
        got = desc.run(x)
        assert torch.equal(got, ours(x)), rows
        if quant is None:
            want = hf(x[None])
            torch.testing.assert_close(got, (want[0] if isinstance(want, tuple) else want)[0], rtol=1e-5, atol=1e-5)


def test_blocks_without_c_kernels_keep_the_module_path() -> None:
    """MXFP4 experts (no C kernel) and float32 experts whose few rows take torch (choose_small_m_paths): no C block."""
    cfg = _hf_config("qwen3_moe")
    ours = _ours("qwen3_moe", cfg, _hf_block("qwen3_moe", cfg))
    ours.plain = True
    assert MoEDesc.supports(ours)
    ours.experts[3].down_proj._small_m_path = "torch"
    assert not MoEDesc.supports(ours)
    mxfp4 = SparseMoE(cfg.hidden_size, ours.shape, mxfp4=True)
    mxfp4.plain = True
    assert not MoEDesc.supports(mxfp4)


PROMPTS = [[5, 9, 23, 44, 11, 3, 70, 8], [100, 2, 57, 19], [31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41], [7, 7, 7]]


# (family, engine options, decode rows): float32 takes kernels.f32_max_rows() rows (2 without AVX-512)
CASES = [
    ("qwen3_moe", {}, 2),  # q/k norm per head, a dense layer among the sparse ones
    ("qwen3_moe", {"quantization": "int8"}, 4),
    pytest.param("qwen2_moe", {}, 2, marks=pytest.mark.slow),  # the shared expert and its gate, q/k/v biases
    pytest.param("qwen2_moe", {"quantization": "int8"}, 3, marks=pytest.mark.slow),
    pytest.param("mixtral", {}, 2, marks=pytest.mark.slow),
    pytest.param("olmoe", {}, 2, marks=pytest.mark.slow),  # q/k norm over the whole projection, no renormalising
    pytest.param("olmoe", {"quantization": "int8"}, 3, marks=pytest.mark.slow),
]


def _case_id(c: object) -> str:
    family, kw, n = c.values if hasattr(c, "values") else c
    return f"{family}-{kw.get('quantization', 'fp32')}-{n}"


@pytest.mark.parametrize(("family", "kw", "n"), CASES, ids=[_case_id(c) for c in CASES])
def test_moe_models_decode_in_one_call(moe_dir_of, compared: list, family: str, kw: dict, n: int) -> None:  # noqa: ANN001, F811
    """The stack runs every decode step (all n rows in one call), bit-identical to the module path; the greedy
    tokens are HF's (float32)."""
    if not kw and n > kernels.f32_max_rows():
        pytest.skip(f"the float32 kernel takes {kernels.f32_max_rows()} rows on this CPU")
    model_dir: Path = moe_dir_of(family)
    llm = LLM(str(model_dir), num_kv_blocks=64, block_size=4, **kw)
    runner = llm.engine.runner
    stack = runner.model.model.decode_stack(runner.kv_caches)
    assert stack is not None and stack._moes, "the MoE model takes the one-call stack"
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS[:n], params, use_tqdm=False)
    assert compared and all(same for _, same in compared), compared
    assert max(rows for rows, _ in compared) == n, "the decodes of all requests run in one call"
    if not kw:
        for prompt, out in zip(PROMPTS[:n], outs, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 10), prompt


def test_long_prefills_run_through_the_c_block(moe_dir_of) -> None:  # noqa: ANN001
    """With the stack built, a prefill of more than ROUTER_KERNEL_MAX_ROWS tokens runs each MoE block through its C
    description in runs of its rows (W4A8 experts: 64), every routed row counted; the greedy tokens equal the
    torch path's on the same prompt."""
    llm = LLM(str(moe_dir_of("qwen3_moe")), num_kv_blocks=128, block_size=4, quantization="int4",
              enable_prefix_caching=False)  # fmt: skip
    runner = llm.engine.runner
    assert runner.model.model.decode_stack(runner.kv_caches) is not None
    moes = [layer.mlp for layer in runner.model.model.layers if isinstance(layer.mlp, SparseMoE)]
    assert moes and all(m.prefill_block is not None and m.prefill_block.rows == ROUTER_KERNEL_MAX_ROWS for m in moes)
    prompt = [(i * 37) % 500 + 3 for i in range(150)]
    before = [m.stack_tokens.sum().item() for m in moes]
    (first,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    k = moes[0].spec.top_k
    assert [m.stack_tokens.sum().item() - b for m, b in zip(moes, before, strict=True)] == [150 * k] * len(moes)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    (c_path,) = llm.generate([prompt], params, use_tqdm=False)
    for m in moes:
        m.prefill_block = None
    (torch_path,) = llm.generate([prompt], params, use_tqdm=False)
    assert c_path.outputs[0].token_ids == torch_path.outputs[0].token_ids
    assert c_path.outputs[0].token_ids[0] == first.outputs[0].token_ids[0]
