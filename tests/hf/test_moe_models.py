"""The MoE families end to end against HF transformers on tiny random models: last-token logits and greedy tokens
under batching, chunked prefill with prefix-cache hits, preemption; int8 / int4 experts run; bad checkpoints."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from lmserve import LLM, SamplingParams
from tests.hf_reference import hf_greedy, hf_last_logits

PROMPTS = ["The capital of France is", "def fib(n):", "import json\nimport os\n\nclass Decoder(object):", "a"]

# family → (config class, model class, config overrides); experts small, several per token, a dense layer for Qwen
SPECS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
                       head_dim=32, mlp_only_layers=[1], num_hidden_layers=3)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=6, num_experts_per_tok=2, intermediate_size=64, sliding_window=None)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(num_experts=8, num_experts_per_tok=3, intermediate_size=32, pad_token_id=0)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64, decoder_sparse_step=2, num_hidden_layers=3)),
}  # fmt: skip


def build_moe_model(out_dir: Path, family: str, tokenizer_dir: Path, seed: int = 0) -> Path:
    import transformers

    config_name, model_name, overrides = SPECS[family]
    kwargs = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, eos_token_id=0, bos_token_id=None,
                  tie_word_embeddings=False, initializer_range=0.2)  # fmt: skip
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**kwargs)).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out_dir / f.name)
    return out_dir


class _Dirs(dict):
    """Family → its tiny model's directory, built on first use."""

    def __init__(self, root: Path, tokenizer_dir: Path) -> None:
        super().__init__()
        self.root, self.tokenizer_dir = root, tokenizer_dir

    def __missing__(self, family: str) -> Path:
        self[family] = build_moe_model(self.root / family, family, self.tokenizer_dir)
        return self[family]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    return _Dirs(tmp_path_factory.mktemp("moe_models"), tokenizer_dir)


def _greedy(llm: LLM, model_dir: Path, prompts: list[str], max_tokens: int = 16) -> list:
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)  # fmt: skip
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, out.prompt_token_ids, max_tokens), prompt
    return outs


# (on a loaded 2-core machine an engine test of these takes minutes: one family in the default suite)
FAST = ["qwen3_moe", *(pytest.param(f, marks=pytest.mark.slow) for f in ("mixtral", "olmoe", "qwen2_moe"))]
SLOW = [pytest.param(f, marks=pytest.mark.slow) for f in SPECS]


@pytest.mark.parametrize("family", FAST)
def test_logits_and_greedy_match_hf(moe_dirs: dict[str, Path], family: str) -> None:
    model_dir = moe_dirs[family]
    llm = LLM(str(model_dir), num_kv_blocks=64)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=1, temperature=0.0))
    sched = engine.scheduler.schedule()
    out = engine.runner.execute(sched)
    for row, s in enumerate(sched.scheduled):
        want = hf_last_logits(model_dir, s.request.prompt_token_ids)
        torch.testing.assert_close(out.logits[row], want, atol=2e-4, rtol=1e-4)
    _greedy(LLM(str(model_dir), num_kv_blocks=64), model_dir, PROMPTS[:3], max_tokens=8)


@pytest.mark.parametrize("family", SLOW)
def test_chunked_prefill_prefix_hits_and_preemption(moe_dirs: dict[str, Path], family: str) -> None:
    model_dir = moe_dirs[family]
    llm = LLM(str(model_dir), num_kv_blocks=96, block_size=4, max_num_batched_tokens=8)
    system = "import json\nimport os\n\nclass Decoder(object):\n"
    _greedy(llm, model_dir, [system + "    pass"])
    outs = _greedy(llm, model_dir, [system + "    x = 1", system + "    def f(self):"])
    assert all(o.num_cached_tokens >= 16 for o in outs), "the shared prefix is reused"
    small = LLM(str(model_dir), num_kv_blocks=12, block_size=16)
    _greedy(small, model_dir, [f"Request number {i}: import json, os, sys" for i in range(6)], max_tokens=30)
    assert small.get_metrics()["num_preemptions_total"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_experts_generate(moe_dirs: dict[str, Path], method: str) -> None:
    """--quantization quantizes the experts (the router stays float32); the engine runs and its greedy tokens agree
    with HF's on most positions (quantization moves some ties)."""
    llm = LLM(str(moe_dirs["qwen3_moe"]), num_kv_blocks=64, quantization=method)
    block = llm.engine.runner.model.model.layers[0].mlp
    assert block.experts[0].gate_up_proj.quant_method == method
    assert block.router.weight.dtype == torch.float32
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)


def test_missing_expert_tensor_names_it(tmp_path: Path, moe_dirs: dict[str, Path]) -> None:
    from safetensors.torch import load_file, save_file

    d = tmp_path / "broken"
    shutil.copytree(moe_dirs["mixtral"], d)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.4.w2.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\..*experts\.4\.down_proj\.weight"):
        LLM(str(d), num_kv_blocks=16)
