"""`lmserve bench offline`: in-process throughput and per-request latencies, no HTTP.

Backends (run_lmserve, run_hf) get the same token ids, all at time 0: lmserve through `LLM.generate`, hf-naive
(HF `generate` one request at a time) and hf-static (HF `generate` on static batches). See docs/benchmarking.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmserve.bench.datasets import BenchRequest
from lmserve.bench.metrics import BenchSummary, RequestRecord, summarize

BACKENDS = ("lmserve", "hf", "all")
HF_MODES = ("naive", "static", "both")


@dataclass
class OfflineRun:
    label: str  # lmserve | hf-naive | hf-static
    records: list[RequestRecord]
    summary: BenchSummary
    info: dict[str, Any] = field(default_factory=dict)  # engine counters, batch size, ...


# ---- lmserve ----------------------------------------------------------------------------------------------


def run_lmserve(llm: Any, requests: list[BenchRequest], temperature: float = 0.0) -> list[RequestRecord]:
    """Queue every request, then step the engine to completion exactly as LLM.generate does, keeping each
    step's new-token count and time per request (LLM.generate only returns the final outputs)."""
    from lmserve.sampling_params import SamplingParams

    engine = llm.engine
    params = [
        SamplingParams(max_tokens=q.output_len, ignore_eos=True, temperature=temperature) for q in requests
    ]
    for i, (q, p) in enumerate(zip(requests, params, strict=True)):
        try:
            engine.validate(q.prompt_token_ids, p)
        except ValueError as e:
            raise ValueError(
                f"request {i} ({q.prompt_len} prompt + {q.output_len} output tokens): {e}"
            ) from None
    t0 = time.time()
    ids = [engine.add_request(None, q.prompt_token_ids, p) for q, p in zip(requests, params, strict=True)]
    chunks: dict[str, list[tuple[float, int]]] = {rid: [] for rid in ids}
    finished: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        now_s = time.time() - t0
        for out in outs:
            k = len(out.outputs[0].delta_token_ids)
            if k:
                chunks[out.request_id].append((now_s, k))
            if out.finished:
                finished[out.request_id] = out
    records = []
    for i, (rid, q) in enumerate(zip(ids, requests, strict=True)):
        out = finished[rid]
        m = out.metrics
        times = [t for t, _ in chunks[rid]]
        # the engine's own timestamps for the first and the last token
        if times and m.first_token_time is not None:
            times[0] = m.first_token_time - t0
        if len(times) > 1 and m.last_token_time is not None:
            times[-1] = m.last_token_time - t0
        arrival_s = m.arrival_time - t0
        records.append(
            RequestRecord(
                index=i,
                prompt_len=q.prompt_len,
                requested_output_len=q.output_len,
                scheduled_s=arrival_s,
                send_s=arrival_s,
                end_s=(m.finished_time - t0) if m.finished_time is not None else None,
                chunk_times_s=times,
                chunk_num_tokens=[k for _, k in chunks[rid]],
                success=True,
                num_output_tokens=len(out.outputs[0].token_ids),
                output_tokens_source="engine",
                chunk_tokens_source="engine",
            )
        )
    return records


# ---- HF transformers --------------------------------------------------------------------------------------


class _TimingStreamer:
    """HF streamer that timestamps every decoding step (the first put() is the prompt)."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.step_times_s: list[float] = []
        self._seen_prompt = False

    def put(self, value: Any) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.step_times_s.append(time.time() - self.t0)

    def end(self) -> None:
        pass


def load_hf_model(model_dir: str, device: str = "cpu") -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep the benchmark's output a table
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    return model, tok


def run_hf(
    model: Any, requests: list[BenchRequest], batch_size: int = 1, pad_token_id: int = 0, device: str = "cpu"
) -> list[RequestRecord]:
    """Greedy HF generate over consecutive batches of `batch_size` (1 = the naive one-request loop); each
    request's output is forced to exactly its length (min_new_tokens), the batch runs to its longest."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    streamer_cls = type("TimingStreamer", (_TimingStreamer, BaseStreamer), {})
    records: list[RequestRecord] = []
    t0 = time.time()
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        width = max(q.prompt_len for q in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, q in enumerate(batch):  # left padding, so every row's next token is at the end
            ids[row, width - q.prompt_len :] = torch.tensor(q.prompt_token_ids)
            mask[row, width - q.prompt_len :] = 1
        max_new = max(q.output_len for q in batch)
        streamer = streamer_cls(t0)
        send_s = time.time() - t0
        with torch.inference_mode():
            model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad_token_id,
                streamer=streamer,
            )
        batch_end_s = time.time() - t0
        for row, q in enumerate(batch):
            times = streamer.step_times_s[: q.output_len]
            records.append(
                RequestRecord(
                    index=start + row,
                    prompt_len=q.prompt_len,
                    requested_output_len=q.output_len,
                    scheduled_s=0.0,
                    send_s=send_s,
                    end_s=batch_end_s,
                    chunk_times_s=times,
                    chunk_num_tokens=[1] * len(times),
                    success=len(times) > 0,
                    error=None if times else "no token generated",
                    num_output_tokens=len(times),
                    output_tokens_source="engine",
                    chunk_tokens_source="engine",
                )
            )
    return records


# ---- the command ------------------------------------------------------------------------------------------


