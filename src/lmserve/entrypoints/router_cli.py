"""`lmserve router --prefill URL [...] --decode URL [...]`: an OpenAI-compatible proxy in front of kv_producer and
kv_consumer servers (prefill/decode disaggregation across servers, vLLM's proxy shape).

A request is prefilled on a prefill server, then sent with the returned kv_transfer_params to a decode server, which
pulls the KV and answers (Router, run_router). See docs/disaggregation.md.
"""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request, imported locally)

import argparse
import json
import logging
import sys
import time
from collections import OrderedDict
from typing import Any

logger = logging.getLogger("lmserve.router")

AFFINITY_BYTES = 64
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def add_parser(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser("router", help="OpenAI-compatible proxy over prefill and decode servers")
    p.add_argument("--prefill", action="append", required=True, metavar="URL", help="a kv_producer server (repeat)")
    p.add_argument("--decode", action="append", required=True, metavar="URL", help="a kv_consumer server (repeat)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--wait-s", type=float, default=300.0, help="how long to wait for the servers at start-up")
    p.add_argument("--timeout-s", type=float, default=600.0, help="upstream request timeout")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run_router)


def check_servers(prefill: list[dict[str, Any]], decode: list[dict[str, Any]], urls: list[str]) -> str | None:
    """The first problem with the servers' GET /v1/kv_transfer answers (prefill then decode, in `urls` order)."""
    from lmserve.engine.kv_transfer import geometry_mismatch

    infos = prefill + decode
    for url, info, role in zip(urls, infos, ["kv_producer"] * len(prefill) + ["kv_consumer"] * len(decode),
                               strict=True):  # fmt: skip
        if info.get("kv_role") != role:
            return f"kv_role: {url} is {info.get('kv_role')!r}, expected {role!r} (--kv-transfer-config)"
    for url, info in zip(urls[1:], infos[1:], strict=True):
        problem = geometry_mismatch(infos[0], info)
        if problem is not None:
            return f"{url} vs {urls[0]}: {problem.replace('the producer', urls[0]).replace('this consumer', url)}"
    return None


class Router:
    """The proxy's state: httpx client, in-flight counts, prefix affinity."""

    def __init__(self, prefill: list[str], decode: list[str], timeout_s: float = 600.0) -> None:
        import httpx

        self.prefill = [u.rstrip("/") for u in prefill]
        self.decode = [u.rstrip("/") for u in decode]
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))
        self.in_flight: dict[str, int] = dict.fromkeys(self.prefill + self.decode, 0)
        self._affinity: dict[str, OrderedDict[int, int]] = {"prefill": OrderedDict(), "decode": OrderedDict()}

    def choose(self, role: str, body: dict[str, Any]) -> str:
        from lmserve.engine.router import choose_core

        urls = self.prefill if role == "prefill" else self.decode
        prompt = body.get("prompt", body.get("messages"))
        key = (prompt if isinstance(prompt, str) else json.dumps(prompt))[:AFFINITY_BYTES].encode()
        loads = {i: (self.in_flight[u], 0.0) for i, u in enumerate(urls)}
        return urls[choose_core(loads, self._affinity[role], list(key), AFFINITY_BYTES)]

    async def close(self) -> None:
        await self.client.aclose()


