"""Gated DeltaNet against HF transformers: the delta rule (chunked and recurrent), the causal conv1d with its window,
chunked prefill equal to a whole-prompt prefill, and whole layers (Qwen3.5, Qwen3-Next) on random weights."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf35
from transformers.models.qwen3_next import modeling_qwen3_next as hfnext

from lmserve.model.linear_attention import (
    GatedDeltaNet,
    LinearAttentionDims,
    LinearAttentionMetadata,
    chunk_gated_delta_rule,
    conv1d_chunk,
    conv1d_decode,
    recurrent_gated_delta_rule,
)

HK, HV, K, V = 2, 4, 16, 8


def random_inputs(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, HK, K, generator=gen)
    k = torch.randn(n, HK, K, generator=gen)
    v = torch.randn(n, HV, V, generator=gen)
    g = -torch.rand(n, HV, generator=gen) * 2  # log decay <= 0
    beta = torch.rand(n, HV, generator=gen)
    state = torch.randn(HV, K, V, generator=gen) * 0.3
    return q, k, v, g, beta, state


def hf_chunk(q, k, v, g, beta, state):
    out, s = hf35.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=None if state is None else state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return out[0], s[0]


@pytest.mark.parametrize("n", [1, 5, 64, 100, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_rule_matches_hf(n: int, with_state: bool) -> None:
    q, k, v, g, beta, state = random_inputs(n)
    state = state if with_state else None
    out, s = chunk_gated_delta_rule(q, k, v, g, beta, state)
    ref_out, ref_s = hf_chunk(q, k, v, g, beta, state)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, ref_s, rtol=1e-4, atol=1e-5)


def test_recurrent_rule_matches_hf_and_the_chunked_rule() -> None:
    q, k, v, g, beta, state = random_inputs(3, seed=1)
    states = torch.stack([state, state * 0.5, -state])  # three sequences, one token each
    out, s = recurrent_gated_delta_rule(q, k, v, g, beta, states)
    ref_out, ref_s = hf35.torch_recurrent_gated_delta_rule(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], initial_state=states,
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    torch.testing.assert_close(out, ref_out[:, 0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s, ref_s, rtol=1e-5, atol=1e-6)
    one_out, one_s = chunk_gated_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], states[0])
    torch.testing.assert_close(one_out[0], out[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(one_s, s[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cuts", [(1,), (7, 64), (30, 31, 99), (64,)])
def test_state_carried_across_chunks_equals_one_prefill(cuts: tuple[int, ...]) -> None:
    n = 150
    q, k, v, g, beta, _ = random_inputs(n, seed=2)
    whole_out, whole_s = chunk_gated_delta_rule(q, k, v, g, beta, None)
    outs, s = [], None
    for a, b in zip((0, *cuts), (*cuts, n), strict=True):
        o, s = chunk_gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), whole_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, whole_s, rtol=1e-4, atol=1e-5)
    # then decode token by token from a prefix's state
    o, s = chunk_gated_delta_rule(q[:100], k[:100], v[:100], g[:100], beta[:100], None)
    for t in range(100, n):
        o, s1 = recurrent_gated_delta_rule(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1],
                                           s[None])  # fmt: skip
        s = s1[0]
        torch.testing.assert_close(o[0], whole_out[t], rtol=1e-4, atol=1e-5)


def test_conv1d_window_matches_hf_whole_sequence() -> None:
    channels, width, n = 6, 4, 11
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    ref = hf35.causal_conv1d_fn(x.t()[None], weight, None, activation="silu")[0].t()  # torch fallback
    for cut in (1, 2, 5):  # a chunk shorter than the window too
        a, state = conv1d_chunk(x[:cut], None, weight)
        b, state = conv1d_chunk(x[cut:8], state, weight)
        rows = [a, b]
        for t in range(8, n):
            o, states = conv1d_decode(x[t : t + 1], state[None], weight)
            state = states[0]
            rows.append(o)
        torch.testing.assert_close(torch.cat(rows), ref, rtol=1e-6, atol=1e-6)
    # HF's single-token update on its (kernel-wide) state agrees with the window
    hf_state = F.pad(x[: n - 1].t(), (1, 0))[:, -width:].clone()[None]
    hf_out = hf35.causal_conv1d_update(x[n - 1 :].t()[None], hf_state, weight, None, activation="silu")
    torch.testing.assert_close(hf_out[0, :, 0], ref[-1], rtol=1e-6, atol=1e-6)


def tiny_text_config(cls, **extra):
    return cls(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_key_heads=HK, linear_num_value_heads=HV,
        linear_key_head_dim=K, linear_value_head_dim=V, linear_conv_kernel_dim=4, **extra,
    )  # fmt: skip


def randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def run_split(mine: GatedDeltaNet, x: torch.Tensor, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Run sequences (rows of x (S, n, hidden)) through `mine` in steps: seqs[i] lists sequence i's chunk
    lengths; a length-1 entry is a decode row (at position 0 too: a one-token prompt, from a zeroed slot). Returns
    each sequence's outputs (n, hidden)."""
    d = mine.dims
    conv = torch.zeros(len(seqs) + 1, d.conv_dim, d.conv_kernel - 1)
    ssm = torch.zeros(len(seqs) + 1, d.num_v_heads, d.k_dim, d.v_dim)
    conv[:], ssm[:] = 5.0, 5.0  # stale states: a fresh sequence must not read its slot
    pos = [0] * len(seqs)
    outs = [[] for _ in seqs]
    for step in range(max(len(s) for s in seqs)):
        decodes = [i for i, s in enumerate(seqs) if step < len(s) and s[step] == 1]
        chunks = [i for i, s in enumerate(seqs) if step < len(s) and i not in decodes]
        rows, prefills, start = [], [], len(decodes)
        for i in decodes:
            rows.append(x[i, pos[i] : pos[i] + 1])
        for i in chunks:
            n = seqs[i][step]
            rows.append(x[i, pos[i] : pos[i] + n])
            prefills.append((start, start + n, i + 1, pos[i] == 0))
            start += n
        slots = torch.tensor([i + 1 for i in decodes], dtype=torch.long)
        fresh = [i + 1 for i in decodes if pos[i] == 0]
        meta = LinearAttentionMetadata(slots, len(decodes), prefills, torch.tensor(fresh) if fresh else None)
        out = mine(torch.cat(rows), conv, ssm, meta)
        for i in decodes:
            outs[i].append(out[decodes.index(i) : decodes.index(i) + 1])
        for (a, b, _, _), i in zip(prefills, chunks, strict=True):
            outs[i].append(out[a:b])
        for i, s in enumerate(seqs):
            if step < len(s):
                pos[i] += s[step]
    return [torch.cat(o) for o in outs]


