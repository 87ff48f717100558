"""The one-call decode stack (model/decode_stack.py, cpu_kernels.c: decode_stack): on every decode step it runs,
its hidden states are bit-identical to the layer-by-layer module path; models and steps it does not cover take
the module path."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import pytest
import torch

from lmserve import LLM, SamplingParams, kernels
from lmserve.model.decode_stack import W4A8_STACK_MAX_ROWS
from lmserve.model.layers import choose_small_m_paths
from lmserve.model.llama import DecoderModel

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: kernels not built")

PROMPTS = [[5, 9, 23, 44, 11, 3, 70, 8], [100, 2, 57, 19], [31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41], [7, 7, 7]]


@pytest.fixture
def compared(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """Every forward the stack serves is recomputed on the module path (the stack switched off for one call;
    the K/V it writes again are the same values in the same slots); records (rows, bit-identical)."""
    seen: list[tuple[int, bool]] = []
    orig = DecoderModel.forward

    def both(self, input_ids, positions, kv_caches, meta):
        out = orig(self, input_ids, positions, kv_caches, meta)
        stack = self.decode_stack(kv_caches)
        if stack is not None and stack.applies(self.embed_tokens(input_ids), meta):
            self._decode_stack = None
            try:
                ref = orig(self, input_ids, positions, kv_caches, meta)
            finally:
                self._decode_stack = stack
            seen.append((input_ids.shape[0], torch.equal(out, ref)))
        return out

    monkeypatch.setattr(DecoderModel, "forward", both)
    return seen


def _generate(llm: LLM, n: int, max_tokens: int = 6) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS[:n], params)
    return [o.outputs[0].token_ids for o in outs]


CASES = [
    ("llama-gqa", {}, 2),
    ("llama-gqa", {}, 4),  # float32 with AVX-512: up to 8 rows in one call (skipped where the kernel takes 2)
    ("llama3-rope-untied", {}, 1),
    ("qwen2", {}, 2),  # q/k/v biases
    ("mistral-swa", {}, 2),  # every layer slides (window 12, shorter than the runs)
    ("qwen2-swa", {}, 2),  # one sliding layer, one full
    ("llama-gqa", {"weight_dtype": "bfloat16"}, 2),
    ("llama-gqa", {"quantization": "int8"}, 2),
    ("llama-gqa", {"quantization": "int4"}, 4),  # int4 kernels take up to 8 rows: four decodes in one call
    ("qwen2", {"quantization": "int4"}, 3),
    ("llama-gqa", {"kv_cache_dtype": "bfloat16"}, 2),
    ("llama-gqa", {"kv_cache_dtype": "int8"}, 2),
    ("mistral-swa", {"kv_cache_dtype": "fp8_e4m3"}, 2),
]


@pytest.mark.parametrize(
    ("name", "kw", "n"), CASES, ids=[f"{c[0]}-{'-'.join(map(str, c[1].values())) or 'fp32'}-{c[2]}" for c in CASES]
)
def test_stack_is_bit_identical_to_the_module_path(
    model_dirs: dict[str, Path], compared: list[tuple[int, bool]], name: str, kw: dict, n: int
) -> None:
    if not kw and n > kernels.f32_max_rows():
        pytest.skip(f"the float32 kernel takes {kernels.f32_max_rows()} rows on this CPU (no AVX-512)")
    llm = LLM(str(model_dirs[name]), num_kv_blocks=64, block_size=4, **kw)
    _generate(llm, n, max_tokens=16)  # 16 tokens: past the sliding windows, across several blocks
    assert compared, "no decode step took the stack"
    assert all(same for _, same in compared), compared
    assert max(rows for rows, _ in compared) == n, "the decodes of all requests run in one call"


def test_rows_beyond_the_kernels_take_the_module_path(model_dirs: dict[str, Path], compared: list) -> None:
    """int8 W8A8 projections take their C kernel for at most 2 rows: 3 decodes run layer by layer. float32
    takes up to kernels.f32_max_rows() (8 with AVX-512), int4 up to I4_MAX_ROWS."""
    llm = LLM(str(model_dirs["llama-gqa"]), num_kv_blocks=64, quantization="int8")
    runner = llm.engine.runner
    _generate(llm, 3)
    stack = runner.model.model.decode_stack(runner.kv_caches)
    assert stack is not None and stack.max_rows == 2
    assert compared == [], "no step of 3 decodes may take the stack"
    fp32 = LLM(str(model_dirs["llama-gqa"]), num_kv_blocks=64).engine.runner
    assert fp32.model.model.decode_stack(fp32.kv_caches).max_rows == kernels.f32_max_rows()
    kw = dict(num_kv_blocks=64, quantization="int4")
    int4 = LLM(str(model_dirs["llama-gqa"]), **kw, int4_compute="weight-only").engine.runner
    assert int4.model.model.decode_stack(int4.kv_caches).max_rows == kernels.I4_MAX_ROWS
    w4a8 = LLM(str(model_dirs["llama-gqa"]), **kw).engine.runner  # every projection on W4A8 panels
    assert w4a8.model.model.decode_stack(w4a8.kv_caches).max_rows == W4A8_STACK_MAX_ROWS


def test_w4a8_batched_decode_stays_in_one_call(model_dirs: dict[str, Path], compared: list) -> None:
    """Every projection on W4A8 panels (each row computed the same whatever the row count): 32 decode streams
    take the stack in one call per step, bit-identical to the module path."""
    llm = LLM(str(model_dirs["llama-gqa"]), num_kv_blocks=256, block_size=4, quantization="int4")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 500, (int(n),), generator=g).tolist() for n in torch.randint(3, 12, (32,), generator=g)]
    llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    assert compared and all(same for _, same in compared), compared
    assert max(rows for rows, _ in compared) == 32, "the decodes of all 32 streams in one call"


@pytest.mark.parametrize("name", ["qwen3", "gemma2", "gemma3", "olmo2", "phi3-longrope-partial"])
def test_layouts_it_does_not_compute_take_the_module_path(model_dirs: dict[str, Path], name: str) -> None:
    """q/k norms, sandwich or post norms, soft-capping, two rotary tables, partial rotary: never the stack."""
    runner = LLM(str(model_dirs[name]), num_kv_blocks=64).engine.runner
    assert runner.model.model.decode_stack(runner.kv_caches) is None
    assert runner.model.model.stack_linears() == []


def test_float16_kv_cache_takes_the_module_path(model_dirs: dict[str, Path]) -> None:
    runner = LLM(str(model_dirs["llama-gqa"]), num_kv_blocks=64, kv_cache_dtype="float16").engine.runner
    assert runner.model.model.decode_stack(runner.kv_caches) is None


def test_small_m_choice_and_the_stack(model_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    """ "torch" moves the projections off their kernels, so the stack stands aside; "auto" keeps the kernel for
    the projections the stack runs (logged) and times only the rest (the LM head); "kernel" restores it."""
    llm = LLM(str(model_dirs["llama3-rope-untied"]), num_kv_blocks=64)
    runner = llm.engine.runner
    decoder = runner.model.model
    _generate(llm, 1, max_tokens=2)
    assert decoder.decode_stack(runner.kv_caches) is not None
    choose_small_m_paths(runner.model, "torch")
    assert decoder.decode_stack(runner.kv_caches) is None, "the choice resets the stack's description"
    with caplog.at_level(logging.INFO, logger="lmserve.model.layers"):
        chosen = choose_small_m_paths(runner.model, "auto", reps=1)
    stacked = [r.getMessage() for r in caplog.records if "(decode stack)" in r.getMessage()]
    timed = [r.getMessage() for r in caplog.records if "M=1 pass" in r.getMessage()]
    assert len(stacked) == 4 and len(timed) == 1, (stacked, timed)  # qkv, o, gate_up, down; the untied head
    assert all(chosen[(m.out_features, m.in_features, "float32")] == "kernel" for m in decoder.stack_linears())
    assert decoder.decode_stack(runner.kv_caches) is not None
    before = _generate(llm, 2)
    choose_small_m_paths(runner.model, "torch")
    assert _generate(llm, 2) == before, "module path with torch projections: the same greedy tokens"


def test_kernel_wrapper_refuses_bad_operands(model_dirs: dict[str, Path]) -> None:
    runner = LLM(str(model_dirs["llama-gqa"]), num_kv_blocks=64).engine.runner
    stack = runner.model.model.decode_stack(runner.kv_caches)
    desc = ctypes.byref(stack._model)
    h = torch.zeros(1, stack._model.hidden)
    cos = sin = torch.zeros(1, stack._model.head_dim)
    ids = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(AssertionError, match="slot_mapping"):
        kernels.decode_stack(desc, h, torch.empty_like(h), cos, sin, ids.int(), ids[None], ids)
    with pytest.raises(AssertionError, match="one row per token"):
        kernels.decode_stack(desc, h, torch.empty(2, stack._model.hidden), cos, sin, ids, ids[None], ids)
