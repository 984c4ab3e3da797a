"""The HTTP API over a fake worker: status codes, bodies, SSE format, headers, metrics."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
import tokenizers
from fake_worker import FakeClient
from prometheus_client.parser import text_string_to_metric_families

from specula_router.block_allocator import BlockAllocator
from specula_router.metrics import Metrics
from specula_router.scheduler import Scheduler, SchedulerConfig
from specula_router.server import RouterState, create_app
from specula_router.validation import ValidationLimits, Validator
from specula_server.testing.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))


def make_state(tokenizer, max_concurrent=8, step_delay=0.0):
    metrics = Metrics()
    client = FakeClient(step_delay)
    scheduler = Scheduler(client, BlockAllocator(256, 16), SchedulerConfig(max_batch_prefill_tokens=512), metrics)
    validator = Validator(tokenizer, ValidationLimits(max_input_tokens=100, max_total_tokens=200),
                          rng=random.Random(0))
    info = {"model_id": "fake", "max_total_tokens": 200, "speculation": {"method": "none"}}
    return RouterState(scheduler, validator, client, metrics, info, max_concurrent, "cpu")


def call(state, fn, payload_limit=2_000_000):
    async def body():
        app = create_app(state, payload_limit=payload_limit)
        loop = asyncio.create_task(state.scheduler.run())
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
                return await fn(client)
        finally:
            loop.cancel()

    return asyncio.run(body())


def test_generate_with_details_and_headers(tokenizer):
    async def fn(client):
        r = await client.post("/generate", json={"inputs": "hello", "parameters": {
            "max_new_tokens": 3, "details": True, "decoder_input_details": True}})
        assert r.status_code == 200
        body = r.json()
        assert body["generated_text"] == "t0 t1 t2 "
        d = body["details"]
        assert d["finish_reason"] == "length" and d["generated_tokens"] == 3 and d["skipped_tokens"] == 0
        assert d["prompt_tokens"] == len(tokenizer.encode("hello").ids)
        assert [t["text"] for t in d["tokens"]] == ["t0 ", "t1 ", "t2 "]
        assert r.headers["x-generated-tokens"] == "3" and r.headers["x-compute-type"] == "cpu"
        assert r.headers["x-skipped-tokens"] == "0" and "x-queue-time" in r.headers

    call(make_state(tokenizer), fn)


def test_compat_route_answers_an_array_or_a_stream(tokenizer):
    async def fn(client):
        r = await client.post("/", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}, "stream": False})
        assert r.status_code == 200 and isinstance(r.json(), list) and r.json()[0]["generated_text"] == "t0 t1 "
        r = await client.post("/", json={"inputs": "hi", "parameters": {"max_new_tokens": 2, "details": True},
                                         "stream": True})
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[5:]) for line in r.text.split("\n\n") if line.startswith("data:")]
        assert [e["token"]["text"] for e in events] == ["t0 ", "t1 "]
        assert events[0]["generated_text"] is None and events[0]["details"] is None
        assert events[-1]["generated_text"] == "t0 t1 "
        assert events[-1]["details"]["finish_reason"] == "length" and events[-1]["details"]["generated_tokens"] == 2

    call(make_state(tokenizer), fn)


def test_return_full_text_prefixes_the_prompt(tokenizer):
    async def fn(client):
        r = await client.post("/generate", json={"inputs": "abc", "parameters": {
            "max_new_tokens": 1, "return_full_text": True}})
        assert r.json()["generated_text"] == "abct0 "

    call(make_state(tokenizer), fn)


@pytest.mark.parametrize("payload,match", [
    ({"inputs": "x", "parameters": {"temperature": 0}}, "temperature"),
    ({"inputs": "x", "parameters": {"max_new_tokens": 500}}, "max_new_tokens"),
    ({"inputs": "", "parameters": {}}, "inputs"),
    ({"inputs": "x", "parameters": {"top_k": "many"}}, "top_k"),
    ({"parameters": {}}, "inputs"),
])
def test_invalid_parameters_are_422_naming_the_field(tokenizer, payload, match):
    async def fn(client):
        r = await client.post("/generate", json=payload)
        assert r.status_code == 422
        assert r.json()["error_type"] == "validation" and match in r.json()["error"]

    call(make_state(tokenizer), fn)


def test_malformed_json_is_422(tokenizer):
    async def fn(client):
        r = await client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 422 and r.json()["error_type"] == "validation"

    call(make_state(tokenizer), fn)


def test_overload_is_rejected_at_once(tokenizer):
    async def fn(client):
        slow = asyncio.create_task(client.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 30}}))
        await asyncio.sleep(0.05)
        r = await client.post("/generate", json={"inputs": "b", "parameters": {"max_new_tokens": 1}})
        assert r.status_code == 429 and r.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
        assert (await slow).status_code == 200

    call(make_state(tokenizer, max_concurrent=1, step_delay=0.01), fn)


def test_payload_limit_is_413(tokenizer):
    async def fn(client):
        r = await client.post("/generate", json={"inputs": "x" * 5000, "parameters": {}})
        assert r.status_code == 413 and r.json()["error_type"] == "payload_limit"

    call(make_state(tokenizer), fn, payload_limit=1000)


def test_worker_failure_is_424_and_an_error_event_in_a_stream(tokenizer):
    state = make_state(tokenizer)

    async def fn(client):
        state.client.fail_next = "prefill"
        r = await client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 424 and r.json()["error_type"] == "generation"
        state.client.fail_next = "decode"
        r = await client.post("/generate_stream", json={"inputs": "x", "parameters": {"max_new_tokens": 3}})
        events = [json.loads(line[5:]) for line in r.text.split("\n\n") if line.startswith("data:")]
        assert events[0]["token"]["text"] == "t0 "
        assert events[-1]["error_type"] == "generation" and "shard exploded" in events[-1]["error"]
        ok = await client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 1}})
        assert ok.status_code == 200

    call(state, fn)


def test_adapter_requests_fail_clearly_until_adapters_are_served(tokenizer):
    async def fn(client):
        r = await client.post("/generate", json={"inputs": "x", "parameters": {"adapter_id": "org/lora"}})
        assert r.status_code == 424 and "org/lora" in r.json()["error"]

    call(make_state(tokenizer), fn)


def test_best_of_returns_the_best_and_the_others(tokenizer):
    async def fn(client):
        r = await client.post("/generate", json={"inputs": "x", "parameters": {
            "max_new_tokens": 2, "best_of": 2, "do_sample": True, "details": True}})
        assert r.status_code == 200
        details = r.json()["details"]
        assert len(details["best_of_sequences"]) == 1
        assert details["seed"] != details["best_of_sequences"][0]["seed"]

    call(make_state(tokenizer), fn)


def test_tokenize_info_health_metrics(tokenizer):
    async def fn(client):
        tokens = (await client.post("/tokenize", json={"inputs": "def f"})).json()
        assert [t["id"] for t in tokens] == tokenizer.encode("def f").ids
        assert (await client.get("/info")).json()["model_id"] == "fake"
        assert (await client.get("/health")).status_code == 200
        await client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}})
        text = (await client.get("/metrics")).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        for name in ("specula_request_count", "specula_request_success", "specula_request_time_to_first_token",
                     "specula_request_inter_token_latency", "specula_batch_inference_duration",
                     "specula_request_generated_tokens", "specula_queue_size"):
            assert name in families, name
        success = [s for s in families["specula_request_success"].samples if s.name.endswith("_total")]
        assert success[0].value == 1 and success[0].labels == {"adapter": ""}
        assert (await client.get("/docs")).status_code == 200
        spec = (await client.get("/api-doc/openapi.json")).json()
        assert {"/generate", "/generate_stream", "/", "/tokenize", "/health", "/info", "/metrics"} <= set(spec["paths"])

    call(make_state(tokenizer), fn)


def test_unhealthy_shards_give_503(tokenizer):
    state = make_state(tokenizer)

    async def broken(timeout=5.0):
        raise RuntimeError("socket gone")

    state.client.health = broken

    async def fn(client):
        r = await client.get("/health")
        assert r.status_code == 503 and r.json() == {"error": "unhealthy", "error_type": "healthcheck"}

    call(state, fn)
