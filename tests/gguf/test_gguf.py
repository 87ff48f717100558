"""GGUF checkpoints on small synthetic files written from the tiny random HF models: name mapping, llama's
q/k permutation, F16 / Q8_0 / Q5_0 dequantization, Q8_0 / Q4_0 / Q4_1 / Q5_0 kept as they are in the file (the
int8w / int4 layouts), the memory ledger of both, and the errors."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import gguf
from lmserve import LLM, SamplingParams
from lmserve.checkpoint import gguf as lm_gguf
from lmserve.memory.ledger import format_bytes
from tests.gguf_helpers import dequantized_hf_model, llama_cpp_permute, memory_json, write_gguf
from tests.hf_reference import hf_greedy, hf_last_logits

PROMPTS = ["The capital of France is", "def fib(n):", "床前明月光，疑是地上霜。"]
FAMILIES = {"llama": "llama-gqa", "qwen2": "qwen2", "qwen3": "qwen3"}


def _last_logits(llm: LLM, prompts: list[str]) -> tuple[list[list[int]], torch.Tensor]:
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=1, temperature=0.0))
    sched = engine.scheduler.schedule()
    assert len(sched.scheduled) == len(prompts)
    out = engine.runner.execute(sched)
    for i in range(len(prompts)):
        engine.abort_request(str(i))
    return [s.request.prompt_token_ids for s in sched.scheduled], out.logits


def _assert_greedy_matches_hf(llm: LLM, ref_dir: Path, max_tokens: int = 8) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False), strict=True):
        assert out.outputs[0].token_ids == hf_greedy(ref_dir, out.prompt_token_ids, max_tokens), prompt


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


# ---- the reader's tables against gguf's and transformers' -----------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tensor_names_agree_with_gguf_name_map(arch: str) -> None:
    """Our GGUF → HF table is the inverse of gguf's own HF → GGUF table for every tensor we read."""
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], 2)
    for gguf_stem, hf_stem in lm_gguf.GLOBAL_TENSOR_NAMES.items():
        assert name_map.get_name(hf_stem) == gguf_stem
    for gguf_stem, hf_stem in lm_gguf.LAYER_TENSOR_NAMES.items():
        if arch != "qwen3" and "norm" in gguf_stem and gguf_stem.startswith("attn_") and gguf_stem != "attn_norm":
            continue  # q/k norms only exist in qwen3
        assert name_map.get_name(f"model.layers.1.{hf_stem}") == f"blk.1.{gguf_stem}"
        assert lm_gguf.hf_tensor_name(f"blk.1.{gguf_stem}.weight") == f"model.layers.1.{hf_stem}.weight"


def test_unpermute_matches_transformers_and_inverts_llama_cpp() -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rng = np.random.default_rng(0)
    for n_head, rows, cols in ((4, 64, 48), (2, 32, 48), (3, 3 * 64, 1)):
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        ours = lm_gguf._unpermute(w, n_head)
        np.testing.assert_array_equal(ours, LlamaTensorProcessor()._reverse_permute_weights(w, n_head, n_head))
        np.testing.assert_array_equal(lm_gguf._unpermute(llama_cpp_permute(w, n_head), n_head), w)
        assert not np.array_equal(ours, w)


# ---- loading: F32 is the HF model exactly; quantized types are the dequantized HF model ---------------------


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_f32_gguf_is_the_safetensors_model(model_dirs: dict[str, Path], gguf_dir: Path, arch: str) -> None:
    model_dir = model_dirs[FAMILIES[arch]]
    file = write_gguf(model_dir, gguf_dir / f"{arch}-f32.gguf")
    llm = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64)
    assert llm.engine.config.model.architecture == lm_gguf.GGUF_ARCHITECTURES[arch]
    ids, logits = _last_logits(llm, PROMPTS)
    _, expected = _last_logits(LLM(str(model_dir), num_kv_blocks=64), PROMPTS)
    torch.testing.assert_close(logits, expected, atol=0, rtol=0)  # same weights, same engine: bit-identical
    for row, prompt_ids in enumerate(ids):
        torch.testing.assert_close(logits[row], hf_last_logits(model_dir, prompt_ids), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("arch", "weight_type"), [("llama", "F16"), ("qwen3", "BF16"), ("llama", "Q8_0"), ("qwen2", "Q4_1")]
)
def test_quantized_gguf_matches_hf_on_dequantized_weights(
    model_dirs: dict[str, Path], gguf_dir: Path, tmp_path: Path, arch: str, weight_type: str, caplog
) -> None:
    model_dir = model_dirs[FAMILIES[arch]]
    file = write_gguf(model_dir, gguf_dir / f"{arch}-{weight_type}.gguf", weight_type)
    ref_dir = dequantized_hf_model(model_dir, file, tmp_path / "ref")
    with caplog.at_level(logging.INFO, logger="lmserve.checkpoint.gguf"):  # quantization="none": all dequantized
        llm = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64, quantization="none")
    assert llm.engine.config.quantization is None
    logged = [r.getMessage() for r in caplog.records if r.name == "lmserve.checkpoint.gguf"]
    if weight_type in ("F16", "BF16"):
        assert logged == [], f"{weight_type} is used as it is"
    else:
        assert len(logged) == 1 and f"{weight_type} tensors dequantized to float32" in logged[0], logged
    ids, logits = _last_logits(llm, PROMPTS)
    for row, prompt_ids in enumerate(ids):
        torch.testing.assert_close(logits[row], hf_last_logits(ref_dir, prompt_ids), atol=2e-4, rtol=1e-4)
    _assert_greedy_matches_hf(llm, ref_dir)


