"""Decode step time against the number of decodes in a step, per weight format (in-process engine).

python benchmarks/bench_decode_rows.py [--quantization int8,int4,fp32] [--batches 1,2,3,4,8] [--tokens 120]

For each format and batch size B, B requests (64-token random prompts, greedy, ignore_eos) decode together in one
LLM engine of the benchmark model; the median step time over the steps where all B decode is the figure (the
prefill steps left out). Shows where a format's decode rows leave its one-call decode stack or its few-row kernels
(a step of B decodes slower per token than one of B - 1). Writes benchmarks/results/decode-rows-*.json with the
machine and the kernels that ran.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from benchmark_model import build_benchmark_model
from machine import write_result

from lmserve.config.engine import EngineArgs
from lmserve.engine.llm_engine import LLMEngine
from lmserve.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"


def step_times(model: str, quantization: str, batches: list[int], tokens: int) -> dict[int, float]:
    """Median step time (ms) of B decodes together, per B."""
    kw = {} if quantization == "fp32" else {"quantization": quantization}
    args = EngineArgs.from_kwargs(model, num_kv_blocks=1200, max_model_len=2048, **kw)
    engine = LLMEngine(args.create_engine_config())
    rng = random.Random(0)
    out = {}
    for b in batches:
        for r in range(b):
            prompt = [rng.randrange(100, 8000) for _ in range(64)]
            params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
            engine.add_request(f"b{b}-{r}", prompt, params)
        times = []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            if len(outs) == b and all(len(o.outputs[0].token_ids) > 1 for o in outs):  # every row a decode
                times.append(dt)
        out[b] = statistics.median(times) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the benchmark model)")
    ap.add_argument("--quantization", default="int8,int4,fp32", help="comma-separated: int8, int4, fp32 ...")
    ap.add_argument("--batches", default="1,2,3,4,8")
    ap.add_argument("--tokens", type=int, default=120, help="output tokens of each request")
    args = ap.parse_args()
    model = args.model or str(build_benchmark_model())
    batches = [int(b) for b in args.batches.split(",")]
    results = {q: step_times(model, q, batches, args.tokens) for q in args.quantization.split(",")}
    print(f"{'format':>8} " + " ".join(f"{f'B={b} ms':>10} {'tok/s':>6}" for b in batches))
    for q, res in results.items():
        print(f"{q:>8} " + " ".join(f"{res[b]:>10.2f} {b * 1e3 / res[b]:>6.0f}" for b in batches))
    payload = {q: {str(b): {"step_ms": ms, "tok_s": b * 1e3 / ms} for b, ms in r.items()} for q, r in results.items()}
    write_result(RESULTS, "decode_rows", args, {"results": payload})


if __name__ == "__main__":
    main()
