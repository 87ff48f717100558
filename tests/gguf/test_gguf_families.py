"""GGUF files of the dense families of 2026 as llama.cpp's converter writes them (`smollm3`, `olmo2` for OLMo 2 and
OLMo 3, `gemma4`), written from the tiny random HF models by tests/gguf_helpers.py: the reader's names against
gguf's own table, greedy tokens identical to HF transformers, Q8_0 kept as it is, the memory ledger, the errors."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

import gguf
from lmserve import LLM, SamplingParams
from lmserve.checkpoint import gguf as lm_gguf
from lmserve.checkpoint.registry.family import LayerSpec
from lmserve.config.model import ModelConfig
from tests.gguf_helpers import GGUF_ARCH, dequantized_hf_model, memory_json, rewrite_gguf, write_gguf
from tests.hf_reference import assert_greedy_matches_hf_up_to_margin, hf_greedy

PROMPTS = ["The capital of France is", "def fib(n):", "床前明月光，疑是地上霜。"]
# model_dirs name → (GGUF architecture, the HF architecture lmserve serves it as)
FAMILIES = {
    "smollm3": ("smollm3", "SmolLM3ForCausalLM"),
    "olmo2": ("olmo2", "Olmo2ForCausalLM"),
    "olmo3": ("olmo2", "Olmo3ForCausalLM"),
    "gemma4": ("gemma4", "Gemma4ForCausalLM"),
}


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-families")


def _greedy(llm: LLM, max_tokens: int = 8) -> list[tuple[list[int], list[int]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [(o.prompt_token_ids, o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _layers(model: Any) -> list[LayerSpec]:
    """A ModelConfig's layer specs with the model-wide defaults filled in (None: the model's head width / KV heads)."""
    return [
        replace(s, head_dim=s.head_dim or model.head_dim, num_kv_heads=s.num_kv_heads or model.num_kv_heads)
        for s in model.layers
    ]


# ---- the reader's names: the inverse of gguf's own table (the converter's) --------------------------------


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_tensor_name_inverts_gguf_name_map(model_dirs: dict[str, Path], name: str) -> None:
    arch = FAMILIES[name][0]
    spec = lm_gguf.GGUF_ARCHS[arch]
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], 8)
    hf_names = list(load_file(model_dirs[name] / "model.safetensors"))
    assert any(".layer_scalar" in n for n in hf_names) == (arch == "gemma4")
    for hf_name in hf_names:
        suffixed = hf_name if hf_name.endswith((".weight", ".bias")) else f"{hf_name}.weight"  # (as the converter)
        gguf_name = name_map.get_name(suffixed, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        assert lm_gguf.hf_tensor_name(gguf_name, spec) == hf_name


# ---- F32: the HF model exactly --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_f32_gguf_is_the_hf_model(model_dirs: dict[str, Path], gguf_dir: Path, name: str) -> None:
    model_dir = model_dirs[name]
    arch, hf_arch = FAMILIES[name]
    file = write_gguf(model_dir, gguf_dir / f"{name}-f32.gguf")
    assert gguf.GGUFReader(str(file)).get_field("general.architecture").contents() == arch
    llm = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64)
    ours = llm.engine.config.model
    assert ours.architecture == hf_arch
    theirs = ModelConfig.from_hf(str(model_dir))
    assert _layers(ours) == _layers(theirs), "the same layers: windows, rotary, KV sources, head widths"
    assert (ours.rope, ours.rope_local, ours.rotary_dim) == (theirs.rope, theirs.rope_local, theirs.rotary_dim)
    for prompt_ids, got in _greedy(llm):
        assert got == hf_greedy(model_dir, prompt_ids, len(got)), (name, prompt_ids)


# ---- Q8_0: dequantized, and kept as it is in the file ----------------------------------------------------


@pytest.mark.parametrize("name", ["olmo3", pytest.param("gemma4", marks=pytest.mark.slow)])
def test_q8_0_gguf_matches_hf_on_its_weights(
    model_dirs: dict[str, Path], gguf_dir: Path, tmp_path: Path, name: str, caplog
) -> None:
    from tests.gguf.test_gguf import _weight_bytes

    model_dir = model_dirs[name]
    file = write_gguf(model_dir, gguf_dir / f"{name}-q8_0.gguf", "Q8_0")
    ref_dir = dequantized_hf_model(model_dir, file, tmp_path / "ref")
    with caplog.at_level(logging.INFO, logger="lmserve.checkpoint.gguf"):  # weight-only: the file's math exactly
        kept = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64, int4_compute="weight-only")
    logged = [r.getMessage() for r in caplog.records if r.name == "lmserve.checkpoint.gguf"]
    assert any("Q8_0 tensors kept as they are in the file" in line for line in logged), logged
    for prompt_ids, got in _greedy(kept):
        matched = assert_greedy_matches_hf_up_to_margin(ref_dir, prompt_ids, got, 1e-3, name)
        assert matched == len(got), f"{name}: a near-tie flipped at token {matched}"
    ckpt = lm_gguf.GGUFCheckpoint(file)
    assert lm_gguf.resident_weight_bytes(ckpt, 4, True)[0] == _weight_bytes(kept)
    plain = LLM(str(file), tokenizer=str(model_dir), num_kv_blocks=64, quantization="none")  # all dequantized
    assert lm_gguf.resident_weight_bytes(ckpt, 4, False)[0] == _weight_bytes(plain)


# ---- lmserve memory --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_memory_cli_counts_the_gguf_as_its_hf_model(
    model_dirs: dict[str, Path], gguf_dir: Path, name: str, capsys
) -> None:
    model_dir = model_dirs[name]
    file = write_gguf(model_dir, gguf_dir / f"{name}-mem.gguf")
    ours, theirs = (memory_json(m, capsys, "--weight-dtype", "fp32") for m in (file, model_dir))
    weights = load_file(model_dir / "model.safetensors")
    hf_params = sum(t.numel() for n, t in weights.items() if n != "lm_head.weight")  # tied head
    assert ours["num_parameters"] == theirs["num_parameters"] == hf_params
    for key in ("kv_bytes_per_token", "kv_bytes_per_request", "weight_bytes"):
        assert ours[key] == theirs[key], key


# ---- what the reader refuses, and the metadata's other spellings -------------------------------------------


def test_gemma4_with_experts_is_refused_naming_them(model_dirs: dict[str, Path], gguf_dir: Path) -> None:
    file = write_gguf(model_dirs["gemma4"], gguf_dir / "gemma4-base.gguf")
    moe = rewrite_gguf(file, gguf_dir / "gemma4-moe.gguf", {"gemma4.expert_count": (4, gguf.GGUFValueType.UINT32)})
    with pytest.raises(ValueError, match=r"gemma4 with experts .* is not supported"):
        LLM(str(moe), tokenizer=str(model_dirs["gemma4"]), num_kv_blocks=64)


def test_gemma4_without_rope_freqs_is_refused(model_dirs: dict[str, Path], gguf_dir: Path) -> None:
    file = write_gguf(model_dirs["gemma4"], gguf_dir / "gemma4-base2.gguf")
    cut = rewrite_gguf(file, gguf_dir / "gemma4-norope.gguf", drop=("rope_freqs.weight",))
    with pytest.raises(ValueError, match=r"gemma4 has no rope_freqs tensor"):
        lm_gguf.GGUFCheckpoint(cut).hf_config()


@pytest.mark.parametrize(("pattern", "sliding"), [(2, [True, False, True, False]), (None, [True, True, True, False])])
def test_olmo3_window_pattern_as_a_period(
    model_dirs: dict[str, Path], gguf_dir: Path, pattern: int | None, sliding: list[bool]
) -> None:
    """llama.cpp's other spelling of the pattern: every n-th layer global (n = 4 when the key is absent)."""
    file = write_gguf(model_dirs["olmo3"], gguf_dir / "olmo3-base.gguf")
    value = None if pattern is None else (pattern, gguf.GGUFValueType.UINT32)
    out = rewrite_gguf(
        file, gguf_dir / f"olmo3-period-{pattern}.gguf", {"olmo2.attention.sliding_window_pattern": value}
    )
    cfg = lm_gguf.GGUFCheckpoint(out).hf_config()
    assert cfg["architectures"] == ["Olmo3ForCausalLM"]
    assert cfg["layer_types"] == ["sliding_attention" if s else "full_attention" for s in sliding]


def test_olmo2_without_a_window_is_olmo2(model_dirs: dict[str, Path], gguf_dir: Path) -> None:
    cfg = lm_gguf.GGUFCheckpoint(write_gguf(model_dirs["olmo2"], gguf_dir / "olmo2-cfg.gguf")).hf_config()
    assert cfg["architectures"] == ["Olmo2ForCausalLM"] and "layer_types" not in cfg
    assert GGUF_ARCH["Olmo3ForCausalLM"] == GGUF_ARCH["Olmo2ForCausalLM"] == "olmo2"