def test_q8_0_matches_transformers_reading_the_same_gguf(model_dirs: dict[str, Path], gguf_dir: Path) -> None:
    """transformers' own GGUF loader (its names, permutation and dequantization) is the reference."""
    from transformers import AutoModelForCausalLM

    model_dir = model_dirs["llama-gqa"]
    file = write_gguf(model_dir, gguf_dir / "llama-hf-q8.gguf", "Q8_0")
    hf = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=file.name, dtype=torch.float32).eval()
    # weight-only: the file's weights times float32 activations (the default W4A8 runs Q8_0 with int8 activation
    # blocks, llama.cpp's q8_0 x q8_0: tests/gguf/test_gguf_q5.py checks it against its own reference)
    llm = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64, int4_compute="weight-only")
    ids, logits = _last_logits(llm, PROMPTS)
    with torch.inference_mode():
        for row, prompt_ids in enumerate(ids):
            expected = hf(torch.tensor([prompt_ids])).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, atol=2e-4, rtol=1e-4)


def test_other_types_dequantized_by_gguf_and_logged_with_their_cost(
    model_dirs: dict[str, Path], gguf_dir: Path, tmp_path: Path, caplog
) -> None:
    model_dir = model_dirs["llama-gqa"]
    # (a Q5_0 part fused with a float one: no layout holds both, so gguf dequantizes it)
    overrides = {"model.layers.0.mlp.gate_proj.weight": "Q5_0", "model.layers.1.mlp.up_proj.weight": "Q5_0"}
    file = write_gguf(model_dir, gguf_dir / "llama-q5.gguf", "F32", overrides)
    ref_dir = dequantized_hf_model(model_dir, file, tmp_path / "ref")
    with caplog.at_level(logging.INFO, logger="lmserve.checkpoint.gguf"):
        llm = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "lmserve.checkpoint.gguf"]
    elements = 2 * 64 * 128
    file_mib, mem_mib = elements // 32 * 22 / 2**20, elements * 4 / 2**20
    assert "2 Q5_0 tensors dequantized to float32" in line
    assert f"{file_mib:.1f} MiB in the file -> {mem_mib:.1f} MiB in memory (+{mem_mib - file_mib:.1f} MiB)" in line
    _assert_greedy_matches_hf(llm, ref_dir)


# ---- the block-32 hook for a quantized weight path ------------------------------------------------------


@pytest.mark.parametrize("weight_type", lm_gguf.BLOCK32_TYPES)
def test_block32_hook_hands_blocks_that_dequantize_like_gguf(
    model_dirs: dict[str, Path], gguf_dir: Path, weight_type: str
) -> None:
    file = write_gguf(model_dirs["llama-gqa"], gguf_dir / f"llama-hook-{weight_type}.gguf", weight_type)
    ckpt = lm_gguf.GGUFCheckpoint(file)
    taken: dict[str, lm_gguf.GGUFTensor] = {}

    def take(name: str, tensor: lm_gguf.GGUFTensor) -> bool:
        taken[name] = tensor
        return ".self_attn." in name  # claim the attention projections only

    yielded = dict(lm_gguf.iter_hf_tensors(ckpt, "float32", 4, take))
    assert set(taken) == {t.hf_name for t in ckpt.tensors() if t.type_name == weight_type}, "offered: every block-32"
    assert all(".self_attn." not in n for n in yielded), "claimed tensors are not dequantized"
    assert set(yielded) | {n for n in taken if ".self_attn." in n} == {t.hf_name for t in ckpt.tensors()}
    for name, tensor in taken.items():
        scales, mins, values = lm_gguf.unpack_block32(tensor)
        rebuilt = scales[..., None].astype(np.float32) * values.astype(np.float32)
        if mins is not None:
            rebuilt += mins[..., None].astype(np.float32)
        np.testing.assert_array_equal(rebuilt.reshape(tensor.shape), tensor.to_numpy())
        if name in yielded:
            np.testing.assert_array_equal(yielded[name], tensor.to_numpy())


