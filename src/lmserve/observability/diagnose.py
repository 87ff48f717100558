"""The bottleneck finder: a window of serving metrics → findings (symptom, most likely cause, evidence, what to
change). One set of rules for `lmserve diagnose --url` (two scrapes of /metrics), `lmserve diagnose --report`
(a `lmserve bench serve` JSON) and the dashboard (its own registry, every second).

Entry points: diagnose (a metrics_window.Window → Diagnosis), diagnose_report. Rules: docs/observability.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The window the rules read lives in metrics_window.py; the "as" imports keep its names importable from here.
from lmserve.observability.window import COUNTERS as COUNTERS
from lmserve.observability.window import GAUGES as GAUGES
from lmserve.observability.window import HISTOGRAMS as HISTOGRAMS
from lmserve.observability.window import PREFIX as PREFIX
from lmserve.observability.window import Dist, Window, window_from_report
from lmserve.observability.window import Scrape as Scrape
from lmserve.observability.window import scrape_url as scrape_url
from lmserve.observability.window import window_between as window_between

# ---- outputs ------------------------------------------------------------------------------------


@dataclass
class Finding:
    rule: str  # a stable id: kv_cache_full, ttft_static_batching, ...
    symptom: str
    cause: str
    evidence: list[str]
    change: str


@dataclass
class Diagnosis:
    findings: list[Finding]
    summary: list[str]  # what the window saw, one line each (shown with "no bottleneck found" too)
    window_s: float
    source: str

    @property
    def healthy(self) -> bool:
        return not self.findings

    def format(self) -> str:
        head = f"lmserve diagnose: {self.window_s:.1f} s window ({self.source})"
        lines = [head, *("  " + s for s in self.summary), ""]
        if not self.findings:
            lines.append("no bottleneck found")
        for i, f in enumerate(self.findings, 1):
            lines.append(f"{i}. {f.symptom}  [{f.rule}]")
            lines.append(f"   most likely cause: {f.cause}")
            lines += [f"   evidence: {e}" for e in f.evidence]
            lines.append(f"   change: {f.change}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {
            "healthy": self.healthy,
            "window_s": self.window_s,
            "source": self.source,
            "summary": self.summary,
            "findings": [asdict(f) for f in self.findings],
        }


@dataclass(frozen=True)
class Thresholds:
    """When a symptom counts. The SLO defaults are the seeds' interactive targets (TTFT < 500 ms, TPOT < 50 ms)."""

    ttft_s: float = 0.5
    tpot_s: float = 0.05
    jitter_ratio: float = 3.0  # P99 / P50
    min_samples: int = 5  # a percentile over fewer is noise
    dominant_share: float = 0.5  # queue time share of TTFT that makes queueing the cause
    shared_prefix_share: float = 0.3  # prompt tokens an earlier prompt had
    step_slowdown: float = 3.0  # decode step time / its idle figure at a small batch → CPU oversubscribed
    small_batch: float = 4.0  # a decode batch this small should step near its idle figure
    large_batch: float = 16.0  # a decode batch this large is a TPOT suspect
    interference_ratio: float = 2.0  # mixed step time / decode-only step time
    long_prompt_tokens: float = 512.0
    kv_full_usage: float = 0.95
    moe_imbalance: float = 2.0  # a layer group's busiest expert over the mean that makes routing the suspect


# ---- the rules ----------------------------------------------------------------------------------


def diagnose(w: Window, th: Thresholds | None = None) -> Diagnosis:
    """The findings of every rule on `w`: counters as deltas over the window, gauges latest, latencies as Dists.

    TTFT splits into queue time vs prefill time, TPOT into preemptions / prefill interference / CPU contention /
    batch size; a rule whose inputs are missing (a client report has no queue time) stays silent or says so.
    """
    th = th or Thresholds()
    findings: list[Finding] = []
    for rule in (_kv_cache_full, _ttft_high, _tpot_high, _jitter, _moe_imbalance):
        findings += rule(w, th)
    return Diagnosis(findings, _summary(w), w.duration_s, w.source)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f} ms"


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def _summary(w: Window) -> list[str]:
    out = []
    n = (w.d("e2e") or w.d("ttft") or Dist(0)).count
    gen = w.c("generation_tokens")
    line = f"{n} requests finished"
    if gen is not None:
        line += f", {gen / w.duration_s:.1f} generated tok/s"
    out.append(line)
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")):
        d = w.d(key)
        if d is not None:
            out.append(f"{label} P50 {_ms(d.p50)}  P95 {_ms(d.p95)}  P99 {_ms(d.p99)}  (n={d.count})")
    if "running" in w.gauges:
        out.append(
            f"running {w.gauges['running']:.0f}, waiting {w.gauges.get('waiting', 0):.0f}, "
            f"KV usage {_pct(w.gauges.get('kv_usage', 0.0))}, preemptions {w.c('preemptions') or 0:.0f}"
        )
    return out


