"""A randomized soak of the process-split servers (colocated engine core, DP = 2, 1P1D, TP = 2): seeded random mixes
of concurrent completions (n / best_of, greedy, seeded and unseeded sampling, logprobs, stop strings, streamed or
not, some cancelled by the client mid-stream) against servers with small KV pools, small token budgets, prefix
caching on or off and various max_num_seqs. After each mix: greedy and seeded outputs equal a solo run of the same
request (an in-process engine of the same configuration), every sequence sent is counted once by finish reason in
/metrics, prompt tokens once per request, KV usage (every core) back to 0, nothing running or waiting.

The default suite runs one mix against one server (the form drawn from the seed); `pytest -m soak` runs each form
for LMSERVE_SOAK_SECONDS (180), a fresh server configuration every 8 mixes, and appends a summary line per form to
LMSERVE_SOAK_REPORT when set. A failure names the seed: LMSERVE_SOAK_SEED=<seed> replays it."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from lmserve.config.engine import EngineArgs
from lmserve.engine.llm_engine import LLMEngine
from lmserve.sampling_params import SamplingParams
from tests.server.test_server import MAX_MODEL_LEN, MODEL_NAME, LiveServer, make_chat_model, metrics

FORMS = {
    "colocated": (),
    "dp2": ("--data-parallel-size", "2", "--num-threads", "1"),
    "1p1d": ("--disaggregation", "1P1D", "--num-threads", "1"),
    "tp2": ("--tensor-parallel-size", "2", "--num-threads", "2"),
}
CANCEL_MAX_TOKENS = 150  # a cancelled stream's request: far from its end when the client goes


@dataclass(frozen=True)
class ServerConfig:
    num_kv_blocks: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    max_num_seqs: int

    @classmethod
    def draw(cls, rng: random.Random) -> ServerConfig:
        return cls(rng.randint(24, 42), rng.randint(22, 54), rng.random() < 0.5, rng.choice([3, 4, 8, 256]))

    def flags(self) -> list[str]:
        out = ["--num-kv-blocks", str(self.num_kv_blocks), "--max-num-batched-tokens", str(self.max_num_batched_tokens),
               "--max-num-seqs", str(self.max_num_seqs)]  # fmt: skip
        return out + ([] if self.enable_prefix_caching else ["--no-prefix-caching"])

    def reference(self, model: Path) -> LLMEngine:
        return LLMEngine(EngineArgs.from_kwargs(
            str(model), max_model_len=MAX_MODEL_LEN, num_kv_blocks=self.num_kv_blocks,
            max_num_batched_tokens=self.max_num_batched_tokens, enable_prefix_caching=self.enable_prefix_caching,
            max_num_seqs=self.max_num_seqs,
        ).create_engine_config())  # fmt: skip


@dataclass
class Req:
    body: dict
    cancel_after: int | None = None  # streamed: close the connection after this many chunks
    kind: str = "greedy"  # greedy / seeded: compared with a solo run; unseeded: counted only

    @property
    def num_seqs(self) -> int:
        return self.body.get("best_of") or self.body["n"]


def draw_mix(rng: random.Random) -> list[Req]:
    prefixes = [[(37 * p + 11 * j) % 397 + 3 for j in range(16 * (1 + p % 2))] for p in range(3)]
    mix = []
    for _ in range(rng.randint(3, 10)):
        kind = rng.choice(["greedy", "greedy", "seeded", "unseeded"])
        prompt = rng.choice(prefixes)[: rng.choice([0, 16, 32])] + [
            rng.randint(3, 399) for _ in range(rng.randint(1, 12))
        ]
        body = {"prompt": prompt, "n": rng.choice([1, 1, 2, 3]), "max_tokens": rng.randint(1, 24),
                "temperature": 0.0 if kind == "greedy" else rng.choice([0.7, 1.0]), "ignore_eos": rng.random() < 0.5,
                "stream": rng.random() < 0.5}  # fmt: skip
        if kind == "seeded":
            body["seed"] = rng.randint(0, 10_000)
        if rng.random() < 0.3:
            body["logprobs"] = rng.choice([0, 1, 2])
        if rng.random() < 0.3:
            body["stop"] = rng.choice([["e"], [" t", "a"], ["\n"]])
        req = Req(body, kind=kind)
        if body["stream"] and rng.random() < 0.4:
            req.cancel_after = rng.randint(1, 3)
            body.update(max_tokens=CANCEL_MAX_TOKENS, ignore_eos=True)
            body.pop("stop", None)
        elif not body["stream"] and rng.random() < 0.25:
            body["best_of"] = body["n"] + rng.randint(0, 2)
        mix.append(req)
    return mix


def _params(body: dict) -> SamplingParams:
    keys = ("n", "best_of", "max_tokens", "temperature", "seed", "stop", "logprobs", "ignore_eos")
    return SamplingParams(**{k: body[k] for k in keys if k in body})


def solo(engine: LLMEngine, req: Req) -> list[tuple[str, str]]:
    """(text, finish_reason) of each choice when the request runs alone."""
    engine.add_request("solo", req.body["prompt"], _params(req.body))
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    return [(c.text, None if c.finish_reason is None else c.finish_reason.value) for c in final.outputs]


async def send(client: httpx.AsyncClient, url: str, req: Req) -> tuple[list[tuple[str, str | None]], bool]:
    """The choices' (text, finish_reason), and whether the client cancelled before the end."""
    body = {"model": MODEL_NAME, **req.body}
    if not req.body["stream"]:
        r = await client.post(url, json=body)
        assert r.status_code == 200, f"HTTP {r.status_code}: {r.text}"
        return [(c["text"], c["finish_reason"]) for c in r.json()["choices"]], False
    texts: dict[int, list] = {}
    chunks = 0
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200, f"HTTP {r.status_code}: {(await r.aread()).decode()}"
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for c in event["choices"]:
                t = texts.setdefault(c["index"], ["", None])
                t[0] += c["text"]
                t[1] = c["finish_reason"] or t[1]
            chunks += 1
            if req.cancel_after is not None and chunks >= req.cancel_after:
                done = len(texts) == req.body["n"] and all(t[1] for t in texts.values())
                return [tuple(texts[i]) for i in sorted(texts)], not done
    return [tuple(texts[i]) for i in sorted(texts)], False


