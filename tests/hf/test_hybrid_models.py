"""Hybrid linear-attention models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) against HF transformers on tiny random
checkpoints: last-token logits, greedy tokens under chunked prefill with a tiny budget, preemption with a tiny pool
and static batches; every state slot back once the requests finish."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from lmserve import LLM, SamplingParams
from tests.hf_reference import assert_greedy_matches_hf_up_to_margin, hf_last_logits
from tests.hybrid_helpers import COMMON, PROMPTS, hf_greedy

# (tiny tensors: two intra-op threads spin against each other on a busy 2-core machine)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def greedy_matches_hf(llm: LLM, model_dir: Path, prompts: list[str], max_tokens: int = 12) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for out in llm.generate(prompts, params, use_tqdm=False):
        expected = hf_greedy(model_dir, out.prompt_token_ids, max_tokens)
        assert out.outputs[0].token_ids == expected, f"greedy mismatch for {out.prompt!r}"
    slots = llm.engine.scheduler.state_slots
    assert slots is not None and slots.num_used == 0, "every state slot is back once the requests finished"
    slots.check_invariants(set())


FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
# (the default suite preempts one family; the MoE hybrids' preemption runs are slow tests)
PREEMPTED = ["qwen3_5", *(pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES[1:])]


@pytest.mark.parametrize("kind", FAMILIES)
def test_last_logits_match_hf(hybrid_dirs: dict[str, Path], kind: str) -> None:
    """One step prefilling all four prompts at once: the logits of each prompt's last token."""
    llm = LLM(str(hybrid_dirs[kind]), num_kv_blocks=64)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=1, temperature=0.0))
    sched = engine.scheduler.schedule()
    assert len(sched.scheduled) == len(PROMPTS)
    out = engine.runner.execute(sched)
    for row, s in enumerate(sched.scheduled):
        expected = hf_last_logits(hybrid_dirs[kind], s.request.prompt_token_ids)
        torch.testing.assert_close(out.logits[row], expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_chunked_prefill_tiny_budget(hybrid_dirs: dict[str, Path], kind: str) -> None:
    """Prompts in chunks of at most 5 tokens beside decode rows: the state carried across chunks."""
    llm = LLM(str(hybrid_dirs[kind]), num_kv_blocks=64, block_size=4, max_num_batched_tokens=5)
    greedy_matches_hf(llm, hybrid_dirs[kind], PROMPTS)


@pytest.mark.parametrize("kind", PREEMPTED)
def test_greedy_under_preemption_with_a_tiny_pool(hybrid_dirs: dict[str, Path], kind: str) -> None:
    """Preempted requests give their slots back and recompute their state on resume."""
    llm = LLM(str(hybrid_dirs[kind]), num_kv_blocks=20, block_size=4, max_num_batched_tokens=16)
    greedy_matches_hf(llm, hybrid_dirs[kind], PROMPTS, max_tokens=20)
    assert llm.engine.scheduler.num_preemptions_total > 0, "the pool is too small for all four at once"


def test_greedy_static_batches(hybrid_dirs: dict[str, Path]) -> None:
    llm = LLM(str(hybrid_dirs["qwen3_5"]), num_kv_blocks=64, scheduling_policy="static", max_num_seqs=2)
    greedy_matches_hf(llm, hybrid_dirs["qwen3_5"], PROMPTS)


def test_conditional_generation_checkpoint_serves_its_text_model(
    hybrid_dirs: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Qwen3_5ForConditionalGeneration checkpoint holding the text model's weights beside a vision tower: the
    same tokens as HF's text model, the vision tower skipped with a log line."""
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text_dir = hybrid_dirs["qwen3_5"]
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)  # fmt: skip
    text = {k: v for k, v in COMMON.items() if k not in ("tie_word_embeddings", "eos_token_id")}
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    vlm = Qwen3_5ForConditionalGeneration(config).eval()
    from transformers import AutoModelForCausalLM

    text_model = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    vlm.model.language_model.load_state_dict(text_model.model.state_dict())
    vlm.lm_head.load_state_dict(text_model.lm_head.state_dict())
    vlm.save_pretrained(tmp_path, safe_serialization=True)
    for f in text_dir.iterdir():
        if not (tmp_path / f.name).exists():
            shutil.copy(f, tmp_path / f.name)
    with caplog.at_level(logging.INFO):
        llm = LLM(str(tmp_path), num_kv_blocks=64)
    assert "vision" in caplog.text and "skipped" in caplog.text
    assert llm.engine.config.model.architecture == "Qwen3_5ForConditionalGeneration"
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for out in llm.generate(PROMPTS[:2], params, use_tqdm=False):
        assert out.outputs[0].token_ids == hf_greedy(text_dir, out.prompt_token_ids, 8)


@pytest.mark.parametrize(("kwargs", "margin"), [({"dtype": "bfloat16"}, 0.08), ({"kv_cache_dtype": "int8"}, 0.2)])
def test_16_bit_compute_and_8_bit_kv_keep_a_float32_state(
    hybrid_dirs: dict[str, Path], kwargs: dict, margin: float
) -> None:
    """bfloat16 compute or an int8 KV cache: the recurrent state stays float32; greedy tokens equal HF's float32
    ones but for a flip at a near-tie (the margin tool)."""
    model_dir = hybrid_dirs["qwen3_5"]
    llm = LLM(str(model_dir), num_kv_blocks=64, **kwargs)
    states = llm.engine.runner.state_cache.layers
    assert all(t.dtype == torch.float32 for layer in states for t in (layer.conv, layer.ssm))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    matched = 0
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        got = out.outputs[0].token_ids
        matched += assert_greedy_matches_hf_up_to_margin(model_dir, out.prompt_token_ids, got, margin, out.prompt)
    assert matched >= 0.7 * len(PROMPTS) * 12