def _kv_advice(w: Window) -> tuple[list[str], str]:
    """The ledger's numbers behind the KV suggestions: what the pool holds, and what each knob buys."""
    from lmserve.memory.ledger import kv_cache_bytes_per_token

    evidence, changes = [], []
    cap = w.gauges.get("kv_capacity_tokens")
    bpt = w.gauges.get("kv_bytes_per_token")
    mml, seqs = w.cfg_int("max_model_len"), w.cfg_int("max_num_seqs")
    p, o = w.d("prompt_len"), w.d("output_len")
    if cap:
        evidence.append(f"KV pool {cap:.0f} tokens" + (f" at {bpt:.0f} B/token" if bpt else ""))
        if mml:
            evidence.append(f"holds {int(cap // mml)} requests of max_model_len={mml}")
        if p is not None and o is not None and p.mean is not None and o.mean is not None:
            per_req = p.mean + o.mean
            fit = int(cap // max(per_req, 1))
            evidence.append(f"mean request {per_req:.0f} tokens → the pool holds {fit} of them")
            if seqs is not None and seqs > fit:
                changes.append(f"--max-num-seqs {max(fit, 1)} (now {seqs}) so admitted requests fit")
    if mml and cap and cap // mml < 4:
        changes.append(f"--max-model-len {mml // 2} (now {mml}) if requests are short: the pool holds twice as many")
    layers, heads, dim = w.cfg_int("num_layers"), w.cfg_int("num_kv_heads"), w.cfg_int("head_dim")
    dtype = w.config.get("kv_cache_dtype")
    if layers and heads and dim and dtype not in (None, "int8", "fp8_e4m3") and bpt:
        int8 = kv_cache_bytes_per_token(layers, heads, dim, "int8")
        changes.append(
            f"--kv-cache-dtype int8: {bpt:.0f} → {int8} B/token, {bpt / int8:.1f}x the tokens in the same memory"
        )
    changes.append("--kv-cache-memory-gib / --num-kv-blocks larger if memory allows")
    return evidence, "; or ".join(changes)


def _kv_cache_full(w: Window, th: Thresholds) -> list[Finding]:
    pre = w.c("preemptions") or 0.0
    usage = w.gauges.get("kv_usage")
    waiting = w.gauges.get("waiting", 0.0)
    full_and_waiting = usage is not None and usage >= th.kv_full_usage and waiting > 0
    if pre <= 0 and not full_and_waiting:
        return []
    evidence = []
    if pre > 0:
        evidence.append(f"{pre:.0f} preemptions in {w.duration_s:.1f} s ({pre / w.duration_s:.2f}/s)")
        cause = "running sequences outgrow the KV pool: the newest is preempted and its prompt recomputed"
    else:
        cause = "the KV pool is full: waiting requests cannot get blocks until running ones finish"
    if usage is not None:
        evidence.append(f"KV usage {_pct(usage)}, {waiting:.0f} waiting")
    more, change = _kv_advice(w)
    return [Finding("kv_cache_full", "KV cache full", cause, evidence + more, change)]


def _ttft_high(w: Window, th: Thresholds) -> list[Finding]:
    ttft = w.d("ttft")
    if ttft is None or ttft.mean is None or max(ttft.mean, ttft.p50 or 0.0) <= th.ttft_s:
        return []
    symptom = f"TTFT high: mean {_ms(ttft.mean)}, P50 {_ms(ttft.p50)} (target {_ms(th.ttft_s)})"
    queue, prefill = w.d("queue"), w.d("prefill")
    if queue is None or prefill is None:
        return [_ttft_from_client_side(w, symptom)]
    share = (queue.mean or 0.0) / ttft.mean
    base = [f"queue time mean {_ms(queue.mean)} = {_pct(share)} of TTFT; prefill time mean {_ms(prefill.mean)}"]
    if share >= th.dominant_share:
        return [_ttft_queueing(w, symptom, base)]
    shareable, hits, prompt = w.c("prefix_shareable") or 0.0, w.c("prefix_hits") or 0.0, w.c("prompt_tokens") or 0.0
    if prompt > 0 and shareable / prompt >= th.shared_prefix_share and hits < 0.5 * shareable:
        evidence = base + [
            f"{shareable:.0f} of {prompt:.0f} prompt tokens ({_pct(shareable / prompt)}) repeat an earlier prompt's "
            f"prefix; the prefix cache found {hits:.0f}"
        ]
        if w.cfg_bool("enable_prefix_caching") is False:
            cause = "prompts share a prefix (a system prompt) but prefix caching is off: every request recomputes it"
            change = "--enable-prefix-caching (drop --no-enable-prefix-caching)"
        else:
            cause = "prompts share a prefix but the pool evicts it before it is reused"
            change = "a larger KV pool (--kv-cache-memory-gib / --num-kv-blocks) or fewer concurrent sequences"
        return [Finding("ttft_prefix_misses", symptom, cause, evidence, change)]
    p = w.d("prompt_len")
    evidence = base + ([f"prompt length mean {p.mean:.0f} tokens, P95 {p.p95:.0f}"] if p and p.mean else [])
    chunked = w.cfg_bool("enable_chunked_prefill")
    budget = w.cfg_int("max_num_batched_tokens")
    change = "shorter prompts, or cache their shared part (prefix caching)"
    if chunked is False:
        change += "; --enable-chunked-prefill so a long prompt does not hold the step"
    elif budget:
        change += f"; a larger --max-num-batched-tokens (now {budget}) computes a prompt in fewer steps"
    cause = "long prefill: computing the prompt dominates time to first token"
    return [Finding("ttft_long_prefill", symptom, cause, evidence, change)]


def _ttft_queueing(w: Window, symptom: str, evidence: list[str]) -> Finding:
    running, waiting = w.gauges.get("running", 0.0), w.gauges.get("waiting", 0.0)
    seqs = w.cfg_int("max_num_seqs")
    evidence = evidence + [
        f"running {running:.0f}" + (f" of max_num_seqs={seqs}" if seqs else "") + f", {waiting:.0f} waiting"
    ]
    if w.config.get("scheduling_policy") == "static":
        return Finding(
            "ttft_static_batching", symptom,
            "static batching: new requests wait until the whole running batch has finished",
            evidence + ["scheduling_policy=static"], "--scheduling-policy continuous",
        )  # fmt: skip
    usage = w.gauges.get("kv_usage", 0.0)
    if usage >= 0.9:
        _, change = _kv_advice(w)
        return Finding("ttft_queueing", symptom, "queueing: waiting requests find no free KV blocks",
                       evidence + [f"KV usage {_pct(usage)}"], change)  # fmt: skip
    slots = w.gauges.get("state_slots_total")
    if slots and w.gauges.get("state_slots_used", 0.0) >= slots:  # a hybrid model: max_num_seqs is capped to them
        return Finding("ttft_queueing", symptom, "queueing: every recurrent-state slot is taken (a hybrid model's "
                       "linear-attention state, one slot per running sequence)",
                       evidence + [f"state slots {w.gauges['state_slots_used']:.0f} of {slots:.0f}"],
                       "a larger --kv-cache-memory-gib (the budget holds the state slots beside the KV blocks) or "
                       "a smaller --max-model-len")  # fmt: skip
    if seqs and running >= seqs:
        return Finding("ttft_queueing", symptom, "queueing: every sequence slot is taken (max_num_seqs)",
                       evidence, f"--max-num-seqs {2 * seqs} (now {seqs}) if the KV pool and TPOT allow")  # fmt: skip
    return Finding(
        "ttft_queueing", symptom, "queueing: requests arrive faster than the engine finishes them",
        evidence, "fewer concurrent requests or more capacity; --max-queued-requests to shed load with 429",
    )  # fmt: skip


def _ttft_from_client_side(w: Window, symptom: str) -> Finding:
    evidence = []
    p = w.d("prompt_len")
    if p is not None and p.mean is not None:
        evidence.append(f"prompt length mean {p.mean:.0f} tokens, P95 {p.p95 or 0:.0f}")
    if w.ttft_growth is not None:
        evidence.append(f"TTFT of the last third of requests is {w.ttft_growth:.1f}x the first third's")
    if w.ttft_growth is not None and w.ttft_growth >= 2.0:
        return Finding("ttft_queueing", symptom, "queueing: TTFT grows as requests pile up (arrivals above throughput)",
                       evidence, "lower the request rate / concurrency, or more capacity")  # fmt: skip
    if p is not None and p.mean is not None and p.mean >= 512:
        return Finding("ttft_long_prefill", symptom, "long prefill: long prompts", evidence,
                       "shorter prompts, prefix caching for their shared part, chunked prefill")  # fmt: skip
    return Finding(
        "ttft_unexplained", symptom, "queueing or prefill: a client report cannot tell them apart", evidence,
        "run `lmserve diagnose --url` during the load to see queue vs prefill time",
    )  # fmt: skip


def _tpot_high(w: Window, th: Thresholds) -> list[Finding]:
    tpot, itl = w.d("tpot"), w.d("itl")
    level = max((tpot.mean or 0.0) if tpot else 0.0, (itl.p95 or 0.0) if itl else 0.0)
    if level <= th.tpot_s:
        return []
    symptom = (
        "TPOT / ITL high: "
        + ", ".join(
            x for x in (f"TPOT mean {_ms(tpot.mean)}" if tpot else "", f"ITL P95 {_ms(itl.p95)}" if itl else "") if x
        )
        + f" (target {_ms(th.tpot_s)})"
    )
    out: list[Finding] = []
    pre = w.c("preemptions") or 0.0
    if pre > 0:
        _, change = _kv_advice(w)
        out.append(Finding("tpot_preemptions", symptom, "preemptions: recomputing preempted sequences stalls decodes",
                           [f"{pre:.0f} preemptions in {w.duration_s:.1f} s"], change))  # fmt: skip
    d_steps, d_time = w.c("decode_steps") or 0.0, w.c("decode_step_time_s") or 0.0
    m_steps, m_time = w.c("mixed_steps") or 0.0, w.c("mixed_step_time_s") or 0.0
    decode_step = d_time / d_steps if d_steps else None
    mixed_step = m_time / m_steps if m_steps else None
    if decode_step and mixed_step and m_steps >= 3 and mixed_step >= th.interference_ratio * decode_step:
        per_mixed = (w.c("mixed_step_prefill_tokens") or 0.0) / m_steps
        evidence = [
            f"{m_steps:.0f} steps computed prompt tokens beside decodes ({per_mixed:.0f} prompt tokens each): "
            f"{_ms(mixed_step)} per step vs {_ms(decode_step)} for a decode-only step",
            f"mixed steps took {_pct(m_time / max(m_time + d_time, 1e-12))} of decode-bearing step time",
        ]
        budget = w.cfg_int("max_num_batched_tokens")
        if w.cfg_bool("enable_chunked_prefill") is False:
            evidence.append("enable_chunked_prefill=False")
            change = "--enable-chunked-prefill with --max-num-batched-tokens 256-512, so a long prompt is computed in "
            change += "chunks between decode steps"
        else:
            change = f"a smaller --max-num-batched-tokens (now {budget}): fewer prompt tokens per step beside decodes"
        out.append(Finding("tpot_prefill_interference", symptom,
                           "prefill interference: long prompts computed in the same steps as decodes stall them",
                           evidence, change))  # fmt: skip
    batch = (w.c("decode_step_seqs") or 0.0) / d_steps if d_steps else None
    idle = w.gauges.get("decode_step_time_min_s") or None
    if decode_step and idle and batch is not None:
        slow = decode_step / idle
        evidence = [f"decode step {_ms(decode_step)} at a mean batch of {batch:.1f} vs its idle figure {_ms(idle)} "
                    f"({slow:.1f}x)"]  # fmt: skip
        if batch <= th.small_batch and slow >= th.step_slowdown:
            out.append(Finding("tpot_cpu_oversubscribed", symptom,
                               "CPU oversubscribed: a small decode batch steps far slower than it did idle (other "
                               "processes or too many threads compete for the cores)", evidence,
                               "--num-threads at most the physical cores, stop competing processes "
                               "(check the load average)"))  # fmt: skip
        elif batch >= th.large_batch and slow >= 2.0:
            seqs = w.cfg_int("max_num_seqs")
            now = f" (now {seqs})" if seqs else ""
            change = f"--max-num-seqs {max(int(batch // 2), 1)}{now} trades throughput for TPOT; or "
            change += "--quantization int8 / --kv-cache-dtype int8 to read fewer bytes per step"
            cause = "decode batch too large: the memory-bound step grows with the batch"
            out.append(Finding("tpot_large_batch", symptom, cause, evidence, change))
    if not out:
        evidence = [f"decode step {_ms(decode_step)}" + (f" at a mean batch of {batch:.1f}" if batch else "")] if (
            decode_step) else []  # fmt: skip
        out.append(Finding("tpot_slow_step", symptom, "the decode step itself is slow for this model on this machine",
                           evidence, "a smaller model, --quantization int8, or faster hardware"))  # fmt: skip
    return out


def _moe_imbalance(w: Window, th: Thresholds) -> list[Finding]:
    """A mixture-of-experts model whose router sends far more tokens to some experts: a batched step computes each
    chosen expert once over its rows, so the busiest experts set its time."""
    ratio = w.gauges.get("moe_imbalance")
    if ratio is None or ratio < th.moe_imbalance:
        return []
    evidence = [f"in its most uneven layer group the busiest expert got {ratio:.1f}x the mean tokens per expert "
                "(lmserve:moe_expert_load_imbalance by layer_group, lmserve:moe_expert_tokens_total by expert)"]
    return [Finding("moe_expert_imbalance", "MoE expert load imbalanced",
                     "the router concentrates tokens on a few experts: their rows dominate each step's expert time",
                     evidence, "expected for a narrow prompt mix (one language or task); a broader mix of requests "
                     "per step evens it, data parallel replicas split the hot experts' rows")]  # fmt: skip


def _jitter(w: Window, th: Thresholds) -> list[Finding]:
    out = []
    for key, label, floor in (("ttft", "TTFT", th.ttft_s), ("itl", "ITL", th.tpot_s), ("e2e", "E2E", None)):
        d = w.d(key)
        if d is None or d.count < th.min_samples or not d.p50 or d.p99 is None:
            continue
        ratio = d.p99 / d.p50
        if ratio < th.jitter_ratio or (floor is not None and d.p99 <= floor):
            continue
        symptom = f"{label} jitter: P99 {_ms(d.p99)} is {ratio:.1f}x P50 {_ms(d.p50)} (P95 {_ms(d.p95)})"
        evidence, causes, changes = [], [], []
        pre = w.c("preemptions") or 0.0
        if pre > 0:
            causes.append("preemptions")
            evidence.append(f"{pre:.0f} preemptions")
            changes.append("see KV cache full")
        p = w.d("prompt_len")
        if p is not None and p.p50 and p.p99 is not None and p.p99 / p.p50 >= 4:
            causes.append("mixed prompt lengths")
            evidence.append(f"prompt length P50 {p.p50:.0f} vs P99 {p.p99:.0f} tokens")
            changes.append(
                "--enable-chunked-prefill" if w.cfg_bool("enable_chunked_prefill") is False
                else "a smaller --max-num-batched-tokens so long prompts are cut into smaller chunks"
            )  # fmt: skip
        q = w.d("queue")
        if q is not None and q.p50 is not None and q.p99 is not None and q.p99 >= max(th.jitter_ratio * q.p50, 0.01):
            causes.append("queue spikes")
            evidence.append(f"queue time P50 {_ms(q.p50)} vs P99 {_ms(q.p99)}")
            changes.append("smooth bursty arrivals, raise --max-num-seqs if the KV pool allows")
        if not causes:
            causes, changes = ["unexplained by the engine's counters"], ["look at the client and the network"]
        out.append(Finding(f"{key}_jitter", symptom, ", ".join(causes), evidence, "; ".join(changes)))
    return out


# ---- sources ------------------------------------------------------------------------------------


def diagnose_report(path: str | Path, th: Thresholds | None = None) -> Diagnosis:
    return diagnose(window_from_report(json.loads(Path(path).read_text())), th)
