"""The hybrid models' layers in the one-call decode stack (model/hybrid_stack.py, kernels/hybrid_stack.c): on every
decode step it runs, its hidden states and the recurrent states it leaves are bit-identical to the module path's,
and the greedy tokens are HF's (float32); the partial-rotary KV write is apply_rotary's bits; steps and models it does
not cover take the module path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmserve import LLM, SamplingParams, kernels
from lmserve.model import hybrid_stack
from lmserve.model.attention import AttentionMetadata
from lmserve.model.decoder import DecoderModel
from lmserve.model.kv_cache import KVCache
from lmserve.model.linear_attention import LinearAttentionMetadata
from tests.hybrid_helpers import PROMPTS, hf_greedy

# (tiny tensors: two intra-op threads spin against each other on a busy 2-core machine)
pytestmark = [
    pytest.mark.skipif(not kernels.available(), reason="no C compiler: kernels not built"),
    pytest.mark.usefixtures("one_torch_thread"),
]


@pytest.fixture
def compared(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool, bool]]:
    """Every forward the stack serves is recomputed on the module path from the same recurrent states (copied before
    the stack's step, put back for the module path's; the K/V rows it writes again are the same values in the same
    slots); records (rows, hidden states bit-identical, states left bit-identical)."""
    seen: list[tuple[int, bool, bool]] = []
    orig = DecoderModel.forward

    def both(self, input_ids, positions, kv_caches, meta):
        stack = self.decode_stack(kv_caches)
        if stack is None or not stack.applies(self.embed_tokens(input_ids), meta):
            return orig(self, input_ids, positions, kv_caches, meta)
        tensors = [t for c in kv_caches if hybrid_stack.is_state(c) for t in _state_tensors(c)]
        before = [t.clone() for t in tensors]
        out = orig(self, input_ids, positions, kv_caches, meta)
        after = [t.clone() for t in tensors]
        for t, b in zip(tensors, before, strict=True):
            t.copy_(b)
        self._decode_stack = None
        try:
            ref = orig(self, input_ids, positions, kv_caches, meta)
        finally:
            self._decode_stack = stack
        same_states = all(torch.equal(a, t) for a, t in zip(after, tensors, strict=True))
        seen.append((input_ids.shape[0], torch.equal(out, ref), same_states))
        return out

    monkeypatch.setattr(DecoderModel, "forward", both)
    return seen


def _state_tensors(state) -> list[torch.Tensor]:  # noqa: ANN001
    """A LayerState's slots and (prefix caching) its snapshots, which decode tokens completing a block write."""
    snapshots = [t for t in (state.conv_snapshots, state.ssm_snapshots) if t is not None]
    return [state.conv, state.ssm, *snapshots]


# (family, engine options, decode rows): float32 takes kernels.f32_max_rows() rows (2 without AVX-512); the fourth
# prompt is one token: its first decode row starts from a zeroed slot
CASES = [
    ("qwen3_5", {}, 2),
    ("qwen3_5", {"quantization": "int8"}, 4),
    ("qwen3_5", {"quantization": "int4"}, 4),  # every projection on W4A8 panels
    ("qwen3_5", {"kv_cache_dtype": "int8"}, 2),
    ("qwen3_5_moe", {}, 2),
    ("qwen3_5_moe", {"quantization": "int8"}, 3),
    ("qwen3_next", {}, 2),  # fused qkvz / ba projections, a dense layer among the sparse ones, the shared expert
    ("qwen3_next", {"quantization": "int8"}, 4),
]


@pytest.mark.parametrize(
    ("family", "kw", "n"),
    CASES,
    ids=[f"{c[0]}-{'-'.join(f'{k}={v}' for k, v in c[1].items()) or 'fp32'}-{c[2]}" for c in CASES],
)
def test_hybrid_models_decode_in_one_call(
    hybrid_dirs: dict[str, Path], compared: list, family: str, kw: dict, n: int
) -> None:
    """The stack runs every decode step (all n rows in one call), bit-identical to the module path in its output
    and in the states it leaves; float32 greedy tokens are HF's."""
    if "quantization" not in kw and n > kernels.f32_max_rows():
        pytest.skip(f"the float32 kernel takes {kernels.f32_max_rows()} rows on this CPU")
    model_dir = hybrid_dirs[family]
    llm = LLM(str(model_dir), num_kv_blocks=64, block_size=4, **kw)
    runner = llm.engine.runner
    stack = runner.model.model.decode_stack(runner.kv_caches)
    assert stack is not None and stack._gdns, "the hybrid model takes the one-call stack"
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS[:n], params, use_tqdm=False)
    assert compared and all(same and states for _, same, states in compared), compared
    assert max(rows for rows, _, _ in compared) == n, "the decodes of all requests run in one call"
    if not kw:
        for out in outs:
            assert out.outputs[0].token_ids == hf_greedy(model_dir, out.prompt_token_ids, 12), out.prompt


