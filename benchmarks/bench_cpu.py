"""The CPU performance table: lmserve vs HF transformers (and optionally a peer OpenAI-compatible server such as
vLLM-CPU), same model, same prompts, one run.

    python benchmarks/bench_cpu.py [--prompt-len 128] [--output-len 128] [--concurrency 32] [--offline-requests 256]
        [--hf-batch 32] [--threads 2] [--peer-url http://host:port [--peer-model NAME]] [--model DIR|FILE.gguf]
        [--skip-single] [--skip-hf] [--skip-server] [--skip-offline] [--out DIR] [--quick]
        [--quantization int8|int4|none [--quantization-group-size 32]] [--llama-cpp-dir DIR]
        [--model FILE.gguf [--gguf-type Q8_0]] [--gguf-type Q4_K_M] [--llama-cpp-settings both|default|no-repack]
        [--gguf-cache DIR]

Workloads (every request a different prompt of exactly --prompt-len random token ids, output length forced):

- single-stream decode: 1 request through the in-process engine (`LLM.generate`) vs HF `generate` batch 1;
  decode tok/s = (N - 1) / (e2e - TTFT). Also through the HTTP server, client-side (1 / TPOT).
- TTFT on an idle server: one streaming /v1/completions request at a time (max_tokens 1), median of 5 after a
  warm-up, send to first token chunk; vs HF `generate(max_new_tokens=1)` on the same prompts.
- concurrent streams: 2 x --concurrency requests, at most --concurrency in flight (closed loop), through HTTP;
  output tok/s, mean and P99 TPOT; vs an HF static batch of --concurrency prompts.
- offline: --offline-requests requests in one `LLM.generate` call vs HF static batches of --hf-batch.

The phases run one after the other so no two of them share the cores: lmserve in-process, then HF, then the
lmserve server (a subprocess, stopped before the next phase), then the peer. The benchmark model is the
SmolLM-135M-shaped random Llama of benchmarks/benchmark_model.py unless --model names an HF model directory or a
.gguf file (lmserve and HF both dequantize it; llama.cpp's llama-server on the same file is a --peer-url). The peer
gets prompts as token ids, so it must serve a model with at least that vocabulary (49152 for the benchmark
model). Prints the table (ratios are lmserve / peer) and writes benchmarks/results/cpu-<timestamp>.json.

--quantization runs lmserve (engine and server) with int8 (W8A8) or int4 weights; HF stays float32. With
--llama-cpp-dir the peer is llama.cpp's llama-server on the same model converted to GGUF at the matching
width (F32 / Q8_0 / Q4_0; benchmarks/llama_cpp_peer.py), --threads threads, --concurrency slots.

With --model FILE.gguf and --llama-cpp-dir, llama-server and lmserve serve that same file: lmserve runs its
Q8_0 / Q4_0 / Q4_1 tensors as they are (no --quantization; `none` dequantizes). --gguf-type Q8_0 first
re-quantizes the file with llama-quantize (cached) and both sides serve the result. Without --model, --gguf-type
(e.g. Q4_K_M) is the benchmark model's F32 GGUF quantized by llama-quantize (cached), which both sides serve: the
K-quant comparison (lmserve keeps its Q4_K / Q6_K / Q5_0 / Q8_0 tensors as they are). Prompts are random token
ids, so --skip-hf --skip-offline keeps the run to the three workloads llama.cpp is compared on (single-stream
decode, TTFT, --concurrency streams).

llama.cpp runs with its default settings and with --no-repack (--llama-cpp-settings both, the default); each row
compares with the faster of the two (JSON: results.peer.settings names which, results.peer_runs holds both).
--repeats N runs the HTTP workloads N times, lmserve and llama.cpp alternating, and shows each number's median
(results.lmserve_server_repeats / results.peer_repeats keep every run): on a 2-core guest one run of a single
stream spreads by ±10 %.
The converted and quantized GGUF files are cached in --gguf-cache (benchmarks/.cache/gguf). Before anything is
timed against llama.cpp, the greedy continuation of the single-stream prompt is asked of both engines
(results.greedy_agreement: how many of the first GREEDY_CHECK_TOKENS agree).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import llama_cpp_peer
import torch
from benchmark_model import CONFIG, FAMILIES, build_benchmark_model, random_prompts
from machine import machine_info

from lmserve.bench.harness import ServerError, free_loopback_port, running_server
from lmserve.checkpoint.gguf import GGUFCheckpoint, find_gguf_file

REPO = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 16  # the engine's default KV block size
TTFT_SAMPLES = 5
FULL = dict(prompt_len=128, output_len=128, concurrency=32, offline_requests=256, hf_batch=32)
QUICK = dict(prompt_len=16, output_len=8, concurrency=4, offline_requests=8, hf_batch=4)
GREEDY_CHECK_TOKENS = 32  # the greedy tokens lmserve and llama.cpp are compared on (the single-stream prompt)


@dataclass(frozen=True)
class Workloads:
    """Every prompt set of the run (token ids, all different), shared by lmserve, HF and the peer."""

    prompt_len: int
    output_len: int
    concurrency: int
    offline_requests: int
    hf_batch: int
    single: list[int]
    ttft: list[list[int]]  # 1 warm-up + TTFT_SAMPLES
    concurrent: list[list[int]]  # 2 x concurrency; HF's static batch takes the first `concurrency`
    offline: list[list[int]]
    warmup: list[list[int]]  # short prompts for untimed warm-ups

    @staticmethod
    def build(args: argparse.Namespace, vocab_size: int) -> Workloads:
        p = args.prompt_len
        return Workloads(
            prompt_len=p,
            output_len=args.output_len,
            concurrency=args.concurrency,
            offline_requests=args.offline_requests,
            hf_batch=args.hf_batch,
            single=random_prompts(1, p, vocab_size, seed=1)[0],
            ttft=random_prompts(1 + TTFT_SAMPLES, p, vocab_size, seed=2),
            concurrent=random_prompts(2 * args.concurrency, p, vocab_size, seed=3),
            offline=random_prompts(args.offline_requests, p, vocab_size, seed=4),
            warmup=random_prompts(max(args.concurrency, args.hf_batch), min(p, 16), vocab_size, seed=5),
        )

    def kv_blocks(self, num_seqs: int, max_model_len: int) -> int:
        """A KV pool that holds `num_seqs` full requests at once (no preemption) and one max-length request."""
        per_seq = math.ceil((self.prompt_len + self.output_len) / BLOCK_SIZE) + 1
        return max(math.ceil(max_model_len / BLOCK_SIZE), num_seqs * per_seq)


# ---- lmserve in-process ------------------------------------------------------------------------------------


def run_lmserve_offline(
    model_dir: Path, w: Workloads, max_model_len: int, single: bool, offline: bool, engine: dict[str, Any]
) -> dict[str, Any]:
    """engine: extra EngineArgs (device, dtype, weight_dtype)."""
    from lmserve import LLM, SamplingParams

    num_seqs = max(256, w.offline_requests)
    llm = LLM(
        str(model_dir),
        max_model_len=max_model_len,
        enable_prefix_caching=False,
        max_num_seqs=num_seqs,
        num_kv_blocks=w.kv_blocks(num_seqs, max_model_len),
        **engine,
    )
    params = SamplingParams(max_tokens=w.output_len, temperature=0, ignore_eos=True)
    llm.generate(w.warmup, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
    res: dict[str, Any] = {}
    if single:
        t0 = time.perf_counter()
        (out,) = llm.generate([w.single], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        assert len(out.outputs[0].token_ids) == w.output_len, "the request must produce exactly output_len tokens"
        m = out.metrics
        ttft = m.first_token_time - m.arrival_time
        e2e = m.finished_time - m.arrival_time
        res["single"] = {
            "wall_s": wall,
            "ttft_s": ttft,
            "e2e_s": e2e,
            "decode_tok_s": (w.output_len - 1) / (e2e - ttft) if e2e > ttft else None,
            "e2e_tok_s": w.output_len / wall,
            "greedy_tokens": list(out.outputs[0].token_ids[:GREEDY_CHECK_TOKENS]),  # (temperature 0)
        }
    if offline:
        before = llm.engine.get_metrics()
        t0 = time.perf_counter()
        outs = llm.generate(w.offline, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = llm.engine.get_metrics()
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        assert n_out == len(w.offline) * w.output_len, "every request must produce exactly output_len tokens"
        ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
        res["offline"] = {
            "requests": len(w.offline),
            "wall_s": wall,
            "output_tok_s": n_out / wall,
            "ttft_mean_s": sum(ttfts) / len(ttfts),
            "num_steps": after["num_steps_total"] - before["num_steps_total"],
            "num_preemptions": after["num_preemptions_total"] - before["num_preemptions_total"],
        }
    res["engine"] = {"max_num_seqs": num_seqs, "num_kv_blocks": llm.engine.config.cache.num_blocks}
    del llm
    gc.collect()
    return res


# ---- HF transformers ---------------------------------------------------------------------------------------


@torch.inference_mode()
def run_hf(
    model_dir: Path,
    w: Workloads,
    single: bool,
    concurrent: bool,
    offline: bool,
    device: str = "cpu",
    dtype: str = "float32",
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    gguf_file = find_gguf_file(model_dir)
    if gguf_file is not None:  # transformers dequantizes the GGUF (needs gguf and accelerate)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, gguf_file=gguf_file.name, dtype=getattr(torch, dtype)
        ).to(device).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()

    class _Clock:
        """A generate() streamer that only notes when each put() came: the prompt's first, then each new token."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: torch.Tensor) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    def gen(prompts: list[list[int]], n: int, clock: _Clock | None = None) -> float:
        """Seconds for a static batch of `prompts` (all the same length: no padding) to produce n tokens each."""
        ids = torch.tensor(prompts, device=device)
        t0 = time.perf_counter()
        out = model.generate(ids, do_sample=False, min_new_tokens=n, max_new_tokens=n, pad_token_id=0, streamer=clock)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        assert out.shape[1] - ids.shape[1] == n, "HF must produce exactly n tokens"
        return wall

    gen(w.warmup[:1], 2)
    gen(w.warmup, 2)  # at the largest batch size too
    res: dict[str, Any] = {}
    n = w.output_len
    if single:
        ttft = gen([w.single], 1)
        clock = _Clock()
        full = gen([w.single], n, clock)
        samples = [gen([p], 1) for p in w.ttft[1:]]
        # decode from the same run's own token times (put 0: the prompt, put 1: the first token), not from a
        # difference of two runs' walls, which noise can make negative on a tiny model
        assert len(clock.times) == n + 1, f"the streamer saw {len(clock.times)} puts for {n} tokens"
        decode = (n - 1) / (clock.times[-1] - clock.times[1]) if n > 1 else None
        res["single"] = {"ttft_s": ttft, "wall_s": full, "decode_tok_s": decode, "e2e_tok_s": n / full}
        res["ttft"] = {"samples_s": samples, "median_s": statistics.median(samples)}
    if concurrent:
        batch = w.concurrent[: w.concurrency]
        ttft = gen(batch, 1)
        full = gen(batch, n)
        res["concurrent"] = {
            "batch": len(batch),
            "ttft_s": ttft,
            "wall_s": full,
            "output_tok_s": len(batch) * n / full,
            "step_ms": 1e3 * (full - ttft) / (n - 1) if n > 1 and full > ttft else None,  # each stream's TPOT
        }
    if offline:
        t0 = time.perf_counter()
        for i in range(0, len(w.offline), w.hf_batch):
            gen(w.offline[i : i + w.hf_batch], n)
        wall = time.perf_counter() - t0
        res["offline"] = {
            "requests": len(w.offline),
            "batch": w.hf_batch,
            "wall_s": wall,
            "output_tok_s": len(w.offline) * n / wall,
        }
    return res  # the model is freed with this frame (gc.collect() in main)


