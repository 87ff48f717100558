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
from lmserve.model.decoder import CausalLM, DecoderModel
from lmserve.model.layers import choose_small_m_paths

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
    ("qwen3", {}, 2),  # q/k norm per head (the norms' kernel on both paths)
    ("qwen3", {"quantization": "int8"}, 4),
    ("mistral-swa", {}, 2),  # every layer slides (window 12, shorter than the runs)
    ("qwen2-swa", {}, 2),  # one sliding layer, one full
    ("llama-gqa", {"weight_dtype": "bfloat16"}, 2),
    ("llama-gqa", {"quantization": "int8"}, 2),
    ("llama-gqa", {"quantization": "int8"}, 4),  # int8 kernels take up to 8 rows too
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
    """int8 W8A8 projections take their C kernel for at most kernels.i8_kernel_rows() rows (8 with VNNI, 64 with
    AVX2 alone): one more decode runs layer by layer. float32 takes up to kernels.f32_max_rows() (8 with AVX-512),
    int4 up to I4_MAX_ROWS."""
    llm = LLM(str(model_dirs["llama-gqa"]), num_kv_blocks=128, quantization="int8")
    runner = llm.engine.runner
    rows = kernels.i8_kernel_rows()
    prompts = [PROMPTS[i % len(PROMPTS)] + [i + 1] for i in range(rows + 1)]
    llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    stack = runner.model.model.decode_stack(runner.kv_caches)
    assert stack is not None and stack.max_rows == rows
    assert compared == [], f"no step of {rows + 1} decodes may take the stack"
    fp32_llm = LLM(str(model_dirs["llama-gqa"]), num_kv_blocks=64)  # kept alive: collecting an LLM closes its engine
    fp32 = fp32_llm.engine.runner
    assert fp32.model.model.decode_stack(fp32.kv_caches).max_rows == kernels.f32_max_rows()
    kw = dict(num_kv_blocks=64, quantization="int4")
    int4_llm = LLM(
        str(model_dirs["llama-gqa"]), **kw, int4_compute="weight-only"
    )  # kept alive: collecting an LLM closes its engine
    int4 = int4_llm.engine.runner
    assert int4.model.model.decode_stack(int4.kv_caches).max_rows == kernels.I4_MAX_ROWS
    w4a8_llm = LLM(str(model_dirs["llama-gqa"]), **kw)  # kept alive: collecting an LLM closes its engine
    w4a8 = w4a8_llm.engine.runner  # every projection on W4A8 panels
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


HEAD_CASES = [({}, 1), ({"quantization": "int8"}, 2), ({"quantization": "int4"}, 1), ({"quantization": "int4"}, 4)]


HEAD_IDS = [f"{c[0].get('quantization', 'fp32')}-{c[1]}" for c in HEAD_CASES]


@pytest.mark.parametrize(("kw", "n"), HEAD_CASES, ids=HEAD_IDS)
def test_stack_logits_are_the_heads(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, kw: dict, n: int
) -> None:
    """A step the stack runs with the LM head (its few-row kernel: "kernel" keeps the float32 head off oneDNN):
    compute_logits hands out those logits, bit-identical to the head's Linear.forward on the same hidden states."""
    monkeypatch.setenv("LMSERVE_SMALL_M_LINEAR", "kernel")
    seen: list[bool] = []
    orig = CausalLM.compute_logits

    def check(self: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
        stack = self.model._decode_stack
        fused = None if stack is None else stack.step_logits
        out = orig(self, hidden)
        if fused is not None and fused[0] is hidden:
            assert out is fused[1]
            seen.append(torch.equal(out, self.lm_head(hidden)))
        return out

    monkeypatch.setattr(CausalLM, "compute_logits", check)
    llm = LLM(str(model_dirs["llama-gqa"]), num_kv_blocks=64, block_size=4, **kw)
    _generate(llm, n, max_tokens=8)
    assert seen and all(seen), seen


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "olmo2", "phi3-longrope-partial"])
def test_layouts_it_does_not_compute_take_the_module_path(model_dirs: dict[str, Path], name: str) -> None:
    """Sandwich or post norms, soft-capping, two rotary tables, partial rotary: never the stack."""
    runner_llm = LLM(str(model_dirs[name]), num_kv_blocks=64)  # kept alive: collecting an LLM closes its engine
    runner = runner_llm.engine.runner
    assert runner.model.model.decode_stack(runner.kv_caches) is None
    assert runner.model.model.stack_linears() == []


