"""Errors of the OpenAI-compatible routes, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Statuses are those of the TGI routes for the same failure (422 an invalid value, 429 overloaded, 424 a worker or
adapter failure, 400 an adapter id the workers refuse, 413 a body too large), plus OpenAI's own: 404
`model_not_found`, and 400 for what the OpenAI routes do not support (`suffix`, image parts).
`type` is OpenAI's (`invalid_request_error`, `server_error`, and `requests` for 429); `code` is OpenAI's where
it has one (`model_not_found`, `rate_limit_exceeded`), else the TGI routes' `error_type`.

`install` makes every error under `/v1/` take this shape, whoever raised it: the routes' own errors, FastAPI's
(an unparsable body, an unknown route or method), the payload limit's 413 and an unexpected 500. Other routes
keep `{"error", "error_type"}`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from specula_router.http_errors import format_request_errors

PREFIX = "/v1/"
_CODES = {"overloaded": "rate_limit_exceeded", "authentication": "invalid_api_key"}  # OpenAI's codes
_REPLACED_HEADERS = (b"content-length", b"content-type")


class OpenAIError(Exception):
    """A request the OpenAI routes refuse; `param` names the offending field when there is one."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, self.param, self.code), status_code=self.status,
                            headers=headers)


def error_type(status: int) -> str:
    if status == 429:
        return "requests"
    return "server_error" if status >= 500 or status == 424 else "invalid_request_error"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": _CODES.get(code or "", code)}}


def from_tgi(status: int, body: Mapping) -> dict:
    """A TGI-shaped error body (`{"error": message, "error_type": type}`) in OpenAI's shape."""
    return error_body(status, str(body.get("error", "error")), None, body.get("error_type"))


def install(app: FastAPI, metrics) -> None:
    """Every error answered under `/v1/` in OpenAI's shape (see the module docstring)."""
    previous = app.exception_handlers.get(RequestValidationError)

    async def invalid_body(request: Request, exc: RequestValidationError):
        if not request.url.path.startswith(PREFIX):
            return await previous(request, exc)
        metrics.request_failure.labels("validation", "").inc()
        errors = exc.errors()
        loc = [str(p) for p in (errors[0].get("loc", ()) if errors else ()) if p != "body"]
        return OpenAIError(422, format_request_errors(errors), ".".join(loc) or None, "validation").response()

    if previous is not None:
        app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_middleware(_OpenAIErrorShape)


class _OpenAIErrorShape:
    """ASGI middleware: an error body in the TGI shape, answered under `/v1/`, is rewritten in OpenAI's.

    Sits outside the payload limit and the error handlers, so it sees their answers too; answers below 400 and
    bodies already in OpenAI's shape pass through untouched (a stream's chunks are not buffered).
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(PREFIX):
            return await self.app(scope, receive, send)
        held: dict | None = None
        chunks: list[bytes] = []

        async def reshape(message):
            nonlocal held
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held = message
                return
            if held is None or message["type"] != "http.response.body":
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = _reshaped(held["status"], b"".join(chunks))
            headers = [(k, v) for k, v in held.get("headers", []) if k.lower() not in _REPLACED_HEADERS]
            headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({**held, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, reshape)


def _reshaped(status: int, body: bytes) -> bytes:
    try:
        raw = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raw = {"error": body.decode("utf-8", "replace") or "error"}
    if isinstance(raw, dict) and isinstance(raw.get("error"), dict):
        return body  # already OpenAI's shape
    if not isinstance(raw, dict):
        raw = {"error": str(raw)}
    return json.dumps(from_tgi(status, raw), ensure_ascii=False).encode()
