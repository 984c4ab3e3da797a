"""`--api-key`: every route of the router's app, over a fake worker, without, with a wrong and with the right key.

The route table below must name every route the app serves (a test checks it against `app.routes`), so a route
added later cannot be left open by accident.
"""

from __future__ import annotations

import asyncio
import logging
import random

import httpx
import pytest
import tokenizers
from fake_worker import FakeClient

from specula_router.adapters import AdapterManager
from specula_router.auth import ApiKeyMiddleware
from specula_router.block_allocator import BlockAllocator
from specula_router.chat_template import ChatTemplate
from specula_router.metrics import Metrics
from specula_router.openai_models import OpenAISettings
from specula_router.scheduler import Scheduler, SchedulerConfig
from specula_router.server import RouterState, create_app
from specula_router.validation import Validator
from specula_router.validation_limits import ValidationLimits
from specula_testing.chat_templates import CHATML
from specula_testing.tokenizer import build_tokenizer

KEY = "s3cret-key-0123"
MODEL = "org/base-model"
GENERATE = {"inputs": "hello", "parameters": {"max_new_tokens": 2}}
# (method, path, body) of every protected route, with a body it answers 200 to.
PROTECTED = [
    ("POST", "/generate", GENERATE),
    ("POST", "/generate_stream", GENERATE),
    ("POST", "/", GENERATE),
    ("GET", "/", None),  # TGI's health alias: it needs the key, as every route but the probes below
    ("POST", "/invocations", GENERATE),  # SageMaker's, dispatched by a middleware (no route of its own)
    ("POST", "/tokenize", {"inputs": "hello"}),
    ("GET", "/info", None),
    ("GET", "/docs", None),
    ("GET", "/docs/oauth2-redirect", None),
    ("GET", "/redoc", None),
    ("GET", "/api-doc/openapi.json", None),
    ("POST", "/v1/chat/completions", {"model": "tgi", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2}),
    ("POST", "/v1/completions", {"model": "tgi", "prompt": "hello", "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{MODEL}", None),
]
OPEN = [("GET", "/health"), ("GET", "/ping"), ("GET", "/metrics")]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))


def make_state(tokenizer) -> RouterState:
    metrics = Metrics()
    client = FakeClient(0.0)
    scheduler = Scheduler(client, BlockAllocator(256, 16), SchedulerConfig(max_batch_prefill_tokens=512), metrics,
                          AdapterManager(client, metrics, 8))
    validator = Validator(tokenizer, ValidationLimits(max_input_tokens=100, max_total_tokens=200), rng=random.Random(0))
    info = {"model_id": MODEL, "version": "0.1.0", "max_total_tokens": 200, "speculation": {"method": "none"}}
    template = ChatTemplate.from_text(CHATML, {"bos_token": "<s>", "eos_token": "</s>"})
    return RouterState(scheduler, validator, client, metrics, info, 8, "cpu", openai=OpenAISettings(template, ()))


def call(tokenizer, fn, api_key: str | None = KEY, cors_origins: list[str] | None = None):
    async def body():
        state = make_state(tokenizer)
        app = create_app(state, cors_origins=cors_origins, api_key=api_key)
        loop = asyncio.create_task(state.scheduler.run())
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
                return await fn(client, app)
        finally:
            loop.cancel()

    return asyncio.run(body())


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_refused(r: httpx.Response, path: str) -> None:
    assert r.status_code == 401, (path, r.status_code, r.text)
    assert r.headers["www-authenticate"] == "Bearer"
    assert KEY not in r.text
    body = r.json()
    if path.startswith("/v1/"):  # OpenAI's shape, which the official client raises as AuthenticationError
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_api_key", body
        assert "API key" in body["error"]["message"]
    else:
        assert body["error_type"] == "authentication" and "API key" in body["error"], body


def test_the_route_table_names_every_route_of_the_app(tokenizer):
    async def fn(client, app):
        served = {(method, route.path) for route in app.routes for method in getattr(route, "methods", None) or ()
                  if method != "HEAD"}
        named = {(m, "/v1/models/{model:path}" if p.startswith("/v1/models/") else p) for m, p, _ in PROTECTED}
        assert served - named - set(OPEN) == set(), "a route the auth tests do not cover"

    call(tokenizer, fn)


