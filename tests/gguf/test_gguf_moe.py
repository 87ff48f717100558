"""GGUF mixture-of-experts files as llama.cpp's converter writes them (tests/gguf_moe_helpers.py) against HF
transformers on the tiny random MoE models: the config read from the metadata, the 3-D expert stacks split into
per-expert views kept in their type (Q8_0 as int8w, MXFP4 in 4 bits), greedy tokens and logits, and the errors."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

import gguf
from lmserve import LLM, SamplingParams
from lmserve.checkpoint import gguf as lm_gguf
from lmserve.checkpoint.gguf_moe import mxfp4_to_hf
from tests.gguf_moe_helpers import quantized_reference, write_moe_gguf
from tests.hf_reference import assert_greedy_matches_hf_up_to_margin, hf_greedy, hf_last_logits

PROMPTS = ["The capital of France is", "def fib(n):", "import json\nimport os\n\nclass Decoder(object):"]
FAMILIES = ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "gpt_oss"]


def _check(llm: LLM, ref_dir: Path, atol: float = 2e-4, batch: int = 3, greedy: int = 2, max_tokens: int = 8) -> None:
    """Last-token logits of a batch of prompts within float32 tolerance of HF's, and greedy tokens identical (the
    default-suite tests check fewer: an HF step of these models takes ~0.5 s on a loaded 2-core machine)."""
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS[:batch]):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=1, temperature=0.0))
    sched = engine.scheduler.schedule()
    out = engine.runner.execute(sched)
    for row, s in enumerate(sched.scheduled):
        want = hf_last_logits(ref_dir, s.request.prompt_token_ids)
        torch.testing.assert_close(out.logits[row], want, atol=atol, rtol=1e-4)
    for i in range(batch):
        engine.abort_request(str(i))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for out in llm.generate(PROMPTS[1 : 1 + greedy], params, use_tqdm=False):
        assert out.outputs[0].token_ids == hf_greedy(ref_dir, out.prompt_token_ids, max_tokens), out.prompt


# ---- the reader: metadata, per-expert views, MXFP4 blocks ---------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_config_from_metadata_is_the_hf_config(moe_dir_of, tmp_path: Path, family: str) -> None:
    """The engine's config of the GGUF file is the HF directory's: experts, top-k, widths, renormalisation, dense
    layers (Qwen), shared expert (Qwen2-MoE), gpt-oss's sliding / full layers, sinks, biases and YaRN."""
    from lmserve.config.engine import ModelConfig

    model_dir = moe_dir_of(family)
    file = write_moe_gguf(model_dir, tmp_path / f"{family}.gguf")
    hf, ours = ModelConfig.from_hf(model_dir), ModelConfig.from_hf(file)
    assert ours.moe == hf.moe and ours.moe is not None
    assert np.float32(ours.rms_norm_eps) == np.float32(hf.rms_norm_eps)  # (GGUF stores it as float32)
    assert dataclasses.replace(ours, path=hf.path, rms_norm_eps=hf.rms_norm_eps) == hf


def test_expert_stacks_are_per_expert_views_in_their_type(moe_dir_of, tmp_path: Path) -> None:
    model_dir = moe_dir_of("qwen3_moe")
    file = write_moe_gguf(model_dir, tmp_path / "q8.gguf", expert_type="Q8_0")
    fused = write_moe_gguf(model_dir, tmp_path / "q8-fused.gguf", expert_type="Q8_0", fuse_gate_up=True)
    ckpt, ckpt_fused = lm_gguf.GGUFCheckpoint(file), lm_gguf.GGUFCheckpoint(fused)
    tensors = {t.hf_name: t for t in ckpt.tensors()}
    stack = next(t for t in ckpt._reader.tensors if t.name == "blk.0.ffn_up_exps.weight")
    expert = tensors["model.layers.0.mlp.experts.5.up_proj.weight"]
    assert expert.type_name == "Q8_0" and expert.shape == (32, 64)
    assert np.shares_memory(expert.raw, stack.data), "a view of the file's bytes, not a copy"
    reference = quantized_reference(model_dir, tmp_path / "ref", "Q8_0")
    from safetensors.torch import load_file

    want = load_file(reference / "model.safetensors")
    for name, t in {t.hf_name: t for t in ckpt_fused.tensors()}.items():
        if ".experts." in name:
            assert t.type_name == "Q8_0", name
            np.testing.assert_array_equal(t.to_numpy(), want[name].numpy())
            np.testing.assert_array_equal(t.to_numpy(), tensors[name].to_numpy())
    assert tensors["model.layers.0.mlp.router.weight"].type_name == "F32"  # (the converter's float32 router)