# ---- Q8_0 / Q4_0 / Q4_1 kept as they are in the file -------------------------------------------------------


def _weight_bytes(llm: LLM) -> int:
    """What the loaded model's weights take: parameters (a tied table once), quantized buffers and the W4A8 panels
    int4 layers are repacked into (int4_compute="w4a8"; their int4-layout buffers are then dropped)."""
    from lmserve.model.layers import Linear

    model = llm.engine.runner.model
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(
        b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith((".qweight", ".scales", ".mins"))
    )
    panels = sum(m._w4a8.nbytes for m in model.modules() if isinstance(m, Linear) and m._w4a8 is not None)
    return params + buffers + panels


@pytest.mark.parametrize(
    ("arch", "weight_type"), [("llama", "Q8_0"), ("llama", "Q4_0"), ("llama", "Q4_1"), ("qwen2", "Q4_1")]
)
def test_block32_tensors_run_as_they_are_in_the_file(
    model_dirs: dict[str, Path], gguf_dir: Path, tmp_path: Path, arch: str, weight_type: str, caplog
) -> None:
    from lmserve.config.engine import QuantizationConfig
    from lmserve.model.gguf_blocks import GGUF_LAYOUTS
    from lmserve.model.layers import Linear
    from tests.hf_reference import assert_greedy_matches_hf_up_to_margin

    model_dir = model_dirs[FAMILIES[arch]]
    file = write_gguf(model_dir, gguf_dir / f"{arch}-kept-{weight_type}.gguf", weight_type)
    ref_dir = dequantized_hf_model(model_dir, file, tmp_path / "ref")
    with caplog.at_level(logging.INFO, logger="lmserve.checkpoint.gguf"):  # weight-only: the file's math exactly
        llm = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64, int4_compute="weight-only")
    assert llm.engine.config.quantization == QuantizationConfig(
        "gguf", 32, prequantized=True, int4_compute="weight-only"
    )
    logged = [r.getMessage() for r in caplog.records if r.name == "lmserve.checkpoint.gguf"]
    assert any(f"{weight_type} tensors kept as they are in the file" in line for line in logged), logged
    assert not any("dequantized" in line for line in logged), logged
    dequantized = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64, quantization="none")
    # (tied: the token embedding has no table of its own, its rows are the head's blocks, gguf's values exactly)
    embed, plain_embed = llm.engine.runner.model.model.embed_tokens, dequantized.engine.runner.model.model.embed_tokens
    assert embed.head_rows and embed.weight is None
    ids = torch.tensor([[0, 5, 5, plain_embed.num_embeddings - 1], [3, 2, 1, 0]])
    assert torch.equal(embed(ids), plain_embed(ids))
    layout, has_mins = GGUF_LAYOUTS[weight_type]
    ours = dict(llm.engine.runner.model.named_modules())
    for name, plain in dequantized.engine.runner.model.named_modules():
        if not isinstance(plain, Linear):
            continue
        kept = ours[name]
        assert (kept.quant_method, kept.group_size, kept.mins is not None) == (layout, 32, has_mins), name
        assert kept.weight is None and kept.qweight.dtype == (torch.int8 if layout == "int8w" else torch.uint8)
        # the same bytes as the file, so the same weights as gguf's dequantizer (bit for bit)
        assert torch.equal(kept.dequantized_weight(), plain.weight), name
    ids, logits = _last_logits(llm, PROMPTS)
    _, expected = _last_logits(dequantized, PROMPTS)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)  # the same math, another float order
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        got = out.outputs[0].token_ids
        matched = assert_greedy_matches_hf_up_to_margin(ref_dir, out.prompt_token_ids, got, 1e-3, out.prompt)
        assert matched == len(got), f"{out.prompt!r}: a near-tie flipped at token {matched}"
    # the memory ledger's figure is the model's own, both ways
    from lmserve.checkpoint.gguf import GGUFCheckpoint, resident_weight_bytes

    ckpt = GGUFCheckpoint(file)
    assert resident_weight_bytes(ckpt, 4, True)[0] == _weight_bytes(llm)
    assert resident_weight_bytes(ckpt, 4, False)[0] == _weight_bytes(dequantized)


