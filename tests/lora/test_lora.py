"""Multi-LoRA against PEFT on tiny random Llama / Qwen2 / Qwen3 bases: a mixed batch of 4 adapters and the base gives
each request PeftModel's logits (1e-4) and greedy tokens; output does not depend on the batch's other adapters;
prefix-cache isolation; slot eviction under max_loras=2 with 5 adapters; refusals of what is not served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmserve import LLM, LoRARequest, SamplingParams
from tests.helpers import build_model, require_extra
from tests.lora_helpers import ADAPTER_SPECS, build_adapter, peft_greedy, peft_last_logits

require_extra("test", "peft")

BASES = {"llama": ("llama", {}), "qwen2": ("qwen2", {}), "qwen3": ("qwen3", {"head_dim": 32})}
PROMPTS = ["The capital of France is", "def fib(n):", "import json\nimport os\n", "a b c d e f g", "class Decoder("]
MIXED = ["all8", "qv64", None, "mlp8rs", "kup64"]  # one per prompt: 4 adapters and the base


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_bases")
    return {name: build_model(root / name, fam, tokenizer_dir, **kw) for name, (fam, kw) in BASES.items()}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, bases: dict[str, Path]) -> dict[str, dict[str, Path]]:
    root = tmp_path_factory.mktemp("lora_adapters")
    return {
        base: {
            name: build_adapter(bases[base], root / base / name, r, alpha, targets, rslora, seed=i)
            for i, (name, (r, alpha, targets, rslora)) in enumerate(ADAPTER_SPECS.items())
        }
        for base in bases
    }


def lora_requests(paths: dict[str, Path]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(p)) for i, (name, p) in enumerate(paths.items())}


def make_llm(base: Path, **kw) -> LLM:
    args = dict(enable_lora=True, max_loras=4, max_lora_rank=64, num_kv_blocks=128)
    return LLM(str(base), **(args | kw))


@pytest.mark.parametrize("base", sorted(BASES))
def test_mixed_batch_logits_match_peft(bases, adapters, base: str) -> None:
    """Prefill and decode steps with 4 adapters and the base mixed: every row's logits are PeftModel's."""
    llm = make_llm(bases[base])
    engine, reqs = llm.engine, lora_requests(adapters[base])
    for i, (prompt, name) in enumerate(zip(PROMPTS, MIXED, strict=True)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                           lora_request=reqs.get(name))  # fmt: skip
    for step in range(2):
        sched = engine.scheduler.schedule()
        assert len(sched.scheduled) == len(PROMPTS), "all requests share each step"
        out = engine.runner.execute(sched)
        for row, s in enumerate(sched.scheduled):
            name = MIXED[int(s.request.request_id)]
            adapter = None if name is None else adapters[base][name]
            ids = s.request.all_token_ids
            expected = peft_last_logits(bases[base], adapter, ids)
            torch.testing.assert_close(out.logits[row], expected, atol=1e-4, rtol=1e-4, msg=f"step {step} {name}")
        engine.scheduler.update_from_output(sched, out, engine.config.scheduler.max_model_len)


@pytest.mark.parametrize("base", sorted(BASES))
def test_mixed_batch_greedy_matches_peft_and_alone(bases, adapters, base: str) -> None:
    llm = make_llm(bases[base])
    reqs = lora_requests(adapters[base])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    loras = [reqs.get(n) for n in MIXED]
    outs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=loras)
    distinct = set()
    for out, name in zip(outs, MIXED, strict=True):
        adapter = None if name is None else adapters[base][name]
        expected = peft_greedy(bases[base], adapter, out.prompt_token_ids, 12)
        assert out.outputs[0].token_ids == expected, f"{base}/{name}: greedy tokens differ from PEFT"
        distinct.add(tuple(out.outputs[0].token_ids))
    # alone (no other adapter in the batch): the same tokens and logprobs
    for prompt, name, out in zip(PROMPTS, MIXED, outs, strict=True):
        alone = llm.generate([prompt], params, use_tqdm=False, lora_request=reqs.get(name))[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        a = [lp.logprob for lp in alone.outputs[0].logprobs]
        b = [lp.logprob for lp in out.outputs[0].logprobs]
        assert a == pytest.approx(b, abs=1e-5)


def test_adapters_change_the_output(bases, adapters) -> None:
    """The random adapters are not no-ops (PEFT's default B = 0 would make every check above vacuous)."""
    llm = make_llm(bases["llama"])
    reqs = lora_requests(adapters["llama"])
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = PROMPTS[0]
    outs = [llm.generate([prompt], params, use_tqdm=False, lora_request=reqs.get(n))[0] for n in [None, *reqs]]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) >= 4


