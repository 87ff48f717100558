"""gpt-oss end to end against HF transformers on a tiny random model: last-token logits and greedy tokens (attention
sinks, q/k/v and o_proj biases, sliding / full layers, YaRN, the router with its bias, the clamped SwiGLU) under
batching, chunked prefill with prefix-cache hits and preemption; a checkpoint with MXFP4 experts as OpenAI ships
them against HF holding transformers' own dequantization of the same bytes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lmserve import LLM, SamplingParams
from tests.hf.test_moe_models import _greedy
from tests.hf_reference import assert_greedy_matches_hf_up_to_margin, hf_last_logits

PROMPTS = ["The capital of France is", "def fib(n):", "import json\nimport os\n\nclass Decoder(object):", "a"]
E, I_EXPERT = 8, 64


def gpt_oss_config(**overrides):  # noqa: ANN201 (a transformers config)
    from transformers import GptOssConfig

    kwargs = dict(vocab_size=512, hidden_size=64, intermediate_size=I_EXPERT, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=E,
                  num_experts_per_tok=3, max_position_embeddings=512, sliding_window=8, eos_token_id=0,
                  tie_word_embeddings=False, initializer_range=0.2,
                  rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                       beta_slow=1.0, truncate=False, original_max_position_embeddings=128),
                  )  # fmt: skip
    kwargs.update(overrides)
    return GptOssConfig(**kwargs)


def build_gpt_oss(out_dir: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(gpt_oss_config(**overrides)).eval()
    with torch.no_grad():  # (HF initialises the biases to zero: random ones, so the test sees them)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out_dir / f.name)
    return out_dir


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_gpt_oss(tmp_path_factory.mktemp("gpt_oss"), tokenizer_dir)


def _check_logits(llm: LLM, model_dir: Path, prompts: list[str]) -> None:
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=1, temperature=0.0))
    sched = engine.scheduler.schedule()
    out = engine.runner.execute(sched)
    for row, s in enumerate(sched.scheduled):
        torch.testing.assert_close(out.logits[row], hf_last_logits(model_dir, s.request.prompt_token_ids),
                                   atol=2e-4, rtol=1e-4)  # fmt: skip


def test_config_reads_gpt_oss(gpt_oss_dir: Path) -> None:
    from lmserve.config.engine import ModelConfig

    cfg = ModelConfig.from_hf(gpt_oss_dir)
    assert cfg.family == "gpt_oss" and cfg.attention_sinks and cfg.o_bias and cfg.qkv_bias
    assert cfg.rope.rope_type == "yarn" and not cfg.rope.truncate
    assert [s.sliding_window for s in cfg.layers] == [8, None, 8]
    assert cfg.moe is not None and cfg.moe.router.scoring == "topk_softmax" and cfg.moe.expert_bias


def test_logits_and_greedy_match_hf(gpt_oss_dir: Path) -> None:
    llm = LLM(str(gpt_oss_dir), num_kv_blocks=64)
    _check_logits(llm, gpt_oss_dir, PROMPTS)
    _greedy(LLM(str(gpt_oss_dir), num_kv_blocks=64), gpt_oss_dir, PROMPTS[:3], max_tokens=12)


@pytest.mark.slow
def test_chunked_prefill_prefix_hits_and_preemption(gpt_oss_dir: Path) -> None:
    llm = LLM(str(gpt_oss_dir), num_kv_blocks=96, block_size=4, max_num_batched_tokens=8)
    system = "import json\nimport os\n\nclass Decoder(object):\n"
    _greedy(llm, gpt_oss_dir, [system + "    pass"])
    outs = _greedy(llm, gpt_oss_dir, [system + "    x = 1", system + "    def f(self):"])
    assert all(o.num_cached_tokens >= 16 for o in outs), "the shared prefix is reused"
    small = LLM(str(gpt_oss_dir), num_kv_blocks=12, block_size=16)
    _greedy(small, gpt_oss_dir, [f"Request number {i}: import json, os, sys" for i in range(6)], max_tokens=30)
    assert small.get_metrics()["num_preemptions_total"] > 0


def _mxfp4_checkpoint(src: Path, out: Path, ref: Path) -> None:
    """out: src with every layer's experts replaced by random MXFP4 bytes (OpenAI's tensor names and layout, the
    config's mxfp4 quantization_config); ref: src with HF's float experts set to transformers' dequantization."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    shutil.copytree(src, out)
    shutil.copytree(src, ref)
    tensors = load_file(src / "model.safetensors")
    quant, ref_tensors = dict(tensors), dict(tensors)
    g = torch.Generator().manual_seed(7)
    h = tensors["model.embed_tokens.weight"].shape[1]
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows, cols = (2 * I_EXPERT, h) if name.endswith("gate_up_proj") else (h, I_EXPERT)
        blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(119, 125, (E, rows, cols // 32), dtype=torch.uint8, generator=g)
        del quant[name]
        quant[f"{name}_blocks"], quant[f"{name}_scales"] = blocks, scales
        ref_tensors[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()
    save_file(quant, out / "model.safetensors", metadata={"format": "pt"})
    save_file(ref_tensors, ref / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                  "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg))


def test_mxfp4_checkpoint_matches_hf_dequantized(
    gpt_oss_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmserve import kernels
    from lmserve.model.mxfp4 import MXFP4_COMPUTE_ENV, Mxfp4Linear

    quant, ref = tmp_path / "mxfp4", tmp_path / "ref"
    _mxfp4_checkpoint(gpt_oss_dir, quant, ref)
    monkeypatch.setenv(MXFP4_COMPUTE_ENV, "weight-only")  # float activations: HF's logits to float32 rounding
    llm = LLM(str(quant), num_kv_blocks=64)
    expert = llm.engine.runner.model.model.layers[0].mlp.experts[0]
    assert isinstance(expert.gate_up_proj, Mxfp4Linear) and expert.gate_up_proj.blocks.dtype == torch.uint8
    _check_logits(llm, ref, PROMPTS[:2])
    _greedy(LLM(str(quant), num_kv_blocks=64), ref, PROMPTS[1:3], max_tokens=8)
    monkeypatch.delenv(MXFP4_COMPUTE_ENV)  # the default: an expert's few rows on the MXFP4 x int8 kernel
    if not kernels.available():
        return
    ran: list[int] = []
    real = kernels.linear_mxfp4
    monkeypatch.setattr(kernels, "linear_mxfp4", lambda *a, **k: ran.append(1) or real(*a, **k))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for out in LLM(str(quant), num_kv_blocks=64).generate(PROMPTS[1:3], params, use_tqdm=False):
        # (int8 activations move the logits by their rounding: a flip is accepted only at a near-tie, as W4A8's)
        assert_greedy_matches_hf_up_to_margin(ref, out.prompt_token_ids, out.outputs[0].token_ids, 0.1, out.prompt)
    assert ran, "the experts' few rows ran the MXFP4 kernel"
    # --quantization int8: the MXFP4 experts become their exact int8w form, the other projections int8 (W8A8)
    int8 = LLM(str(quant), num_kv_blocks=64, quantization="int8")
    expert = int8.engine.runner.model.model.layers[0].mlp.experts[0]
    assert expert.gate_up_proj.quant_method == "int8w" == expert.down_proj.quant_method
    engine = int8.engine
    engine.add_request("int8", PROMPTS[2], SamplingParams(max_tokens=1, temperature=0.0))
    sched = engine.scheduler.schedule()
    got = engine.runner.execute(sched).logits[0]
    want = hf_last_logits(ref, sched.scheduled[0].request.prompt_token_ids)
    assert (got - want).norm() / want.norm() < 0.25  # (int8 W8A8 attention: within its error, as test_moe_quantized)


def test_lora_on_moe_layers_is_refused_by_name(gpt_oss_dir: Path) -> None:
    from lmserve.config.engine import EngineArgs

    with pytest.raises(ValueError, match=r"enable_lora: LoRA adapters on GptOssForCausalLM's mixture-of-experts"):
        EngineArgs(str(gpt_oss_dir), enable_lora=True, num_kv_blocks=8).create_engine_config()