@pytest.mark.parametrize("weight_type", ["Q4_0", "Q4_1"])
def test_q4_blocks_run_w4a8_by_default(
    model_dirs: dict[str, Path], gguf_dir: Path, tmp_path: Path, weight_type: str
) -> None:
    """A file's Q4_0 / Q4_1 tensors (the projections and, tied, the LM head) are repacked for the W4A8 kernels:
    the same codes, scales and mins (dequantized_weight bit for bit), the memory ledger's bytes, logits within
    the int8 activations' rounding of the weight-only engine's, and greedy tokens HF's up to near-ties."""
    from lmserve import kernels
    from lmserve.model.layers import Linear
    from tests.hf_reference import assert_greedy_matches_hf_up_to_margin

    if not kernels.available():
        pytest.skip("no C compiler: int4 runs weight-only")
    model_dir = model_dirs["llama-gqa"]
    file = write_gguf(model_dir, gguf_dir / f"llama-w4a8-{weight_type}.gguf", weight_type)
    llm = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64)
    exact = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64, int4_compute="weight-only")
    plain = dict(exact.engine.runner.model.named_modules())
    packed = 0
    for name, m in llm.engine.runner.model.named_modules():
        if isinstance(m, Linear) and m.quant_method == "int4":
            assert m._w4a8 is not None and m.qweight is None and (m._w4a8.mins is not None) == (weight_type == "Q4_1")
            assert torch.equal(m.dequantized_weight(), plain[name].dequantized_weight()), name
            packed += 1
    assert packed == 4 * 2 + 1  # 2 layers x qkv, o, gate_up, down; the tied head
    ckpt = lm_gguf.GGUFCheckpoint(file)
    assert lm_gguf.resident_weight_bytes(ckpt, 4, True)[0] == _weight_bytes(llm)
    _, logits = _last_logits(llm, PROMPTS)
    _, expected = _last_logits(exact, PROMPTS)
    rel = ((logits - expected).norm() / expected.norm()).item()
    # measured 0.032 (Q4_0) and 0.046 (Q4_1) on this 2-layer random model
    assert rel < 0.1, f"W4A8 logits {rel:.4f} (relative) from the weight-only engine's"
    ref_dir = dequantized_hf_model(model_dir, file, tmp_path / "ref")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        assert_greedy_matches_hf_up_to_margin(ref_dir, out.prompt_token_ids, out.outputs[0].token_ids, 0.1, out.prompt)


def test_fused_parts_of_different_types_are_dequantized_together(
    model_dirs: dict[str, Path], gguf_dir: Path, tmp_path: Path
) -> None:
    model_dir = model_dirs["llama-gqa"]
    overrides = {"model.layers.0.self_attn.v_proj.weight": "Q8_0", "model.layers.1.mlp.down_proj.weight": "Q5_0"}
    file = write_gguf(model_dir, gguf_dir / "llama-mixed.gguf", "Q4_1", overrides)
    llm = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64, int4_compute="weight-only")
    model = llm.engine.runner.model
    layers = model.model.layers
    assert layers[0].self_attn.qkv_proj.quant_method is None, "q/k Q4_1 with v Q8_0: one float matrix"
    assert layers[1].self_attn.qkv_proj.quant_method == "int4" and layers[0].mlp.gate_up_proj.quant_method == "int4"
    assert layers[1].mlp.down_proj.quant_method == "int5", "Q5_0 alone: kept (int5)"
    ckpt = lm_gguf.GGUFCheckpoint(file)
    assert lm_gguf.resident_weight_bytes(ckpt, 4, True)[0] == _weight_bytes(llm)
    ref_dir = dequantized_hf_model(model_dir, file, tmp_path / "ref")
    ids, logits = _last_logits(llm, PROMPTS)
    for row, prompt_ids in enumerate(ids):
        torch.testing.assert_close(logits[row], hf_last_logits(ref_dir, prompt_ids), atol=2e-4, rtol=1e-4)


