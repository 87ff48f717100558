"""Scoring throughput through the server, and the memory of scoring one long prompt.

    python benchmarks/bench_scoring.py [--requests 1000] [--prompt-len 256] [--concurrency 8] [--rounds 1]
        [--threads 2] [--peak-prompt-len 2000] [--model DIR] [--out DIR] [--quick] [--no-peak]

One `lmserve serve` (the benchmark model of benchmarks/benchmark_model.py unless --model: 49,152-token vocabulary),
every request a different prompt of exactly --prompt-len random token ids, --concurrency in flight (closed loop,
non-streaming /v1/completions). Two modes on the same prompts, alternating which goes first each round (ABBA):

  scoring  max_tokens 0, echo, logprobs 1: every prompt position's logprob and top-1 (what lm-eval's
           loglikelihood reads; it sends max_tokens 1, and other harnesses 0)
  prefill  max_tokens 1: the same prompts as plain prefill, one token sampled

Reports prompt tokens/s of each (the median over rounds) and their ratio. Scoring runs the LM head on every
prompt position (a prefill runs it on the last only): on the benchmark model that is 2 x 576 x 49,152 =
57 MFLOP per token beside the decoder's 2 x 106 M = 212 MFLOP, so ~0.79x is the compute bound.

Then the peak memory of one --peak-prompt-len prompt with prompt_logprobs 5 and max_tokens 0 (the whole prompt
in one step), offline in a fresh process: the process's peak RSS after a plain prefill of the same prompt, and
after scoring it, once with the log_softmax in 16 MiB slices of rows (lmserve's) and once over the whole
[prompt_len, vocab] (the slice made larger than the prompt), to show what slicing saves.
Writes benchmarks/results/scoring-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmark_model import CONFIG, add_size_args, build_benchmark_model, random_prompts, resolve_size_args
from machine import write_result

from lmserve.bench.harness import ServerError, free_loopback_port, running_server

FULL = dict(requests=1000, prompt_len=256, concurrency=8, rounds=1, peak_prompt_len=2000)
QUICK = dict(requests=16, prompt_len=64, concurrency=4, rounds=1, peak_prompt_len=256)
MODES = ("scoring", "prefill")


@contextlib.contextmanager
def server(model_dir: Path, args: argparse.Namespace) -> Iterator[str]:
    port = free_loopback_port()
    cmd = [sys.executable, "-m", "lmserve.entrypoints.cli", "serve", "--model", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--no-access-log", "--log-level", "warning"]
    # both modes see the same prompts: a prefill must not find the blocks a scoring request just computed
    cmd += ["--no-prefix-caching"]
    cmd += ["--max-num-seqs", str(args.concurrency), "--max-model-len", str(args.prompt_len + 16)]
    cmd += ["--num-threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    with running_server(cmd, f"http://127.0.0.1:{port}", "lmserve serve", args.server_timeout, env=env) as url:
        yield url


def body(mode: str, prompt: list[int]) -> dict[str, Any]:
    if mode == "scoring":
        return {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    return {"prompt": prompt, "max_tokens": 1, "temperature": 0}


async def load(url: str, mode: str, prompts: list[list[int]], concurrency: int) -> dict[str, float]:
    """Every prompt once, `concurrency` in flight; prompt tokens/s over the wall time of the whole set."""
    import httpx

    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    latencies: list[float] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            start = time.perf_counter()
            r = await client.post(url + "/v1/completions", json=body(mode, prompt))
            latencies.append(time.perf_counter() - start)
            if r.status_code != 200:
                raise ServerError(f"{mode}: HTTP {r.status_code}: {r.text[:300]}")
            out = r.json()
            choice, usage = out["choices"][0], out["usage"]
            if mode == "scoring":
                scored = choice["logprobs"]["token_logprobs"]
                if len(scored) != len(prompt) or scored[0] is not None or usage["completion_tokens"] != 0:
                    raise ServerError(f"scoring: {len(scored)} logprobs for {len(prompt)} tokens, usage {usage}")
            elif usage["completion_tokens"] != 1:
                raise ServerError(f"prefill: usage {usage}")

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=1800.0, limits=limits, trust_env=False) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    tokens = sum(len(p) for p in prompts)
    return {
        "prompt_tok_s": tokens / wall,
        "wall_s": wall,
        "latency_p50_s": statistics.median(latencies),
        "latency_max_s": max(latencies),
    }


def peak_rss_child(model_dir: str, prompt_len: int, slice_elements: int | None, threads: int) -> None:
    """(In a fresh process) peak RSS after a plain prefill of one prompt, then after scoring it; JSON on stdout."""
    import resource

    import torch

    torch.set_num_threads(threads)
    from lmserve import LLM, SamplingParams
    from lmserve.worker import model_runner

    if slice_elements is not None:
        model_runner.PROMPT_LOGPROBS_SLICE_ELEMENTS = slice_elements
    llm = LLM(
        model_dir, max_model_len=prompt_len + 16, max_num_batched_tokens=prompt_len + 16, enable_prefix_caching=False,
        kv_cache_memory_gib=0.5,
    )  # fmt: skip
    vocab = llm.engine.config.model.vocab_size
    (prompt,) = random_prompts(1, prompt_len, vocab, seed=99)
    for _ in range(2):  # the second one with the allocator warm
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    plain_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=5), use_tqdm=False)[0]
    elapsed = time.perf_counter() - start
    assert len(out.prompt_logprobs) == prompt_len, "one entry per prompt token"
    scored_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows = model_runner.PROMPT_LOGPROBS_SLICE_ELEMENTS // vocab
    print(json.dumps({"plain_peak_mib": plain_kib / 1024, "scoring_peak_mib": scored_kib / 1024,
                      "extra_mib": (scored_kib - plain_kib) / 1024, "rows_per_slice": min(rows, prompt_len),
                      "full_logits_mib": prompt_len * vocab * 4 / 2**20, "scoring_s": elapsed}))  # fmt: skip


def peak_memory(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for name, slice_elements in (("sliced", None), ("unsliced", 1 << 40)):
        cmd = [sys.executable, __file__, "--_peak-child", str(model_dir), str(args.peak_prompt_len)]
        cmd += [str(slice_elements), str(args.threads)]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, check=False)
        if done.returncode != 0:
            raise ServerError(f"peak-memory child failed:\n{done.stderr[-2000:]}")
        out[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"peak memory, {name}: {out[name]}", flush=True)
    return out


def format_table(result: dict[str, dict[str, float]], ratio: float) -> str:
    lines = [f"{'mode':<10} {'prompt tok/s':>12} {'wall s':>8} {'p50 s':>8} {'max s':>8}"]
    for mode in MODES:
        r = result[mode]
        lines.append(
            f"{mode:<10} {r['prompt_tok_s']:>12.1f} {r['wall_s']:>8.1f} {r['latency_p50_s']:>8.2f} "
            f"{r['latency_max_s']:>8.2f}"
        )
    lines.append(f"scoring / prefill: {ratio:.3f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--_peak-child":
        model_dir, prompt_len, slice_elements, threads = argv[1:5]
        peak_rss_child(model_dir, int(prompt_len), None if slice_elements == "None" else int(slice_elements),
                       int(threads))  # fmt: skip
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_args(ap, FULL, QUICK)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the server (and the peak run)")
    ap.add_argument("--model", type=Path, default=None, help="HF model directory (default: the benchmark model)")
    ap.add_argument("--server-timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--no-peak", action="store_true", help="skip the peak-memory measurement")
    args = ap.parse_args(argv)
    resolve_size_args(ap, args, FULL, QUICK)
    model_dir = args.model or build_benchmark_model()
    vocab = CONFIG["vocab_size"]
    if args.model is not None:
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rounds: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    with server(model_dir, args) as url:
        warm = random_prompts(args.concurrency, args.prompt_len, vocab, seed=1000)
        for mode in MODES:  # untimed: both paths, every batch size up to the concurrency
            asyncio.run(load(url, mode, warm, args.concurrency))
        for r in range(args.rounds):
            prompts = random_prompts(args.requests, args.prompt_len, vocab, seed=r)
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                row = asyncio.run(load(url, mode, prompts, args.concurrency))
                rounds[mode].append(row)
                print(f"round {r} {mode}: {row}", flush=True)
    result = {m: {k: statistics.median(row[k] for row in rounds[m]) for k in rounds[m][0]} for m in MODES}
    ratio = result["scoring"]["prompt_tok_s"] / result["prefill"]["prompt_tok_s"]
    peak = None if args.no_peak else peak_memory(model_dir, args)
    print(
        f"\n{args.requests} requests x {args.rounds} rounds of {args.prompt_len}-token prompts, "
        f"{args.concurrency} concurrent (median over rounds)"
    )
    print(format_table(result, ratio))
    if peak is not None:
        s, u = peak["sliced"], peak["unsliced"]
        print(
            f"one {args.peak_prompt_len}-token prompt, prompt_logprobs 5: peak RSS +{s['extra_mib']:.0f} MiB over "
            f"its plain prefill sliced ({s['rows_per_slice']} rows a slice), +{u['extra_mib']:.0f} MiB unsliced "
            f"(the whole logits: {s['full_logits_mib']:.0f} MiB)"
        )
    write_result(args.out, "scoring", args, {"result": result, "ratio": ratio, "rounds": rounds, "peak": peak})
    return 0


if __name__ == "__main__":
    sys.exit(main())
