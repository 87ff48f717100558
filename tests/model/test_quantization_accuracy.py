"""Held-out accuracy of the quantized bundled model against float32 (the issue's bounds): perplexity of
int8 within +1 % and of int4 (group 32) within +6 %; greedy next-token agreement of int8 >= 97 % over
>= 2,000 positions. Measured on this branch: int8 (LM head included) +0.06 % perplexity, 99.0 % agreement;
int4 (its LM head at 8 bits since the fourth session) -0.07 % perplexity, 97.2 % agreement (2,191 positions)."""

from __future__ import annotations

import pytest

from lmserve import LLM
from lmserve.bench.accuracy import Scores, heldout_windows, score

NUM_POSITIONS = 2200


def _scores(**engine_args) -> Scores:
    llm = LLM(num_kv_blocks=256, max_num_batched_tokens=512, **engine_args)
    return score(llm, heldout_windows(llm, window=256, max_tokens=NUM_POSITIONS))


@pytest.mark.slow
def test_quantized_bundled_model_stays_within_the_accuracy_bounds() -> None:
    fp32, int8 = _scores(), _scores(quantization="int8")
    int4 = _scores(quantization="int4")  # W4A8 (int4_compute's default)
    int4_wo = _scores(quantization="int4", int4_compute="weight-only")
    assert fp32.num_positions >= 2000
    ratio8, ratio4, ratio4_wo = (s.perplexity / fp32.perplexity for s in (int8, int4, int4_wo))
    print(
        f"fp32 ppl {fp32.perplexity:.2f}; int8 x{ratio8:.4f} agree {int8.agreement(fp32):.4f}; "
        f"int4 W4A8 x{ratio4:.4f} agree {int4.agreement(fp32):.4f}; "
        f"int4 weight-only x{ratio4_wo:.4f} agree {int4_wo.agreement(fp32):.4f} over {fp32.num_positions} positions"
    )
    assert ratio8 <= 1.01, f"int8 perplexity {int8.perplexity:.3f} vs fp32 {fp32.perplexity:.3f}"
    for name, ratio in (("W4A8", ratio4), ("weight-only", ratio4_wo)):
        assert ratio <= 1.06, f"int4 {name} perplexity x{ratio:.4f} of fp32 {fp32.perplexity:.3f}"
    assert int8.agreement(fp32) >= 0.97
