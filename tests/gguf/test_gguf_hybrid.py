"""GGUF hybrid files as llama.cpp's converter writes them (tests/gguf_hybrid_helpers.py, independently of the reader):
`qwen35` (Qwen3.5), `qwen35moe` (Qwen3.5-MoE) and `qwen3next` (Qwen3-Next). The Gated DeltaNet tensors back under
HF's names and layout, the experts and shared expert, greedy tokens identical to HF transformers under chunked
prefill, Q8_0 kept as it is in the file, the memory ledger, the MTP blocks skipped, and the errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import gguf
from lmserve import LLM, SamplingParams
from lmserve.checkpoint import gguf as lm_gguf
from tests.gguf_helpers import memory_json, rewrite_gguf
from tests.gguf_hybrid_helpers import HYBRID_ARCH, dequantized_hybrid_model, write_hybrid_gguf
from tests.hf_reference import assert_greedy_matches_hf_up_to_margin
from tests.hybrid_helpers import PROMPTS, hf_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]  # (tests/hybrid_helpers.py: Qwen3-Next's layer 1 is dense)


def _greedy_matches(llm: LLM, ref_dir: Path, max_tokens: int = 12, prompts: list[str] = PROMPTS) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for out in llm.generate(prompts, params, use_tqdm=False):
        assert out.outputs[0].token_ids == hf_greedy(ref_dir, out.prompt_token_ids, max_tokens), out.prompt
    assert llm.engine.scheduler.state_slots.num_used == 0


def _arch(model_dir: Path) -> str:
    return HYBRID_ARCH[json.loads((model_dir / "config.json").read_text())["architectures"][0]]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_name_inverts_gguf_name_map(hybrid_dirs: dict[str, Path], family: str) -> None:
    """The reader's names are the inverse of gguf's own table (the converter's), expert stacks and Qwen3-Next's
    ssm_ba (read in parts) included."""
    model_dir = hybrid_dirs[family]
    arch = _arch(model_dir)
    spec = lm_gguf.GGUF_ARCHS[arch]
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], 8)
    cfg = {"model_type": "qwen3_next", "linear_num_key_heads": 2, "linear_num_value_heads": 4}
    for hf_name in load_file(model_dir / "model.safetensors"):
        if ".experts." in hf_name:  # the converter's stack of them: read as one view per expert
            stack = hf_name.rsplit(".", 3)[0] + "." + hf_name.split(".")[-2]  # model.layers.N.mlp.experts.<proj>
            gguf_name = name_map.get_name(stack, try_suffixes=(".weight",)) + ".weight"
            parts = spec.parts(cfg, gguf_name, (4, 32, 64), np.zeros((4, 32, 64), np.float32))
            assert hf_name in {hf for _, hf, _, _ in parts}, hf_name
            continue
        if ".in_proj_qkvz." in hf_name or (family == "qwen3_next" and ".layers.1.mlp." in hf_name):
            continue  # (split by the converter into attn_qkv and attn_gate; a dense layer gguf's table lacks)
        converted = hf_name.replace(".dt_bias", ".dt_proj.bias")  # (the converter's rename)
        gguf_name = name_map.get_name(converted, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        if gguf_name.endswith(".ssm_ba.weight"):  # Qwen3-Next's in_proj_ba, read as Qwen3.5's in_proj_b and _a
            parts = spec.parts(cfg, gguf_name, (8, 64), np.zeros((8, 64), np.float32))
            assert [hf for _, hf, _, _ in parts] == [hf_name.replace("_ba.", f"_{p}.") for p in "ba"]
            continue
        # (every family's router is read as mlp.router: SparseMoE.load_tensor's name for it)
        assert lm_gguf.hf_tensor_name(gguf_name, spec) == hf_name.replace(".mlp.gate.", ".mlp.router."), hf_name


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_is_the_hf_model(hybrid_dirs: dict[str, Path], tmp_path: Path, family: str) -> None:
    from lmserve.model.linear_attention import qwen3_next_row_order

    model_dir = hybrid_dirs[family]
    file = write_hybrid_gguf(model_dir, tmp_path / f"{family}-f32.gguf")
    # prompts in chunks of at most 5 tokens: the recurrent state carried across chunks
    llm = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64, block_size=4, max_num_batched_tokens=5)
    ours = llm.engine.config.model
    theirs = LLM(str(model_dir), num_kv_blocks=16).engine.config.model
    assert ours.architecture == theirs.architecture
    assert (ours.layers, ours.linear, ours.rope, ours.rotary_dim, ours.moe) == (
        theirs.layers, theirs.linear, theirs.rope, theirs.rotary_dim, theirs.moe
    )  # fmt: skip
    model = llm.engine.runner.model.model
    hf = load_file(model_dir / "model.safetensors")
    for i, layer in enumerate(model.layers):  # the converter's transforms undone, to the bit but A_log's exp / log
        if i == 3:
            continue  # (the full-attention layer)
        la, prefix = layer.mixer, f"model.layers.{i}.linear_attn"
        if family == "qwen3_next":  # HF's fused rows, in Qwen3.5's order: the file's qkv and z, its ba split
            qkvz_order, ba_order = qwen3_next_row_order(la.dims)
            qkvz = torch.cat([la.in_proj_qkv.weight, la.in_proj_z.weight])
            assert torch.equal(qkvz, hf[f"{prefix}.in_proj_qkvz.weight"][qkvz_order])
            ba = torch.cat([la.in_proj_b.weight, la.in_proj_a.weight])
            assert torch.equal(ba, hf[f"{prefix}.in_proj_ba.weight"][ba_order])
        else:
            for part in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
                assert torch.equal(getattr(la, part).weight, hf[f"{prefix}.{part}.weight"]), part
        assert torch.equal(la.out_proj.weight, hf[f"{prefix}.out_proj.weight"])
        assert torch.equal(la.conv1d.weight, hf[f"{prefix}.conv1d.weight"])
        assert torch.equal(la.dt_bias, hf[f"{prefix}.dt_bias"])
        torch.testing.assert_close(la.A_log, hf[f"{prefix}.A_log"], atol=1e-6, rtol=1e-6)
    if family != "qwen3_5":  # an expert of a sparse layer: the stack's rows, gate then up
        gate_up = model.layers[2].mlp.experts[3].gate_up_proj.weight
        want = [hf[f"model.layers.2.mlp.experts.3.{p}_proj.weight"] for p in ("gate", "up")]
        assert torch.equal(gate_up, torch.cat(want))
    _greedy_matches(llm, model_dir)


@pytest.mark.parametrize(
    ("family", "weight_type"),
    [*((f, "Q8_0") for f in FAMILIES), pytest.param("qwen3_5_moe", "Q4_0", marks=pytest.mark.slow)],
)
def test_quantized_gguf_matches_hf_on_its_weights(
    hybrid_dirs: dict[str, Path], tmp_path: Path, family: str, weight_type: str
) -> None:
    """Q8_0 / Q4_0 projections and experts kept as they are in the file (weight-only: the file's math exactly, float
    order aside) against HF holding gguf's dequantization of the same file; Qwen3.5's also all dequantized."""
    from tests.gguf.test_gguf import _weight_bytes

    model_dir = hybrid_dirs[family]
    file = write_hybrid_gguf(model_dir, tmp_path / f"{family}-{weight_type}.gguf", weight_type)
    ref_dir = dequantized_hybrid_model(model_dir, file, tmp_path / "ref")
    kept = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64, int4_compute="weight-only")
    layers = kept.engine.runner.model.model.layers
    layout = {"Q8_0": "int8w", "Q4_0": "int4"}[weight_type]
    assert layers[3].mixer.qkv_proj.quant_method == layout, f"attention: {weight_type} kept"
    if family != "qwen3_5":
        moe = layers[3].mlp
        assert all(ex.gate_up_proj.quant_method == layout == ex.down_proj.quant_method for ex in moe.experts)
        assert moe.shared_expert.gate_up_proj.quant_method == layout, "the shared expert's gate / up"
        assert moe.router.weight.dtype == torch.float32
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for out in kept.generate(PROMPTS, params, use_tqdm=False):
        got = out.outputs[0].token_ids
        matched = assert_greedy_matches_hf_up_to_margin(ref_dir, out.prompt_token_ids, got, 1e-3, out.prompt)
        assert matched == len(got), f"{out.prompt!r}: a near-tie flipped at token {matched}"
    ckpt = lm_gguf.GGUFCheckpoint(file)
    assert lm_gguf.resident_weight_bytes(ckpt, 4, True)[0] == _weight_bytes(kept)
    if family == "qwen3_5":
        plain = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64, quantization="none")
        _greedy_matches(plain, ref_dir)
        assert lm_gguf.resident_weight_bytes(ckpt, 4, False)[0] == _weight_bytes(plain)


def test_mxfp4_experts_stay_4_bit_and_match_hf(hybrid_dirs: dict[str, Path], tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """llama-quantize's MXFP4_MOE layout (MXFP4 expert stacks, Q8_0 elsewhere): the experts hold the file's 4-bit
    codes (lmserve's MXFP4 experts), and the engine (weight-only: float activations, the MXFP4 experts too) matches
    HF holding gguf's dequantization of the file."""
    from lmserve.model.mxfp4 import MXFP4_COMPUTE_ENV, Mxfp4Linear

    monkeypatch.setenv(MXFP4_COMPUTE_ENV, "weight-only")

    model_dir = hybrid_dirs["qwen3_5_moe"]
    file = write_hybrid_gguf(model_dir, tmp_path / "mxfp4.gguf", "Q8_0", expert_type="MXFP4")
    ref_dir = dequantized_hybrid_model(model_dir, file, tmp_path / "ref")
    llm = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64, int4_compute="weight-only")
    model = llm.engine.runner.model
    expert = model.model.layers[0].mlp.experts[2]
    assert isinstance(expert.gate_up_proj, Mxfp4Linear) and isinstance(expert.down_proj, Mxfp4Linear)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    suffixes = (".qweight", ".scales", ".mins", ".blocks")
    buffers = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith(suffixes))
    assert lm_gguf.resident_weight_bytes(lm_gguf.GGUFCheckpoint(file), 4, True)[0] == params + buffers
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for out in llm.generate(PROMPTS, sampling, use_tqdm=False):
        got = out.outputs[0].token_ids
        matched = assert_greedy_matches_hf_up_to_margin(ref_dir, out.prompt_token_ids, got, 1e-3, out.prompt)
        assert matched == len(got), f"{out.prompt!r}: a near-tie flipped at token {matched}"


