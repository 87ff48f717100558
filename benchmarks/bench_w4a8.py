"""int4 weight-only against int4 W4A8 (int4_compute) on the benchmark model, in one process, alternating.

python bench/bench_w4a8.py [--rows 1,8,32,128] [--rounds 7] [--isas auto] [--engine] [--gguf FILE]

Kernels: one pass over the benchmark model's 120 int4 projections (30 layers x qkv, o, gate_up, down, group 32) per
row count, through lmserve's Linear: weight-only (the table kernel up to 8 rows, dequantized tiles + float32 GEMM
beyond) against the W4A8 path (each --isas entry: auto, vnni512, vnni256, avx2, scalar). Rounds alternate the paths,
so a busy moment slows them alike; best and median of --rounds.
--engine: the engine's single-stream decode step (decode stack, 8-bit LM head) and a 128-token prefill (TTFT, one
request) of LLM(quantization="int4") with int4_compute weight-only and w4a8, alternating request by request.
--gguf FILE: the same engine figures for a GGUF file (its Q4_0 / Q4_1 projections are the int4 layers).
Writes bench/results/w4a8-*.json with the machine (bench/machine.py) and the kernels that ran.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from benchmark_model import CONFIG, build_benchmark_model, random_prompts
from machine import write_result

from lmserve import LLM, SamplingParams, kernels
from lmserve.model.layers import Linear

RESULTS = Path(__file__).resolve().parent / "results"


def projection_layers() -> list[tuple[Linear, Linear]]:
    """(weight-only, W4A8) Linear pairs with the same int4 codes, one per projection of the benchmark model."""
    h, i = CONFIG["hidden_size"], CONFIG["intermediate_size"]
    d = h // CONFIG["num_attention_heads"]
    qkv = (CONFIG["num_attention_heads"] + 2 * CONFIG["num_key_value_heads"]) * d
    shapes = [(h, qkv), (h, h), (h, 2 * i), (i, h)] * CONFIG["num_hidden_layers"]
    pairs = []
    torch.manual_seed(0)
    for fan_in, fan_out in shapes:
        wo = Linear(fan_in, fan_out, bias=False)
        wo.quantize("int4", 32)
        w4 = Linear(fan_in, fan_out, bias=False)
        w4._set_quantized("int4", 32, wo.qweight.clone(), wo.scales.clone())
        w4.pack_w4a8()
        pairs.append((wo, w4))
    return pairs


def time_pass(layers: list[Linear], xs: dict[int, torch.Tensor]) -> tuple[float, float]:
    """(wall, this thread's CPU) seconds of one pass. With one torch thread the kernels run in this thread, so the
    CPU time leaves out the time a busy machine kept it off a core."""
    t0, c0 = time.perf_counter(), time.thread_time()
    for m in layers:
        m(xs[m.in_features])
    return time.perf_counter() - t0, time.thread_time() - c0


@torch.inference_mode()
def bench_kernels(rows: list[int], isas: list[str], rounds: int) -> dict:
    pairs = projection_layers()
    old, new = [a for a, _ in pairs], [b for _, b in pairs]
    out = {}
    for m in rows:
        xs = {k: torch.randn(m, k) for k in {p.in_features for p in old}}
        paths = {"weight-only": (old, None)} | {f"w4a8-{isa}": (new, isa) for isa in isas}
        times: dict[str, list[tuple[float, float]]] = {p: [] for p in paths}
        for r in range(rounds + 1):  # round 0 warms up
            for name, (layers, isa) in paths.items():
                if isa is not None:
                    kernels.os.environ[kernels.W4A8_ISA_ENV] = isa
                t = time_pass(layers, xs)
                if r:
                    times[name].append(t)
        kernels.os.environ.pop(kernels.W4A8_ISA_ENV, None)
        one_thread = torch.get_num_threads() == 1
        key = 1 if one_thread else 0  # CPU time where it measures the kernels' own work, else wall
        base = statistics.median(t[key] for t in times["weight-only"])
        row = {
            name: {
                "wall_best_ms": min(w for w, _ in t) * 1e3,
                "wall_median_ms": statistics.median(w for w, _ in t) * 1e3,
                **({"cpu_median_ms": statistics.median(c for _, c in t) * 1e3} if one_thread else {}),
                "speedup_vs_weight_only": base / statistics.median(x[key] for x in t),
            }
            for name, t in times.items()
        }
        out[str(m)] = row
        unit = "cpu" if one_thread else "wall"
        print(
            f"M={m:4d} ({unit}): "
            + "; ".join(
                f"{n} {v[unit + '_median_ms']:.2f} ms (x{v['speedup_vs_weight_only']:.2f})" for n, v in row.items()
            )
        )
    return out


def _decode_step_ms(llm: LLM, steps: int, streams: int = 1) -> float:
    """Mean engine step of `streams` requests decoding together, each after a 128-token prompt."""
    eng = llm.engine
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for i in range(streams):
        eng.add_request(f"d{i}", [1 + (i + j) % 1000 for j in range(128)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step()  # prefill
    eng.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    dt = (time.perf_counter() - t0) / steps
    while eng.has_unfinished_requests():
        eng.step()
    return dt * 1e3


def _prefill_ms(llm: LLM, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return (time.perf_counter() - t0) * 1e3


def bench_engine(model: str, rounds: int, steps: int = 32) -> dict:
    gguf = model.endswith(".gguf")
    extra = {"tokenizer": str(Path(model).parent)} if gguf and (Path(model).parent / "tokenizer.json").is_file() else {}
    llms = {c: LLM(model, quantization=None if gguf else "int4", int4_compute=c, enable_prefix_caching=False,
                   max_model_len=1024, **extra) for c in ("weight-only", "w4a8")}  # fmt: skip
    vocab = llms["w4a8"].engine.config.model.vocab_size
    prompts = random_prompts(rounds + 1, 128, vocab, seed=1)
    keys = ("decode_step_ms", "decode_step_32_streams_ms", "prefill_128_ms")
    res: dict[str, dict[str, list[float]]] = {c: {k: [] for k in keys} for c in llms}
    for r in range(rounds + 1):
        for c, llm in llms.items():
            run = (_decode_step_ms(llm, steps), _decode_step_ms(llm, 8, 32), _prefill_ms(llm, prompts[r]))
            if r:
                for k, v in zip(keys, run, strict=True):
                    res[c][k].append(v)
    out = {}
    for key in keys:
        med = {c: statistics.median(v[key]) for c, v in res.items()}
        out[key] = {c: {"median": med[c], "best": min(res[c][key])} for c in res}
        out[key]["ratio_weight_only_over_w4a8"] = med["weight-only"] / med["w4a8"]
        print(f"{key}: weight-only {med['weight-only']:.2f} ms, w4a8 {med['w4a8']:.2f} ms "
              f"(x{med['weight-only'] / med['w4a8']:.2f})")  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32,128")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--isas", default="auto", help="comma-separated W4A8 paths: auto, vnni512, vnni256, avx2, scalar")
    ap.add_argument("--engine", action="store_true", help="also the engine's decode step and 128-token prefill")
    ap.add_argument("--gguf", default=None, help="a GGUF file for the engine figures instead of the benchmark model")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    assert kernels.available(), "the C kernels are needed"
    isas = [s.strip() for s in args.isas.split(",") if s.strip()]
    payload: dict = {"threads": torch.get_num_threads(), "load_avg_1m": __import__("os").getloadavg()[0]}
    payload["kernels"] = kernels.quantized_kernel_names() | {
        f"w4a8-{i}": kernels.w4a8_isa_name(kernels.w4a8_isa(i)) for i in isas
    }
    if not args.skip_kernels:
        payload["projections_pass"] = bench_kernels([int(r) for r in args.rows.split(",")], isas, args.rounds)
    if args.engine or args.gguf:
        model = args.gguf or str(build_benchmark_model())
        payload["engine"] = {"model": model, **bench_engine(model, args.rounds)}
    write_result(RESULTS, "w4a8", args, payload)


if __name__ == "__main__":
    main()