def test_layer_matches_hf_qwen3_5_in_mixed_steps() -> None:
    cfg = tiny_text_config(hf35.Qwen3_5TextConfig)
    ref = hf35.Qwen3_5GatedDeltaNet(cfg, 0).eval()
    randomize(ref, 4)
    mine = GatedDeltaNet(LinearAttentionDims.from_hf(cfg.to_dict())).eval()
    mine.load_state_dict(ref.state_dict())
    x = torch.randn(3, 20, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = ref(x)  # whole sequences, no cache: HF's chunked rule
        got = run_split(mine, x, [[20], [3, 9, 1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 5, 11]])
    for i in range(3):
        torch.testing.assert_close(got[i], expected[i], rtol=1e-4, atol=1e-5)


def test_layer_matches_hf_qwen3_next_with_its_fused_projections() -> None:
    cfg = tiny_text_config(hfnext.Qwen3NextConfig)
    ref = hfnext.Qwen3NextGatedDeltaNet(cfg, 0).eval()
    randomize(ref, 6)
    mine = GatedDeltaNet(LinearAttentionDims.from_hf(cfg.to_dict()), fused=True).eval()
    mine.load_state_dict(ref.state_dict())  # the checkpoint's fused projections as they are
    x = torch.randn(2, 13, cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = ref(x)
        got = run_split(mine, x, [[13], [4, 6, 1, 1, 1]])
    for i in range(2):
        torch.testing.assert_close(got[i], expected[i], rtol=1e-4, atol=1e-5)


def test_c_decode_step_matches_the_torch_path() -> None:
    from lmserve import kernels

    if not kernels.available():
        pytest.skip("no C compiler: the torch path runs")
    cfg = tiny_text_config(hf35.Qwen3_5TextConfig)
    layer = GatedDeltaNet(LinearAttentionDims.from_hf(cfg.to_dict())).eval()
    randomize(layer, 8)
    d = layer.dims
    gen = torch.Generator().manual_seed(9)
    conv = torch.randn(5, d.conv_dim, d.conv_kernel - 1, generator=gen)
    ssm = torch.randn(5, d.num_v_heads, d.k_dim, d.v_dim, generator=gen) * 0.3
    x = torch.randn(3, d.hidden_size, generator=gen)
    meta = LinearAttentionMetadata(torch.tensor([4, 0, 2]), 3, [])
    results = {}
    for enabled in (True, False):
        kernels.set_enabled(enabled)
        try:
            c, s = conv.clone(), ssm.clone()
            with torch.no_grad():
                results[enabled] = (layer(x, c, s, meta), c, s)
        finally:
            kernels.set_enabled(True)
    for got, want in zip(results[True], results[False], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    ssm_after = results[True][2]
    assert not torch.equal(ssm_after[4], ssm[4]) and torch.equal(ssm_after[1], ssm[1]), "slots 4, 0, 2 only"
