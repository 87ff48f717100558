"""--quantization int8 on the MoE families (gpt-oss, Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE): every expert (and the
shared expert) int8, the router and the shared expert's gate float32; the last-token logits stay close to the
float32 engine's (which is HF-exact: test_moe_models.py, test_gpt_oss.py) and agree on the argmax."""

from __future__ import annotations

import pytest
import torch

from lmserve import LLM, SamplingParams
from lmserve.model.layers import Linear
from lmserve.model.layers.moe import SparseMoE
from tests.hf.test_moe_models import PROMPTS

# int8 W8A8 on these tiny random models (flat logits, routers near ties) moves the last-token logits by 2-16 %
# (relative L2, measured on every family here), and the argmax at most to float's second best
MAX_RELATIVE_ERROR, MAX_MEAN_RELATIVE_ERROR, MAX_RANK = 0.25, 0.1, 2



def _last_logits(llm: LLM) -> torch.Tensor:
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"logits-{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    sched = engine.scheduler.schedule()
    assert len(sched.scheduled) == len(PROMPTS)
    return engine.runner.execute(sched).logits.clone()


# (each builds two engines; on a loaded 2-core machine 10-35 s a family)
FAMILIES = [pytest.param(f, marks=pytest.mark.slow) for f in ("gpt_oss", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe")]


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_experts_stay_close_to_float(moe_dir_of, family: str) -> None:  # noqa: ANN001
    model_dir = moe_dir_of(family)
    want = _last_logits(LLM(str(model_dir), num_kv_blocks=32))
    llm = LLM(str(model_dir), num_kv_blocks=32, quantization="int8")
    blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]
    assert blocks
    for block in blocks:
        assert all(ex.gate_up_proj.quant_method == "int8" == ex.down_proj.quant_method for ex in block.experts)
        assert not isinstance(block.router, Linear) and block.router.weight.dtype == torch.float32
        if block.shared_expert is not None:
            assert block.shared_expert.down_proj.quant_method == "int8"
            assert block.shared_expert_gate.weight.dtype == torch.float32
    got = _last_logits(llm)
    err = (got - want).norm(dim=-1) / want.norm(dim=-1)
    rank = (want > want.gather(1, got.argmax(-1, keepdim=True))).sum(-1)  # int8's choice among float's
    assert (err < MAX_RELATIVE_ERROR).all() and err.mean() < MAX_MEAN_RELATIVE_ERROR, f"relative error {err.tolist()}"
    assert (rank <= MAX_RANK).all(), f"int8's greedy tokens rank {rank.tolist()} among float's"
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
