"""`lmserve serve --grpc-port` as a real process: a Python gRPC client against lmserve.v1.Generation, compared
with the HTTP API of the same server (same engine). One server per module, started with an API key so the auth
tests need no second one; every test leaves it idle."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import build_model, require_extra

require_extra("grpc", "grpc", "google.protobuf", "grpc_health", "grpc_reflection")

import grpc  # noqa: E402
import httpx  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (  # noqa: E402
    ProtoReflectionDescriptorDatabase,
)

from lmserve.grpc_proto import lmserve_pb2 as pb  # noqa: E402
from lmserve.grpc_proto import lmserve_pb2_grpc as pb_grpc  # noqa: E402
from tests.server.test_server import MODEL_NAME, LiveServer, free_port, wait_until  # noqa: E402
from tests.server.test_server import metrics as http_metrics  # noqa: E402

pytestmark = pytest.mark.slow  # gRPC servers: in `-m slow` (CI runs it), out of the default run

KEY = "sekrit-grpc"
# A long request holds its slot open by construction, not by hoping the engine is slow: 32k decode steps take
# seconds on the fastest machine, and every test that starts one cancels it (or lets its deadline abort it).
MAX_MODEL_LEN = 1 << 15
AUTH = (("authorization", f"Bearer {KEY}"),)
PROMPT = "The capital of France is"
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 4 + PROMPT  # > 2 KV blocks: prefix-cacheable


@pytest.fixture(scope="module")
def long_llama_dir(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tests' tiny llama with MAX_MODEL_LEN positions (the shared one has 512)."""
    out = tmp_path_factory.mktemp("llama-long")
    return build_model(out, "llama", tokenizer_dir, max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(long_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("grpc-serve")
    srv = LiveServer(
        long_llama_dir, root / "server.log", "--grpc-port", str(free_port()), "--api-key", KEY,
        "--max-num-seqs", "2", "--max-queued-requests", "0", "--max-model-len", str(MAX_MODEL_LEN),
        "--num-kv-blocks", str(2 * MAX_MODEL_LEN // 16 + 64),  # two whole long requests at once (16-token blocks)
    )  # fmt: skip
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def _grpc_port(server: LiveServer) -> int:
    args = server.proc.args
    return int(args[args.index("--grpc-port") + 1])  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def channel(server: LiveServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{_grpc_port(server)}") as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def metrics(server: LiveServer) -> dict[str, float]:
    return http_metrics(server)


def kv_free(server: LiveServer) -> bool:
    m = metrics(server)
    return m["lmserve:kv_cache_usage_perc"] == 0.0 and m["lmserve:num_requests_running"] == 0


def greedy(**kw: object) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]


def http_completion(http: httpx.Client, **body: object) -> dict:
    r = http.post("/v1/completions", json={"model": MODEL_NAME, "temperature": 0, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def http_tokens(http: httpx.Client, text: str) -> list[int]:
    r = http.post("/tokenize", json={"prompt": text})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# ---- outputs equal the HTTP API's ----------------------------------------------------------------


@pytest.mark.parametrize("prompt_kind", ["text", "token_ids"])
def test_unary_and_stream_equal_http(stub: pb_grpc.GenerationStub, http: httpx.Client, prompt_kind: str) -> None:
    ids = http_tokens(http, LONG_PROMPT)
    prompt = {"text": LONG_PROMPT} if prompt_kind == "text" else {"token_ids": pb.TokenIds(ids=ids)}
    req = pb.GenerateRequest(model=MODEL_NAME, sampling_params=greedy(max_tokens=12, logprobs=3), **prompt)
    ref = http_completion(http, prompt=LONG_PROMPT if prompt_kind == "text" else ids, max_tokens=12, logprobs=3)
    ref_choice, ref_lp = ref["choices"][0], ref["choices"][0]["logprobs"]

    unary = stub.Generate(req, metadata=AUTH, timeout=60)
    assert unary.model == MODEL_NAME and unary.id.startswith("grpc-")
    (c,) = unary.choices
    assert c.text == ref_choice["text"] and c.finish_reason == ref_choice["finish_reason"] == "length"
    assert len(c.token_ids) == 12
    # token by token: the chosen tokens, their logprobs and the top alternatives are the HTTP API's
    assert [lp.token_id for lp in c.logprobs] == list(c.token_ids)
    assert [lp.token for lp in c.logprobs] == ref_lp["tokens"]
    assert [lp.logprob for lp in c.logprobs] == ref_lp["token_logprobs"]
    for lp, ref_top in zip(c.logprobs, ref_lp["top_logprobs"], strict=True):
        assert len(lp.top_logprobs) == 3
        assert {t.token: t.logprob for t in lp.top_logprobs} | {lp.token: lp.logprob} == ref_top
        assert lp.rank >= 1 and lp.token_bytes.decode("utf-8", "replace") is not None
    # the detokenized ids are the text (the ids are the ones the text came from)
    r = http.post("/detokenize", json={"tokens": list(c.token_ids)})
    assert r.json()["prompt"] == c.text
    usage = ref["usage"]
    assert (unary.usage.prompt_tokens, unary.usage.completion_tokens, unary.usage.total_tokens) == (
        usage["prompt_tokens"], 12, usage["prompt_tokens"] + 12,
    )  # fmt: skip
    assert unary.usage.cached_prompt_tokens >= 32  # the HTTP request just computed this prompt

    messages = list(stub.GenerateStream(req, metadata=AUTH, timeout=60))
    assert all(m.id == messages[0].id for m in messages)
    assert [m.HasField("usage") for m in messages] == [False] * (len(messages) - 1) + [True]
    deltas = [ch for m in messages for ch in m.choices]
    assert "".join(d.text for d in deltas) == c.text
    assert [t for d in deltas for t in d.token_ids] == list(c.token_ids)
    assert [lp.logprob for d in deltas for lp in d.logprobs] == [lp.logprob for lp in c.logprobs]
    assert [d.finish_reason for d in deltas] == [""] * (len(deltas) - 1) + ["length"]
    assert messages[-1].usage.completion_tokens == 12


def test_n_choices_and_stop_reason(stub: pb_grpc.GenerationStub, http: httpx.Client) -> None:
    ref = http_completion(http, prompt=PROMPT, max_tokens=8, n=2, temperature=0.8, seed=7)
    sp = pb.SamplingParams(max_tokens=8, n=2, temperature=0.8, seed=7, ignore_eos=True)
    out = stub.Generate(pb.GenerateRequest(text=PROMPT, sampling_params=sp), metadata=AUTH, timeout=60)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [c["text"] for c in ref["choices"]]  # seeded: the same samples
    # a stop string ends the choice with the string as its stop reason, as the HTTP API reports it
    req = pb.GenerateRequest(text=PROMPT, sampling_params=greedy(max_tokens=8))
    text = stub.Generate(req, metadata=AUTH).choices[0].text
    stop = next(text[i : i + 2] for i in range(2, len(text) - 1) if text[i : i + 2].strip())
    ref = http_completion(http, prompt=PROMPT, max_tokens=8, stop=[stop])["choices"][0]
    req = pb.GenerateRequest(text=PROMPT, sampling_params=greedy(max_tokens=8, stop=[stop]))
    c = stub.Generate(req, metadata=AUTH).choices[0]
    assert (c.text, c.finish_reason, c.stop_str) == (ref["text"], "stop", ref["stop_reason"]) == (
        text[: text.index(stop)], "stop", stop,
    )  # fmt: skip
    assert c.WhichOneof("stop_reason") == "stop_str"


def test_structured_output_finishes_as_the_http_api(stub: pb_grpc.GenerationStub, http: httpx.Client) -> None:
    """A JSON schema without additionalProperties closes after its properties (unary, stream, n = 2); a budget
    too small ends "length", the text cut short, as the HTTP API says."""
    schema = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "n": {"type": "integer", "minimum": 0,
              "maximum": 9}}, "required": ["unit", "n"]}  # fmt: skip
    for max_tokens, reason in [(40, "stop"), (2, "length")]:
        so = pb.StructuredOutputs(json=json.dumps(schema))
        sp = pb.SamplingParams(max_tokens=max_tokens, n=2, temperature=1.0, seed=5, structured_outputs=so)
        req = pb.GenerateRequest(text=PROMPT, sampling_params=sp)
        unary = stub.Generate(req, metadata=AUTH, timeout=60)
        streamed = {i: "" for i in range(2)}
        for m in stub.GenerateStream(req, metadata=AUTH, timeout=60):
            for d in m.choices:
                streamed[d.index] += d.text
                if d.finish_reason:
                    assert d.finish_reason == reason
        ref = http_completion(http, prompt=PROMPT, max_tokens=max_tokens, n=2, temperature=1.0, seed=5,
                              ignore_eos=False, structured_outputs={"json": schema})["choices"]  # fmt: skip
        for c in unary.choices:
            assert c.finish_reason == reason == ref[c.index]["finish_reason"]
            assert c.text == streamed[c.index] == ref[c.index]["text"]
            if reason == "stop":
                assert sorted(json.loads(c.text)) == ["n", "unit"], c.text
            else:
                assert len(c.token_ids) == max_tokens


def test_prompt_logprobs_and_echo_equal_http(stub: pb_grpc.GenerationStub, http: httpx.Client) -> None:
    """Scoring over gRPC: prompt_logprobs (entry i scores prompt token i + 1) and echo with max_tokens 0."""
    ids = http_tokens(http, LONG_PROMPT)
    ref = http_completion(http, prompt=LONG_PROMPT, max_tokens=0, echo=True, prompt_logprobs=2)
    ref_entries = ref["choices"][0]["prompt_logprobs"][1:]
    req = pb.GenerateRequest(text=LONG_PROMPT, echo=True, sampling_params=greedy(max_tokens=0, prompt_logprobs=2))
    unary = stub.Generate(req, metadata=AUTH, timeout=60)
    (c,) = unary.choices
    assert (c.text, list(c.token_ids), c.finish_reason) == (LONG_PROMPT, [], "length")
    assert (unary.usage.prompt_tokens, unary.usage.completion_tokens) == (len(ids), 0)
    assert [e.token_id for e in unary.prompt_logprobs] == ids[1:]
    for e, ref_e in zip(unary.prompt_logprobs, ref_entries, strict=True):
        # the same computation (a scoring request never reads the prefix cache): the same values
        assert (e.logprob, e.rank) == (ref_e[str(e.token_id)]["logprob"], ref_e[str(e.token_id)]["rank"])
        assert len(e.top_logprobs) == 2
        top = {t: v["logprob"] for t, v in ref_e.items() if v["rank"] <= 2}  # the HTTP entry adds the prompt's
        assert {str(t.token_id): t.logprob for t in e.top_logprobs} == top
    req = pb.GenerateRequest(text=LONG_PROMPT, echo=True, sampling_params=greedy(max_tokens=3, prompt_logprobs=2))
    messages = list(stub.GenerateStream(req, metadata=AUTH, timeout=60))
    assert list(messages[0].prompt_logprobs) == list(unary.prompt_logprobs), "in the first message"
    assert all(not m.prompt_logprobs for m in messages[1:])
    text = "".join(ch.text for m in messages for ch in m.choices)
    plain = http_completion(http, prompt=LONG_PROMPT, max_tokens=3)["choices"][0]["text"]
    assert messages[0].choices[0].text.startswith(LONG_PROMPT) and text == LONG_PROMPT + plain
    with pytest.raises(grpc.RpcError) as e:  # max_tokens 0 without echo: nothing to return
        stub.Generate(pb.GenerateRequest(text=PROMPT, sampling_params=greedy(max_tokens=0)), metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("max_tokens")


def test_tokenize_detokenize_models(stub: pb_grpc.GenerationStub, http: httpx.Client) -> None:
    tok = stub.Tokenize(pb.TokenizeRequest(text=PROMPT), metadata=AUTH)
    assert list(tok.tokens) == http_tokens(http, PROMPT) and tok.count == len(tok.tokens)
    assert tok.max_model_len == MAX_MODEL_LEN
    assert stub.Detokenize(pb.DetokenizeRequest(tokens=tok.tokens), metadata=AUTH).text == PROMPT
    (card,) = stub.ListModels(pb.ListModelsRequest(), metadata=AUTH).models
    assert card.id == MODEL_NAME and card.max_model_len == MAX_MODEL_LEN
    with pytest.raises(grpc.RpcError) as e:
        stub.Detokenize(pb.DetokenizeRequest(tokens=[10**6]), metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("tokens")


# ---- refusals ------------------------------------------------------------------------------------

INVALID = [
    ("n", dict(n=0)),
    ("n", dict(n=1000)),
    ("best_of", dict(n=2, best_of=1)),
    ("temperature", dict(temperature=-0.5)),
    ("temperature", dict(temperature=2.5)),
    ("top_p", dict(top_p=0.0)),
    ("top_k", dict(top_k=-2)),
    ("min_p", dict(min_p=1.5)),
    ("presence_penalty", dict(presence_penalty=2.5)),
    ("frequency_penalty", dict(frequency_penalty=-2.5)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=MAX_MODEL_LEN)),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(max_tokens=4, min_tokens=5)),
    ("stop", dict(stop=[""])),
    ("stop", dict(stop=["x"] * 17)),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("stop_token_ids", dict(stop_token_ids=[10**6])),
    ("logprobs", dict(logprobs=21)),
    ("logprobs", dict(logprobs=-1)),
    ("prompt_logprobs", dict(prompt_logprobs=21)),
    ("logit_bias", dict(logit_bias={5: 101.0})),
    ("logit_bias", dict(logit_bias={10**6: 1.0})),
    ("logit_bias", dict(logit_bias={-1: 1.0})),
    ("structured_outputs", dict(structured_outputs=pb.StructuredOutputs(json="not json"))),
    ("structured_outputs", dict(structured_outputs=pb.StructuredOutputs(regex="("))),
    ("structured_outputs", dict(structured_outputs=pb.StructuredOutputs())),
]


@pytest.mark.parametrize(("field", "params"), INVALID, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID)])
@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_invalid_field_is_invalid_argument_naming_it(
    stub: pb_grpc.GenerationStub, field: str, params: dict, method: str
) -> None:
    req = pb.GenerateRequest(text=PROMPT, sampling_params=pb.SamplingParams(**params))
    with pytest.raises(grpc.RpcError) as e:
        call = getattr(stub, method)(req, metadata=AUTH, timeout=30)
        list(call) if method == "GenerateStream" else None
    err = e.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details().startswith(field), err.details()
    assert ("lmserve-param", field) in tuple(err.trailing_metadata()), err.trailing_metadata()


@pytest.mark.parametrize(
    "prompt",
    [
        {},
        {"token_ids": pb.TokenIds(ids=[])},
        {"token_ids": pb.TokenIds(ids=[10**6])},
        {"token_ids": pb.TokenIds(ids=[1] * MAX_MODEL_LEN)},
    ],
    ids=["missing", "empty", "out-of-vocab", "too-long"],
)
def test_bad_prompt_is_invalid_argument(stub: pb_grpc.GenerationStub, prompt: dict) -> None:
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb.GenerateRequest(sampling_params=greedy(max_tokens=4), **prompt), metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert "prompt" in e.value.details() or "max_tokens" in e.value.details(), e.value.details()


def test_unknown_model_not_found(stub: pb_grpc.GenerationStub) -> None:
    for call, req in (
        (stub.Generate, pb.GenerateRequest(model="gpt-9", text=PROMPT)),
        (stub.Tokenize, pb.TokenizeRequest(model="gpt-9", text=PROMPT)),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call(req, metadata=AUTH)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "gpt-9" in e.value.details()


def test_api_key_required(stub: pb_grpc.GenerationStub, channel: grpc.Channel) -> None:
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", KEY),)):
        with pytest.raises(grpc.RpcError) as e:
            stub.ListModels(pb.ListModelsRequest(), metadata=metadata)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            list(stub.GenerateStream(pb.GenerateRequest(text=PROMPT), metadata=metadata))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert stub.ListModels(pb.ListModelsRequest(), metadata=(("authorization", f"bearer {KEY}"),)).models
    # health stays open, as /health does
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING


# ---- cancellation, backpressure ------------------------------------------------------------------


def _long_stream(stub: pb_grpc.GenerationStub, timeout: float = 60) -> grpc.Future:
    req = pb.GenerateRequest(text=PROMPT, sampling_params=greedy(max_tokens=MAX_MODEL_LEN - 16, logprobs=20))
    return stub.GenerateStream(req, metadata=AUTH, timeout=timeout)


def test_cancel_frees_kv_and_full_queue_is_resource_exhausted(stub: pb_grpc.GenerationStub, server: LiveServer) -> None:
    wait_until(lambda: kv_free(server))
    before = metrics(server)["lmserve:num_aborted_requests_total"]
    calls = [_long_stream(stub), _long_stream(stub)]
    for call in calls:
        next(call)  # running: both of --max-num-seqs 2 slots are taken
    assert metrics(server)["lmserve:kv_cache_usage_perc"] > 0
    # --max-queued-requests 0: a third sequence could not start now → the same backpressure as HTTP's 429
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb.GenerateRequest(text=PROMPT, sampling_params=greedy(max_tokens=4)), metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("retry-after", "1") in tuple(e.value.trailing_metadata())
    for call in calls:
        call.cancel()
    wait_until(lambda: kv_free(server), timeout_s=5)
    assert metrics(server)["lmserve:num_aborted_requests_total"] == before + 2


def test_deadline_aborts_the_request(stub: pb_grpc.GenerationStub, server: LiveServer) -> None:
    wait_until(lambda: kv_free(server))
    before = metrics(server)["lmserve:num_aborted_requests_total"]
    call = _long_stream(stub, timeout=0.2)  # ~32k steps: the deadline comes first on any machine
    with pytest.raises(grpc.RpcError) as e:
        for _ in call:
            pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: kv_free(server), timeout_s=5)
    assert metrics(server)["lmserve:num_aborted_requests_total"] == before + 1


# ---- health, reflection, metrics -----------------------------------------------------------------


def test_health_and_reflection(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "lmserve.v1.Generation"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == (
            health_pb2.HealthCheckResponse.SERVING
        )
    services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert {"lmserve.v1.Generation", "grpc.health.v1.Health"} <= set(services)


def test_metrics_count_grpc_requests_under_their_frontend(
    stub: pb_grpc.GenerationStub, http: httpx.Client, server: LiveServer
) -> None:
    before = metrics(server)
    req = pb.GenerateRequest(text="one two", sampling_params=greedy(max_tokens=3))
    stub.Generate(req, metadata=AUTH)
    list(stub.GenerateStream(req, metadata=AUTH))
    with pytest.raises(grpc.RpcError):
        stub.Generate(pb.GenerateRequest(text="x", sampling_params=greedy(max_tokens=0)), metadata=AUTH)
    http_completion(http, prompt="one two", max_tokens=3)
    after = metrics(server)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("lmserve:e2e_request_latency_seconds_count{frontend=grpc}") == 2
    assert delta("lmserve:request_generation_tokens_sum{frontend=grpc}") == 6
    assert delta("lmserve:time_to_first_token_seconds_count{frontend=grpc}") == 2
    assert delta("lmserve:e2e_request_latency_seconds_count{frontend=http}") == 1
    assert delta("lmserve:num_rejected_requests_total{frontend=grpc,reason=invalid_request}") == 1
    assert delta("lmserve:generation_tokens_total") == 9  # engine counters: both frontends


# ---- the load generator's gRPC backend -----------------------------------------------------------


def test_loadgen_grpc_backend_times_every_token(server: LiveServer, http: httpx.Client) -> None:
    import asyncio

    from lmserve.bench.datasets import BenchRequest
    from lmserve.bench.loadgen import LoadConfig, finalize_all, run_load

    wait_until(lambda: kv_free(server))
    prompts = [f"{PROMPT} number {i}" for i in range(3)]
    requests = [BenchRequest(p, http_tokens(http, p), 6) for p in prompts]
    cfg = LoadConfig(base_url=f"grpc://127.0.0.1:{_grpc_port(server)}", backend="grpc", api_key=KEY, max_concurrency=2)
    result = asyncio.run(run_load(requests, cfg, warmup=requests[:1]))
    assert result.fatal_error is None and result.model == MODEL_NAME and not result.warmup_errors
    records = finalize_all(result, requests, cfg)
    for rec, prompt in zip(records, prompts, strict=True):
        assert rec.success, rec.error
        assert rec.num_output_tokens == 6 and rec.output_tokens_source == "usage"
        assert rec.chunk_tokens_source == "token_ids" and sum(rec.chunk_num_tokens) == 6
        assert rec.send_s <= rec.chunk_times_s[0] <= rec.chunk_times_s[-1] <= rec.end_s
        assert rec.generated_text == http_completion(http, prompt=prompt, max_tokens=6)["choices"][0]["text"]
    bad = LoadConfig(base_url=f"grpc://127.0.0.1:{_grpc_port(server)}", backend="grpc", api_key="wrong")
    result = asyncio.run(run_load(requests[:1], bad))
    assert result.fatal_error is not None and "UNAUTHENTICATED" in result.fatal_error


# ---- health follows the engine: loading, serving, dead (in-process, no HTTP server) --------------


def test_health_mirrors_loading_and_engine_death(llama_dir: Path) -> None:
    import asyncio

    from lmserve.config.engine import EngineArgs
    from lmserve.engine.async_engine import AsyncEngine
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.entrypoints.grpc.server import HEALTH_POLL_S, grpc_frontend
    from lmserve.entrypoints.openai.server import ServerState

    state = ServerState(MODEL_NAME, None, 1 << 20)  # no engine yet: loading, as /health's 503
    port = free_port()

    async def main() -> None:
        async with grpc_frontend("127.0.0.1", port)(state):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                health, stub = health_pb2_grpc.HealthStub(ch), pb_grpc.GenerationStub(ch)

                async def status() -> int:
                    return (await health.Check(health_pb2.HealthCheckRequest(service="lmserve.v1.Generation"))).status

                async def until_status(want: int, timeout_s: float = 30.0) -> None:
                    # the health service polls the engine every HEALTH_POLL_S: wait for its next polls, however
                    # long a loaded machine takes to run them
                    deadline = time.monotonic() + timeout_s
                    while await status() != want:
                        assert time.monotonic() < deadline, f"health never became {want}"
                        await asyncio.sleep(HEALTH_POLL_S)

                assert await status() == health_pb2.HealthCheckResponse.NOT_SERVING
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Generate(pb.GenerateRequest(text=PROMPT))
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in e.value.details()

                args = EngineArgs.from_kwargs(str(llama_dir), num_kv_blocks=64, max_model_len=128)
                engine = AsyncEngine(LLMEngine.from_engine_args(args)).start()
                state.engine = engine
                await until_status(health_pb2.HealthCheckResponse.SERVING)
                out = await stub.Generate(pb.GenerateRequest(text=PROMPT, sampling_params=greedy(max_tokens=3)))
                assert out.usage.completion_tokens == 3

                await asyncio.to_thread(engine.shutdown)  # the engine loop ends: dead, as /health reports it
                await until_status(health_pb2.HealthCheckResponse.NOT_SERVING)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Generate(pb.GenerateRequest(text=PROMPT))
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())
