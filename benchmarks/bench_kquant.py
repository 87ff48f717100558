"""A GGUF K-quant file (llama-quantize's Q4_K_M / Q5_K_M mix of Q4_K or Q5_K with Q6_K) of a random-weight Llama
whose widths are multiples of 256, loaded by lmserve with its K-quants kept as they are, against the same file
dequantized to float32 (quantization="none"):

- memory: the file's tensor bytes, `lmserve memory`'s exact figure, and the resident set after load (a fresh
  process per mode; RSS after the load minus RSS before it, the engine's imports and tokenizer already in);
- decode: engine steps of one request (128-token prompt), both models in one process, timed in alternating
  rounds so a busy moment of the machine slows both alike.

python benchmarks/bench_kquant.py [--preset benchmark|bundled|small] [--base Q4_K] [--threads 2] [--rounds 5]
    [--steps 32] [--skip-decode] [--skip-memory] [--json out.json]

The `benchmark` preset is the benchmark model's depth, heads and vocabulary with widths rounded to multiples of 256
(hidden 512, intermediate 1536: llama-quantize falls back to Q5_0 / Q8_0 for rows of 576, see docs/performance.md);
`bundled` is the bundled default model's shape (hidden 256, 6 layers, vocabulary 8000).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(__file__).resolve().parent / ".cache"
PRESETS = {
    "benchmark": dict(
        vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
        num_key_value_heads=4, tie_word_embeddings=True,
    ),
    "bundled": dict(
        vocab_size=8000, hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
    ),
    "small": dict(
        vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, tie_word_embeddings=False,
    ),
}  # fmt: skip


def build_model_dir(preset: str) -> Path:
    """A random-weight HF Llama of the preset's shape with the bundled model's tokenizer, cached."""
    out = CACHE / f"kquant-{preset}"
    if (out / "model.safetensors").is_file():
        return out
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(**PRESETS[preset], max_position_embeddings=2048, bos_token_id=None, eos_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    tokenizer = REPO / "src" / "lmserve" / "default_model" / "target"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, out / name)
    return out


def build_gguf(preset: str, base: str) -> tuple[Path, Path]:
    """(HF directory, GGUF file): the preset's model as a {base}_M file (cached)."""
    model_dir = build_model_dir(preset)
    out = CACHE / f"kquant-{preset}-{base}_M.gguf"
    if not out.is_file():
        sys.path.insert(0, str(REPO))
        from tests.gguf_helpers import q4_k_m_types, write_gguf

        cfg = json.loads((model_dir / "config.json").read_text())
        types = q4_k_m_types(cfg["num_hidden_layers"], base, cfg["tie_word_embeddings"])
        write_gguf(model_dir, out.with_suffix(".part"), base, types)
        os.replace(out.with_suffix(".part"), out)
    return model_dir, out


