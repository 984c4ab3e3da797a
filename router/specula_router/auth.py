"""API key check of the HTTP API (`--api-key`, env `API_KEY`, as TGI): an ASGI middleware in `server.py`'s app.

With a key set, every request but the probes (`OPEN_PATHS`: load balancers and Prometheus scrapers carry no
credentials, as in TGI) must send `Authorization: Bearer <key>`; anything else is answered 401
`{"error", "error_type": "authentication"}` before routing, so an unknown route is a 401 too and reveals nothing.
Under `/v1/`, `openai_errors` (an outer middleware) turns that body into OpenAI's shape.

The middleware sits inside CORS, so a browser's preflight (which never carries credentials) is answered by CORS
and a 401 still carries the CORS headers the browser needs to read it. The key is compared in constant time
(`hmac.compare_digest`) and is never logged nor echoed: the 401 says only what is missing or wrong.

    app.add_middleware(ApiKeyMiddleware, api_key="s3cret")
    GET /info                                        -> 401 {"error": "missing ...", "error_type": "authentication"}
    GET /info  Authorization: Bearer s3cret          -> 200
    GET /health                                      -> 200 (open)
"""

from __future__ import annotations

import hmac
import json

# Probes answered without the key (TGI leaves the same ones open).
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})
ERROR_TYPE = "authentication"


class ApiKeyMiddleware:
    """401 for an HTTP request without `Authorization: Bearer <api_key>`, except on `OPEN_PATHS`."""

    def __init__(self, app, api_key: str) -> None:
        if not api_key:
            raise ValueError("--api-key must not be empty")
        self.app = app
        self._expected = b"Bearer " + api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = [value for name, value in scope.get("headers") or () if name == b"authorization"]
        if not given:
            return await _reject(send, "missing API key: send the header `Authorization: Bearer <key>`")
        # One header, compared whole in constant time; a repeated header is refused rather than guessed at.
        if len(given) != 1 or not hmac.compare_digest(given[0], self._expected):
            return await _reject(send, "invalid API key")
        return await self.app(scope, receive, send)


def document_api_key(app) -> None:
    """Make the app's OpenAPI document say what the middleware does: a bearer scheme required everywhere but on
    `OPEN_PATHS`, and a 401 on every other operation (in OpenAI's error shape under `/v1/`)."""
    build = app.openapi

    def with_security() -> dict:
        doc = build()
        if "bearer" not in doc.get("components", {}).get("securitySchemes", {}):
            doc.setdefault("components", {}).setdefault("securitySchemes", {})["bearer"] = {
                "type": "http", "scheme": "bearer", "description": "The server's --api-key (env API_KEY)."}
            doc["security"] = [{"bearer": []}]
            for path, operations in doc.get("paths", {}).items():
                for operation in operations.values():
                    if path in OPEN_PATHS:
                        operation["security"] = []
                        continue
                    schema = "OpenAIErrorResponse" if path.startswith("/v1/") else "ErrorResponse"
                    operation.setdefault("responses", {})["401"] = {
                        "description": "Missing or wrong API key", "content": {"application/json": {
                            "schema": {"$ref": f"#/components/schemas/{schema}"}}}}
        return doc

    app.openapi = with_security


async def _reject(send, message: str) -> None:
    body = json.dumps({"error": message, "error_type": ERROR_TYPE}).encode()
    await send({"type": "http.response.start", "status": 401, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": body})
