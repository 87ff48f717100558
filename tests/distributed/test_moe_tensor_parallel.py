"""Tensor parallelism over MoE layers (model/parallel.py: every rank holds every expert's slice of the expert width,
one all-reduce per MoE block): TP = 2 against TP = 1 on tiny Qwen3-MoE (a dense layer among sparse ones), Qwen2-MoE
(the shared expert) and gpt-oss (sinks, o_proj bias, expert biases); logits within 1e-4 relative, greedy identical."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmserve import LLM
from lmserve.model.layers.moe import SparseMoE
from tests.distributed.test_tensor_parallel import (  # noqa: F401 (fixtures)
    GREEDY,
    PROMPTS,
    assert_rel_close,
    engines,
    first_step_logits,
    greedy,
    make,
    one_thread_per_rank,
    spy_stack_steps,
    tokens,
)

pytestmark = pytest.mark.slow  # multi-process TP engines: in `-m slow` (CI runs it), out of the default run


@pytest.mark.parametrize("family", ["qwen3_moe", *(pytest.param(f, marks=pytest.mark.slow) for f in ("gpt_oss",
                                                                                                  "qwen2_moe"))])
def test_tp2_matches_tp1(moe_dir_of, engines: list[LLM], family: str) -> None:  # noqa: ANN001, F811
    model_dir = moe_dir_of(family)
    one = make(engines, model_dir, num_kv_blocks=64)
    two = make(engines, model_dir, num_kv_blocks=64, tensor_parallel_size=2)
    moe = two.engine.config.model.moe
    block = next(m for m in two.engine.runner.model.modules() if isinstance(m, SparseMoE))  # rank 0's
    assert block.experts[0].down_proj.weight.shape[1] == moe.expert_intermediate_size // 2  # half of every expert
    assert_rel_close(first_step_logits(two, PROMPTS), first_step_logits(one, PROMPTS))
    assert greedy(two) == greedy(one)


@pytest.mark.slow
def test_tp2_int8_experts_run(moe_dir_of, engines: list[LLM]) -> None:  # noqa: ANN001, F811
    """int8 experts under TP: each expert's down_proj channel scale is the max over the ranks (TP = 1's codes); the
    activations are quantized per rank slice, so TP = 2 stays within TP = 1's quantization error of float32."""
    model_dir = moe_dir_of("qwen3_moe")
    float_logits = first_step_logits(make(engines, model_dir, num_kv_blocks=64), PROMPTS)
    one = first_step_logits(make(engines, model_dir, num_kv_blocks=64, quantization="int8"), PROMPTS)
    two = first_step_logits(make(engines, model_dir, num_kv_blocks=64, quantization="int8", tensor_parallel_size=2),
                            PROMPTS)  # fmt: skip
    quant_error = (one - float_logits).abs().max()
    assert (two - float_logits).abs().max() < 1.5 * quant_error


def test_tp2_moe_stack_is_bit_identical(moe_dir_of, engines: list[LLM], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001, F811
    """Under TP = 2 with the shared-memory all-reduce, Qwen3-MoE's decode steps take the one-call C stack, which sums
    each MoE block over the ranks from C: every such step on rank 0 recomputed on the module path (rank 1 sent the
    step again) gives the same bits, and the greedy tokens are TP = 1's (two streams: the float32 kernel's rows)."""
    model_dir = moe_dir_of("qwen3_moe")
    expected = tokens(make(engines, model_dir, num_kv_blocks=64).generate(PROMPTS[:2], GREEDY, use_tqdm=False))
    two = make(engines, model_dir, num_kv_blocks=64, tensor_parallel_size=2)
    assert two.engine.executor.group.all_reduce_kind == "shm"
    seen = spy_stack_steps(two, monkeypatch)
    assert tokens(two.generate(PROMPTS[:2], GREEDY, use_tqdm=False)) == expected
    assert len(seen) >= 10 and all(seen), f"{seen.count(False)} of {len(seen)} stack steps differ from the module path"


def test_refusals_name_the_expert_width(moe_dir_of, tmp_path: Path) -> None:  # noqa: ANN001
    """An expert width tensor_parallel_size does not divide, and MXFP4 experts (not sliced): named at start-up."""
    import json
    import shutil

    from lmserve.config.engine import EngineArgs

    src = moe_dir_of("qwen3_moe")  # 4 heads, intermediate 128, experts 32 wide
    d = tmp_path / "odd"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 30}))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide the experts' width 30"):
        EngineArgs(str(d), tensor_parallel_size=4, num_kv_blocks=8).create_engine_config()
    cfg = json.loads((moe_dir_of("gpt_oss") / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 with GptOssForCausalLM's MXFP4 experts"):
        EngineArgs(str(d), tensor_parallel_size=2, num_kv_blocks=8).create_engine_config()