def test_memory_cli_reports_file_and_resident_bytes(model_dirs: dict[str, Path], gguf_dir: Path, capsys) -> None:
    from lmserve.memory.ledger import load_model_shape, num_parameters

    model_dir = model_dirs["llama-gqa"]
    file = write_gguf(model_dir, gguf_dir / "llama-mem-q8.gguf", "Q8_0")
    tensors = gguf.GGUFReader(str(file)).tensors
    weights = load_file(model_dir / "model.safetensors")
    hf_params = sum(t.numel() for name, t in weights.items() if name != "lm_head.weight")  # tied head
    file_bytes = sum(int(t.n_bytes) for t in tensors)
    assert num_parameters(load_model_shape(file)) == hf_params
    # default: the Q8_0 projections stay as in the file, the tied head holds token_embd's blocks once (the
    # embedding looks its rows up there), the norms are float32
    embd = next(t for t in tensors if t.name == "token_embd.weight")
    projections = [t for t in tensors if t.name.startswith("blk.") and t.tensor_type.name == "Q8_0"]
    kept = sum(int(t.n_bytes) for t in projections) + int(embd.n_bytes)
    floats = hf_params - sum(int(t.n_elements) for t in projections) - int(embd.n_elements)
    kept_report = memory_json(file, capsys)
    assert kept_report["num_parameters"] == hf_params == sum(int(t.n_elements) for t in tensors)
    assert kept_report["quantization"] == "gguf" and kept_report["weight_bytes"] == kept + 4 * floats
    notes = kept_report["notes"]
    assert any(f"GGUF file: {format_bytes(file_bytes)} of tensors" in n and "Q8_0 tensors" in n for n in notes)
    assert any(f"keeps {format_bytes(kept)} of block-32 tensors as they are" in n for n in notes), notes
    # --quantization none: everything dequantized to float32
    none = memory_json(file, capsys, "--quantization", "none")
    assert none["weight_dtype"] == "fp32" and none["weight_bytes"] == 4 * hf_params and none["quantization"] is None
    assert any(f"dequantizes Q8_0 at load: the weights take {format_bytes(4 * hf_params)}" in n for n in none["notes"])


def test_directory_holding_one_gguf(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = model_dirs["llama-gqa"]
    write_gguf(model_dir, tmp_path / "model.gguf")
    llm = LLM(str(tmp_path), tokenizer=str(model_dir), num_kv_blocks=64)
    assert llm.engine.config.model.path == str(tmp_path / "model.gguf")
    shutil.copy(tmp_path / "model.gguf", tmp_path / "other.gguf")
    with pytest.raises(ValueError, match=r"holds 2 \.gguf files \(model\.gguf, other\.gguf\)"):
        LLM(str(tmp_path), tokenizer=str(model_dir))


def test_gguf_without_tokenizer_asks_for_one(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    file = write_gguf(model_dirs["llama-gqa"], tmp_path / "model.gguf")
    with pytest.raises(ValueError, match=r"tokenizer: cannot build a tokenizer from the metadata of model\.gguf"):
        LLM(str(file), num_kv_blocks=64)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"GGUF architecture 'gpt2' in m\.gguf is not supported; supported: llama"):
        LLM(str(tmp_path / "m.gguf"))


def test_type_gguf_cannot_dequantize_is_named(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    file = write_gguf(model_dirs["llama-gqa"], tmp_path / "m.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "q81.gguf"), "llama")
    for t in gguf.GGUFReader(str(file)).tensors:
        if t.name == "blk.0.ffn_up.weight":  # (128, 64) as Q8_1: 2 blocks of 40 bytes per row
            w.add_tensor(t.name, np.zeros((128, 80), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    reader = gguf.GGUFReader(str(file))
    for key, field in reader.fields.items():
        if key.startswith("llama."):
            w.add_key_value(key, field.contents(), field.types[0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    match = r"'blk\.0\.ffn_up\.weight' has type Q8_1, which the gguf package cannot dequantize"
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path / "q81.gguf"), tokenizer=str(model_dirs["llama-gqa"]), num_kv_blocks=64)


def test_truncated_file_names_the_tensor(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    file = write_gguf(model_dirs["llama-gqa"], tmp_path / "m.gguf")
    last = max(gguf.GGUFReader(str(file)).tensors, key=lambda t: t.data_offset)
    data = file.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: last.data_offset + 10])
    with pytest.raises(ValueError, match=rf"cut\.gguf is truncated: tensor '{last.name}' ends at byte"):
        LLM(str(tmp_path / "cut.gguf"), tokenizer=str(model_dirs["llama-gqa"]))
