"""Tensor parallelism (model/parallel.py, engine/tp_executor.py): TP = 2 against TP = 1 on the tiny random models,
gloo with one thread per rank. Logits within 1e-4 relative, greedy tokens identical, through every scheduling path
(chunked prefill, prefix hits, preemption), quantized weights and an int8 KV cache; refusals; a killed rank."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmserve import LLM, SamplingParams
from lmserve.config.engine import EngineArgs

pytestmark = pytest.mark.slow  # multi-process TP engines: in `-m slow` (CI runs it), out of the default run

PROMPTS = [
    "def fib(n):",
    "import json\nimport os\n\nclass Decoder(object):\n    def __init__(self, strict=True):",
    "The capital of France is",
]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
REL_TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_rank() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def engines() -> Iterator[list[LLM]]:
    """LLMs made in a test; their worker processes are stopped after it, whatever happened."""
    made: list[LLM] = []
    yield made
    for llm in made:
        if llm.engine.executor is not None:
            llm.engine.executor.close()


def make(engines: list[LLM], model_dir: Path, **kwargs) -> LLM:
    llm = LLM(str(model_dir), **kwargs)
    engines.append(llm)
    return llm


def first_step_logits(llm: LLM, prompts: list[str]) -> torch.Tensor:
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"logits-{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    sched = engine.scheduler.schedule()
    assert len(sched.scheduled) == len(prompts), "all prompts should share one step"
    out = engine.runner.execute(sched)
    for i in range(len(prompts)):
        engine.abort_request(f"logits-{i}")
    return out.logits


def assert_rel_close(a: torch.Tensor, b: torch.Tensor, tol: float = REL_TOL) -> None:
    assert a.shape == b.shape, f"{tuple(a.shape)} vs {tuple(b.shape)}"
    rel = ((a - b).abs().max() / b.abs().max()).item()
    assert rel <= tol, f"max |TP2 - TP1| / max |TP1| = {rel:.2e} > {tol:.0e}"


def tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def greedy(llm: LLM) -> list[list[int]]:
    return tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


# llama-gqa: 2 KV heads, one per rank; llama3-rope-untied: 1 KV head (< tp: replicated), an untied head;
# qwen2: q/k/v biases; qwen3: per-head q/k norms; gemma2: soft-capping (attention and logits), sliding windows;
# gemma3: sliding / global layers with their own rotary; phi3: fused qkv / gate_up checkpoint tensors, partial rotary
FAMILIES = ["llama-gqa", "llama3-rope-untied", "qwen2", "qwen3", "gemma2", "gemma3", "phi3-longrope-partial"]


@pytest.mark.parametrize("name", FAMILIES)
def test_tp2_matches_tp1(model_dirs: dict[str, Path], engines: list[LLM], name: str) -> None:
    one = make(engines, model_dirs[name], num_kv_blocks=64)
    two = make(engines, model_dirs[name], num_kv_blocks=64, tensor_parallel_size=2)
    assert_rel_close(first_step_logits(two, PROMPTS), first_step_logits(one, PROMPTS))
    assert greedy(two) == greedy(one)


def test_tp2_scheduling_paths_match_tp1(llama_dir: Path, engines: list[LLM]) -> None:
    """Chunked prefill (8-token budget), prefix-cache hits, preemption (a 12-block pool), prompt logprobs and seeded
    sampling: the same tokens, logprobs and counters at TP = 2 as at TP = 1."""
    kw = dict(num_kv_blocks=12, block_size=16, max_num_batched_tokens=8)
    one, two = make(engines, llama_dir, **kw), make(engines, llama_dir, tensor_parallel_size=2, **kw)
    system = "You are a helpful assistant. Answer in one line.\nimport json\n"
    prompts = [system + f"Request number {i}: import os, sys" for i in range(6)]
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, prompt_logprobs=2, logprobs=2),
        SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
    ] * 3
    a, b = one.generate(prompts, params, use_tqdm=False), two.generate(prompts, params, use_tqdm=False)
    assert tokens(b) == tokens(a)
    assert sum(o.num_cached_tokens for o in b) == sum(o.num_cached_tokens for o in a) > 0, "prefix hits"
    m1, m2 = one.get_metrics(), two.get_metrics()
    assert m2["num_preemptions_total"] == m1["num_preemptions_total"] > 0, "the small pool must preempt"
    scored = []
    for o, p in zip(a, b, strict=True):
        scored += [(x, y) for x, y in zip(o.prompt_logprobs or [], p.prompt_logprobs or [], strict=True) if x]
        scored += list(zip(o.outputs[0].logprobs or [], p.outputs[0].logprobs or [], strict=True))
    assert len(scored) > 100
    for x, y in scored:
        assert (x.token_id, x.rank) == (y.token_id, y.rank)
        assert abs(x.logprob - y.logprob) < 1e-4
        assert [t for t, _ in x.top_logprobs] == [t for t, _ in y.top_logprobs]
    assert two.engine.kv.pool.num_free_blocks == 12, "every block is free again at the end"


@pytest.mark.parametrize(
    "kw",
    [{"kv_cache_dtype": "int8"}, {"quantization": "int4", "int4_compute": "w4a8"}, {"quantization": "int4",
     "int4_compute": "weight-only"}],
    ids=["kv-int8", "int4-w4a8", "int4-weight-only"],
)  # fmt: skip
def test_tp2_quantized_matches_tp1(llama_dir: Path, engines: list[LLM], kw: dict) -> None:
    """int4 groups and W4A8's activation blocks lie inside a shard, KV scales are per KV head: same codes as TP = 1,
    so the same logits to float rounding."""
    one = make(engines, llama_dir, num_kv_blocks=64, **kw)
    two = make(engines, llama_dir, num_kv_blocks=64, tensor_parallel_size=2, **kw)
    assert_rel_close(first_step_logits(two, PROMPTS), first_step_logits(one, PROMPTS))
    assert greedy(two) == greedy(one)


def test_tp2_int8_weights_within_quantization_error(llama_dir: Path, engines: list[LLM]) -> None:
    """int8 (W8A8): the weight codes are TP = 1's (a row-parallel layer's channel scale is the max over all ranks),
    but a row-parallel layer quantizes its activations per rank slice (a finer per-token scale): TP = 2 differs from
    TP = 1 by less than TP = 1 differs from float32."""
    float_logits = first_step_logits(make(engines, llama_dir, num_kv_blocks=64), PROMPTS)
    one = first_step_logits(make(engines, llama_dir, num_kv_blocks=64, quantization="int8"), PROMPTS)
    two = first_step_logits(make(engines, llama_dir, num_kv_blocks=64, quantization="int8", tensor_parallel_size=2),
                            PROMPTS)  # fmt: skip
    quant_error = (one - float_logits).abs().max()
    assert (two - one).abs().max() < quant_error
    assert (two - float_logits).abs().max() < 1.5 * quant_error


def test_refusals_name_the_numbers(model_dirs: dict[str, Path]) -> None:
    llama = str(model_dirs["llama-gqa"])  # 4 heads, 2 KV heads, intermediate 128
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide 4 attention heads"):
        EngineArgs(llama, tensor_parallel_size=3, num_kv_blocks=8).create_engine_config()
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be a positive integer, got 0"):
        EngineArgs(llama, tensor_parallel_size=0, num_kv_blocks=8).create_engine_config()
    with pytest.raises(ValueError, match=r"multiples of quantization_group_size=64"):
        EngineArgs(llama, tensor_parallel_size=2, quantization="int4", quantization_group_size=64,
                   num_kv_blocks=8).create_engine_config()  # fmt: skip
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 with enable_lora"):
        EngineArgs(llama, tensor_parallel_size=2, enable_lora=True, num_kv_blocks=8).create_engine_config()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 with a draft model"):
        EngineArgs(llama, tensor_parallel_size=2, num_kv_blocks=8,
                   speculative_config={"method": "draft_model", "model": llama, "num_speculative_tokens": 2},
                   ).create_engine_config()  # fmt: skip
    with pytest.raises(ValueError, match=r"OLMo 2"):
        EngineArgs(str(model_dirs["olmo2"]), tensor_parallel_size=2, num_kv_blocks=8).create_engine_config()


def test_kv_pool_is_sized_per_rank(model_dirs: dict[str, Path]) -> None:
    """The engine's KV bytes per token are the ledger's per-rank figure (memory.kv_heads_per_rank), to the byte."""
    from lmserve.memory import ledger as memory
    for name, tp in [("llama-gqa", 2), ("llama3-rope-untied", 2), ("mistral", 4)]:
        cfg = EngineArgs(str(model_dirs[name]), tensor_parallel_size=tp, num_kv_blocks=8).create_engine_config()
        m = cfg.model
        heads = memory.kv_heads_per_rank(m.num_kv_heads, tp)
        assert heads == (m.num_kv_heads // tp or 1)
        expected = memory.kv_cache_bytes_per_token(m.num_layers, heads, m.head_dim, cfg.cache.kv_cache_dtype)
        assert cfg.cache.kv_bytes_per_token == expected
        assert cfg.cache.pool_bytes == 8 * cfg.cache.block_size * expected


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_killed_rank_fails_the_step_and_close_leaves_no_process(llama_dir: Path, engines: list[LLM]) -> None:
    llm = make(engines, llama_dir, num_kv_blocks=64, tensor_parallel_size=2)
    executor = llm.engine.executor
    assert tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False))
    (pid,) = executor.worker_pids
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    while executor.failure is None and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    assert executor.failure is not None and time.monotonic() - t0 < 1.0, "the death is seen within a second"
    assert "rank 1" in executor.failure and "signal 9" in executor.failure
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    executor.close()
    assert not _alive(pid)


def test_close_stops_every_worker(llama_dir: Path, engines: list[LLM]) -> None:
    llm = make(engines, llama_dir, num_kv_blocks=64, tensor_parallel_size=2)
    pids = llm.engine.executor.worker_pids
    assert all(_alive(p) for p in pids)
    llm.engine.executor.close()
    assert not any(_alive(p) for p in pids)


def _all_reduce_rank(rank: int, port: int, mode: str, queue) -> None:  # noqa: ANN001 (a multiprocessing queue)
    torch.set_num_threads(1)
    from lmserve.distributed.group import Rendezvous, TPGroup

    group = TPGroup(Rendezvous("127.0.0.1", port, 2, timeout_s=60, all_reduce=mode), rank)
    g = torch.Generator().manual_seed(rank)
    results = []
    for numel in (64, 576, 3 * 2**20 + 5):  # the last one in chunks (a slot is 4 MiB)
        x = torch.randn(numel, generator=g)
        results.append(group.all_reduce(x.clone()).numpy())  # (numpy: pickled by value)
    queue.put((rank, group.all_reduce_kind, results))
    group.barrier_backend()
    group.close()


@pytest.mark.parametrize("mode", ["shm", "backend"])
def test_all_reduce_sums_identically_on_every_rank(mode: str) -> None:
    import multiprocessing as mp

    from lmserve.distributed.group import free_port

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_all_reduce_rank, args=(r, port, mode, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict((r, (kind, res)) for r, kind, res in (queue.get(timeout=120) for _ in procs))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert got[0][0] == got[1][0] == ("shm" if mode == "shm" else "gloo")
    gens = [torch.Generator().manual_seed(r) for r in range(2)]  # each rank's draws, replayed
    for numel, a, b in zip((64, 576, 3 * 2**20 + 5), got[0][1], got[1][1], strict=True):
        expected = torch.randn(numel, generator=gens[0]) + torch.randn(numel, generator=gens[1])
        assert (a == b).all(), "every rank holds the same sum"
        torch.testing.assert_close(torch.from_numpy(a), expected)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("lmserve-tp-")], "no shared-memory file is left"


@pytest.mark.parametrize("name", ["llama-gqa", "llama3-rope-untied"])
def test_ledger_per_rank_matches_the_engine_to_the_byte(model_dirs: dict[str, Path], engines: list[LLM],
                                                         name: str) -> None:  # fmt: skip
    """`lmserve memory --tensor-parallel-size 2`'s per-rank weights and KV are what a TP = 2 rank holds: its
    parameters' bytes (vocabulary rows padded to ceil(V / tp)), its KV tensors' bytes and its pool's block count."""
    from lmserve.memory import ledger as memory
    from lmserve.memory.report import memory_report

    shape = memory.load_model_shape(model_dirs[name])
    report = memory_report(shape, kv_dtype="int8", weight_dtype="float32", tp=2, memory_bytes=2**30)
    budget = 3 * 2**20
    llm = make(engines, model_dirs[name], kv_cache_memory_gib=budget / 2**30, kv_cache_dtype="int8",
               tensor_parallel_size=2, max_model_len=128)  # fmt: skip
    cache, runner = llm.engine.config.cache, llm.engine.runner
    assert cache.kv_bytes_per_token == report.kv_bytes_per_token_per_rank
    assert cache.num_blocks == memory.max_num_kv_blocks(budget, cache.block_size, report.kv_bytes_per_token_per_rank)
    kv_bytes = sum(t.nbytes for c in runner.kv_caches for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None)
    assert kv_bytes == cache.pool_bytes
    weights = {p.data_ptr(): p.nbytes for p in runner.model.parameters()}  # (a tied head counted once)
    assert sum(weights.values()) == report.weight_bytes_per_rank