def test_prefix_cache_isolated_between_adapters(bases, adapters) -> None:
    """A prompt cached under one adapter is not a hit under another (or the base); under the same one it is."""
    llm = make_llm(bases["llama"])
    reqs = lora_requests(adapters["llama"])
    prompt = list(range(1, 50))  # 3 full blocks of 16
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False, lora_request=reqs["all8"])[0]
    assert first.num_cached_tokens == 0
    for name in (None, "qv64"):
        other = llm.generate([prompt], params, use_tqdm=False, lora_request=reqs.get(name))[0]
        assert other.num_cached_tokens == 0, f"{name}: reused KV computed under another adapter"
        expected = peft_greedy(bases["llama"], None if name is None else adapters["llama"][name], prompt, 4)
        assert other.outputs[0].token_ids == expected
    again = llm.generate([prompt], params, use_tqdm=False, lora_request=reqs["all8"])[0]
    assert again.num_cached_tokens == 48
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_slot_eviction_max_loras_2_with_5_adapters(bases, adapters) -> None:
    """5 adapters in use, 2 compute slots: requests wait for a slot (never taking one a running request holds), and
    every request gets PeftModel's tokens."""
    base = bases["llama"]
    llm = make_llm(base, max_loras=2, max_cpu_loras=3)
    engine = llm.engine
    reqs = lora_requests(adapters["llama"])
    names = list(reqs) * 2
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, name in enumerate(names):
        engine.add_request(str(i), PROMPTS[i % len(PROMPTS)], params, lora_request=reqs[name])
    slots = engine.scheduler.lora_slots
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        running = {r.lora_int_id for r in engine.scheduler.running}
        assert len(running) <= 2, "more adapters running than compute slots"
        for r in engine.scheduler.running:  # each running request's slot holds its adapter
            assert slots.holder[r.lora_slot] == r.lora_int_id
            assert engine.runner.lora.slot_ids[r.lora_slot] == r.lora_int_id
    assert slots.num_evictions_total >= 3
    assert len(engine.runner.lora.cpu) <= 3
    for i, name in enumerate(names):
        prompt_ids = engine.tokenizer.encode(PROMPTS[i % len(PROMPTS)])
        assert done[str(i)] == peft_greedy(base, adapters["llama"][name], prompt_ids, 6), name


