"""What the serving experiments (experiments.py) and the benchmark scripts stand on: a server subprocess
(`running_server`: start any server command, wait for its /health, stop it; `lmserve_server`: `lmserve serve` on a
free loopback port), the experiments' sizes (`Workloads`), their results (`Point`, `Section`), and `Harness`: the
server an experiment asks for (kept up while the next asks for the same flags), fresh prompts and load runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmserve.bench.datasets import BenchRequest, DatasetConfig, build_requests
from lmserve.bench.metrics import BenchSummary, RequestRecord, summarize


@dataclass(frozen=True)
class Workloads:
    """Sizes of every experiment; `quick` fits the bundled model on 2 cores in a few minutes."""

    prompt_sweep: tuple[int, ...]
    prompt_sweep_output_len: int
    output_sweep: tuple[int, ...]
    output_sweep_input_len: int
    concurrency_sweep: tuple[int, ...]
    concurrency_input_len: int
    concurrency_output_len: int
    requests_per_point: int
    hf_num_requests: int
    hf_input_len: int
    hf_output_len: int
    static_max_num_seqs: int
    static_num_requests: int
    static_output_len: int
    prefix_len: int
    prefix_suffix_len: int
    prefix_num_requests: int
    # a burst sharing a system prompt, all sent at once: in-step prefix sharing on vs off
    prefix_burst_len: int = 512
    prefix_burst_num_requests: int = 32

    @staticmethod
    def quick() -> Workloads:
        return Workloads(
            prompt_sweep=(16, 64, 256),
            prompt_sweep_output_len=4,
            output_sweep=(4, 16, 48),
            output_sweep_input_len=32,
            concurrency_sweep=(1, 2, 4, 8),
            concurrency_input_len=32,
            concurrency_output_len=16,
            requests_per_point=3,
            hf_num_requests=8,
            hf_input_len=32,
            hf_output_len=16,
            static_max_num_seqs=4,
            static_num_requests=12,
            static_output_len=24,
            prefix_len=384,
            prefix_suffix_len=16,
            prefix_num_requests=8,
            prefix_burst_len=256,
            prefix_burst_num_requests=8,
        )

    @staticmethod
    def full() -> Workloads:
        return Workloads(
            prompt_sweep=(32, 128, 256, 512, 768),
            prompt_sweep_output_len=16,
            output_sweep=(16, 64, 128, 256),
            output_sweep_input_len=128,
            concurrency_sweep=(1, 2, 4, 8, 16, 32),
            concurrency_input_len=128,
            concurrency_output_len=128,
            requests_per_point=16,
            hf_num_requests=32,
            hf_input_len=128,
            hf_output_len=128,
            static_max_num_seqs=8,
            static_num_requests=48,
            static_output_len=128,
            prefix_len=768,
            prefix_suffix_len=32,
            prefix_num_requests=24,
        )


@dataclass
class Point:
    label: str
    summary: BenchSummary
    records: list[RequestRecord]
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class Section:
    number: int
    markdown: list[str] = field(default_factory=list)
    points: list[Point] = field(default_factory=list)
    error: str | None = None
    skipped: str | None = None


class ServerError(Exception):
    pass


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def lmserve_server(
    model_dir: str, flags: list[str], log_path: Path, startup_timeout_s: float = 300.0
) -> Iterator[tuple[str, list[str]]]:
    """`lmserve serve` on a free 127.0.0.1 port; yields (base_url, command). Stopped on exit."""
    port = free_loopback_port()
    cmd = [sys.executable, "-m", "lmserve.entrypoints.cli", "serve", "--model", model_dir]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--no-access-log", "--log-level", "warning", *flags]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with running_server(cmd, f"http://127.0.0.1:{port}", "lmserve serve", startup_timeout_s, log_path=log_path) as url:
        yield url, cmd


@contextlib.contextmanager
def running_server(
    cmd: list[str],
    base_url: str,
    what: str,
    timeout_s: float,
    env: dict[str, str] | None = None,
    log_path: Path | None = None,
) -> Iterator[str]:
    """Start `cmd`, a server listening at `base_url` (loopback), wait until its GET /health answers 200, yield
    `base_url`; stop it on exit. Its output goes to `log_path` (else a temporary file), whose tail a start-up
    failure quotes."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    with open(log_path, "w+b") if log_path is not None else tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

        def tail() -> str:
            log.seek(0)
            return log.read().decode(errors="replace")[-2000:]

        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise ServerError(f"{what} exited with code {proc.returncode} during start-up:\n{tail()}")
                try:
                    with opener.open(base_url + "/health", timeout=2) as resp:
                        if resp.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise ServerError(f"{what} not healthy within {timeout_s:g} s:\n{tail()}")
                time.sleep(0.25)
            yield base_url
        finally:
            stop_process(proc)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM (graceful shutdown), then SIGKILL after 15 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