def test_tp4_replicates_two_kv_heads(llama_dir: Path, engines: list[LLM]) -> None:
    """4 ranks, 2 KV heads: each KV head lives on 2 ranks (rank r holds head r // 2), one query head per rank."""
    from lmserve.model.parallel import TPShard

    one = make(engines, llama_dir, num_kv_blocks=64)
    four = make(engines, llama_dir, num_kv_blocks=64, tensor_parallel_size=4)
    cfg = four.engine.config.model
    assert [TPShard.of(cfg, r, 4).kv_head_start for r in range(4)] == [0, 0, 1, 1]
    assert four.engine.runner.kv_caches[0].k.shape[2] == 1
    assert_rel_close(first_step_logits(four, PROMPTS), first_step_logits(one, PROMPTS))
    assert greedy(four) == greedy(one)


def test_nccl_path_is_importable_and_refused_without_cuda() -> None:
    from lmserve.distributed.group import Rendezvous, TPGroup, backend_for, free_port

    assert backend_for("cuda:0") == "nccl" and backend_for("cpu") == "gloo"
    if torch.cuda.is_available():
        pytest.skip("a CUDA build: the NCCL group needs its peers")
    with pytest.raises(ValueError, match="'nccl' needs a CUDA build of torch"):
        TPGroup(Rendezvous("127.0.0.1", free_port(), 1, backend="nccl", timeout_s=10), 0)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2"])