@dataclass
class Tally:
    servers: int = 0
    mixes: int = 0
    requests: int = 0
    cancelled: int = 0
    comparisons: int = 0
    violations: list[str] = field(default_factory=list)

    def line(self, form: str) -> str:
        return (f"soak {form}: {self.servers} servers, {self.mixes} mixes, {self.requests} requests, "
                f"{self.cancelled} cancelled, {self.comparisons} compared with a solo run, "
                f"{len(self.violations)} violations")  # fmt: skip


def _sum(m: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in m.items() if k == prefix or k.startswith(prefix + "{") and "engine=" not in k)


def _idle(m: dict[str, float]) -> list[str]:
    busy = []
    for k, v in m.items():
        name = k.split("{")[0]
        if name in ("lmserve:num_requests_running", "lmserve:num_requests_waiting", "lmserve:kv_cache_usage_perc",
                    "lmserve:kv_transfer_leases", "lmserve:kv_transfer_waiting") and v != 0:  # fmt: skip
            busy.append(f"{k}={v}")
    return busy


def run_mix(srv: LiveServer, ref: LLMEngine, rng: random.Random, tally: Tally, where: str) -> None:
    mix = draw_mix(rng)
    before = metrics(srv)

    async def all_requests():
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            url = srv.url + "/v1/completions"
            return await asyncio.gather(*(send(client, url, r) for r in mix), return_exceptions=True)

    results = asyncio.run(all_requests())
    bad = [f"{where} request {i} {mix[i].body}: {r!r}" for i, r in enumerate(results) if isinstance(r, BaseException)]
    tally.violations += bad
    tally.mixes += 1
    tally.requests += len(mix)
    if bad:
        return
    cancelled = [r for r, (_, c) in zip(mix, results, strict=True) if c]
    tally.cancelled += len(cancelled)
    for req, (choices, was_cancelled) in zip(mix, results, strict=True):
        if was_cancelled or req.kind == "unseeded":
            continue
        tally.comparisons += 1
        expected = solo(ref, req)
        if [tuple(c) for c in choices] != expected:
            tally.violations.append(f"{where} {req.body}: got {choices}, a solo run gives {expected}")
    deadline = time.monotonic() + 30
    while (busy := _idle(after := metrics(srv))) and time.monotonic() < deadline:
        time.sleep(0.05)
    if busy:
        tally.violations.append(f"{where}: not idle 30 s after the mix: {busy}")
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    reasons = {
        r: _sum(delta, f"lmserve:request_success_total{{finished_reason={r}}}") for r in ("stop", "length", "abort")
    }
    num_seqs = sum(r.num_seqs for r in mix)
    cancelled_seqs = sum(r.num_seqs for r in cancelled)
    checks = {
        "sequences counted by finish reason": (sum(reasons.values()), num_seqs),
        "sequences counted as abort": (reasons["abort"], cancelled_seqs),
        "requests counted as aborted": (_sum(delta, "lmserve:num_aborted_requests_total"), len(cancelled)),
        "prompt tokens": (_sum(delta, "lmserve:prompt_tokens_total"), sum(len(r.body["prompt"]) for r in mix)),
    }
    for what, (got, want) in checks.items():
        if got != want:
            tally.violations.append(
                f"{where}: {what}: /metrics says {got}, sent {want} ({reasons}; mix {[r.body for r in mix]})"
            )


