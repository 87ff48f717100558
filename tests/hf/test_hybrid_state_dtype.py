"""state_cache_dtype=bfloat16 for hybrid models: the recurrent state (and its prefix-cache snapshots) stored in
bfloat16 halves the ledger's state bytes, to the byte in the worker's tensors, and keeps every step's logits close to
HF's float32 ones (teacher-forced on the engine's own tokens, through chunked prefill and decode)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmserve import LLM, SamplingParams
from lmserve.config.engine import EngineArgs
from tests.hf_reference import hf_last_logits
from tests.hybrid_helpers import PROMPTS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def step_logits(llm: LLM, prompt: str, num_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """(the tokens before it, the logits) of every sampled step of one greedy request."""
    engine = llm.engine
    engine.add_request("r", prompt, SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True))
    request, out = engine.scheduler.requests["r"], []
    while engine.has_unfinished_requests():
        sched = engine.scheduler.schedule()
        result = engine.runner.execute(sched)
        if result.logits is not None:
            out.append((list(request.all_token_ids), result.logits[0].clone()))
        engine.scheduler.update_from_output(sched, result, engine.config.scheduler.max_model_len)
    return out


def max_error(llm: LLM, model_dir: Path) -> float:
    steps = step_logits(llm, PROMPTS[1], 8)
    assert len(steps) == 8
    return max((logits - hf_last_logits(model_dir, ids)).abs().max().item() for ids, logits in steps)


@pytest.mark.parametrize("kind", ["qwen3_5", pytest.param("qwen3_next", marks=pytest.mark.slow)])
def test_bfloat16_state_halves_the_ledger_and_stays_close_to_hf(hybrid_dirs: dict[str, Path], kind: str) -> None:
    model_dir = hybrid_dirs[kind]
    f32, bf16 = (EngineArgs(model=str(model_dir), num_kv_blocks=64, state_cache_dtype=d).create_engine_config().cache
                 for d in ("float32", "bfloat16"))  # fmt: skip
    assert bf16.state_bytes_per_sequence * 2 == f32.state_bytes_per_sequence and bf16.state_cache_dtype == "bfloat16"
    kwargs = dict(num_kv_blocks=64, block_size=4, max_num_batched_tokens=5)  # chunks of 5: the state stored between
    llm = LLM(str(model_dir), state_cache_dtype="bfloat16", **kwargs)
    cache = llm.engine.runner.state_cache
    assert cache.layers[0].ssm.dtype == cache.layers[0].ssm_snapshots.dtype == torch.bfloat16
    assert cache.nbytes == bf16.num_state_slots * bf16.state_bytes_per_sequence
    assert cache.snapshot_nbytes == llm.engine.config.cache.num_state_snapshots * bf16.state_bytes_per_sequence
    error = max_error(llm, model_dir)
    reference = max_error(LLM(str(model_dir), **kwargs), model_dir)
    assert reference < 2e-4, "float32: HF's tolerance"
    assert reference < error < 5e-2, f"bfloat16 state: logits within 5e-2 of HF's (max |diff| {error:.2e})"


def test_state_cache_dtype_is_checked() -> None:
    with pytest.raises(ValueError, match="state_cache_dtype must be one of"):
        EngineArgs(model="unused", state_cache_dtype="float16").create_engine_config()