def test_mxfp4_blocks_convert_to_hf_layout_exactly() -> None:
    """ggml block_mxfp4 bytes → HF's blocks / scales: lmserve's dequantizer of the result is gguf's of the file,
    bit for bit, for every code and every exponent."""
    from lmserve.model.mxfp4 import dequantize_mxfp4

    rng = np.random.default_rng(0)
    rows, cols = 40, 96
    raw = rng.integers(0, 256, (rows, cols // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(0, 255, (rows, cols // 32))  # every e8m0 exponent but 255 (NaN)
    with np.errstate(over="ignore"):
        want = gguf.dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType.MXFP4)
    blocks, scales = mxfp4_to_hf(raw.reshape(rows, -1), rows, cols)
    got = dequantize_mxfp4(torch.from_numpy(blocks), torch.from_numpy(scales))
    np.testing.assert_array_equal(got.numpy(), want)


def test_k_quant_experts_keep_their_super_blocks() -> None:
    """Q4_K gate / up and Q6_K down stacks (Q4_K_M's choice) split per expert land in each expert's K-quant rows
    byte for byte: the weights are gguf's dequantization, and the block computes what float experts holding those
    weights compute."""
    from lmserve.checkpoint.gguf_moe import split_expert_stack
    from lmserve.checkpoint.registry.moe import MoEShape, RouterSpec
    from lmserve.model.layers.moe import SparseMoE
    from tests.gguf_helpers import quantize_kquant

    e_n, inter, hidden = 3, 256, 256
    shape = MoEShape(RouterSpec(e_n, 2, renormalize=True), inter, (True,))
    torch.manual_seed(0)
    kept, plain = SparseMoE(hidden, shape), SparseMoE(hidden, shape)
    plain.router.load_state_dict(kept.router.state_dict())
    for ex in kept.experts:
        ex.gate_up_proj.prepare_kquant([("Q4_K", inter), ("Q4_K", inter)])
        ex.down_proj.prepare_kquant([("Q6_K", hidden)])
    rng = np.random.default_rng(0)
    floats: dict[str, list[np.ndarray]] = {}
    for stem, proj, type_name, rows, cols in (("ffn_gate_exps", "gate_proj", "Q4_K", inter, hidden),
                                              ("ffn_up_exps", "up_proj", "Q4_K", inter, hidden),
                                              ("ffn_down_exps", "down_proj", "Q6_K", hidden, inter)):  # fmt: skip
        w = rng.standard_normal((e_n, rows, cols)).astype(np.float32) * 0.1
        raw = quantize_kquant(w.reshape(-1, cols), type_name).reshape(e_n, rows, -1)
        for name, hf_name, part_shape, part in split_expert_stack(f"blk.0.{stem}.weight", (e_n, rows, cols), raw):
            assert part_shape == (rows, cols) and np.shares_memory(part, raw), name
            e = int(hf_name.split(".")[5])
            kept.load_tensor(f"experts.{e}.{proj}.qweight", torch.from_numpy(part.copy()))
            deq = gguf.dequantize(part, gguf.GGMLQuantizationType[type_name]).reshape(rows, cols)
            floats.setdefault(proj, []).append(deq)
    for e, ex in enumerate(kept.experts):
        assert ex.gate_up_proj.quant_method == "kquant" and ex.gate_up_proj.weight is None
        want = np.concatenate([floats["gate_proj"][e], floats["up_proj"][e]])
        np.testing.assert_array_equal(ex.gate_up_proj.dequantized_weight().numpy(), want)
        np.testing.assert_array_equal(ex.down_proj.dequantized_weight().numpy(), floats["down_proj"][e])
        plain.set_expert(e, *(torch.from_numpy(floats[p][e]) for p in ("gate_proj", "up_proj", "down_proj")))
    x = torch.randn(5, hidden)
    with torch.no_grad():
        torch.testing.assert_close(kept(x), plain(x), atol=1e-4, rtol=1e-4)


# ---- end to end against HF ----------------------------------------------------------------------------------


def test_qwen3_moe_f32_matches_hf(moe_dir_of, tmp_path: Path) -> None:
    model_dir = moe_dir_of("qwen3_moe")
    file = write_moe_gguf(model_dir, tmp_path / "qwen3moe.gguf")
    _check(LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64), model_dir, greedy=1, max_tokens=6)


def test_qwen3_moe_q8_0_experts_run_as_they_are(moe_dir_of, tmp_path: Path, caplog, capsys) -> None:
    """Q8_0 expert stacks stay Q8_0 (int8w Linears, the file's bytes; the router float32), and the engine matches HF
    holding gguf's dequantization of the same file (weight-only: the file's math exactly, float order aside)."""
    from safetensors.torch import load_file

    from lmserve.checkpoint.gguf import GGUFCheckpoint, resident_weight_bytes
    from lmserve.model.layers import Linear

    model_dir = moe_dir_of("qwen3_moe")
    file = write_moe_gguf(model_dir, tmp_path / "qwen3moe-q8.gguf", expert_type="Q8_0")
    ref = quantized_reference(model_dir, tmp_path / "ref", "Q8_0")
    with caplog.at_level(logging.INFO, logger="lmserve.checkpoint.gguf"):
        llm = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64, int4_compute="weight-only")
    assert not any("dequantized" in r.getMessage() for r in caplog.records), "nothing dequantized"
    model = llm.engine.runner.model
    block = model.model.layers[0].mlp
    assert block.router.weight.dtype == torch.float32
    for ex in block.experts:
        assert ex.gate_up_proj.quant_method == "int8w" == ex.down_proj.quant_method and ex.gate_up_proj.weight is None
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith((".qweight", ".scales")))
    assert resident_weight_bytes(GGUFCheckpoint(file), 4, True)[0] == params + buffers
    import argparse
    import json

    from lmserve.entrypoints.memory_cli import add_memory_parser

    parser = argparse.ArgumentParser()
    add_memory_parser(parser.add_subparsers())
    args = parser.parse_args(["memory", "--model", str(file), "--json", "--int4-compute", "weight-only"])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    hf_params = sum(t.numel() for t in load_file(model_dir / "model.safetensors").values())
    assert report["num_parameters"] == hf_params and report["weight_bytes"] == params + buffers
    assert all(m.quant_method in (None, "int8w") for m in model.modules() if isinstance(m, Linear))
    _check(llm, ref, batch=2, greedy=1, max_tokens=6)


