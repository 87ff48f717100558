"""paged_attention's sinks (gpt-oss) against HF's eager_attention_forward on random operands: the CPU flash path
(float32: output and log-sum-exp) and the materialised-scores path (other dtypes and devices), with GQA, a causal
mask over cached context and a sliding window."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lmserve.model.attention import _attend, _Spec, causal_mask_with_context


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("window", [None, 5])
@torch.inference_mode()
def test_sinks_match_hf_eager(dtype: torch.dtype, window: int | None) -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d, context, n = 4, 2, 16, 7, 6
    q = torch.randn(1, heads, n, d, generator=g, dtype=dtype)
    k = torch.randn(1, kv_heads, context + n, d, generator=g, dtype=dtype)
    v = torch.randn(1, kv_heads, context + n, d, generator=g, dtype=dtype)
    sinks = torch.randn(heads, generator=g, dtype=dtype) * 2
    mask = causal_mask_with_context(context, n, q.device, window)
    got = _attend(q, k, v, mask, _Spec(d**-0.5, window, None, sinks))
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, sinks=sinks, training=False)
    additive = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))
    want = eager_attention_forward(module, q, k, v, additive, scaling=d**-0.5)[0].transpose(1, 2)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    plain = _attend(q, k, v, mask, _Spec(d**-0.5, window))
    assert (got - plain).abs().max() > 1e-3  # (the sinks matter)
