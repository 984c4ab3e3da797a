"""Every error the HTTP API answers, in one shape: `{"error": message, "error_type": type}`.

Sits at the edge of `server.py`'s app. FastAPI's own answers (`{"detail": ...}` for a body it cannot parse, an
unknown route or method, an unhandled exception) are turned into this shape here, so a client (and the OpenAPI
document's `ErrorResponse`) sees one format whatever failed. `PayloadLimitMiddleware` answers 413 before the body
is read. Messages name the field and the limit; none repeats a request's `api_token`.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match

from specula_router.metrics import Metrics

logger = logging.getLogger("specula.router.http")

# Statuses Starlette raises itself, and the `error_type` they get.
_HTTP_ERROR_TYPES = {404: "not_found", 405: "method_not_allowed", 415: "validation"}


def error(status: int, message: str, error_type: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "error_type": error_type}, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Answer invalid bodies with 422 `validation`, unknown routes and methods with 404/405, and anything
    unexpected with 500 `internal`, all as `{"error", "error_type"}`."""

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError):
        metrics.request_failure.labels("validation", "").inc()
        return error(422, format_request_errors(exc.errors()), "validation")

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        if exc.status_code == 400 and exc.__cause__ is not None:
            # FastAPI's "There was an error parsing the body": the JSON parser itself gave up.
            metrics.request_failure.labels("validation", "").inc()
            return error(422, body_parse_error(exc.__cause__), "validation")
        error_type = _HTTP_ERROR_TYPES.get(exc.status_code, "validation" if exc.status_code < 500 else "internal")
        message = f"{exc.detail}: {request.method} {request.url.path}" if exc.status_code in (404, 405) \
            else str(exc.detail)
        headers = exc.headers
        if exc.status_code == 405:  # Starlette lists the first matching route's methods; a path may have several
            headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request))}
        return error(exc.status_code, message, error_type, headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error(500, "internal error", "internal")


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at the request's path."""
    methods: set[str] = set()
    for route in request.app.routes:
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


def body_parse_error(cause: BaseException) -> str:
    """Why the body could not be parsed as JSON, in a client's terms (never echoing the body)."""
    if isinstance(cause, UnicodeDecodeError):
        return f"the body is not valid UTF-8 (byte {cause.start})"
    if isinstance(cause, RecursionError):
        return "the body is nested too deeply"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return f"the body has an integer with more than {sys.get_int_max_str_digits()} digits"
    return f"the body could not be parsed as JSON ({type(cause).__name__})"


def format_request_errors(errors: Sequence[Mapping[str, Any]]) -> str:
    """One readable message from pydantic's (FastAPI's `RequestValidationError.errors()`) error list.

    Example: [{"loc": ("body", "parameters", "top_k"), "msg": "Input should be a valid integer"}]
             -> "`parameters.top_k`: Input should be a valid integer"
    """
    parts = []
    for err in errors:
        if err.get("type") == "json_invalid":
            reason = (err.get("ctx") or {}).get("error", "invalid JSON")
            parts.append(f"the body is not valid JSON: {reason} (at character {err['loc'][-1]})")
            continue
        loc = [str(part) for part in err.get("loc", ()) if part != "body"]
        where = ".".join(loc) or "body"
        parts.append(f"`{where}`: {err.get('msg', 'invalid value')}")
    return "; ".join(parts) or "invalid request body"


class PayloadLimitMiddleware:
    """413 for request bodies over the limit: at once by Content-Length, else by reading a chunked body first.

    A chunked body is buffered (at most `limit` bytes) before the app sees it, so an oversized one is answered
    413 rather than failing later inside the app's body parsing.
    """

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.limit:
                return await self._reject(send)
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message], receive), send)
            size += len(message.get("body", b""))
            if size > self.limit:
                return await self._reject(send)
            chunks.append(message)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(chunks, receive), send)

    async def _reject(self, send) -> None:
        body = json.dumps({"error": f"payload larger than {self.limit} bytes", "error_type": "payload_limit"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _replay(messages: list, receive):
    """An ASGI receive that first returns `messages`, then defers to the real one."""
    pending = list(messages)

    async def replay():
        return pending.pop(0) if pending else await receive()

    return replay