def rss() -> dict[str, int]:
    """This process's resident set, total and by kind, in bytes (/proc/self/status)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def measure_memory_child(gguf_file: str, tokenizer: str, quantization: str | None, int4_compute: str = "w4a8") -> None:
    """(In a fresh process.) Load the file and print the memory figures as one JSON line."""
    import gc

    import torch
    from transformers import AutoTokenizer

    from lmserve import LLM
    from lmserve.checkpoint.gguf import GGUFCheckpoint, resident_weight_bytes

    AutoTokenizer.from_pretrained(tokenizer)  # (its imports and tables are not the model's)
    with torch.device("meta"):  # torch's one-time meta-device setup (~17 MiB of registrations, whatever the model)
        torch.nn.Linear(4, 4)(torch.arange(8, dtype=torch.float32)[:, None] * torch.ones(4)).cos()
    ckpt = GGUFCheckpoint(gguf_file)
    file_bytes = sum(b for _, b, _ in ckpt.bytes_by_type().values())
    from lmserve import kernels

    panels = int4_compute == "w4a8" and kernels.available()  # (the Q4_K / Q5_K projections held as W4A8 panels)
    ledger, kept = resident_weight_bytes(ckpt, 4, quantization is None, panels)
    del ckpt
    gc.collect()
    import lmserve.worker.model_runner as model_runner

    load, around_load = model_runner.load_model, {}

    def measured_load(*args, **kwargs):  # the resident set across the weights' load alone
        around_load["before"] = rss()
        model = load(*args, **kwargs)
        gc.collect()
        around_load["after"] = rss()
        return model

    model_runner.load_model = measured_load
    before = rss()
    kwargs = {"int4_compute": int4_compute} if quantization is None else {"quantization": quantization}
    llm = LLM(gguf_file, tokenizer=tokenizer, num_kv_blocks=64, **kwargs)
    gc.collect()
    after = rss()
    cache = llm.engine.runner.kv_caches
    kv_bytes = sum(t.numel() * t.element_size() for c in cache for t in (c.k, c.v))
    maps = [line for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(Path(gguf_file).name)]
    print(json.dumps({
        "quantization": quantization or "gguf (kept)", "int4_compute": int4_compute, "file_tensor_bytes": file_bytes,
        "file_bytes": Path(gguf_file).stat().st_size, "ledger_weight_bytes": ledger, "ledger_kept_bytes": kept,
        "rss_before": before, "rss_after": after, "rss_delta": after["VmRSS"] - before["VmRSS"],
        "rss_load_model_delta": around_load["after"]["VmRSS"] - around_load["before"]["VmRSS"],
        "kv_pool_bytes": kv_bytes, "file_still_mapped": bool(maps),
    }))  # fmt: skip


def measure_memory(gguf_file: Path, tokenizer: Path, quantization: str | None, int4_compute: str = "w4a8") -> dict:
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); import bench_kquant; "
        f"bench_kquant.measure_memory_child({str(gguf_file)!r}, {str(tokenizer)!r}, {quantization!r}, "
        f"{int4_compute!r})"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def decode_steps(engines: dict, steps: int, rounds: int, prompt_len: int, vocab: int) -> dict[str, float]:
    """Best ms per decode step of one request per engine, the engines taking turns each round."""
    import torch

    from lmserve import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, min(vocab, 8000), (prompt_len,), generator=g).tolist()
    best = dict.fromkeys(engines, float("inf"))
    for r in range(rounds + 1):  # round 0 warms up (small-M choice, first steps)
        for name, eng in engines.items():
            eng.add_request(f"r{r}", prompt, SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True))
            while any(q.num_computed_tokens < q.num_prompt_tokens for q in eng.scheduler.requests.values()):
                eng.step()
            eng.step()
            t0 = time.perf_counter()
            for _ in range(steps):
                eng.step()
            dt = (time.perf_counter() - t0) / steps
            eng.abort_request(f"r{r}")
            if r:
                best[name] = min(best[name], dt * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="benchmark")
    ap.add_argument("--base", choices=["Q4_K", "Q5_K"], default="Q4_K")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model_dir, gguf_file = build_gguf(args.preset, args.base)
    result: dict = {"preset": args.preset, "shape": PRESETS[args.preset], "file": str(gguf_file), "base": args.base}
    result["load_average"] = os.getloadavg()
    if not args.skip_memory:
        for quantization in (None, "none"):
            m = measure_memory(gguf_file, model_dir, quantization)
            result.setdefault("memory", []).append(m)
            file = m["file_tensor_bytes"]
            print(
                f"{m['quantization']:>12}: file {file / 2**20:.1f} MiB of tensors, ledger "
                f"{m['ledger_weight_bytes'] / 2**20:.1f} MiB; RSS +{m['rss_load_model_delta'] / 2**20:.1f} MiB "
                f"across the weights' load ({m['rss_load_model_delta'] / file:.2f}x the file), "
                f"+{m['rss_delta'] / 2**20:.1f} MiB across LLM() ({(m['rss_delta'] - m['kv_pool_bytes']) / file:.2f}x "
                f"the file beside its KV pool of {m['kv_pool_bytes'] / 2**20:.1f} MiB); file still mapped: "
                f"{m['file_still_mapped']}"
            )
    if not args.skip_decode:
        import torch

        from lmserve import LLM, kernels

        torch.set_num_threads(args.threads)
        engines = {
            "kquant": LLM(str(gguf_file), tokenizer=str(model_dir), num_kv_blocks=64).engine,
            "float32": LLM(str(gguf_file), tokenizer=str(model_dir), num_kv_blocks=64, quantization="none").engine,
        }
        vocab = PRESETS[args.preset]["vocab_size"]
        best = decode_steps(engines, args.steps, args.rounds, args.prompt_len, vocab)
        result["decode_ms"] = best
        result["kquant_kernel"] = kernels.kquant_kernel_name()
        result["decode_speedup"] = best["float32"] / best["kquant"]
        print(
            f"decode step, 1 request, {args.threads} threads: K-quant {best['kquant']:.2f} ms, float32 "
            f"{best['float32']:.2f} ms ({result['decode_speedup']:.2f}x; kernels: {result['kquant_kernel']})"
        )
    result["load_average_end"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