@pytest.mark.parametrize("method,path,body", PROTECTED, ids=[f"{m} {p}" for m, p, _ in PROTECTED])
def test_every_route_needs_the_key(tokenizer, method, path, body):
    async def fn(client, app):
        missing = await client.request(method, path, json=body)
        wrong = await client.request(method, path, json=body, headers=bearer("not-" + KEY))
        other_scheme = await client.request(method, path, json=body, headers={"Authorization": f"Basic {KEY}"})
        right = await client.request(method, path, json=body, headers=bearer(KEY))
        return missing, wrong, other_scheme, right

    missing, wrong, other_scheme, right = call(tokenizer, fn)
    for refused in (missing, wrong, other_scheme):
        assert_refused(refused, path)
    assert "missing API key" in missing.text and "invalid API key" in wrong.text
    assert right.status_code == 200, (path, right.text)


@pytest.mark.parametrize("method,path", OPEN)
def test_probes_stay_open(tokenizer, method, path):
    async def fn(client, app):
        return await client.request(method, path), await client.request(method, path, headers=bearer("wrong"))

    for r in call(tokenizer, fn):
        assert r.status_code == 200, (path, r.text)


def test_without_a_key_every_route_is_open(tokenizer):
    async def fn(client, app):
        return [await client.request(m, p, json=b) for m, p, b in PROTECTED]

    for (_, path, _), r in zip(PROTECTED, call(tokenizer, fn, api_key=None)):
        assert r.status_code == 200, (path, r.text)


def test_unknown_routes_and_methods_are_401_before_404(tokenizer):
    async def fn(client, app):
        return (await client.get("/nope"), await client.get("/v1/nope"), await client.get("/generate"),
                await client.get("/nope", headers=bearer(KEY)))

    nope, v1_nope, wrong_method, known = call(tokenizer, fn)
    assert_refused(nope, "/nope")
    assert_refused(v1_nope, "/v1/nope")
    assert_refused(wrong_method, "/generate")
    assert known.status_code == 404


def test_a_repeated_authorization_header_is_refused(tokenizer):
    async def fn(client, app):
        headers = [("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer other")]
        return await client.get("/info", headers=headers)

    assert_refused(call(tokenizer, fn), "/info")


def test_cors_preflight_passes_and_a_401_carries_cors_headers(tokenizer):
    origin = "https://app.example"

    async def fn(client, app):
        preflight = await client.options("/generate", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        refused = await client.post("/generate", json=GENERATE, headers={"Origin": origin})
        return preflight, refused

    preflight, refused = call(tokenizer, fn, cors_origins=[origin])
    assert preflight.status_code == 200
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == origin


def test_the_key_is_never_logged(tokenizer, caplog):
    async def fn(client, app):
        await client.post("/generate", json=GENERATE, headers=bearer(KEY))
        await client.post("/generate", json=GENERATE, headers=bearer(KEY + "x"))
        await client.post("/v1/completions", json={"prompt": "hi"}, headers=bearer("x" + KEY))

    with caplog.at_level(logging.DEBUG):
        call(tokenizer, fn)
    assert KEY not in caplog.text


def test_an_empty_key_is_refused():
    with pytest.raises(ValueError, match="--api-key"):
        ApiKeyMiddleware(None, "")


def test_the_openapi_document_declares_the_key(tokenizer):
    async def fn(client, app):
        return (await client.get("/api-doc/openapi.json", headers=bearer(KEY))).json()

    doc = call(tokenizer, fn)
    assert doc["components"]["securitySchemes"]["bearer"] == {
        "type": "http", "scheme": "bearer", "description": "The server's --api-key (env API_KEY)."}
    assert doc["security"] == [{"bearer": []}]
    assert doc["paths"]["/health"]["get"]["security"] == []
    assert "401" not in doc["paths"]["/metrics"]["get"]["responses"]
    assert doc["paths"]["/generate"]["post"]["responses"]["401"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorResponse"}
    v1 = doc["paths"]["/v1/completions"]["post"]["responses"]["401"]["content"]["application/json"]["schema"]
    assert v1 == {"$ref": "#/components/schemas/OpenAIErrorResponse"}
    assert {"ErrorResponse", "OpenAIErrorResponse"} <= set(doc["components"]["schemas"])
    pytest.importorskip("openapi_spec_validator").validate(doc)

    async def without_key(client, app):
        return (await client.get("/api-doc/openapi.json")).json()

    plain = call(tokenizer, without_key, api_key=None)
    assert "security" not in plain and "securitySchemes" not in plain.get("components", {})
