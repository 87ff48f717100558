"""Qwen3.5's V-head reorder undone on a GGUF file's raw data (checkpoint/gguf_hybrid.hybrid_reorder, GGUFTensor's
reorder): the Gated DeltaNet projections keep their quantized type, their blocks dequantize bit-identically to the
converter's reorder undone on gguf's dequantization (tests/gguf_hybrid_helpers.py, independent of the reader), and an
out_proj whose V heads are narrower than the type's blocks falls back to the float transform."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gguf
from lmserve import LLM, SamplingParams
from lmserve.checkpoint import gguf as lm_gguf
from lmserve.checkpoint.gguf_hybrid import block_order
from tests.gguf_hybrid_helpers import _dims, _reorder_v_heads, dequantized_hybrid_model, write_hybrid_gguf
from tests.hf_reference import assert_greedy_matches_hf_up_to_margin
from tests.hybrid_helpers import PROMPTS, build

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
LAYOUT = {"Q8_0": "int8w", "Q4_0": "int4"}


@pytest.fixture(scope="module")
def wide_v_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A tiny Qwen3.5 whose V heads are 32 wide: out_proj's column groups are whole block-32 blocks."""
    return build(tmp_path_factory.mktemp("wide-v") / "qwen3_5", tokenizer_dir, "qwen3_5", linear_value_head_dim=32)


def _hf_order(model_dir: Path, proj: str, w: np.ndarray) -> np.ndarray:
    """The converter's reorder of a dequantized projection undone (the helpers' inverse, not the reader's)."""
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    num_k, per_k, _, v_dim, qk = _dims(cfg)
    if proj == "in_proj_qkv":
        return np.concatenate([w[:qk], _reorder_v_heads(w[qk:], 0, num_k, per_k, v_dim, back=True)])
    if proj == "out_proj":
        return _reorder_v_heads(w, 1, num_k, per_k, v_dim, back=True)
    return _reorder_v_heads(w, 0, num_k, per_k, v_dim if proj == "in_proj_z" else 1, back=True)


def _check_tensors(model_dir: Path, file: Path, weight_type: str, out_proj_kept: bool) -> None:
    """Every linear-attention projection keeps the file's type; its (reordered) blocks, dequantized by gguf, are HF's
    order of the file's values bit for bit, and so is the float path (to_numpy)."""
    ckpt = lm_gguf.GGUFCheckpoint(file)
    kept = lm_gguf.kept_quantized(ckpt, tie_word_embeddings=False)
    qtype = gguf.GGMLQuantizationType[weight_type]
    seen = 0
    for t in ckpt.tensors():
        proj = t.hf_name.split(".")[-2]
        if ".linear_attn." not in t.hf_name or proj not in PROJECTIONS:
            continue
        seen += 1
        assert t.type_name == weight_type, t.gguf_name
        want = _hf_order(model_dir, proj, gguf.dequantize(t.raw, qtype).reshape(t.shape))
        assert np.array_equal(t.to_numpy(), want), t.gguf_name
        if proj == "out_proj" and not out_proj_kept:
            assert t.transform is not None and t.reorder is None and t.hf_name not in kept, t.gguf_name
            continue
        assert t.transform is None and t.hf_name in kept, t.gguf_name
        assert np.array_equal(gguf.dequantize(t.blocks(), qtype).reshape(t.shape), want), t.gguf_name
    assert seen == 3 * len(PROJECTIONS), "three linear-attention layers of four"


def _load_and_check(model_dir: Path, file: Path, ref_dir: Path, weight_type: str, out_proj_kept: bool) -> None:
    """The engine holds the projections in the type's layout (out_proj as float32 where it fell back), the weights
    it loads are the ledger's, and its greedy tokens are HF's on the file's weights."""
    import torch
    from safetensors.torch import load_file

    from tests.gguf.test_gguf import _weight_bytes

    llm = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64, int4_compute="weight-only")
    ref = load_file(ref_dir / "model.safetensors")
    for i, layer in enumerate(llm.engine.runner.model.model.layers[:3]):  # (layer 3 is full attention)
        for proj in PROJECTIONS:
            module = getattr(layer.mixer, proj)
            if proj == "out_proj" and not out_proj_kept:
                assert module.quant_method is None and module.weight.dtype == torch.float32
                assert torch.equal(module.weight, ref[f"model.layers.{i}.linear_attn.out_proj.weight"])
            else:
                assert module.quant_method == LAYOUT[weight_type], f"layer {i} {proj}"
    assert lm_gguf.resident_weight_bytes(lm_gguf.GGUFCheckpoint(file), 4, True)[0] == _weight_bytes(llm)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        got = out.outputs[0].token_ids
        matched = assert_greedy_matches_hf_up_to_margin(ref_dir, out.prompt_token_ids, got, 1e-3, out.prompt)
        assert matched == len(got), f"{out.prompt!r}: a near-tie flipped at token {matched}"


@pytest.mark.parametrize("weight_type", ["Q4_0", "Q8_0"])
def test_block_aligned_projections_stay_quantized(wide_v_dir: Path, tmp_path: Path, weight_type: str) -> None:
    file = write_hybrid_gguf(wide_v_dir, tmp_path / f"wide-{weight_type}.gguf", weight_type)
    _check_tensors(wide_v_dir, file, weight_type, out_proj_kept=True)
    ref_dir = dequantized_hybrid_model(wide_v_dir, file, tmp_path / "ref")
    _load_and_check(wide_v_dir, file, ref_dir, weight_type, out_proj_kept=True)


def test_out_proj_narrower_than_a_block_falls_back_to_floats(hybrid_dirs: dict[str, Path], tmp_path: Path) -> None:
    """V heads 8 wide: out_proj's column groups split Q8_0's blocks, so it is dequantized and moved as floats while
    the row-permuted input projections stay Q8_0."""
    model_dir = hybrid_dirs["qwen3_5"]
    file = write_hybrid_gguf(model_dir, tmp_path / "narrow-Q8_0.gguf", "Q8_0")
    _check_tensors(model_dir, file, "Q8_0", out_proj_kept=False)
    ref_dir = dequantized_hybrid_model(model_dir, file, tmp_path / "ref")
    _load_and_check(model_dir, file, ref_dir, "Q8_0", out_proj_kept=False)


def test_block_order_moves_only_whole_blocks() -> None:
    index = np.concatenate([np.arange(64, 96), np.arange(0, 64)])
    assert block_order(index, 32).tolist() == [2, 0, 1]
    assert block_order(index, 1).tolist() == index.tolist()
    assert block_order(np.concatenate([np.arange(8, 40), np.arange(8)]), 32) is None  # a run off the grid
    assert block_order(np.arange(48), 32) is None  # not whole blocks