class Harness:
    def __init__(self, args: argparse.Namespace, model_dir: str, tokenizer: Any, out_dir: Path) -> None:
        self.args = args
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.out_dir = out_dir
        self.work = Workloads.quick() if args.quick else Workloads.full()
        # the bundled model needs little KV memory; don't let every quick server reserve the default pool
        quick_flags = ["--kv-cache-memory-gib", "0.25"] if args.quick and not args.model else []
        self.server_flags = quick_flags + shlex.split(args.server_args or "")
        self.server_commands: list[str] = []
        self.seed = args.seed
        self._dataset_seed = 0
        self._server: tuple[list[str], str, contextlib.ExitStack] | None = None
        self.load_avg_start = os.getloadavg()[0]

    # -- building blocks

    def requests(self, n: int, input_len: int, output_len: int, **kw: Any) -> list[BenchRequest]:
        """A fresh set of unique prompts (a new seed each call, so no two points share prompts)."""
        self._dataset_seed += 1
        cfg = DatasetConfig(
            num_requests=n,
            input_len=input_len,
            output_len=output_len,
            seed=self.seed * 1000 + self._dataset_seed,
            **kw,
        )
        return build_requests(cfg, self.tokenizer)

    @contextlib.contextmanager
    def server(self, name: str, flags: list[str] | None = None) -> Iterator[str]:
        """A server with these extra flags. The last one started stays up for the next experiment that
        asks for the same flags (one server at a time: they share the machine with the client)."""
        if self.args.base_url:
            yield self.args.base_url
            return
        all_flags = [*self.server_flags, *(flags or [])]
        if self._server is None or self._server[0] != all_flags:
            self.close()
            stack = contextlib.ExitStack()
            log = self.out_dir / f"server-{name}.log"
            try:
                url, cmd = stack.enter_context(lmserve_server(self.model_dir, all_flags, log))
                self.server_commands.append(f"{name}: `{' '.join(shlex.quote(c) for c in cmd[1:])}`")
                self.load(url, self.requests(2, 16, 4))  # warm-up, untimed
            except BaseException:
                stack.close()
                raise
            self._server = (all_flags, url, stack)
        yield self._server[1]

    def close(self) -> None:
        if self._server is not None:
            self._server[2].close()
            self._server = None

    def load(
        self,
        base_url: str,
        requests: list[BenchRequest],
        max_concurrency: int | None = None,
        request_rate_rps: float = math.inf,
        slos: Any = None,
    ) -> tuple[list[RequestRecord], BenchSummary]:
        """Send `requests` (all at once, or Poisson arrivals at request_rate_rps); SLOs give attainment."""
        from lmserve.bench.loadgen import LoadConfig, finalize_all, run_load

        cfg = LoadConfig(
            base_url=base_url,
            model=self.args.served_model_name,
            max_concurrency=max_concurrency,
            request_rate_rps=request_rate_rps,
            seed=self.seed,
            timeout_s=self.args.request_timeout,
        )
        result = asyncio.run(run_load(requests, cfg))
        records = finalize_all(result, requests, cfg, self.tokenizer)
        summary = summarize(records, result.duration_s or None, request_rate_rps, max_concurrency, slos)
        if result.fatal_error:
            raise ServerError(result.fatal_error)
        if summary.num_failed:
            raise ServerError(f"{summary.num_failed}/{summary.num_requests} requests failed: {summary.errors[:3]}")
        return records, summary


def resolve_tokenizer_path(tokenizer: str | None, model: str | None) -> str:
    if tokenizer:
        return tokenizer
    if model and Path(model).is_dir():
        return model
    from lmserve.default_model import default_model_path

    return default_model_path()
