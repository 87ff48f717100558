"""Hybrid linear-attention models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) against HF transformers on tiny random
checkpoints: last-token logits, greedy tokens under chunked prefill with a tiny budget, preemption with a tiny pool
and static batches; every state slot back once the requests finish."""

from __future__ import annotations

import logging
import shutil
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from lmserve import LLM, SamplingParams
from tests.hf_reference import hf_last_logits, hf_model

PROMPTS = [
    "The capital of France is",
    "import json\nimport os\n\nclass Decoder(object):\n    def __init__(self, strict=True):",
    "def fib(n):",
    "a",
]
COMMON = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=512, eos_token_id=0,
    tie_word_embeddings=False, initializer_range=0.2,
)  # fmt: skip
MAX_TOKENS = 20  # HF's reference is computed once per prompt, this long (tests compare a prefix of it)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def hf_model_of(kind: str) -> torch.nn.Module:
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    from transformers.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM

    if kind == "qwen3_5":
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**COMMON))
    if kind == "qwen3_next":  # a dense layer (mlp_only_layers) beside the sparse ones
        return Qwen3NextForCausalLM(Qwen3NextConfig(**COMMON, **MOE, mlp_only_layers=[1], norm_topk_prob=True))
    return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**COMMON, **MOE))


def build(out: Path, tokenizer_dir: Path, kind: str, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = hf_model_of(kind)
    with torch.no_grad():
        for name, p in model.named_parameters():  # HF's init leaves the norms at 0 / 1 and A_log uniform: perturb all
            p.copy_(torch.randn_like(p) * (0.05 if "norm" in name else 0.2))
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(-2, 1)
    model.eval().save_pretrained(out, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


class _Dirs(dict):
    """Checkpoints built on first use (a test of one family builds only that one)."""

    def __init__(self, root: Path, tokenizer_dir: Path) -> None:
        super().__init__()
        self.root, self.tokenizer_dir = root, tokenizer_dir

    def __missing__(self, kind: str) -> Path:
        self[kind] = build(self.root / kind, self.tokenizer_dir, kind)
        return self[kind]


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    return _Dirs(tmp_path_factory.mktemp("hybrid"), tokenizer_dir)


@lru_cache(maxsize=32)
@torch.inference_mode()
def _hf_greedy(model_dir: Path, prompt_ids: tuple[int, ...]) -> list[int]:
    """HF's greedy decoding with its own cache (the chunked delta rule for the prompt, the recurrent form after)."""
    ids = torch.tensor([prompt_ids])
    out = hf_model(model_dir).generate(
        ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt_ids) :].tolist()


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    assert max_tokens <= MAX_TOKENS
    return _hf_greedy(model_dir, tuple(prompt_ids))[:max_tokens]


def greedy_matches_hf(llm: LLM, model_dir: Path, prompts: list[str], max_tokens: int = 12) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for out in llm.generate(prompts, params, use_tqdm=False):
        expected = hf_greedy(model_dir, out.prompt_token_ids, max_tokens)
        assert out.outputs[0].token_ids == expected, f"greedy mismatch for {out.prompt!r}"
    slots = llm.engine.scheduler.state_slots
    assert slots is not None and slots.num_used == 0, "every state slot is back once the requests finished"
    slots.check_invariants(set())


FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
# (an engine run of the MoE hybrids takes half a minute on a loaded 2-core machine: their greedy runs are slow tests)
GREEDY = ["qwen3_5", *(pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES[1:])]


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


@pytest.mark.parametrize("kind", GREEDY)
def test_greedy_chunked_prefill_tiny_budget(hybrid_dirs: dict[str, Path], kind: str) -> None:
    """Prompts in chunks of at most 5 tokens beside decode rows: the state carried across chunks."""
    llm = LLM(str(hybrid_dirs[kind]), num_kv_blocks=64, block_size=4, max_num_batched_tokens=5)
    greedy_matches_hf(llm, hybrid_dirs[kind], PROMPTS)


def test_greedy_under_preemption_with_a_tiny_pool(hybrid_dirs: dict[str, Path]) -> None:
    llm = LLM(str(hybrid_dirs["qwen3_5"]), num_kv_blocks=20, block_size=4, max_num_batched_tokens=16)
    greedy_matches_hf(llm, hybrid_dirs["qwen3_5"], PROMPTS, max_tokens=20)
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
