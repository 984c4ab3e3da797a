"""The HTTP API over a fake worker: status codes, bodies, SSE format, headers, metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import random

import httpx
import pytest
import tokenizers
from fake_worker import AdapterBehaviour, FakeClient
from prometheus_client.parser import text_string_to_metric_families

from specula_router.adapters import AdapterManager
from specula_router.block_allocator import BlockAllocator
from specula_router.metrics import Metrics
from specula_router.scheduler import Scheduler, SchedulerConfig
from specula_router.server import RouterState, create_app
from specula_router.validation import Validator
from specula_router.validation_limits import ValidationLimits
from specula_testing.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))


def make_state(tokenizer, max_concurrent=8, step_delay=0.0, adapters=None, max_active_adapters=8):
    metrics = Metrics()
    client = FakeClient(step_delay)
    client.adapters.update(adapters or {})
    manager = AdapterManager(client, metrics, max_active_adapters)
    scheduler = Scheduler(client, BlockAllocator(256, 16), SchedulerConfig(max_batch_prefill_tokens=512), metrics,
                          manager)
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


def sse_events(response) -> list[dict]:
    return [json.loads(line[5:]) for line in response.text.split("\n\n") if line.startswith("data:")]


def test_adapter_requests_are_served_by_their_adapter(tokenizer):
    async def fn(client):
        r = await client.post("/generate", json={"inputs": "x", "parameters": {
            "adapter_id": "org/lora", "max_new_tokens": 2, "details": True}})
        assert r.status_code == 200 and r.json()["generated_text"] == "org/lora:t0 org/lora:t1 "
        r = await client.post("/", json={"inputs": "x", "stream": True, "parameters": {
            "adapter_id": "org/other", "adapter_source": "local", "max_new_tokens": 2}})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert [e["token"]["text"] for e in sse_events(r)] == ["org/other:t0 ", "org/other:t1 "]
        r = await client.post("/", json={"inputs": "x", "parameters": {"adapter_id": "", "max_new_tokens": 1}})
        assert r.json()[0]["generated_text"] == "t0 "  # LoRAX's empty id: the base model

    state = make_state(tokenizer)
    call(state, fn)
    assert [(r.adapter_id, r.adapter_source) for r in state.client.load_requests] == [
        ("org/lora", "hub"), ("org/other", "local")]


def test_base_requests_flow_while_an_adapter_loads(tokenizer):
    async def fn(client):
        slow = asyncio.create_task(client.post("/generate", json={"inputs": "x", "parameters": {
            "adapter_id": "org/slow", "max_new_tokens": 1}}))
        await asyncio.sleep(0.05)
        for _ in range(3):
            r = await client.post("/generate", json={"inputs": "y", "parameters": {"max_new_tokens": 3}})
            assert r.status_code == 200 and r.json()["generated_text"] == "t0 t1 t2 "
        assert not slow.done()
        assert (await slow).json()["generated_text"] == "org/slow:t0 "

    call(make_state(tokenizer, adapters={"org/slow": AdapterBehaviour(delay=1.0)}), fn)


@pytest.mark.parametrize("path,stream", [("/generate", None), ("/generate_stream", None), ("/", False), ("/", True)])
def test_failed_adapter_load_is_the_workers_status_with_its_reason(tokenizer, path, stream):
    adapters = {"org/missing": AdapterBehaviour(delay=0.05, error="adapter `org/missing`: repository not found"),
                "../etc": AdapterBehaviour(error="adapter `../etc` is outside the adapter directories", status=400)}

    async def fn(client):
        def body(adapter_id):
            payload = {"inputs": "x", "parameters": {"adapter_id": adapter_id, "max_new_tokens": 2}}
            return payload if stream is None else {**payload, "stream": stream}

        base = asyncio.create_task(client.post(path, json={**body(""), "parameters": {"max_new_tokens": 2}}))
        r = await client.post(path, json=body("org/missing"))
        assert r.status_code == 424
        assert r.json() == {"error": "adapter `org/missing`: repository not found", "error_type": "generation"}
        r = await client.post(path, json=body("../etc"))
        assert r.status_code == 400 and r.json()["error_type"] == "validation" and "outside" in r.json()["error"]
        assert (await base).status_code == 200

    state = make_state(tokenizer, adapters=adapters)
    call(state, fn)
    assert state.in_flight == 0 and state.scheduler.num_waiting == 0


def test_adapter_fields_are_validated_with_422(tokenizer):
    async def fn(client):
        for parameters, message in [
            ({"adapter_id": "a" * 257}, "`adapter_id` must be at most 256 characters. Given: 257"),
            ({"adapter_id": "org/\u0007lora"}, "`adapter_id` must not contain control characters"),
            ({"adapter_id": "org/lora", "adapter_source": "s3"}, "`adapter_source` must be one of ['hub', 'local']"),
            ({"adapter_id": ["org/lora"]}, "`parameters.adapter_id`"),
            ({"adapter_id": "org/lora", "api_token": 5}, "`parameters.api_token`"),
        ]:
            r = await client.post("/generate", json={"inputs": "x", "parameters": parameters})
            assert r.status_code == 422 and r.json()["error_type"] == "validation", parameters
            assert message in r.json()["error"], (parameters, r.json())

    state = make_state(tokenizer)
    call(state, fn)
    assert state.client.load_requests == []


def test_api_token_is_never_logged_nor_echoed(tokenizer, caplog):
    token = "hf_SeCrEtToKeN123"
    adapters = {"org/private": AdapterBehaviour(delay=0.02),
                "org/denied": AdapterBehaviour(error=f"adapter `org/denied`: 401 for token {token}")}

    async def fn(client):
        texts = []
        for adapter_id in ("org/private", "org/denied"):
            for path, stream in (("/generate", None), ("/", True)):
                payload = {"inputs": "x", "parameters": {"adapter_id": adapter_id, "api_token": token,
                                                         "max_new_tokens": 2, "details": True}}
                if stream is not None:
                    payload["stream"] = stream
                r = await client.post(path, json=payload)
                texts.append(r.text + json.dumps(dict(r.headers)))
        r = await client.post("/generate", json={"inputs": "x", "parameters": {
            "adapter_id": "org/\u0000", "api_token": token}})
        assert r.status_code == 422
        texts.append(r.text)
        texts.append((await client.get("/metrics")).text + (await client.get("/info")).text)
        return texts

    caplog.set_level(logging.DEBUG)
    state = make_state(tokenizer, adapters=adapters)
    texts = call(state, fn)
    assert all(token not in t for t in texts)
    assert any("***" in t for t in texts)  # the worker's message that quoted it, redacted
    assert caplog.records and all(token not in r.getMessage() for r in caplog.records)
    assert [r.api_token for r in state.client.load_requests] == [token] * 3  # it did reach the loads


def test_adapter_metrics_are_served(tokenizer):
    async def fn(client):
        for adapter_id in ("a", "bad", "b", "b"):  # one slot: a is offloaded for bad, whose slot b then takes
            await client.post("/generate", json={"inputs": "x", "parameters": {"adapter_id": adapter_id,
                                                                               "max_new_tokens": 1}})
        text = (await client.get("/metrics")).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
        assert samples[("specula_adapter_load_duration_count", (("adapter", "a"),))] == 1
        # A load that failed never gives its client-chosen id a label.
        assert samples[("specula_adapter_load_failure_total", (("adapter", "other"), ("status", "424")))] == 1
        assert "bad" not in text
        assert samples[("specula_adapter_offload_total", (("adapter", "a"),))] == 1
        assert samples[("specula_adapter_active", ())] == 1
        # Labels exist from the load on: the first request of each adapter arrived before it, as `other`.
        assert samples[("specula_request_count_total", (("adapter", "b"),))] == 1
        assert samples[("specula_request_count_total", (("adapter", "other"),))] == 3
        assert samples[("specula_request_success_total", (("adapter", "a"),))] == 1
        assert samples[("specula_request_success_total", (("adapter", "b"),))] == 2
        assert samples[("specula_request_failure_total", (("adapter", "other"), ("err", "generation")))] == 1

    call(make_state(tokenizer, max_active_adapters=1, adapters={"bad": AdapterBehaviour(error="no such adapter")}),
         fn)


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


def test_stream_events_carry_tgi_index_and_input_length(tokenizer):
    async def fn(client):
        body = {"inputs": "hello", "parameters": {"max_new_tokens": 3, "details": True}}
        stream = sse_events(await client.post("/generate_stream", json=body))
        compat = sse_events(await client.post("/", json={**body, "stream": True}))
        ping = await client.get("/ping")
        return stream, compat, ping

    stream, compat, ping = call(make_state(tokenizer), fn)
    prompt_tokens = len(tokenizer.encode("hello").ids)
    for events in (stream, compat):
        assert [e["index"] for e in events] == [1, 2, 3]  # 1-based, as TGI
        details = events[-1]["details"]
        assert details["input_length"] == details["prompt_tokens"] == prompt_tokens
        assert all(e["details"] is None for e in events[:-1])
    assert ping.status_code == 200 and ping.text == ""  # TGI's alias of /health


def test_get_root_is_health_and_invocations_dispatches_by_body(tokenizer):
    """TGI's GET / (health) and SageMaker's /invocations: a TGI body goes to the compat route, a completions body
    (`prompt`) to /v1/completions."""
    async def fn(client):
        assert (await client.get("/")).status_code == 200
        r = await client.post("/invocations", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 200 and r.json()[0]["generated_text"] == "t0 t1 "
        r = await client.post("/invocations", json={"prompt": "hi", "max_tokens": 2, "model": "fake"})
        assert r.status_code == 200 and r.json()["object"] == "text_completion"
        assert r.json()["choices"][0]["text"] == "t0 t1 "
        r = await client.post("/invocations", json={"inputs": "", "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 422  # refused as the route it went to refuses it

    call(make_state(tokenizer), fn)


def test_a_waiting_stream_sends_keep_alive_comments(tokenizer, monkeypatch):
    """A stream whose next token is slow to come sends SSE comments meanwhile (proxies cut idle connections);
    clients skip them, so the events are unchanged."""
    from specula_router import responses

    monkeypatch.setattr(responses, "KEEPALIVE_S", 0.01)

    async def fn(client):
        r = await client.post("/generate_stream", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 200
        assert ": keep-alive\n\n" in r.text
        assert [e["token"]["text"] for e in sse_events(r)] == ["t0 ", "t1 "]

    call(make_state(tokenizer, step_delay=0.05), fn)