@pytest.mark.parametrize("family", FAMILIES)
def test_memory_cli_counts_the_gguf_as_its_hf_model(
    hybrid_dirs: dict[str, Path], tmp_path: Path, capsys, family: str
) -> None:
    model_dir = hybrid_dirs[family]
    ours = memory_json(write_hybrid_gguf(model_dir, tmp_path / "mem.gguf"), capsys, "--weight-dtype", "fp32")
    theirs = memory_json(model_dir, capsys, "--weight-dtype", "fp32")
    for key in ("num_parameters", "kv_bytes_per_token", "weight_bytes", "state_bytes_per_sequence"):
        assert ours[key] == theirs[key], key
    assert ours["state_bytes_per_sequence"] > 0
    assert ours["num_parameters"] == sum(t.numel() for t in load_file(model_dir / "model.safetensors").values())


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_mtp_blocks_after_the_trunk_are_skipped(hybrid_dirs: dict[str, Path], tmp_path: Path, family: str) -> None:
    """A file converted without --no-mtp: block_count counts the MTP block, its tensors sit at blk.{layers} (with a
    router and expert stacks in a MoE file)."""
    model_dir = hybrid_dirs[family]
    file = write_hybrid_gguf(model_dir, tmp_path / "hybrid.gguf")
    f32 = gguf.GGMLQuantizationType.F32
    mtp = {f"blk.4.{t}.weight": (np.ones(64, np.float32), f32) for t in ("attn_norm", "nextn.enorm", "nextn.hnorm")}
    if family == "qwen3_5_moe":
        mtp["blk.4.ffn_gate_inp.weight"] = (np.zeros((4, 64), np.float32), f32)
        mtp.update({f"blk.4.ffn_{p}_exps.weight": (np.zeros((4, 32, 64), np.float32), f32) for p in ("gate", "up")})
        mtp["blk.4.ffn_down_exps.weight"] = (np.zeros((4, 64, 32), np.float32), f32)
    u32 = gguf.GGUFValueType.UINT32
    fields = {f"{_arch(model_dir)}.block_count": (5, u32), f"{_arch(model_dir)}.nextn_predict_layers": (1, u32)}
    out = rewrite_gguf(file, tmp_path / "hybrid-mtp.gguf", fields, add=mtp)
    ckpt = lm_gguf.GGUFCheckpoint(out)
    assert ckpt.hf_config()["num_hidden_layers"] == 4
    assert not any(t.hf_name.startswith("model.layers.4.") for t in ckpt.tensors())
    llm = LLM(str(out), tokenizer=str(model_dir), num_kv_blocks=64)
    _greedy_matches(llm, model_dir, max_tokens=4, prompts=PROMPTS[:2])


