"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status; on Anthropic's
paths (ANTHROPIC_PATHS) the same errors in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`."""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi.responses import JSONResponse

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}

ANTHROPIC_PATHS = ("/v1/messages",)
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """An error answer; raise it anywhere in a handler."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _ERROR_TYPES.get(status_code, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        default = "invalid_request_error" if self.status_code < 500 else "api_error"
        kind = _ANTHROPIC_TYPES.get(self.status_code, default)
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, path: str = "") -> JSONResponse:
        """The error answer to a request for `path` (Anthropic's shape on its paths)."""
        body = self.anthropic_body() if path.startswith(ANTHROPIC_PATHS) else self.body()
        return _ErrorJSON(body, status_code=self.status_code, headers=self.headers)


class _ErrorJSON(JSONResponse):
    """An error body that always serialises: text echoed from a request (a jinja error quoting a message)
    could hold a lone surrogate, which UTF-8 cannot encode; JSON's \\u escapes can."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


_LEADING_FIELD = re.compile(r"^([a-z_]+)(?:\[|\s)")


def from_value_error(e: ValueError, rename: dict[str, str] | None = None) -> APIError:
    """A ValueError from SamplingParams / the engine (whose messages start with the field) → 400."""
    message = str(e)
    m = _LEADING_FIELD.match(message)
    param = m.group(1) if m else None
    if param in ("request", "prompt") or message.startswith("request needs"):
        param = "max_tokens" if message.startswith("request needs") else "prompt"
    if rename and param in rename:
        param = rename[param]
    return bad_request(message, param)


# pydantic's union member tags inside an error location ("str", "list[int]", "function-after[...]", ...)
_TAG = re.compile(
    r"^(str|int|float|bool|none|list|dict|tuple|.*\[.*\].*|function-.*|literal.*|lax-.*|strict-.*)$"
)


def from_validation_errors(errors: list[dict[str, Any]]) -> APIError:
    """FastAPI/pydantic request-validation errors → one 400 naming the first bad field."""
    if not errors:
        return bad_request("invalid request body")
    # A value refused by a validator (e.g. a lone surrogate) is the real fault; in a union pydantic lists it
    # beside the members the value did not even match, so it is named rather than the union's first member.
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    if first.get("type") == "value_error":
        param = _format_loc([p for p in first.get("loc", ()) if p != "body"])
        message = str((first.get("ctx") or {}).get("error", first.get("msg", "invalid value")))
        return bad_request(f"{param}: {message}", param or None)
    loc = [p for p in first.get("loc", ()) if p != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", first.get("msg", ""))
        return bad_request(f"request body is not valid JSON: {detail}", None, "invalid_json")
    if not loc:
        if kind == "missing":
            return bad_request("request body is missing: send a JSON object")
        return bad_request("request body must be a JSON object")
    tags = [i for i, p in enumerate(loc) if isinstance(p, str) and _TAG.match(p)]
    if tags:  # a union (e.g. prompt: str | list[str] | list[int] | ...): name the field, not the member
        param = _format_loc(loc[: tags[0]])
        return bad_request(f"{param}: invalid value or type ({first.get('msg', 'invalid')})", param)
    param = _format_loc(loc)
    return bad_request(f"{param}: {first.get('msg', 'invalid value')}", param)


def _format_loc(loc: list[Any]) -> str:
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif isinstance(p, str) and _TAG.match(p):
            continue
        else:
            out += ("." if out else "") + str(p)
    return out