def test_gpt_oss_mxfp4_experts_stay_4_bit_and_match_hf(
    moe_dir_of, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpt-oss with MXFP4 experts as OpenAI ships them, converted as llama.cpp's GptOssModel repacks them: the
    experts hold the file's 4-bit codes, and the engine (weight-only: float activations) matches HF holding
    transformers' dequantization."""
    from lmserve.checkpoint.gguf import GGUFCheckpoint, resident_weight_bytes
    from lmserve.model.mxfp4 import MXFP4_COMPUTE_ENV, Mxfp4Linear
    from tests.hf.test_gpt_oss import _mxfp4_checkpoint

    monkeypatch.setenv(MXFP4_COMPUTE_ENV, "weight-only")
    quant, ref = tmp_path / "mxfp4", tmp_path / "ref"
    _mxfp4_checkpoint(moe_dir_of("gpt_oss"), quant, ref)
    file = write_moe_gguf(quant, tmp_path / "gpt-oss-mxfp4.gguf")
    llm = LLM(str(file), tokenizer=str(quant), num_kv_blocks=64)
    model = llm.engine.runner.model
    expert = model.model.layers[1].mlp.experts[3]
    assert isinstance(expert.gate_up_proj, Mxfp4Linear) and isinstance(expert.down_proj, Mxfp4Linear)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() for n, b in model.named_buffers() if n.endswith((".blocks", ".scales")))
    assert resident_weight_bytes(GGUFCheckpoint(file), 4, False)[0] == params + buffers
    _check(llm, ref, batch=2, greedy=1, max_tokens=6)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe", "gpt_oss"])
def test_f32_matches_hf(moe_dir_of, tmp_path: Path, family: str) -> None:
    model_dir = moe_dir_of(family)
    file = write_moe_gguf(model_dir, tmp_path / f"{family}.gguf")
    _check(LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64), model_dir)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "expert_type"), [("mixtral", "Q8_0"), ("qwen2_moe", "Q8_0"), ("olmoe", "Q4_0")])
def test_quantized_experts_match_hf_on_dequantized_weights(
    moe_dir_of, tmp_path: Path, family: str, expert_type: str
) -> None:
    """Block-32 experts (and Qwen2-MoE's shared expert) kept as they are, with the attention in Q8_0 too (the
    converter's --outtype q8_0): weight-only, HF's logits and greedy tokens on the dequantized weights; under the
    default W4A8 kernels (int8 activations) the same up to that rounding."""
    from lmserve import kernels

    model_dir = moe_dir_of(family)
    file = write_moe_gguf(model_dir, tmp_path / f"{family}.gguf", expert_type=expert_type, dense_type="Q8_0")
    ref = quantized_reference(model_dir, tmp_path / "ref", expert_type, dense_type="Q8_0")
    exact = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64, int4_compute="weight-only")
    _check(exact, ref, atol=1e-3)
    if not kernels.available():
        return
    llm = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64)
    block = next(layer.mlp for layer in llm.engine.runner.model.model.layers if hasattr(layer.mlp, "experts"))
    assert block.experts[0].gate_up_proj._w4a8 is not None, "the experts run on the W4A8 kernels"
    if block.shared_expert is not None:
        assert block.shared_expert.gate_up_proj._w4a8 is not None
        assert block.shared_expert_gate.weight.dtype == torch.float32
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        assert_greedy_matches_hf_up_to_margin(ref, out.prompt_token_ids, out.outputs[0].token_ids, 0.1, out.prompt)


# ---- errors ---------------------------------------------------------------------------------------------------


def test_expert_stack_that_contradicts_the_metadata_is_named(moe_dir_of, tmp_path: Path) -> None:
    model_dir = moe_dir_of("qwen3_moe")
    file = write_moe_gguf(model_dir, tmp_path / "bad.gguf")
    reader = gguf.GGUFReader(str(file))
    out = tmp_path / "bad-count.gguf"
    w = gguf.GGUFWriter(str(out), "qwen3moe")
    for field in reader.fields.values():
        if field.name.startswith("qwen3moe.") and field.name != "qwen3moe.expert_count":
            w.add_key_value(field.name, field.contents(), field.types[0])
    w.add_expert_count(7)  # the stacks hold 8
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"ffn_\w+_exps\.weight.*expert_count"):
        LLM(str(out), tokenizer=str(model_dir), num_kv_blocks=16)