def build_router_app(router: Router) -> Any:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    app = FastAPI(title="lmserve router")

    def error(status: int, message: str, param: str | None = None) -> JSONResponse:
        body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}
        return JSONResponse(body, status_code=status)

    async def relay(path: str, request: Request) -> Response:
        """Prefill, then decode. A request the prefill server finished outright (EOS or max_tokens at the first
        token) goes to the decode server as it came, so the answer keeps the client's shape."""
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return error(400, f"the body is not valid JSON: {e}")
        if not isinstance(body, dict):
            return error(400, "the body must be a JSON object")
        for name in ("prompt_logprobs", "echo"):
            if body.get(name):
                return error(400, f"{name}: not supported through lmserve router (the prompt is scored on one "
                                  "server and answered by another)", name)  # fmt: skip
        prefill_url = router.choose("prefill", body)
        pre_body = {**body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        pre_body.pop("stream_options", None)
        router.in_flight[prefill_url] += 1
        try:
            pre = await router.client.post(prefill_url + path, json=pre_body, headers=_auth(request))
        finally:
            router.in_flight[prefill_url] -= 1
        if pre.status_code != 200:
            return Response(pre.content, status_code=pre.status_code, media_type="application/json")
        params = pre.json().get("kv_transfer_params")
        dec_body = dict(body)
        if params is not None:
            dec_body["kv_transfer_params"] = params
        decode_url = router.choose("decode", body)
        if not body.get("stream"):
            router.in_flight[decode_url] += 1
            try:
                r = await router.client.post(decode_url + path, json=dec_body, headers=_auth(request))
            finally:
                router.in_flight[decode_url] -= 1
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        req = router.client.build_request("POST", decode_url + path, json=dec_body, headers=_auth(request))
        router.in_flight[decode_url] += 1
        try:
            upstream = await router.client.send(req, stream=True)
        except BaseException:
            router.in_flight[decode_url] -= 1
            raise
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            router.in_flight[decode_url] -= 1
            return Response(content, status_code=upstream.status_code, media_type="application/json")

        async def pipe():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:  # finished, or the client left: closing aborts it upstream
                await upstream.aclose()
                router.in_flight[decode_url] -= 1

        return StreamingResponse(pipe(), media_type="text/event-stream")

    for path in GENERATION_PATHS:
        app.add_api_route(path, _route(relay, path), methods=["POST"])

    @app.get("/health")
    async def health() -> JSONResponse:
        states = {}
        for url in router.prefill + router.decode:
            try:
                r = await router.client.get(url + "/health", timeout=5.0)
                states[url] = r.json().get("status", str(r.status_code))
            except Exception as e:  # a server down is reported, not raised
                states[url] = f"unreachable: {type(e).__name__}"
        ok = all(s == "ok" for s in states.values())
        return JSONResponse({"status": "ok" if ok else "degraded", "servers": states}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        r = await router.client.get(router.decode[0] + "/v1/models", headers=_auth(request))
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.on_event("shutdown")
    async def close() -> None:
        await router.close()

    return app


def _route(relay: Any, path: str) -> Any:
    from fastapi import Request

    async def handler(request: Request) -> Any:
        return await relay(path, request)

    return handler


def _auth(request: Any) -> dict[str, str]:
    value = request.headers.get("authorization")
    return {"Authorization": value} if value else {}


def wait_for_servers(urls: list[str], wait_s: float) -> list[dict[str, Any]]:
    """Every server's GET /v1/kv_transfer once it answers 200 (they may still be loading)."""
    import httpx

    deadline = time.monotonic() + wait_s
    infos = []
    for url in urls:
        while True:
            try:
                r = httpx.get(url.rstrip("/") + "/v1/kv_transfer", timeout=5.0)
                if r.status_code == 200:
                    infos.append(r.json())
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer GET /v1/kv_transfer within {wait_s:.0f} s")
            time.sleep(0.5)
    return infos


def run_router(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)  # fmt: skip
    urls = args.prefill + args.decode
    try:
        infos = wait_for_servers(urls, args.wait_s)
    except RuntimeError as e:
        print(f"lmserve router: error: {e}", file=sys.stderr)
        return 2
    problem = check_servers(infos[: len(args.prefill)], infos[len(args.prefill) :], urls)
    if problem is not None:
        print(f"lmserve router: error: {problem}", file=sys.stderr)
        return 2
    app = build_router_app(Router(args.prefill, args.decode, args.timeout_s))
    logger.info("routing %s (prefill) → %s (decode) at http://%s:%d", args.prefill, args.decode, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0