def test_float16_kv_cache_takes_the_module_path(model_dirs: dict[str, Path]) -> None:
    runner_llm = LLM(
        str(model_dirs["llama-gqa"]), num_kv_blocks=64, kv_cache_dtype="float16"
    )  # kept alive: collecting an LLM closes its engine
    runner = runner_llm.engine.runner
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
    runner_llm = LLM(str(model_dirs["llama-gqa"]), num_kv_blocks=64)  # kept alive: collecting an LLM closes its engine
    runner = runner_llm.engine.runner
    stack = runner.model.model.decode_stack(runner.kv_caches)
    desc = ctypes.byref(stack._model)
    h = torch.zeros(1, stack._model.hidden)
    cos = sin = torch.zeros(1, stack._model.head_dim)
    ids = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(AssertionError, match="slot_mapping"):
        kernels.decode_stack(desc, h, torch.empty_like(h), cos, sin, ids.int(), ids[None], ids)
    with pytest.raises(AssertionError, match="one row per token"):
        kernels.decode_stack(desc, h, torch.empty(2, stack._model.hidden), cos, sin, ids, ids[None], ids)


# ---- LoRA rows inside the stack: the hooks' deltas added in C (cpu_kernels.c: ls_lora_add, lora_delta_f32)

LORA_SPECS = {"all8": (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
              "qv16": (16, 32, ("q_proj", "v_proj")), "mlp8": (8, 8, ("o_proj", "gate_proj", "down_proj"))}  # fmt: skip


@pytest.fixture(scope="module")
def lora_dirs(tmp_path_factory: pytest.TempPathFactory, model_dirs: dict[str, Path]) -> dict[str, dict[str, Path]]:
    from tests.helpers import require_extra

    require_extra("test", "peft")
    from tests.lora_helpers import build_adapter

    root = tmp_path_factory.mktemp("stack_lora")
    return {
        base: {
            n: build_adapter(model_dirs[base], root / base / n, r, a, t, seed=i)
            for i, (n, (r, a, t)) in enumerate(LORA_SPECS.items())
        }  # fmt: skip
        for base in ("llama-gqa", "qwen2")
    }


@pytest.fixture
def compared_lora(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool, bool]]:
    """As `compared`, recording (rows, bit-identical, the step had LoRA rows) for every forward the stack serves;
    the module path recomputes it with the LoRA hooks on."""
    seen: list[tuple[int, bool, bool]] = []
    orig = DecoderModel.forward

    def both(self, input_ids, positions, kv_caches, meta):
        out = orig(self, input_ids, positions, kv_caches, meta)
        stack = self.decode_stack(kv_caches)
        lora = self.lora_hooks if self.lora_active else None
        if stack is not None and stack.applies(self.embed_tokens(input_ids), meta):
            if lora is not None and not stack.takes_lora(lora):
                return out
            self._decode_stack = None
            try:
                ref = orig(self, input_ids, positions, kv_caches, meta)
            finally:
                self._decode_stack = stack
            seen.append((input_ids.shape[0], torch.equal(out, ref), bool(lora is not None and lora.groups)))
        return out

    monkeypatch.setattr(DecoderModel, "forward", both)
    return seen


def _lora_llm(model_dirs: dict[str, Path], name: str, **kw) -> LLM:
    return LLM(str(model_dirs[name]), num_kv_blocks=96, block_size=4, enable_lora=True, max_loras=3,
               max_lora_rank=16, **kw)  # fmt: skip


LORA_CASES = [
    ("llama-gqa", {}, ["all8"]),  # one stream under an adapter: the single-stream fast path
    ("llama-gqa", {}, ["all8", None, "qv16", "mlp8"]),  # three adapters and the base in one call (AVX-512: 8 rows)
    ("qwen2", {}, ["qv16", "all8"]),  # q/k/v biases, then the delta
    ("llama-gqa", {"quantization": "int4"}, ["mlp8", "all8", None]),
    # W4A8 panels take up to 64 decode rows in one call: a run of 7 rows of one adapter and three more
    ("llama-gqa", {"quantization": "int4"}, ["all8"] * 7 + ["qv16", None, "mlp8"]),
    ("llama-gqa", {"weight_dtype": "bfloat16"}, ["all8", None]),
    ("llama-gqa", {"kv_cache_dtype": "int8"}, ["qv16", "all8"]),
]