# ---- HTTP: the lmserve server and the peer -----------------------------------------------------------------


@contextlib.contextmanager
def lmserve_server(
    model_dir: Path,
    max_model_len: int,
    max_num_seqs: int,
    num_kv_blocks: int,
    threads: int,
    timeout_s: float,
    engine_flags: list[str],
) -> Iterator[str]:
    """`lmserve serve` on a free loopback port with `threads` torch threads; yields its base URL, stops it after."""
    port = free_loopback_port()
    cmd = [sys.executable, "-m", "lmserve.entrypoints.cli", "serve", "--model", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--no-access-log", "--log-level", "warning"]
    cmd += ["--no-prefix-caching", "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs)]
    cmd += ["--num-kv-blocks", str(num_kv_blocks), *engine_flags]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with running_server(cmd, f"http://127.0.0.1:{port}", "lmserve serve", timeout_s, env=env) as base_url:
        yield base_url


def _bench_request(ids: list[int], output_len: int) -> Any:
    from lmserve.bench.datasets import BenchRequest

    # loadgen sends `prompt` as is and the completions API takes token ids, so the server does no tokenizing
    return BenchRequest(prompt=cast(str, ids), prompt_token_ids=ids, output_len=output_len)


def http_load(
    base_url: str,
    model: str | None,
    prompts: list[list[int]],
    output_len: int,
    max_concurrency: int | None,
    warmup: list[list[int]] | None = None,
    strict: bool = True,
) -> tuple[Any, str | None]:
    """Stream `prompts` (ignore_eos, temperature 0) with at most `max_concurrency` in flight; (summary, model).
    strict: every request must produce exactly output_len tokens."""
    from lmserve.bench.loadgen import LoadConfig, finalize_all, run_load
    from lmserve.bench.metrics import summarize

    cfg = LoadConfig(base_url=base_url, model=model, max_concurrency=max_concurrency, timeout_s=1800.0)
    reqs = [_bench_request(p, output_len) for p in prompts]
    warm = [_bench_request(p, output_len) for p in warmup or []]
    result = asyncio.run(run_load(reqs, cfg, warm))
    if result.fatal_error:
        raise ServerError(result.fatal_error)
    if result.warmup_errors:
        raise ServerError(f"{len(result.warmup_errors)} warm-up requests failed: {result.warmup_errors[0]}")
    records = finalize_all(result, reqs, cfg)
    summary = summarize(records, result.duration_s or None, math.inf, max_concurrency)
    if summary.num_failed:
        raise ServerError(f"{summary.num_failed}/{summary.num_requests} requests failed: {summary.errors[:3]}")
    if summary.output_len_matched_pct != 100.0:
        msg = f"{base_url}: only {summary.output_len_matched_pct:.0f}% of the outputs had exactly {output_len} tokens"
        if strict:
            raise ServerError(msg)
        print(f"warning: {msg}", file=sys.stderr)
    return summary, result.model


def run_http(base_url: str, model: str | None, w: Workloads, strict: bool) -> dict[str, Any]:
    """TTFT on the idle server, one stream, then the concurrent streams, against one endpoint."""
    n = w.output_len
    # untimed: a batch of short requests (warms the batched paths) and one full-length prompt
    _, model = http_load(base_url, model, w.warmup[:2], 2, None, warmup=w.warmup, strict=strict)
    s, _ = http_load(base_url, model, w.ttft[1:], 1, 1, warmup=w.ttft[:1], strict=strict)
    ttft = {
        "samples": s.ttft_from_send_ms.count,
        "median_ms": s.ttft_from_send_ms.p50,
        "mean_ms": s.ttft_from_send_ms.mean,
    }
    s, _ = http_load(base_url, model, [w.single], n, 1, strict=strict)
    single = {
        "ttft_ms": s.ttft_from_send_ms.mean,
        "tpot_ms": s.tpot_ms.mean,
        "decode_tok_s": 1e3 / s.tpot_ms.mean if s.tpot_ms.mean else None,
        "e2e_tok_s": s.total_output_tokens / (s.e2e_from_send_ms.mean / 1e3),
    }
    s, _ = http_load(base_url, model, w.concurrent, n, w.concurrency, strict=strict)
    concurrent = {
        "requests": s.num_requests,
        "max_concurrency": w.concurrency,
        "duration_s": s.duration_s,
        "output_tok_s": s.output_throughput_tok_s,
        "tpot_mean_ms": s.tpot_ms.mean,
        "tpot_p99_ms": s.tpot_ms.p99,
        "ttft_mean_ms": s.ttft_from_send_ms.mean,
        "ttft_p99_ms": s.ttft_from_send_ms.p99,
        "output_len_matched_pct": s.output_len_matched_pct,
    }
    return {"url": base_url, "model": model, "ttft": ttft, "single": single, "concurrent": concurrent}


# ---- the table ---------------------------------------------------------------------------------------------


def _get_list(d: dict[str, Any] | None, *keys: str) -> list | None:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d if isinstance(d, list) else None


def _get(d: dict[str, Any] | None, *keys: str) -> float | None:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d if isinstance(d, int | float) else None


def build_rows(
    res: dict[str, Any], w: Workloads, peer_name: str | None, single: bool, http: bool, offline: bool
) -> list[dict[str, Any]]:
    """One row per (workload, metric, peer) of the sections that ran; a value is None where its side was skipped
    (--skip-hf) or failed (the peer)."""
    ours_off, hf, srv, peer = (res.get(k) for k in ("lmserve_offline", "hf", "lmserve_server", "peer"))
    c = w.concurrency
    rows: list[dict[str, Any]] = []

    def row(workload: str, metric: str, higher: bool, ours: float | None, *peers: tuple[str, float | None]) -> None:
        for name, value in peers:
            rows.append(
                {
                    "workload": workload,
                    "metric": metric,
                    "higher_is_better": higher,
                    "lmserve": ours,
                    "peer": name,
                    "peer_value": value,
                    "ratio": ours / value if ours is not None and value else None,
                }
            )

    def vs_peer(*keys: str) -> list[tuple[str, float | None]]:
        return [(peer_name, _get(peer, *keys))] if peer_name else []

    hf_ttft_s = _get(hf, "ttft", "median_s")
    if single:
        hf1 = "HF generate batch 1"
        row(
            "single-stream decode, 1 request (engine)",
            "decode tok/s",
            True,
            _get(ours_off, "single", "decode_tok_s"),
            (hf1, _get(hf, "single", "decode_tok_s")),
        )
        row(
            "single-stream e2e, 1 request (engine)",
            "output tok/s",
            True,
            _get(ours_off, "single", "e2e_tok_s"),
            (hf1, _get(hf, "single", "e2e_tok_s")),
        )
    if http:
        hfc = f"HF static batch {c}"
        row(
            "single-stream decode, 1 request (HTTP)",
            "decode tok/s",
            True,
            _get(srv, "single", "decode_tok_s"),
            ("HF generate batch 1", _get(hf, "single", "decode_tok_s")),
            *vs_peer("single", "decode_tok_s"),
        )
        row(
            f"TTFT, {w.prompt_len}-token prompt, idle server (HTTP)",
            "median ms (lower better)",
            False,
            _get(srv, "ttft", "median_ms"),
            ("HF generate max_new_tokens=1", None if hf_ttft_s is None else 1e3 * hf_ttft_s),
            *vs_peer("ttft", "median_ms"),
        )
        row(
            f"{c} concurrent streams (HTTP)",
            "output tok/s",
            True,
            _get(srv, "concurrent", "output_tok_s"),
            (hfc, _get(hf, "concurrent", "output_tok_s")),
            *vs_peer("concurrent", "output_tok_s"),
        )
        row(
            f"{c} concurrent streams (HTTP)",
            "mean TPOT ms (lower better)",
            False,
            _get(srv, "concurrent", "tpot_mean_ms"),
            (hfc + " (step time)", _get(hf, "concurrent", "step_ms")),
            *vs_peer("concurrent", "tpot_mean_ms"),
        )
        if peer_name:
            row(
                f"{c} concurrent streams (HTTP)",
                "P99 TPOT ms (lower better)",
                False,
                _get(srv, "concurrent", "tpot_p99_ms"),
                *vs_peer("concurrent", "tpot_p99_ms"),
            )
    if offline:
        row(
            f"offline, {w.offline_requests} requests (engine)",
            "output tok/s",
            True,
            _get(ours_off, "offline", "output_tok_s"),
            (f"HF static batches of {w.hf_batch}", _get(hf, "offline", "output_tok_s")),
        )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    header = ["workload", "metric", "lmserve", "peer", "peer value", "lmserve/peer"]
    body = [
        [
            r["workload"],
            r["metric"],
            f(r["lmserve"]),
            r["peer"] or "-",
            f(r["peer_value"]),
            "-" if r["ratio"] is None else f"{r['ratio']:.2f}x",
        ]
        for r in rows
    ]
    widths = [max(len(x[i]) for x in [header, *body]) for i in range(len(header))]
    right = {2, 4, 5}
    lines = []
    for i, cells in enumerate([header, *body]):
        lines.append(
            " | ".join(
                c.rjust(wd) if j in right else c.ljust(wd) for j, (c, wd) in enumerate(zip(cells, widths, strict=True))
            )
        )
        if i == 0:
            lines.append("-+-".join("-" * wd for wd in widths))
    return "\n".join(lines)


# ---- main --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=None, help="tokens per prompt (default 128; --quick 16)")
    ap.add_argument("--output-len", type=int, default=None, help="tokens per output (default 128; --quick 8)")
    ap.add_argument("--concurrency", type=int, default=None, help="streams in flight over HTTP (default 32)")
    ap.add_argument("--offline-requests", type=int, default=None, help="offline workload size (default 256)")
    ap.add_argument("--hf-batch", type=int, default=None, help="HF static batch for the offline workload (32)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads, here and in the lmserve server")
    ap.add_argument("--model", type=Path, default=None, help="HF model dir or .gguf (default: the benchmark model)")
    ap.add_argument("--family", default="dense", choices=sorted(FAMILIES), help="which benchmark model, no --model")
    ap.add_argument("--max-model-len", type=int, default=1024, help="capped at the model's max positions")
    ap.add_argument("--peer-url", default=None, help="an OpenAI-compatible server to compare with (vLLM-CPU, ...)")
    ap.add_argument("--peer-model", default=None, help="model name for the peer (default: first at /v1/models)")
    ap.add_argument("--skip-single", action="store_true", help="no single-stream workload (offline engine)")
    ap.add_argument("--skip-hf", action="store_true", help="no HF transformers runs")
    ap.add_argument("--skip-server", action="store_true", help="no lmserve server (TTFT, HTTP workloads)")
    ap.add_argument("--skip-offline", action="store_true", help="no offline workload")
    ap.add_argument("--server-timeout", type=float, default=120.0, help="seconds for the server to get healthy")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run")
    ap.add_argument(
        "--repeats", type=int, default=1,
        help="run the HTTP workloads N times, lmserve and the peer alternating; the table shows each number's "
        "median over the runs (the JSON keeps every run)",
    )  # fmt: skip
    ap.add_argument(
        "--weight-dtype", default=None, choices=["bfloat16"], help="lmserve's linear weights in bf16 (fp32 compute)"
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda (lmserve and HF alike)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="model dtype")
    ap.add_argument(
        "--quantization", default=None, choices=["int8", "int4", "none"], help="lmserve's quantized weights"
    )
    ap.add_argument(
        "--gguf-type",
        default=None,
        help="with --model FILE.gguf and --llama-cpp-dir: re-quantize the file to this GGML type first (Q8_0, ...)",
    )
    ap.add_argument("--quantization-group-size", type=int, default=None, help="int4: inputs per scale (32)")
    ap.add_argument(
        "--llama-cpp-dir", type=Path, default=None, help="built llama.cpp tree: llama-server at the same width as peer"
    )
    ap.add_argument(
        "--llama-cpp-args",
        default="",
        help="extra llama-server arguments, e.g. '--no-repack' (its AMX repacking crashed on one KVM host)",
    )
    ap.add_argument(
        "--llama-cpp-settings",
        default="both",
        choices=["both", *llama_cpp_peer.REPACK_SETTINGS],
        help="llama.cpp's runs: default settings, --no-repack, or both (compare with the faster; default)",
    )
    ap.add_argument("--gguf-cache", type=Path, default=llama_cpp_peer.CACHE, help="converted GGUF files (cached)")
    args = ap.parse_args(argv)
    if args.llama_cpp_dir and args.peer_url:
        ap.error("give --peer-url or --llama-cpp-dir, not both")
    if args.gguf_type and not args.llama_cpp_dir:
        ap.error("--gguf-type needs --llama-cpp-dir (llama-quantize converts the model or --model FILE.gguf)")
    if args.gguf_type and args.quantization and args.quantization != "none":
        ap.error("--gguf-type: lmserve serves the GGUF file's own types (no --quantization)")
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for k in (*FULL, "threads", "max_model_len", "repeats"):
        if getattr(args, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    if args.output_len < 2:
        ap.error("--output-len must be >= 2 (decode rates need a second token)")
    if args.peer_url and not args.peer_url.startswith(("http://", "https://")):
        ap.error(f"--peer-url must start with http:// or https://, got {args.peer_url!r}")
    return args


def read_hf_config(model: Path) -> dict[str, Any]:
    """config.json of an HF directory, or the HF-style config lmserve reads from a GGUF file's metadata."""
    gguf_file = find_gguf_file(model)
    if gguf_file is not None:
        return GGUFCheckpoint(gguf_file).hf_config()
    return json.loads((model / "config.json").read_text())


def run_lmserve_server(
    args: argparse.Namespace, w: Workloads, model_dir: Path, max_model_len: int, engine: dict[str, Any]
) -> dict[str, Any]:
    """The HTTP workloads against a fresh `lmserve serve`."""
    num_seqs = max(64, w.concurrency)
    blocks = w.kv_blocks(num_seqs, max_model_len)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine.items()]
    with lmserve_server(model_dir, max_model_len, num_seqs, blocks, args.threads, args.server_timeout, flags) as url:
        out = run_http(url, None, w, strict=True)
    out.update(max_num_seqs=num_seqs, num_kv_blocks=blocks)
    return out


def run_llama_cpp(
    args: argparse.Namespace,
    w: Workloads,
    gguf: Path,
    peer_name: str | None,
    greedy_into: dict[str, Any] | None,
    errors: dict[str, str],
) -> dict[str, Any]:
    """The HTTP workloads against llama-server with each of --llama-cpp-settings (name -> run_http result; a
    failed setting is absent, its error in `errors`). greedy_into: where the peer's greedy tokens go, once."""
    settings = llama_cpp_peer.REPACK_SETTINGS
    names = list(settings) if args.llama_cpp_settings == "both" else [args.llama_cpp_settings]
    runs: dict[str, Any] = {}
    for name in names:
        print(f"{peer_name} (llama-server, {name} settings, {args.threads} threads) ...", flush=True)
        try:
            ctx = w.prompt_len + w.output_len + 16
            with llama_cpp_peer.llama_server(
                args.llama_cpp_dir.resolve(), gguf, args.threads, w.concurrency, ctx, args.server_timeout,
                [*settings[name], *shlex.split(args.llama_cpp_args)],
            ) as url:
                if greedy_into is not None and "greedy" not in greedy_into:  # the same model? (untimed)
                    greedy_into["greedy"] = llama_cpp_peer.greedy_tokens(url, w.single, GREEDY_CHECK_TOKENS)
                runs[name] = run_http(url, None, w, strict=False)
        except (ServerError, OSError) as e:
            errors[f"peer {name}"] = str(e)
            print(f"warning: peer ({name} settings) failed: {e}", file=sys.stderr)
    return runs


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from several runs of the same workloads: each number the median of its runs' (a section or
    value a run lacks is left out of that median), anything else the first run's."""
    out: dict[str, Any] = {}
    for key, first in runs[0].items():
        values = [r[key] for r in runs if key in r]
        if isinstance(first, dict):
            out[key] = median_run([v for v in values if isinstance(v, dict)])
        elif isinstance(first, (int, float)) and not isinstance(first, bool):
            nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
            out[key] = statistics.median(nums)
        else:
            out[key] = first
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    machine = machine_info()
    t_start = time.perf_counter()
    model_dir = args.model.resolve() if args.model else build_benchmark_model(family=args.family)
    model_gguf = find_gguf_file(model_dir) if args.model else None
    cache = args.gguf_cache.resolve()
    llama_cpp = args.llama_cpp_dir.resolve() if args.llama_cpp_dir else None
    if model_gguf is not None and args.gguf_type:
        model_dir = model_gguf = llama_cpp_peer.requantize(llama_cpp, model_gguf, args.gguf_type, cache)
    elif args.gguf_type:  # the benchmark model's F32 GGUF, llama-quantized (e.g. Q4_K_M): both sides serve it
        model_dir = model_gguf = llama_cpp_peer.quantize(llama_cpp, model_dir, args.gguf_type, cache)
    hf_config = read_hf_config(model_dir)
    vocab_size = CONFIG["vocab_size"] if args.model is None and model_gguf is None else hf_config["vocab_size"]
    max_model_len = min(args.max_model_len, hf_config.get("max_position_embeddings") or args.max_model_len)
    if args.prompt_len + args.output_len > max_model_len:
        raise SystemExit(f"--prompt-len + --output-len exceeds max_model_len {max_model_len}")
    w = Workloads.build(args, vocab_size)
    do_single, do_server, do_offline = not args.skip_single, not args.skip_server, not args.skip_offline
    peer_name = None
    if args.peer_url:
        peer_name = f"peer {args.peer_model or args.peer_url}"
    res: dict[str, Any] = {}
    errors: dict[str, str] = {}
    engine: dict[str, Any] = {"device": args.device, "dtype": args.dtype}
    if args.weight_dtype:
        engine["weight_dtype"] = args.weight_dtype
    if args.quantization:
        engine["quantization"] = args.quantization
    if args.quantization_group_size:
        engine["quantization_group_size"] = args.quantization_group_size
    if args.llama_cpp_dir:
        kind = args.gguf_type or (
            llama_cpp_peer.main_type(model_gguf) if model_gguf else llama_cpp_peer.gguf_type(args.quantization)
        )
        peer_name = f"llama.cpp {kind}"

    if do_single or do_offline:
        print("lmserve offline engine ...", flush=True)
        res["lmserve_offline"] = run_lmserve_offline(model_dir, w, max_model_len, do_single, do_offline, engine)
    has_peer = bool(args.peer_url or args.llama_cpp_dir)
    if not args.skip_hf and (do_single or do_server or do_offline or has_peer):
        print("HF transformers ...", flush=True)
        http = do_server or has_peer
        res["hf"] = run_hf(model_dir, w, do_single or http, http, do_offline, args.device, args.dtype)
        gc.collect()
    gguf = None
    if args.llama_cpp_dir:
        try:
            gguf = model_gguf or llama_cpp_peer.convert(
                args.llama_cpp_dir.resolve(), model_dir, args.quantization, cache
            )
        except ServerError as e:
            errors["peer"] = str(e)
            print(f"warning: peer failed: {e}", file=sys.stderr)
    server_runs: list[dict[str, Any]] = []
    peer_rounds: list[dict[str, Any]] = []  # per repeat: llama.cpp settings name -> run_http result
    for rep in range(args.repeats):  # lmserve, then the peer, alternating: a drift of the machine hits both
        tag = f" (repeat {rep + 1} of {args.repeats})" if args.repeats > 1 else ""
        if do_server:
            print(f"lmserve server{tag} ...", flush=True)
            server_runs.append(run_lmserve_server(args, w, model_dir, max_model_len, engine))
        if gguf is not None:
            peer_rounds.append(run_llama_cpp(args, w, gguf, peer_name, res if do_single else None, errors))
    if server_runs:
        res["lmserve_server"] = median_run(server_runs)
        if len(server_runs) > 1:
            res["lmserve_server_repeats"] = server_runs
    if args.peer_url:
        print(f"peer {args.peer_url} ...", flush=True)
        try:
            res["peer"] = run_http(args.peer_url, args.peer_model, w, strict=False)
            peer_name = f"peer {res['peer']['model'] or args.peer_url}"
        except ServerError as e:
            errors["peer"] = str(e)
            print(f"warning: peer failed: {e}", file=sys.stderr)
    if args.llama_cpp_dir:
        rounds = [r for r in peer_rounds if r]
        if rounds:
            best = [llama_cpp_peer.best_of(r) for r in rounds]
            res["peer"] = median_run(best)
            res["peer"]["gguf"] = str(gguf)
            res["peer_runs"] = rounds[0] if len(rounds) == 1 else rounds
            if len(rounds) > 1:
                res["peer_repeats"] = best
            errors = {k: v for k, v in errors.items() if not k.startswith("peer ")}  # another setting ran
        ours = _get_list(res.get("lmserve_offline"), "single", "greedy_tokens")
        if "greedy" in res and ours:
            theirs = res.pop("greedy")
            same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), len(ours))
            res["greedy_agreement"] = {"tokens": len(ours), "matching_prefix": same, "lmserve": ours, "peer": theirs}
            print(f"greedy tokens, lmserve vs {peer_name}: the first {same} of {len(ours)} agree", flush=True)

    machine["load_avg_1m_end"] = os.getloadavg()[0]
    rows = build_rows(res, w, peer_name, do_single, do_server or has_peer, do_offline)
    print(
        f"\nprompt {w.prompt_len}, output {w.output_len}, {args.dtype} compute on {args.device}"
        f"{', lmserve weights ' + args.weight_dtype if args.weight_dtype else ''}"
        f"{', lmserve quantization ' + args.quantization if args.quantization else ''}, {args.threads} threads; "
        f"model {model_dir}\n"
        f"{machine['cpu_model']}, {machine['usable_cpus']} CPUs ({machine['physical_cores']} cores), "
        f"{machine['mem_total_gib']} GiB; torch {machine['torch']}, transformers {machine['transformers']}; "
        f"commit {str(machine['git']['commit'])[:10]}{' (dirty)' if machine['git']['dirty'] else ''}; "
        f"load avg 1m {machine['load_avg_1m_start']:.2f} -> {machine['load_avg_1m_end']:.2f}\n"
    )
    print(format_table(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "cpu",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model_dir": str(model_dir),
        "max_model_len": max_model_len,
        "machine": machine,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "wall_s": time.perf_counter() - t_start,
        "rows": rows,
        "results": res,
        "errors": errors,
    }
    path = args.out / f"cpu-{stamp}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
