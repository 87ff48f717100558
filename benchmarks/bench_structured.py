"""Structured outputs on the benchmark model: what a grammar costs.

1. grammar compile time (llguidance) for the test schemas / regex / choice / grammar, and a cache hit;
2. a batch-32 decode step with 32 JSON-schema requests vs 32 unconstrained (the issue's bound: <= 10 % more);
3. time to first token for a never-seen schema vs the same schema again (cached).

python benchmarks/bench_structured.py [--batch 32] [--steps 30] [--prompt-len 128] [--quick]
Prints a table and writes benchmarks/results/structured-<timestamp>.json. --quick: the bundled model, tiny sizes
(a smoke test, numbers meaningless).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch
from benchmark_model import CONFIG, build_benchmark_model, random_prompts
from machine import machine_info

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.sample.test_structured_output import ARITH_GBNF, CHOICES, CODES, DATE, ORDER, PERSON  # noqa: E402

# A schema the random-weight model keeps writing for a long time: an open array of records.
RECORDS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["id", "name", "tags"],
    },
}


def compile_times(engine, repeats: int) -> dict[str, dict[str, float]]:
    from lmserve.sample.structured_output import StructuredOutputManager
    from lmserve.sampling_params import StructuredOutputsParams

    cases = {
        "json: flat object + enum": StructuredOutputsParams(json=PERSON),
        "json: nested array of objects": StructuredOutputsParams(json=ORDER),
        "json: pattern + minItems": StructuredOutputsParams(json=CODES),
        "json: records (bench)": StructuredOutputsParams(json=RECORDS),
        "regex: date": StructuredOutputsParams(regex=DATE),
        "choice: 3": StructuredOutputsParams(choice=CHOICES),
        "grammar: arithmetic (GBNF)": StructuredOutputsParams(grammar=ARITH_GBNF),
    }
    out = {}
    for name, so in cases.items():
        cold, hit = [], []
        for _ in range(repeats):
            mgr = StructuredOutputManager(engine.tokenizer, engine.config.model.vocab_size, engine.eos_token_ids)
            mgr._tokenizer()  # tokenizer conversion is once per engine, not per grammar
            t = time.perf_counter()
            mgr.compile(so).result()
            cold.append(time.perf_counter() - t)
            t = time.perf_counter()
            mgr.compile(so).result()
            hit.append(time.perf_counter() - t)
            mgr.shutdown()
        out[name] = {"compile_ms": statistics.median(cold) * 1e3, "cached_ms": statistics.median(hit) * 1e3}
    return out


def decode_step_ms(engine, prompts: list[list[int]], steps: int, schema: dict | None) -> dict[str, float]:
    """Median step time over `steps` decode steps in which every request is running (prefill excluded)."""
    from lmserve import SamplingParams, StructuredOutputsParams

    so = None if schema is None else StructuredOutputsParams(json=schema)
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=steps + 8, ignore_eos=True, structured_outputs=so)
    ids = [engine.add_request(None, p, params) for p in prompts]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()) or (
        len(engine.scheduler.running) < len(ids) and engine.has_unfinished_requests()
    ):
        engine.step()
    times = []
    for _ in range(steps):
        if len(engine.scheduler.running) < len(ids):
            break  # a constrained request completed its grammar: the batch is no longer full
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return {"step_ms": statistics.median(times) * 1e3 if times else float("nan"), "num_steps": len(times)}


def ttft_ms(engine, prompt: list[int], schema: dict) -> float:
    from lmserve import SamplingParams, StructuredOutputsParams

    params = SamplingParams(temperature=1.0, max_tokens=1, structured_outputs=StructuredOutputsParams(json=schema))
    t = time.perf_counter()
    engine.add_request(None, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--quick", action="store_true", help="bundled model, tiny sizes: a smoke test")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from lmserve import LLM

    if args.quick:
        args.batch, args.steps, args.prompt_len, args.repeats = 4, 3, 16, 1
        llm = LLM(num_kv_blocks=64)
        vocab = llm.engine.config.model.vocab_size
    else:
        llm = LLM(str(build_benchmark_model()), max_model_len=1024)
        vocab = CONFIG["vocab_size"]
    engine = llm.engine
    prompts = random_prompts(args.batch, args.prompt_len, vocab)

    compiled = compile_times(engine, args.repeats)
    decode_step_ms(engine, prompts, 2, None)  # warm-up
    plain = decode_step_ms(engine, prompts, args.steps, None)
    constrained = decode_step_ms(engine, prompts, args.steps, RECORDS)
    fresh = {**PERSON, "title": uuid.uuid4().hex}
    ttft_new = ttft_ms(engine, prompts[0], fresh)
    ttft_cached = ttft_ms(engine, prompts[0], fresh)

    overhead = constrained["step_ms"] / plain["step_ms"] - 1
    print(f"\ngrammar compile (llguidance), median of {args.repeats}:")
    for name, r in compiled.items():
        print(f"  {name:32s} {r['compile_ms']:8.2f} ms   cached {r['cached_ms']:.3f} ms")
    print(f"\nbatch-{args.batch} decode step, median of {plain['num_steps']} / {constrained['num_steps']} steps:")
    print(f"  unconstrained                    {plain['step_ms']:8.2f} ms")
    print(f"  {args.batch} JSON-schema requests          {constrained['step_ms']:8.2f} ms   ({overhead:+.1%})")
    print("\ntime to first token, one request, idle engine:")
    print(f"  never-seen schema                {ttft_new:8.2f} ms")
    print(f"  cached schema                    {ttft_cached:8.2f} ms")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"structured-{time.strftime('%Y%m%d-%H%M%S')}.json"
    result = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine": machine_info(),
        "compile": compiled,
        "decode_step": {"unconstrained": plain, "json_schema": constrained, "overhead": overhead},
        "ttft_ms": {"never_seen": ttft_new, "cached": ttft_cached},
    }
    path.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
