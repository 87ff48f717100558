"""Per-step time breakdown of lmserve on the benchmark model: schedule / prepare+forward+sample / update.

python benchmarks/profile_step.py [--requests 32] [--prompt-len 128] [--steps 20] [--torch-profile]
"""

from __future__ import annotations

import argparse
import time

import torch
from benchmark_model import CONFIG, build_benchmark_model, random_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--torch-profile", action="store_true")
    args = ap.parse_args()
    from lmserve import LLM, SamplingParams

    llm = LLM(str(build_benchmark_model()), max_model_len=1024, enable_prefix_caching=False)
    eng = llm.engine
    for i, p in enumerate(random_prompts(args.requests, args.prompt_len, CONFIG["vocab_size"])):
        eng.add_request(str(i), p, SamplingParams(max_tokens=10_000 // 20, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step()
    print(f"prefill of {args.requests} x {args.prompt_len}: {time.perf_counter() - t0:.2f} s")
    eng.step()
    times = {"schedule": 0.0, "execute": 0.0, "update": 0.0}
    prof = torch.profiler.profile() if args.torch_profile else None
    if prof:
        prof.__enter__()
    for _ in range(args.steps):
        t = time.perf_counter()
        sched = eng.scheduler.schedule()
        t1 = time.perf_counter()
        out = eng.runner.execute(sched)
        t2 = time.perf_counter()
        eng.scheduler.update_from_output(sched, out, 1024)
        t3 = time.perf_counter()
        times["schedule"] += t1 - t
        times["execute"] += t2 - t1
        times["update"] += t3 - t2
    if prof:
        prof.__exit__(None, None, None)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    total = sum(times.values())
    print(
        f"decode step, batch {args.requests}: {1000 * total / args.steps:.1f} ms/step, "
        f"{args.requests * args.steps / total:.1f} tok/s"
    )
    for k, v in times.items():
        print(f"  {k:>9}: {1000 * v / args.steps:7.2f} ms ({100 * v / total:4.1f}%)")


if __name__ == "__main__":
    main()
