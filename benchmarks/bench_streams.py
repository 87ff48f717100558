"""The int8 kernel's row runs per thread (kernels.set_streams), A/B inside one engine process.

python benchmarks/bench_streams.py [--quantization int8] [--streams 1,2,3,4] [--steps 2000] [--model DIR]

One request at a time decodes greedily (64-token prompt, 400 tokens, ignore_eos) on LLM engine of the benchmark
model; the setting switches every 16 steps through --streams, and the first step after a switch is left out, so a
slow minute of this shared guest slows every setting alike. Prints each setting's median and 10th-percentile step
time. Every request decodes the same prompt, and the settings fall on different positions in each (400 is not a
multiple of the cycle), so all requests' tokens must be equal (the walk changes the order of the rows only).
Writes benchmarks/results/streams-*.json with the machine and the kernels that ran.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from benchmark_model import build_benchmark_model
from machine import write_result

from lmserve import kernels
from lmserve.config import EngineArgs
from lmserve.engine.llm_engine import LLMEngine
from lmserve.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
SWITCH_EVERY = 16  # steps between two settings


def run(model: str, quantization: str | None, settings: list[int], steps: int) -> dict[int, dict[str, float]]:
    """Median / p10 step time (ms) and steps timed per setting."""
    kw = {} if quantization in (None, "fp32") else {"quantization": quantization}
    args = EngineArgs.from_kwargs(model, num_kv_blocks=400, max_model_len=2048, **kw)
    engine = LLMEngine(args.create_engine_config())
    rng = random.Random(0)
    prompt = [rng.randrange(100, 8000) for _ in range(64)]
    times: dict[int, list[float]] = {s: [] for s in settings}
    finished: list[list[int]] = []
    done = 0
    while done < steps:
        engine.add_request(f"r{done}", prompt, SamplingParams(max_tokens=400, ignore_eos=True, temperature=0))
        i = 0
        while engine.has_unfinished_requests():
            setting = settings[(i // SWITCH_EVERY) % len(settings)]
            kernels.set_streams(setting)
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            if i % SWITCH_EVERY and i > 1:  # the prefill and the first step after a switch left out
                times[setting].append(dt)
            finished += [list(o.outputs[0].token_ids) for o in outs if o.finished]
            i += 1
            done += 1
    kernels.set_streams(settings[0])
    assert all(t == finished[0] for t in finished), "a setting changed the greedy tokens"
    return {
        s: {
            "median_ms": statistics.median(ts) * 1e3,
            "p10_ms": sorted(ts)[len(ts) // 10] * 1e3,
            "steps": len(ts),
        }
        for s, ts in times.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the benchmark model)")
    ap.add_argument("--quantization", default="int8")
    ap.add_argument("--streams", default="1,2,3,4", help="comma-separated settings, 1-16")
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    settings = [int(s) for s in args.streams.split(",")]
    if not kernels.available():
        raise SystemExit("the C kernels are not available (no compiler?)")
    model = args.model or str(build_benchmark_model())
    res = run(model, args.quantization, settings, args.steps)
    base = res[settings[0]]["median_ms"]
    print(f"{'streams':>8} {'median ms':>10} {'p10 ms':>8} {'tok/s':>7} {'vs first':>9}")
    for s, r in res.items():
        ms = r["median_ms"]
        print(f"{s:>8} {ms:>10.3f} {r['p10_ms']:>8.3f} {1e3 / ms:>7.1f} {base / ms:>8.2f}×")
    write_result(RESULTS, "streams", args, {"results": {str(s): r for s, r in res.items()}})


if __name__ == "__main__":
    main()
