"""What every request passes before its route: the API key (401; a bearer token, or Anthropic's `x-api-key`), the
body size cap (413), and the answers to errors — APIError, request validation, Starlette's HTTP errors and anything
unhandled — as OpenAI-shaped bodies (Anthropic-shaped on its paths), counted in the rejection metrics."""

from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lmserve.entrypoints.openai.dashboard import PAGES
from lmserve.entrypoints.openai.errors import APIError, from_validation_errors
from lmserve.entrypoints.openai.state import ServerState

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/metrics", "/docs", "/redoc", "/openapi.json", "/static/")
OPEN_PAGES = frozenset(PAGES)  # exact paths: the web pages, which ask for the key themselves


class GuardMiddleware:
    """Checks `Authorization: Bearer KEY` (when a key is set; the scheme in any case, RFC 7235), caps the
    request body (413), and answers an unhandled exception with a 500 body itself: raised further, it would
    make the HTTP server drop the keep-alive connection under the client's next request."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        key = self.state.api_key
        if key and not (scope["path"].startswith(OPEN_PATHS) or scope["path"] in OPEN_PAGES):
            if not (bearer_ok(headers.get(b"authorization", b"").decode("latin-1"), key)
                    or x_api_key_ok(headers.get(b"x-api-key"), key)):  # fmt: skip
                err = APIError(
                    401,
                    "missing or invalid API key: send 'Authorization: Bearer KEY' (or 'x-api-key: KEY')",
                    code="invalid_api_key",
                )
                err.headers = {"WWW-Authenticate": "Bearer"}
                await err.response(scope["path"])(scope, receive, send)
                return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self._call_app(scope, receive, send)
            return
        limit = self.state.max_request_body_bytes
        too_large = APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await too_large.response(scope["path"])(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                await too_large.response(scope["path"])(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: waits for http.disconnect

        await self._call_app(scope, replay, send)

    async def _call_app(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            if started:
                raise  # half a response went out: only closing the connection can end it
            logger.exception("unhandled error on %s", scope.get("path"))
            await internal_error(e).response(scope.get("path", ""))(scope, receive, send)


def bearer_ok(authorization: str, key: str) -> bool:
    """Whether an `Authorization` value is `Bearer KEY` (scheme case-insensitive), compared in constant time."""
    scheme, _, credentials = authorization.partition(" ")
    given = credentials.strip(" ").encode("latin-1", "replace") if scheme.lower() == "bearer" else b""
    return hmac.compare_digest(given, key.encode())


def x_api_key_ok(value: bytes | None, key: str) -> bool:
    """Whether an `x-api-key` header (Anthropic's clients send the key there) is KEY, in constant time."""
    return value is not None and hmac.compare_digest(value.strip(b" "), key.encode())


def internal_error(e: Exception) -> APIError:
    return APIError(500, f"internal server error: {type(e).__name__}: {e}")


def add_exception_handlers(app: FastAPI, state: ServerState) -> None:
    def count(status: int) -> None:
        reason = {429: "queue_full", 503: "unavailable", 413: "too_large", 401: "unauthorized"}.get(status)
        if reason is None and 400 <= status < 500:
            reason = "invalid_request"
        if reason is not None and state.metrics is not None:
            state.metrics.on_request_rejected(reason)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        count(exc.status_code)
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        count(400)
        return from_validation_errors(list(exc.errors())).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))
        return err.response(request.url.path)

    @app.exception_handler(Exception)
    async def unhandled_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return internal_error(exc).response(request.url.path)