def test_tp2_decode_stack_is_bit_identical_to_the_module_path(
    model_dirs: dict[str, Path], engines: list[LLM], monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Under TP = 2 with the shared-memory all-reduce, decode steps take the one-call C stack, which sums o and down
    over the ranks from C: every such step on rank 0 is recomputed on the module path (the Python all-reduce, the
    same sequence of calls; rank 1 is sent the step again) and must give the same bits. Greedy tokens equal TP = 1's.
    """
    from lmserve import kernels

    if len(PROMPTS) > kernels.f32_max_rows():  # as tests/model/test_decode_stack.py skips it
        pytest.skip(f"the float32 kernel takes {kernels.f32_max_rows()} rows on this CPU (no AVX-512)")
    one = make(engines, model_dirs[name], num_kv_blocks=64)
    two = make(engines, model_dirs[name], num_kv_blocks=64, tensor_parallel_size=2)
    executor, expected = two.engine.executor, greedy(one)
    assert executor.group.all_reduce_kind == "shm"
    seen = spy_stack_steps(two, monkeypatch)
    assert greedy(two) == expected
    assert len(seen) >= 10 and all(seen), f"{seen.count(False)} of {len(seen)} stack steps differ from the module path"


def _shm_pair(tmp_path: Path, **kw) -> tuple:  # noqa: ANN003
    from lmserve.distributed.shm_allreduce import ShmAllReduce

    path = str(tmp_path / "shm")
    return ShmAllReduce(path, 0, 2, create=True, **kw), ShmAllReduce(path, 1, 2, create=False, **kw)


def test_shm_all_reduce_c_and_python_calls_interleave_with_the_same_bits(tmp_path: Path) -> None:
    """Rank 0 sums through C (kernels.shm_all_reduce), rank 1 through the torch ops, on one sequence of calls (and
    gathers between them): both get the same bits, which are the Python side's x0 + x1."""
    import threading

    from lmserve import kernels

    if not kernels.available():
        pytest.skip("no C compiler: kernels not built")
    a, b = _shm_pair(tmp_path, slot_bytes=4096)  # 1,024 floats a slot: the longer inputs go in chunks
    b.desc = None  # rank 1: the Python path only
    sizes = [576, 3000, 7, 576 * 8]
    gens = [torch.Generator().manual_seed(r) for r in range(2)]
    inputs = [[torch.randn(n, generator=g) for n in sizes] for g in gens]
    got: dict[int, list] = {0: [], 1: []}

    def run(rank: int, shm) -> None:  # noqa: ANN001
        for x in inputs[rank]:
            got[rank].append(shm.all_reduce(x.clone()))
            got[rank].append(shm.gather(x.clone()))

    threads = [threading.Thread(target=run, args=(r, s)) for r, s in ((0, a), (1, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        for i, (x0, x1) in enumerate(zip(*inputs, strict=True)):
            want = torch.add(x0, x1)
            assert torch.equal(got[0][2 * i], want) and torch.equal(got[1][2 * i], want)
            assert [torch.equal(p, x) for p, x in zip(got[0][2 * i + 1], (x0, x1), strict=True)] == [True, True]
            assert got[1][2 * i + 1] is None
    finally:
        a.close()
        b.close()


def test_shm_all_reduce_in_c_gives_up_on_abort_and_on_timeout(tmp_path: Path) -> None:
    """A rank waiting in C for a peer that never comes: alive()'s reason once the watcher sees it, else the
    timeout (both raised as RuntimeError)."""
    from lmserve import kernels

    if not kernels.available():
        pytest.skip("no C compiler: kernels not built")
    t0 = time.monotonic()
    a, b = _shm_pair(tmp_path, alive=lambda: "peer gone" if time.monotonic() - t0 > 0.3 else None)
    try:
        assert a.desc is not None
        with pytest.raises(RuntimeError, match="peer gone"):
            a.all_reduce(torch.ones(576))
        assert time.monotonic() - t0 < 5
    finally:
        a.close()
        b.close()
    a, b = _shm_pair(tmp_path, timeout_s=0.3)
    try:
        with pytest.raises(RuntimeError, match="did not arrive in 0.3 s"):
            a.all_reduce(torch.ones(576))
    finally:
        a.close()
        b.close()


def test_tp2_on_gloo_keeps_the_module_path(
    llama_dir: Path, engines: list[LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """LMSERVE_TP_ALL_REDUCE=backend: the all-reduce is gloo's, which C cannot call, so no decode stack; the same
    greedy tokens as TP = 1."""
    one = make(engines, llama_dir, num_kv_blocks=64)
    monkeypatch.setenv("LMSERVE_TP_ALL_REDUCE", "backend")
    two = make(engines, llama_dir, num_kv_blocks=64, tensor_parallel_size=2)
    runner = two.engine.runner
    assert two.engine.executor.group.all_reduce_kind == "gloo"
    assert runner.model.model.decode_stack(runner.kv_caches) is None
    assert greedy(two) == greedy(one)


def test_rank_killed_while_rank0_waits_in_c_fails_the_step(llama_dir: Path, engines: list[LLM]) -> None:
    """Rank 1 stopped (SIGSTOP) so rank 0's next step waits for it in the C all-reduce (asleep on the futex, the GIL
    released), then killed: the watcher's failure reaches the C wait through the abort word, and the step raises
    naming the rank, within seconds (not the 300 s timeout)."""
    import threading

    llm = make(engines, llama_dir, num_kv_blocks=64, tensor_parallel_size=2)
    executor = llm.engine.executor
    assert executor.group.all_reduce_kind == "shm"
    assert tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False))
    (pid,) = executor.worker_pids
    os.kill(pid, signal.SIGSTOP)
    killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    finally:
        killer.join()
    assert time.monotonic() - t0 < 10
    executor.close()
    assert not _alive(pid)


def spy_stack_steps(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """From now on, every decode step rank 0 runs on the one-call stack is recomputed on the module path (rank 1 is
    sent the step again); the list it returns gets, per such step, whether the two gave the same bits."""
    from lmserve.engine.tp_executor import _forward_message
    from lmserve.model.decoder import DecoderModel

    executor, rank0 = llm.engine.executor, llm.engine.runner.model.model
    seen: list[bool] = []
    orig = DecoderModel.forward

    def both(self, input_ids, positions, kv_caches, meta):  # noqa: ANN001, ANN202
        out = orig(self, input_ids, positions, kv_caches, meta)
        stack = self.decode_stack(kv_caches)
        if self is rank0 and stack is not None and stack.applies(self.embed_tokens.weight[: len(input_ids)], meta):
            executor._send(_forward_message(input_ids, positions, meta))  # rank 1 runs the step again
            self._decode_stack = None
            try:
                ref = orig(self, input_ids, positions, kv_caches, meta)
            finally:
                self._decode_stack = stack
            seen.append(torch.equal(out, ref))
        return out

    monkeypatch.setattr(DecoderModel, "forward", both)
    return seen