def compare_table(runs: list[OfflineRun]) -> str:
    base = next((r for r in runs if r.label == "hf-naive"), runs[0])
    head = (
        f"{'backend':<12}{'req/s':>9}{'out tok/s':>11}{'vs ' + base.label:>14}{'TTFT P50':>10}"
        f"{'TPOT P50':>10}{'E2E P99':>10}{'wall s':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in runs:
        s = r.summary
        ratio = (
            s.output_throughput_tok_s / base.summary.output_throughput_tok_s
            if base.summary.output_throughput_tok_s
            else 0
        )
        lines.append(
            f"{r.label:<12}{s.request_throughput_rps:>9.2f}{s.output_throughput_tok_s:>11.1f}{ratio:>13.2f}x"
            f"{_ms(s.ttft_ms.p50):>10}{_ms(s.tpot_ms.p50):>10}{_ms(s.e2e_ms.p99):>10}{s.duration_s:>9.2f}"
        )
    return "\n".join(lines) + "\n(latencies in ms; every request arrives at time 0)"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def offline_runs(
    model_dir: str,
    requests: list[BenchRequest],
    backend: str,
    hf_mode: str = "both",
    hf_batch_size: int = 8,
    engine_kwargs: dict[str, Any] | None = None,
    warmup: list[BenchRequest] | None = None,
    device: str = "cpu",
) -> list[OfflineRun]:
    if backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {list(BACKENDS)}, got {backend!r}")
    if hf_mode not in HF_MODES:
        raise ValueError(f"--hf-mode must be one of {list(HF_MODES)}, got {hf_mode!r}")
    if hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {hf_batch_size}")
    runs: list[OfflineRun] = []
    if backend in ("lmserve", "all"):
        from lmserve.llm import LLM

        llm = LLM(model_dir, **(engine_kwargs or {}))
        if warmup:
            run_lmserve(llm, warmup)
        records = run_lmserve(llm, requests)
        runs.append(OfflineRun("lmserve", records, summarize(records), {"engine": llm.get_metrics()}))
        del llm
    if backend in ("hf", "all"):
        model, tok = load_hf_model(model_dir, device)
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        modes = [("hf-naive", 1), ("hf-static", hf_batch_size)]
        for label, bs in modes:
            if hf_mode not in ("both", label.removeprefix("hf-")):
                continue
            if warmup:
                run_hf(model, warmup[:bs], bs, pad, device)
            records = run_hf(model, requests, bs, pad, device)
            runs.append(OfflineRun(label, records, summarize(records), {"batch_size": bs}))
    return runs


def run_bench_offline(args: argparse.Namespace) -> int:
    from lmserve.bench.datasets import build_requests, dataset_config_from_args, load_tokenizer
    from lmserve.config.args import engine_kwargs, model_path

    try:
        if args.warmup_requests < 0:
            raise ValueError(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
        if args.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
        if args.plot:
            from lmserve.bench.report import load_pyplot

            load_pyplot()  # fail before the run, not after it
        model_dir = model_path(args)
        tokenizer = load_tokenizer(args.tokenizer or model_dir)
        cfg = dataset_config_from_args(args, args.num_requests + args.warmup_requests)
        all_requests = build_requests(cfg, tokenizer)
        warmup, requests = all_requests[: args.warmup_requests], all_requests[args.warmup_requests :]
        runs = offline_runs(
            model_dir,
            requests,
            args.backend,
            args.hf_mode,
            args.hf_batch_size,
            engine_kwargs(args),
            warmup,
            args.device,
        )
    except ValueError as e:
        print(f"lmserve bench offline: error: {e}", file=sys.stderr)
        return 2
    _print_and_save(args, runs)
    return 0


def _print_and_save(args: argparse.Namespace, runs: list[OfflineRun]) -> None:
    from lmserve.bench.report import format_summary, json_safe, plot_latency_cdfs, write_json

    for r in runs:
        print(format_summary(r.summary, f"offline: {r.label}"))
        print()
    if len(runs) > 1:
        print(compare_table(runs))
    out = Path(args.output_json or f"bench_results/offline-{time.strftime('%Y%m%d-%H%M%S')}.json")
    first = runs[0]
    extra = {
        "other_runs": {
            r.label: {"summary": r.summary, "info": r.info, "requests": r.records} for r in runs[1:]
        },
        "backend": first.label,
        "info": first.info,
    }
    write_json(out, json_safe(vars(args) | {"func": None}), first.summary, first.records, extra)
    print(f"wrote {out}")
    if args.plot:
        png = plot_latency_cdfs({r.label: r.records for r in runs}, f"{out.with_suffix('')}_latency_cdf.png")
        print(f"wrote {png}")


def add_offline_args(p: argparse.ArgumentParser) -> None:
    from lmserve.bench.datasets import add_dataset_args
    from lmserve.config.args import add_engine_args

    p.add_argument("--backend", default="lmserve", choices=BACKENDS, help="all = lmserve + HF")
    p.add_argument(
        "--hf-mode", default="both", choices=HF_MODES, help="HF naive loop, static batches, or both"
    )
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument("--warmup-requests", type=int, default=2)
    p.add_argument("--output-json", default=None, help="default: bench_results/offline-<time>.json")
    p.add_argument("--plot", action="store_true", help="latency CDF PNG beside the JSON (needs matplotlib)")
    add_dataset_args(p)
    add_engine_args(p)
