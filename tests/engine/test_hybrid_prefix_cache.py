"""Prefix caching for hybrid models (Qwen3.5, Qwen3-Next) through the engine: a later prompt sharing a prefix skips it,
its state restored from a snapshot at a block boundary, and its greedy tokens still equal HF's (whole prompts,
chunked prefill with a tiny budget, preemption with a tiny pool); cached_tokens counts only the tokens skipped;
reset_prefix_cache forgets the snapshots; the snapshots' bytes are the ledger's."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmserve import LLM, RequestOutput, SamplingParams
from lmserve.checkpoint.shape import load_model_shape
from lmserve.config.engine import EngineArgs
from lmserve.memory import ledger as memory
from lmserve.request import Request
from tests.hybrid_helpers import PROMPTS, hf_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEM = PROMPTS[1]  # 47 tokens of code: whole blocks a later prompt shares
SHARING = [STEM, STEM + "\n        self.strict = strict", STEM + "\n        pass", STEM[:60] + " = None"]
MAX_TOKENS = 8


def run_in_turn(llm: LLM, model_dir: Path, prompts: list[str]) -> tuple[list[list[int]], list[int]]:
    """Each prompt after the one before has finished (so its snapshots are kept), its greedy tokens checked against
    HF's; returns (the prompts' token ids, their cached tokens)."""
    ids, cached = [], []
    for prompt in prompts:
        out = turn(llm, model_dir, prompt)
        ids.append(out.prompt_token_ids)
        cached.append(out.num_cached_tokens)
    scheduler = llm.engine.scheduler
    scheduler.state_slots.check_invariants(set())
    scheduler.state_snapshots.check_invariants()
    return ids, cached


def turn(llm: LLM, model_dir: Path, prompt: str | list[int]) -> RequestOutput:
    """One request run to the end, its greedy tokens checked against HF's."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(model_dir, out.prompt_token_ids, MAX_TOKENS), prompt
    return out