def test_n_and_structured_outputs_with_an_adapter(bases, adapters) -> None:
    from lmserve import StructuredOutputsParams

    llm = make_llm(bases["llama"])
    req = lora_requests(adapters["llama"])["all8"]
    out = llm.generate(["x"], SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=1), use_tqdm=False,
                       lora_request=req)[0]  # fmt: skip
    assert len(out.outputs) == 3
    params = SamplingParams(
        max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    out = llm.generate(["Answer:"], params, use_tqdm=False, lora_request=req)[0]
    assert out.outputs[0].text in ("yes", "no")


def _copy_adapter(src: Path, dst: Path, **config_changes) -> Path:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(config_changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_bad_adapters_are_refused_naming_the_field(tmp_path: Path, bases, adapters) -> None:
    llm = make_llm(bases["llama"], max_lora_rank=16)
    good = adapters["llama"]["all8"]
    cases = {
        "modules_to_save": _copy_adapter(good, tmp_path / "mts", modules_to_save=["lm_head"]),
        "use_dora": _copy_adapter(good, tmp_path / "dora", use_dora=True),
        "max_lora_rank": adapters["llama"]["qv64"],
        "embedding": _copy_adapter(good, tmp_path / "emb", target_modules=["embed_tokens", "q_proj"]),
        "base model mismatch": adapters["qwen3"]["all8"],  # qwen3's head_dim 32: other q/k/v shapes
        "adapter_config.json": tmp_path,
    }
    for i, (field, path) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=field):
            llm.generate(["x"], SamplingParams(max_tokens=1), use_tqdm=False,
                         lora_request=LoRARequest(f"bad{i}", 100 + i, str(path)))  # fmt: skip
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(str(bases["llama"]), num_kv_blocks=16).generate(
            ["x"], SamplingParams(max_tokens=1), use_tqdm=False, lora_request=LoRARequest("a", 1, str(good))
        )
    with pytest.raises(ValueError, match="speculative"):
        make_llm(bases["llama"], speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_lora_enabled_unused_skips_the_lora_path(bases, adapters) -> None:
    """With no LoRA row in the step no hook is on the projections (the decode stack may run), and the tokens are
    the base model's."""
    llm = make_llm(bases["llama"])
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    req = lora_requests(adapters["llama"])["all8"]
    llm.generate(["x y"], params, use_tqdm=False, lora_request=req)
    base_out = llm.generate(["x y"], params, use_tqdm=False)[0]
    pool = llm.engine.runner.lora
    assert not pool.hooks.installed and not llm.engine.runner.model.model.lora_active
    plain = LLM(str(bases["llama"]), num_kv_blocks=128).generate(["x y"], params, use_tqdm=False)[0]
    assert base_out.outputs[0].token_ids == plain.outputs[0].token_ids
    metrics = llm.get_metrics()
    assert metrics["lora_slot_bytes"] == pool.num_bytes > 0


def test_ledger_counts_the_slot_bytes(bases) -> None:
    from lmserve.memory import ledger as memory

    llm = make_llm(bases["qwen3"], max_loras=3, max_lora_rank=32)
    mc = llm.engine.config.model
    expected = memory.lora_slot_bytes(mc.num_layers, mc.hidden_size, mc.num_heads * mc.head_dim,
                                      mc.num_kv_heads * mc.head_dim, mc.intermediate_size, 3, 32, 4)  # fmt: skip
    assert llm.engine.runner.lora.num_bytes == expected == llm.get_metrics()["lora_slot_bytes"]


def test_kv_budget_takes_the_slot_bytes_and_the_report_agrees(bases, tmp_path: Path) -> None:
    """kv_cache_memory_gib is the KV pool plus the LoRA slots: the pool gets what the slots leave, and
    `lmserve memory --enable-lora` (memory_report and its CLI) counts the same slot bytes and the same blocks."""
    import argparse
    import contextlib
    import io

    from lmserve.entrypoints.memory_cli import add_memory_parser
    from lmserve.memory import ledger as memory
    from lmserve.memory.report import memory_report

    gib, block = 0.004, 4
    budget = int(gib * 2**30)
    llm = make_llm(bases["qwen3"], max_loras=3, max_lora_rank=32, num_kv_blocks=None, kv_cache_memory_gib=gib,
                   block_size=block)  # fmt: skip
    cfg = llm.engine.config
    slot_bytes = llm.engine.runner.lora.num_bytes
    assert slot_bytes == cfg.lora.slot_bytes > 0, "the engine set aside what its slots hold"
    assert cfg.cache.pool_bytes + slot_bytes <= budget, "the pool and the slots fit the budget"
    assert cfg.cache.num_blocks == memory.max_num_kv_blocks(budget - slot_bytes, block, cfg.cache.kv_bytes_per_token)
    plain_llm = LLM(
        str(bases["qwen3"]), kv_cache_memory_gib=gib, block_size=block
    )  # kept alive: collecting an LLM closes its engine
    plain = plain_llm.engine.config.cache
    assert plain.num_blocks > cfg.cache.num_blocks, "without LoRA the whole budget is KV"

    shape = memory.load_model_shape(bases["qwen3"])
    no_lora = memory_report(shape, kv_dtype="fp32", weight_dtype="fp32", block_size=block)
    total = budget + no_lora.weight_bytes_per_rank  # a device budget leaving the engine's KV budget after weights
    report = memory_report(shape, kv_dtype="fp32", weight_dtype="fp32", block_size=block, memory_bytes=total,
                           max_loras=3, max_lora_rank=32)  # fmt: skip
    assert report.lora_slot_bytes == slot_bytes, "the report's slot bytes are the engine's, to the byte"
    assert report.kv_budget_bytes_per_rank == budget - slot_bytes
    assert report.num_kv_blocks == cfg.cache.num_blocks, "and so are its KV blocks"
    assert "LoRA slots (fp32)" in report.format_table()

    parser = argparse.ArgumentParser()
    add_memory_parser(parser.add_subparsers())
    args = parser.parse_args(["memory", "--model", str(bases["qwen3"]), "--kv-dtype", "fp32", "--weight-dtype",
                              "fp32", "--block-size", str(block), "--memory", str(total), "--enable-lora",
                              "--max-loras", "3", "--max-lora-rank", "32", "--json"])  # fmt: skip
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert args.func(args) == 0
    printed = json.loads(buf.getvalue())
    assert printed["lora_slot_bytes"] == slot_bytes and printed["num_kv_blocks"] == cfg.cache.num_blocks
    args.max_loras = 0
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert args.func(args) == 2
    assert "--max-loras" in err.getvalue()


def test_chunked_prefill_and_preemption_keep_peft_tokens(bases, adapters) -> None:
    """Chunks of 8 tokens and a pool too small for every request at once (preemption by recompute releases the
    request's slot, readmission takes one again): PeftModel's tokens still."""
    base = bases["llama"]
    llm = make_llm(base, max_loras=2, num_kv_blocks=10, block_size=4, max_num_batched_tokens=8, max_model_len=40)
    reqs = lora_requests(adapters["llama"])
    names = ["all8", "qv64", None, "kup64", "all8"]
    prompts = ["import json\nimport os\nclass A:", "def fib(n): return n", "a b c d e f", "x = [1, 2, 3]", "y"]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=[reqs.get(n) for n in names])
    assert llm.get_metrics()["num_preemptions_total"] > 0
    for out, name in zip(outs, names, strict=True):
        adapter = None if name is None else adapters["llama"][name]
        assert out.outputs[0].token_ids == peft_greedy(base, adapter, out.prompt_token_ids, 10), name


def test_remove_lora_refused_while_in_use(bases, adapters) -> None:
    llm = make_llm(bases["llama"])
    engine = llm.engine
    req = lora_requests(adapters["llama"])["all8"]
    engine.add_request("r", "x y z", SamplingParams(max_tokens=3, ignore_eos=True), lora_request=req)
    with pytest.raises(ValueError, match="in use"):
        engine.remove_lora(req.lora_int_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.list_loras() == [req.lora_int_id]
    assert engine.remove_lora(req.lora_int_id)
    assert engine.list_loras() == [] and engine.scheduler.lora_slots.slot_of(req.lora_int_id) == -1


def test_metrics_count_running_sequences_per_adapter(bases, adapters) -> None:
    llm = make_llm(bases["llama"])
    engine, reqs = llm.engine, lora_requests(adapters["llama"])
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for i, name in enumerate(["all8", "all8", "qv64", None]):
        engine.add_request(str(i), "x y", params, lora_request=reqs.get(name))
    engine.step()  # all four admitted and running: 3 more tokens each to go
    assert engine.get_metrics()["lora_num_requests_running_by_adapter"] == {"all8": 2, "qv64": 1, "": 1}
    while engine.has_unfinished_requests():
        engine.step()
    m = engine.get_metrics()
    assert m["lora_num_requests_running_by_adapter"] == {} and m["lora_num_slot_loads_total"] == 2


def test_async_engine_in_process_with_adapters(bases, adapters) -> None:
    """AsyncEngine (the in-process server's engine thread): adapters ride the add command; PeftModel's tokens."""
    import asyncio

    from lmserve.engine.async_engine import AsyncEngine

    base = bases["llama"]
    llm = make_llm(base)  # kept alive: collecting an LLM closes its engine
    engine = AsyncEngine(llm.engine).start()
    reqs = lora_requests(adapters["llama"])
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    names = ["all8", None, "qv64"]

    async def run():
        streams = [engine.add_request(None, PROMPTS[i], params, lora_request=reqs.get(n)) for i, n in enumerate(names)]
        finals = []
        for stream in streams:
            async for out in stream:
                final = out
            finals.append(final)
        return finals

    try:
        finals = asyncio.run(run())
    finally:
        engine.shutdown()
    for out, name in zip(finals, names, strict=True):
        adapter = None if name is None else adapters["llama"][name]
        assert out.outputs[0].token_ids == peft_greedy(base, adapter, out.prompt_token_ids, 6), name


def test_bfloat16_base_runs_adapters(bases, adapters) -> None:
    """bf16 compute: the slots are bf16 too; the adapter still changes the output and nothing fails."""
    llm = make_llm(bases["llama"], dtype="bfloat16")
    reqs = lora_requests(adapters["llama"])
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with_adapter = llm.generate([PROMPTS[0]], params, use_tqdm=False, lora_request=reqs["all8"])[0]
    assert llm.engine.runner.lora.linears[(0, "self_attn.qkv_proj")].A.dtype == torch.bfloat16
    assert len(with_adapter.outputs[0].token_ids) == 6


def test_dp_affinity_key_is_salted_by_the_adapter() -> None:
    from collections import OrderedDict

    from lmserve.engine.router import choose_core, first_block_key

    prompt = list(range(16))
    assert first_block_key(prompt, 16) != first_block_key(prompt, 16, lora_int_id=3)
    assert first_block_key(prompt, 16, lora_int_id=3) != first_block_key(prompt, 16, lora_int_id=4)
    affinity: OrderedDict[int, int] = OrderedDict()
    assert choose_core({0: (0, 0.0), 1: (1, 0.0)}, affinity, prompt, 16, lora_int_id=3) == 0
    assert choose_core({0: (2, 0.0), 1: (1, 0.0)}, affinity, prompt, 16, lora_int_id=4) == 1  # its own key
    assert choose_core({0: (2, 0.0), 1: (1, 0.0)}, affinity, prompt, 16, lora_int_id=3) == 0  # affine, in slack


def test_beam_search_width_1_under_an_adapter_is_peft_greedy(bases, adapters) -> None:
    from lmserve import BeamSearchParams

    llm = make_llm(bases["llama"])
    req = lora_requests(adapters["llama"])["kup64"]
    out = llm.beam_search(["def fib(n):"], BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True),
                          lora_request=req)[0]  # fmt: skip
    prompt_ids = out.prompt_token_ids
    expected = peft_greedy(bases["llama"], adapters["llama"]["kup64"], prompt_ids, 6)
    assert out.sequences[0].token_ids == expected
