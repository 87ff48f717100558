"""What an open dashboard costs the engine: N streams decoded with and without a dashboard feed subscribed
(the block map built on the engine thread at most once a second, the feed's registry reads and diagnosis twice a
second on the event loop, as `/v1/dashboard/stream` does). Prints the mean step time both ways; the budget is
≤ 1 % at 32 streams.

    python benchmarks/bench_dashboard.py [--streams 32] [--prompt-len 128] [--output-len 256] [--repeats 3]
                                    [--kv-cache-memory-gib 2] [--threads N] [--quick]

--quick: the bundled tiny model, 4 streams, 24 tokens (a smoke test of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from benchmark_model import CONFIG, build_benchmark_model, random_prompts
from machine import write_result


def run_once(engine, metrics, prompts: list[list[int]], output_len: int, dashboard: bool) -> dict:
    from lmserve import SamplingParams
    from lmserve.entrypoints.openai.dashboard import INTERVAL_S, ScrapeHistory, feed_update

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    state = SimpleNamespace(engine=engine, metrics=metrics, served_model_name="bench")
    history = ScrapeHistory()
    num_updates = 0

    async def stream(p: list[int]) -> None:
        async for _ in engine.generate(p, params):
            pass

    async def feed(stop: asyncio.Event) -> None:
        nonlocal num_updates
        while not stop.is_set():
            feed_update(state, history)
            num_updates += 1
            try:
                await asyncio.wait_for(stop.wait(), INTERVAL_S)
            except TimeoutError:
                pass

    async def main() -> tuple[float, float, int]:
        stop = asyncio.Event()
        if dashboard:
            engine.watch_block_map(True)
            feeder = asyncio.ensure_future(feed(stop))
        before = engine.snapshot().metrics
        start = time.perf_counter()
        await asyncio.gather(*(stream(p) for p in prompts))
        wall = time.perf_counter() - start
        after = engine.snapshot().metrics
        if dashboard:
            stop.set()
            await feeder
            engine.watch_block_map(False)
        steps = after["num_steps_total"] - before["num_steps_total"]
        return wall, after["step_time_s_total"] - before["step_time_s_total"], steps

    wall, model_s, steps = asyncio.run(main())
    return {
        "dashboard": dashboard,
        "wall_s": wall,
        "steps": steps,
        "mean_step_ms": 1e3 * wall / steps,  # the engine loop's time per step, snapshot and block map included
        "mean_model_step_ms": 1e3 * model_s / steps,
        "feed_updates": num_updates,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-cache-memory-gib", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    from lmserve.config.engine import EngineArgs
    from lmserve.engine.async_engine import AsyncEngine
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.observability.prometheus import Metrics

    if args.quick:
        from lmserve.default_model import default_model_path

        model, vocab = default_model_path("target"), 2000
        args.streams, args.prompt_len, args.output_len, args.repeats = 4, 16, 24, 1
        engine_kw = dict(num_kv_blocks=256, max_model_len=256)
    else:
        model, vocab = str(build_benchmark_model()), CONFIG["vocab_size"]
        engine_kw = dict(kv_cache_memory_gib=args.kv_cache_memory_gib, max_model_len=1024)
    if args.threads:
        torch.set_num_threads(args.threads)
    llm_engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(str(model), **engine_kw))
    engine = AsyncEngine(llm_engine, num_threads=args.threads).start()
    metrics = Metrics("bench", engine.snapshot)
    engine.stat_loggers.append(metrics)
    prompts = random_prompts(args.streams, args.prompt_len, vocab)
    num_blocks = llm_engine.config.cache.num_blocks
    try:
        run_once(engine, metrics, prompts[:2], 4, False)  # warm-up
        runs = []
        for _ in range(args.repeats):  # alternate, so drifting machine load hits both alike
            for dashboard in (False, True):
                r = run_once(engine, metrics, prompts, args.output_len, dashboard)
                runs.append(r)
                print(f"dashboard={'on ' if dashboard else 'off'}  mean step {r['mean_step_ms']:.3f} ms "
                      f"(model {r['mean_model_step_ms']:.3f} ms) over {r['steps']} steps, "
                      f"{r['feed_updates']} feed updates")  # fmt: skip
    finally:
        engine.shutdown()
    off = statistics.mean(r["mean_step_ms"] for r in runs if not r["dashboard"])
    on = statistics.mean(r["mean_step_ms"] for r in runs if r["dashboard"])
    overhead_pct = 100 * (on - off) / off
    print(f"{args.streams} streams, {num_blocks} KV blocks: mean step {off:.3f} ms without a dashboard, "
          f"{on:.3f} ms with one: {overhead_pct:+.2f} % (budget 1 %)")  # fmt: skip
    payload = {"num_kv_blocks": num_blocks, "mean_step_ms_off": off, "mean_step_ms_on": on,
               "overhead_pct": overhead_pct, "runs": runs}  # fmt: skip
    write_result(Path(args.out), "bench_dashboard", args, payload, "-quick" if args.quick else "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