def test_chunked_prefill_beside_the_stack_keeps_hf_tokens(hybrid_dirs: dict[str, Path], compared: list) -> None:
    """Prompts in chunks of 5 tokens beside decode rows: the mixed steps take the module path, the pure decode steps
    the stack, the states passing between them; the greedy tokens stay HF's."""
    model_dir = hybrid_dirs["qwen3_5"]
    llm = LLM(str(model_dir), num_kv_blocks=64, block_size=4, max_num_batched_tokens=5)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert compared and all(same and states for _, same, states in compared), compared
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(model_dir, out.prompt_token_ids, 12), out.prompt


def test_bfloat16_state_keeps_the_module_path(hybrid_dirs: dict[str, Path]) -> None:
    llm = LLM(str(hybrid_dirs["qwen3_5"]), num_kv_blocks=64, state_cache_dtype="bfloat16")
    runner = llm.engine.runner
    assert runner.model.model.decode_stack(runner.kv_caches) is None


def test_steps_with_chunks_or_chunk_saves_take_the_module_path() -> None:
    """A decode step takes the stack when its state metadata has every row on a slot: no chunk, no chunk's save."""
    slots = torch.tensor([3, 1], dtype=torch.int64)
    meta = AttentionMetadata(slot_mapping=torch.zeros(2, dtype=torch.int64), num_decode_tokens=2)
    meta.linear = LinearAttentionMetadata(slots, 2)
    assert hybrid_stack.takes_step(meta, 2)
    meta.linear = LinearAttentionMetadata(slots, 2, saves={0: (4, 0)})
    assert not hybrid_stack.takes_step(meta, 2)
    meta.linear = LinearAttentionMetadata(slots, 2, decode_saves=[(1, 0)])  # (saved after the call: end_step)
    assert hybrid_stack.takes_step(meta, 2)
    meta.linear = LinearAttentionMetadata(slots, 2, prefills=[(2, 5, 0, True)])
    assert not hybrid_stack.takes_step(meta, 2)
    meta.linear = None
    assert not hybrid_stack.takes_step(meta, 2)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8", "fp8_e4m3"])
def test_partial_rotary_kv_write_is_apply_rotarys(kv_dtype: str) -> None:
    """kernels.rope_write_kv with cos / sin narrower than the heads (the gated attention's partial rotary): q and k
    are apply_rotary's to the bit, and the cache holds the bytes KVCache.write stores for them."""
    from lmserve.config.engine import RopeConfig
    from lmserve.model.layers import RotaryEmbedding, apply_rotary

    tokens, heads, kv_heads, d, rd, block_size = 5, 4, 2, 16, 4, 4
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), rd, 64)
    cos, sin = rotary(torch.randperm(64)[:tokens], torch.float32)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g) * 3
    q, k, v = (t.view(tokens, -1, d) for t in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
    q_want, k_want = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    slots = torch.randperm(8 * block_size, generator=g)[:tokens]
    ref = KVCache.allocate(8, block_size, kv_heads, d, kv_dtype, torch.device("cpu"))
    ref.write(k_want, v, slots)
    out = KVCache.allocate(8, block_size, kv_heads, d, kv_dtype, torch.device("cpu"))
    q, k = q.contiguous(), k.contiguous()
    kernels.rope_write_kv(q, k, v, cos.squeeze(1), sin.squeeze(1), out.k, out.v, slots, out.k_scale, out.v_scale)
    assert torch.equal(q, q_want) and torch.equal(k, k_want)
    for got, want in ((out.k, ref.k), (out.v, ref.v), (out.k_scale, ref.k_scale), (out.v_scale, ref.v_scale)):
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