def follow_up(llm: LLM, out: RequestOutput, text: str) -> list[int]:
    """The next turn's prompt: the last one's prompt and output, then text."""
    return out.prompt_token_ids + list(out.outputs[0].token_ids) + llm.get_tokenizer().encode(text)


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def whole_prompt_hits(ids: list[list[int]], block_size: int = 4) -> list[int]:
    """The hits when each prompt is prefilled whole and every snapshot is kept: a prompt saves its state at its last
    full block before its last token; a later prompt hits the longest such boundary it shares whole."""
    hits = []
    for i, p in enumerate(ids):
        limit = (len(p) - 1) // block_size * block_size
        ends = [(len(q) - 1) // block_size * block_size for q in ids[:i]]
        hits.append(max([e for q, e in zip(ids[:i], ends, strict=True) if e <= min(limit, common(p, q))], default=0))
    return hits


@pytest.mark.parametrize(
    ("kind", "budget"),  # (Qwen3-Next's whole-prompt run is a slow test: the chunked one covers its restores)
    [("qwen3_5", 2048), ("qwen3_5", 6), ("qwen3_next", 6), pytest.param("qwen3_next", 2048, marks=pytest.mark.slow)],
)
def test_shared_prefixes_hit_and_equal_hf(hybrid_dirs: dict[str, Path], kind: str, budget: int) -> None:
    llm = LLM(str(hybrid_dirs[kind]), num_kv_blocks=96, block_size=4, max_num_batched_tokens=budget)
    ids, cached = run_in_turn(llm, hybrid_dirs[kind], SHARING)
    scheduler = llm.engine.scheduler
    for i, (c, p) in enumerate(zip(cached, ids, strict=True)):  # whole blocks of a prefix an earlier prompt had
        assert c % 4 == 0 and c <= max([common(p, q) for q in ids[:i]], default=0), (i, c)
    if budget == 2048:
        assert cached == whole_prompt_hits(ids) and cached[1] >= 44, cached
    else:  # a snapshot at the end of every chunk: the stem's shared blocks are found to within a chunk
        assert all(c >= common(p, ids[0]) // 4 * 4 - 8 for c, p in zip(cached[1:], ids[1:], strict=True)), cached
    assert sum(cached) == scheduler.prefix_cache_hits_total > 0, "the metric counts exactly the tokens skipped"
    m = llm.get_metrics()
    assert m["prefix_cache_hits_total"] == sum(cached)
    assert m["state_snapshot_restores_total"] == sum(c > 0 for c in cached)
    assert m["num_state_snapshots_cached"] == scheduler.state_snapshots.num_cached > 0


def test_hits_under_preemption_equal_hf(hybrid_dirs: dict[str, Path]) -> None:
    """Four prompts sharing the stem at once in a 20-block pool: requests are preempted and recomputed, later ones
    hit the snapshots earlier ones saved, and every greedy output is HF's."""
    model_dir = hybrid_dirs["qwen3_5"]
    llm = LLM(str(model_dir), num_kv_blocks=20, block_size=4, max_num_batched_tokens=16, max_num_seqs=3)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(SHARING, params, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(model_dir, out.prompt_token_ids, MAX_TOKENS), out.prompt
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions_total > 0 and scheduler.prefix_cache_hits_total > 0
    scheduler.state_slots.check_invariants(set())
    scheduler.state_snapshots.check_invariants()


def test_reset_prefix_cache_forgets_snapshots(hybrid_dirs: dict[str, Path]) -> None:
    model_dir = hybrid_dirs["qwen3_5"]
    llm = LLM(str(model_dir), num_kv_blocks=64, block_size=4)
    assert run_in_turn(llm, model_dir, SHARING[:2])[1][1] >= 44
    llm.engine.reset_prefix_cache()
    assert llm.engine.scheduler.state_snapshots.num_cached == 0
    ids, cached = run_in_turn(llm, model_dir, [SHARING[1], SHARING[1]])
    assert cached == [0, (len(ids[0]) - 1) // 4 * 4], "recomputed, then hit again"
    from prometheus_client.parser import text_string_to_metric_families

    from lmserve.engine.async_engine import EngineSnapshot
    from lmserve.observability.prometheus import Metrics

    m = llm.get_metrics()
    snapshot = EngineSnapshot(metrics=m, num_batched_tokens=0, num_aborted_requests_total=0, time=0.0)
    body, _ = Metrics("m", lambda: snapshot).render()
    samples = {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    assert samples["lmserve:state_snapshots_cached"] == llm.engine.scheduler.state_snapshots.num_cached > 0
    assert samples["lmserve:state_snapshots_total"] == llm.engine.config.cache.num_state_snapshots
    assert samples["lmserve:state_snapshot_restores_total"] == 2  # before the reset and after it
    assert samples["lmserve:prefix_cache_hits_total"] == m["prefix_cache_hits_total"] > 0


def test_one_snapshot_slot_evicts_and_never_restores_a_stale_state(hybrid_dirs: dict[str, Path]) -> None:
    """state_snapshot_memory_gib for exactly one snapshot: each new prompt's snapshot evicts the last; a prompt whose
    KV blocks are still cached but whose snapshot was evicted computes from a zero state, and equals HF; a prompt
    extending the last one hits its snapshot."""
    model_dir = hybrid_dirs["qwen3_5"]
    state = memory.linear_state_bytes_per_sequence(load_model_shape(model_dir))
    llm = LLM(str(model_dir), num_kv_blocks=96, block_size=4, state_snapshot_memory_gib=state / 2**30)
    assert llm.engine.config.cache.num_state_snapshots == 1
    assert llm.engine.runner.state_cache.snapshot_nbytes == state
    other = PROMPTS[0] * 4  # shares nothing with the stem: its snapshots take the one slot
    ids, cached = run_in_turn(llm, model_dir, [STEM, other])
    probe = Request("probe", ids[0] + [1], SamplingParams(max_tokens=1), max_tokens=1)
    assert llm.engine.kv.num_ram_hit_blocks(probe) == len(ids[0]) // 4, "the stem's KV blocks are cached, not its state"
    first = turn(llm, model_dir, SHARING[1])
    longer = turn(llm, model_dir, follow_up(llm, first, "\n\n    def run(self):"))  # the last snapshot: first's
    last_boundary = (len(first.prompt_token_ids) + MAX_TOKENS - 1) // 4 * 4
    assert cached + [first.num_cached_tokens, longer.num_cached_tokens] == [0, 0, 0, last_boundary], cached


@pytest.mark.parametrize("kind", ["qwen3_5", pytest.param("qwen3_next", marks=pytest.mark.slow)])
def test_a_follow_up_turn_hits_through_the_output(hybrid_dirs: dict[str, Path], kind: str) -> None:
    """A chat's next turn (the last prompt, its output, a new message) hits up to the last block the output completed:
    the decode saved the state there. Greedy tokens equal HF's; the decode's earlier snapshots were released."""
    model_dir = hybrid_dirs[kind]
    llm = LLM(str(model_dir), num_kv_blocks=96, block_size=4)
    first = turn(llm, model_dir, STEM)
    saves = llm.engine.scheduler.state_snapshots.num_saves_total
    assert saves == 1 + MAX_TOKENS // 4, "the prompt's last full block, then each block its output completed"
    assert llm.engine.scheduler.state_snapshots.num_cached == 2, "the prompt's and the output's latest"
    second = turn(llm, model_dir, follow_up(llm, first, "\n        pass"))
    assert second.num_cached_tokens == (len(first.prompt_token_ids) + MAX_TOKENS - 1) // 4 * 4
    assert second.num_cached_tokens > len(first.prompt_token_ids)
    third = turn(llm, model_dir, follow_up(llm, second, "\n    return None"))
    assert third.num_cached_tokens == (len(second.prompt_token_ids) + MAX_TOKENS - 1) // 4 * 4
    llm.engine.scheduler.state_snapshots.check_invariants()


def test_zero_snapshot_memory_turns_prefix_caching_off(hybrid_dirs: dict[str, Path]) -> None:
    llm = LLM(str(hybrid_dirs["qwen3_5"]), num_kv_blocks=64, block_size=4, state_snapshot_memory_gib=0)
    assert not llm.engine.config.cache.enable_prefix_caching and llm.engine.scheduler.state_snapshots is None
    with pytest.raises(ValueError, match="state_snapshot_memory_gib"):
        LLM(str(hybrid_dirs["qwen3_5"]), num_kv_blocks=64, state_snapshot_memory_gib=-1.0)
    with pytest.raises(ValueError, match="cannot hold one state snapshot"):
        LLM(str(hybrid_dirs["qwen3_5"]), num_kv_blocks=64, state_snapshot_memory_gib=1e-9)


def test_the_disk_tier_is_refused_naming_the_hybrid(hybrid_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The snapshots live in RAM only: kv_cache_disk_dir with a hybrid is refused at start-up, naming both."""
    args = EngineArgs(model=str(hybrid_dirs["qwen3_5"]), num_kv_blocks=64, kv_cache_disk_dir=str(tmp_path / "kv"))
    with pytest.raises(ValueError, match=r"kv_cache_disk_dir: .*a hybrid model \(its linear-attention state snapshots"):
        args.create_engine_config()