@pytest.mark.parametrize(
    ("name", "kw", "names"), LORA_CASES,
    ids=[f"{c[0]}-{'-'.join(map(str, c[1].values())) or 'fp32'}-{len(c[2])}" for c in LORA_CASES],
)  # fmt: skip
def test_lora_rows_take_the_stack_bit_identically(
    model_dirs: dict[str, Path], lora_dirs: dict, compared_lora: list, name: str, kw: dict, names: list
) -> None:
    from lmserve import LoRARequest

    if not kw and len(names) > kernels.f32_max_rows():
        pytest.skip(f"the float32 kernel takes {kernels.f32_max_rows()} rows on this CPU (no AVX-512)")
    llm = _lora_llm(model_dirs, name, **kw)
    stack = llm.engine.runner.model.model.decode_stack(llm.engine.runner.kv_caches)
    if stack is None or stack.max_rows < len(names):
        pytest.skip(f"the stack takes {stack and stack.max_rows} rows here (int4 off W4A8 panels)")
    ids = {n: i + 1 for i, n in enumerate(LORA_SPECS)}
    reqs = [None if n is None else LoRARequest(n, ids[n], str(lora_dirs[name][n])) for n in names]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = (PROMPTS * 3)[: len(names)]
    llm.generate(prompts, params, lora_request=reqs, use_tqdm=False)
    lora_steps = [c for c in compared_lora if c[2]]
    assert lora_steps, "no decode step with LoRA rows took the stack"
    assert all(same for _, same, _ in compared_lora), compared_lora
    assert max(rows for rows, _, _ in lora_steps) == len(names), "the decodes of all requests run in one call"


def test_lora_in_the_stack_matches_peft(model_dirs: dict[str, Path], lora_dirs: dict) -> None:
    """A single stream and a mixed batch under adapters, decoded on the stack: PeftModel's logits (1e-4) at every
    step and its greedy tokens."""
    from lmserve import LoRARequest
    from tests.lora_helpers import peft_greedy, peft_last_logits

    base = model_dirs["llama-gqa"]
    llm = _lora_llm(model_dirs, "llama-gqa")
    engine, decoder = llm.engine, llm.engine.runner.model.model
    names = ["all8", "qv16", None][: max(1, min(3, kernels.f32_max_rows()))]
    reqs = [None if n is None else LoRARequest(n, i + 1, str(lora_dirs["llama-gqa"][n])) for i, n in enumerate(names)]
    taken = []
    stack_cls = type(decoder.decode_stack(engine.runner.kv_caches))
    orig_run = stack_cls.run

    def run(self, h, cos, sin, meta, lora=None, **kw):
        taken.append(lora is not None and bool(lora.groups))
        return orig_run(self, h, cos, sin, meta, lora, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stack_cls, "run", run)
        for i, req in enumerate(reqs):
            engine.add_request(str(i), PROMPTS[i], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                               lora_request=req)  # fmt: skip
        for step in range(6):
            sched = engine.scheduler.schedule()
            out = engine.runner.execute(sched)
            for row, s in enumerate(sched.scheduled):
                n = names[int(s.request.request_id)]
                adapter = None if n is None else lora_dirs["llama-gqa"][n]
                expected = peft_last_logits(base, adapter, s.request.all_token_ids)
                torch.testing.assert_close(out.logits[row], expected, atol=1e-4, rtol=1e-4, msg=f"step {step} {n}")
            engine.scheduler.update_from_output(sched, out, engine.config.scheduler.max_model_len)
    assert sum(taken) >= 4, f"the decode steps with LoRA rows took the stack: {taken}"
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = _lora_llm(model_dirs, "llama-gqa").generate(PROMPTS[: len(names)], params, lora_request=reqs, use_tqdm=False)
    for out, n, prompt in zip(outs, names, PROMPTS, strict=False):
        adapter = None if n is None else lora_dirs["llama-gqa"][n]
        assert list(out.outputs[0].token_ids) == peft_greedy(base, adapter, prompt, 10), n


def test_lora_delta_kernel_is_the_two_products() -> None:
    """kernels.lora_delta against torch: y += (x · A[:c]ᵀ) · B[:, :c]ᵀ on a slot's stacked weights (float32 sums in
    another order: 1e-5)."""
    gen = torch.Generator().manual_seed(0)
    x, a, b = (torch.randn(s, generator=gen) for s in ((3, 40), (24, 40), (50, 24)))
    y = torch.randn(3, 50, generator=gen)
    ref = y + (x @ a[:16].t()) @ b[:, :16].t()
    kernels.lora_delta(x, a, b, y, 16)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(AssertionError, match="LoRA delta shapes"):
        kernels.lora_delta(x, a, b, y, 25)
