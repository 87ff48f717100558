"""GGUF `qwen35` (Qwen3.5, dense) as llama.cpp's converter writes it (tests/gguf_hybrid_helpers.py, independently of
the reader): the Gated DeltaNet tensors back under HF's names and layout, greedy tokens identical to HF transformers
under chunked prefill, Q8_0 kept as it is in the file, the memory ledger, the MTP blocks skipped."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import gguf
from lmserve import LLM, SamplingParams
from lmserve.checkpoint import gguf as lm_gguf
from tests.gguf_helpers import memory_json
from tests.gguf_hybrid_helpers import dequantized_qwen35_model, write_qwen35_gguf
from tests.hf_reference import assert_greedy_matches_hf_up_to_margin
from tests.hybrid_helpers import PROMPTS, hf_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def qwen35_dir(hybrid_dirs: dict[str, Path]) -> Path:
    return hybrid_dirs["qwen3_5"]


def _greedy_matches(llm: LLM, ref_dir: Path, max_tokens: int = 12) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        assert out.outputs[0].token_ids == hf_greedy(ref_dir, out.prompt_token_ids, max_tokens), out.prompt
    assert llm.engine.scheduler.state_slots.num_used == 0


def test_every_tensor_name_inverts_gguf_name_map(qwen35_dir: Path) -> None:
    spec = lm_gguf.GGUF_ARCHS["qwen35"]
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, 8)
    for hf_name in load_file(qwen35_dir / "model.safetensors"):
        converted = hf_name.replace(".dt_bias", ".dt_proj.bias")  # (the converter's rename)
        gguf_name = name_map.get_name(converted, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        assert lm_gguf.hf_tensor_name(gguf_name, spec) == hf_name


def test_f32_gguf_is_the_hf_model(qwen35_dir: Path, tmp_path: Path) -> None:
    file = write_qwen35_gguf(qwen35_dir, tmp_path / "qwen35-f32.gguf")
    # prompts in chunks of at most 5 tokens: the recurrent state carried across chunks
    llm = LLM(str(file), tokenizer=str(qwen35_dir), num_kv_blocks=64, block_size=4, max_num_batched_tokens=5)
    ours = llm.engine.config.model
    theirs = LLM(str(qwen35_dir), num_kv_blocks=16).engine.config.model
    assert ours.architecture == "Qwen3_5ForCausalLM"
    assert (ours.layers, ours.linear, ours.rope, ours.rotary_dim) == (
        theirs.layers, theirs.linear, theirs.rope, theirs.rotary_dim
    )  # fmt: skip
    model = llm.engine.runner.model.model
    hf = load_file(qwen35_dir / "model.safetensors")
    for i, layer in enumerate(model.layers):  # the converter's transforms undone, to the bit but A_log's exp / log
        if i == 3:
            continue  # (the full-attention layer)
        la = layer.mixer
        for part in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
            assert torch.equal(getattr(la, part).weight, hf[f"model.layers.{i}.linear_attn.{part}.weight"]), part
        assert torch.equal(la.conv1d.weight, hf[f"model.layers.{i}.linear_attn.conv1d.weight"])
        assert torch.equal(la.dt_bias, hf[f"model.layers.{i}.linear_attn.dt_bias"])
        torch.testing.assert_close(la.A_log, hf[f"model.layers.{i}.linear_attn.A_log"], atol=1e-6, rtol=1e-6)
    _greedy_matches(llm, qwen35_dir)


def test_q8_0_gguf_matches_hf_on_its_weights(qwen35_dir: Path, tmp_path: Path) -> None:
    from tests.gguf.test_gguf import _weight_bytes

    file = write_qwen35_gguf(qwen35_dir, tmp_path / "qwen35-q8_0.gguf", "Q8_0")
    ref_dir = dequantized_qwen35_model(qwen35_dir, file, tmp_path / "ref")
    plain = LLM(str(file), tokenizer=str(qwen35_dir), num_kv_blocks=64, quantization="none")
    _greedy_matches(plain, ref_dir)
    kept = LLM(str(file), tokenizer=str(qwen35_dir), num_kv_blocks=64, int4_compute="weight-only")
    assert kept.engine.runner.model.model.layers[3].mixer.qkv_proj.quant_method == "int8w", "attention: Q8_0 kept"
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for out in kept.generate(PROMPTS, params, use_tqdm=False):
        got = out.outputs[0].token_ids
        matched = assert_greedy_matches_hf_up_to_margin(ref_dir, out.prompt_token_ids, got, 1e-3, out.prompt)
        assert matched == len(got), f"{out.prompt!r}: a near-tie flipped at token {matched}"
    ckpt = lm_gguf.GGUFCheckpoint(file)
    assert lm_gguf.resident_weight_bytes(ckpt, 4, True)[0] == _weight_bytes(kept)
    assert lm_gguf.resident_weight_bytes(ckpt, 4, False)[0] == _weight_bytes(plain)


def test_memory_cli_counts_the_gguf_as_its_hf_model(qwen35_dir: Path, tmp_path: Path, capsys) -> None:
    ours = memory_json(write_qwen35_gguf(qwen35_dir, tmp_path / "qwen35-mem.gguf"), capsys, "--weight-dtype", "fp32")
    theirs = memory_json(qwen35_dir, capsys, "--weight-dtype", "fp32")
    for key in ("num_parameters", "kv_bytes_per_token", "weight_bytes", "state_bytes_per_sequence"):
        assert ours[key] == theirs[key], key
    assert ours["state_bytes_per_sequence"] > 0
    assert ours["num_parameters"] == sum(t.numel() for t in load_file(qwen35_dir / "model.safetensors").values())


def test_mtp_blocks_after_the_trunk_are_skipped(qwen35_dir: Path, tmp_path: Path) -> None:
    """A file converted without --no-mtp: block_count counts the MTP block, its tensors sit at blk.{layers}."""
    file = write_qwen35_gguf(qwen35_dir, tmp_path / "qwen35.gguf")
    reader = gguf.GGUFReader(str(file))
    w = gguf.GGUFWriter(str(tmp_path / "qwen35-mtp.gguf"), "qwen35")
    for key, field in reader.fields.items():
        if key.startswith("qwen35.") and key != "qwen35.block_count":
            w.add_key_value(key, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
    w.add_block_count(5)
    w.add_nextn_predict_layers(1)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name in ("blk.4.attn_norm.weight", "blk.4.nextn.enorm.weight", "blk.4.nextn.hnorm.weight"):
        w.add_tensor(name, np.ones(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ckpt = lm_gguf.GGUFCheckpoint(tmp_path / "qwen35-mtp.gguf")
    assert ckpt.hf_config()["num_hidden_layers"] == 4
    assert not any(t.hf_name.startswith("model.layers.4.") for t in ckpt.tensors())
    llm = LLM(str(tmp_path / "qwen35-mtp.gguf"), tokenizer=str(qwen35_dir), num_kv_blocks=64)
    _greedy_matches(llm, qwen35_dir, max_tokens=4)