# ---- errors ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "tensor"),
    [("qwen3_next", "blk.0.ssm_ba.weight"), ("qwen3_next", "blk.2.ffn_gate_inp_shexp.weight"),
     ("qwen3_5_moe", "blk.3.ffn_up_exps.weight"), ("qwen3_5_moe", "blk.1.ssm_a")],
)  # fmt: skip
def test_missing_tensor_is_named(hybrid_dirs: dict[str, Path], tmp_path: Path, family: str, tensor: str) -> None:
    file = write_hybrid_gguf(hybrid_dirs[family], tmp_path / "full.gguf")
    out = rewrite_gguf(file, tmp_path / "missing.gguf", drop=(tensor,))
    with pytest.raises(ValueError, match=rf"tensor '{tensor}' is missing \({_arch(hybrid_dirs[family])} layer"):
        LLM(str(out), tokenizer=str(hybrid_dirs[family]), num_kv_blocks=16)


def test_expert_stack_of_a_type_gguf_cannot_dequantize_is_named(hybrid_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = hybrid_dirs["qwen3_5_moe"]
    file = write_hybrid_gguf(model_dir, tmp_path / "full.gguf")
    q8_1 = gguf.GGMLQuantizationType.Q8_1
    block, size = gguf.GGML_QUANT_SIZES[q8_1]
    stack = (np.zeros((4, 32, 64 // block * size), np.uint8), q8_1)  # (experts, rows, row bytes)
    out = rewrite_gguf(file, tmp_path / "q8_1.gguf", add={"blk.0.ffn_up_exps.weight": stack})
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_up_exps\.weight\[0\]' has type Q8_1, which the gguf package"):
        LLM(str(out), tokenizer=str(model_dir), num_kv_blocks=16)