@pytest.fixture(scope="module")
def soak_model(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_model(llama_dir, tmp_path_factory.mktemp("soak") / "model")


def _seed() -> int:
    env = os.environ.get("LMSERVE_SOAK_SEED")
    return int(env) if env else random.SystemRandom().randrange(1 << 30)


def soak(model: Path, log_dir: Path, form: str, seconds: float, mixes_per_server: int, min_mixes: int = 1,
         seed: int | None = None) -> Tally:  # fmt: skip
    """Servers of `form` one after another (a configuration drawn for each from its seed: `seed` for the first),
    mixes until `seconds` have passed."""
    tally, t0 = Tally(), time.monotonic()
    while tally.mixes < min_mixes or time.monotonic() - t0 < seconds:
        seed = _seed() if seed is None or tally.servers else seed
        rng = random.Random(seed)
        config = ServerConfig.draw(rng)
        where = f"[{form} {config}, LMSERVE_SOAK_SEED={seed} replays it]"
        srv = LiveServer(model, log_dir / f"{form}-{seed}.log", *FORMS[form], *config.flags())
        tally.servers += 1
        try:
            srv.wait_healthy(600)
            ref = config.reference(model)
            for _ in range(mixes_per_server):
                run_mix(srv, ref, rng, tally, where)
                if tally.violations or (tally.mixes >= min_mixes and time.monotonic() - t0 >= seconds):
                    break
        except Exception as e:
            tally.violations.append(f"{where}: {type(e).__name__}: {e}")
        finally:
            srv.stop()
        if "Traceback" in srv.log():
            tally.violations.append(f"{where}: the server logged a traceback:\n{srv.log()[-3000:]}")
        if tally.violations:
            break
    return tally


@pytest.fixture
def report() -> Iterator[list[str]]:
    lines: list[str] = []
    yield lines
    path = os.environ.get("LMSERVE_SOAK_REPORT")
    if path and lines:
        with open(path, "a") as f:
            f.write("\n".join(lines) + "\n")


def test_short_soak(soak_model: Path, tmp_path: Path, report: list[str]) -> None:
    """One mix against one server (each server start costs seconds): the form, like the configuration and the
    mix, comes from the seed, so successive runs cover all four."""
    seed = _seed()
    form = list(FORMS)[seed % len(FORMS)]
    tally = soak(soak_model, tmp_path, form, seconds=0, mixes_per_server=1, seed=seed)
    report.append(tally.line(form))
    assert not tally.violations, "\n".join(tally.violations[:5])


@pytest.mark.soak
@pytest.mark.parametrize("form", list(FORMS))
def test_long_soak(soak_model: Path, tmp_path: Path, form: str, report: list[str]) -> None:
    seconds = float(os.environ.get("LMSERVE_SOAK_SECONDS", "180"))
    tally = soak(soak_model, tmp_path, form, seconds=seconds, mixes_per_server=8, min_mixes=2)
    report.append(tally.line(form))
    print(tally.line(form))
    assert not tally.violations, "\n".join(tally.violations[:5])
