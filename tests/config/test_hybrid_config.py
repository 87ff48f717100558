"""Engine arguments for hybrid models without a model: the combinations that cannot hold the state are refused
naming them, and the KV blocks and state slots come from one budget as the ledger splits it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lmserve.config.engine import EngineArgs
from lmserve.memory import ledger as memory

HYBRID = SimpleNamespace(architecture="Qwen3_5ForCausalLM")
# the features a hybrid model's recurrent state cannot go with (engine arguments → the name the error gives)
REFUSED_WITH_STATE = [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative_config"),
    ({"kv_transfer_config": {"kv_role": "kv_producer"}}, "kv_transfer_config"),
    ({"enable_lora": True}, "enable_lora"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size > 1"),
]


@pytest.mark.parametrize(("kwargs", "named"), REFUSED_WITH_STATE)
def test_combinations_without_state_support_are_refused(kwargs: dict, named: str) -> None:
    args = EngineArgs(model="unused", **kwargs)
    with pytest.raises(ValueError, match=rf"{named}.*Qwen3_5ForCausalLM"):
        args._check_hybrid(HYBRID)


def test_plain_arguments_pass() -> None:
    EngineArgs(model="unused")._check_hybrid(HYBRID)


def test_budget_split_is_the_ledgers() -> None:
    state, kv = 3_000_000, 4096
    args = EngineArgs(model="unused", kv_cache_memory_gib=0.05, max_num_seqs=256)
    blocks, slots, snapshots = args._hybrid_pools(kv, state)
    budget = int(0.05 * 2**30)
    assert (snapshots, budget - snapshots * state) == memory.state_snapshot_split(budget, state)
    assert snapshots == budget // 8 // state  # the prefix cache's state snapshots: 1/8 of the budget by default
    assert (blocks, slots) == memory.hybrid_pool_split(budget - snapshots * state, 16, kv, state, 256)
    assert slots < 256 and blocks * 16 * kv + (slots + snapshots) * state <= budget
    # explicit blocks: a slot per sequence, the snapshots 1/8 of the three pools (at least one)
    assert EngineArgs(model="unused", num_kv_blocks=64, max_num_seqs=5)._hybrid_pools(kv, state) == (64, 5, 1)
    assert EngineArgs(model="unused", num_kv_blocks=64, max_num_seqs=40)._hybrid_pools(kv, state) == (64, 40, 5)
    sized = EngineArgs(model="unused", kv_cache_memory_gib=0.05, state_snapshot_memory_gib=0.01)
    assert sized._hybrid_pools(kv, state)[2] == int(0.01 * 2**30) // state
    off = EngineArgs(model="unused", num_kv_blocks=64, enable_prefix_caching=False)
    assert off._hybrid_pools(kv, state) == (64, 256, 0), "no prefix caching: no snapshot bytes"
    with pytest.raises(ValueError, match="kv_cache_memory_gib"):
        EngineArgs(model="unused", kv_cache_memory_gib=0.001)._hybrid_pools(kv, state)
