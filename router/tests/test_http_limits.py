"""The HTTP API's limits over a fake worker: numbers the wire types cannot hold, bodies that cannot be parsed,
/tokenize's input limits, JSON without NaN, bounded metrics labels, and /health answering during slow work."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time

import pytest
import tokenizers
from fake_worker import AdapterBehaviour, FakeClient
from test_http import call, sse_events

from specula_router.adapters import AdapterManager
from specula_router.block_allocator import BlockAllocator
from specula_router.entries import TokenOut
from specula_router.metrics import Metrics
from specula_router.scheduler import Scheduler, SchedulerConfig
from specula_router.server import RouterState
from specula_router.validation import Validator
from specula_router.validation_limits import ValidationLimits
from specula_testing.tokenizer import build_tokenizer

LIMITS = ValidationLimits(max_input_tokens=100, max_total_tokens=200, max_speculative_tokens=2)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))


def build_state(tokenizer, client: FakeClient | None = None, max_concurrent: int = 8, validation_workers: int = 2,
                max_adapter_labels: int = 32, info: dict | None = None) -> RouterState:
    metrics = Metrics(max_adapter_labels=max_adapter_labels)
    client = client or FakeClient()
    scheduler = Scheduler(client, BlockAllocator(256, 16), SchedulerConfig(max_batch_prefill_tokens=512), metrics,
                          AdapterManager(client, metrics, 8))
    validator = Validator(tokenizer, LIMITS, rng=random.Random(0))
    info = info or {"model_id": "fake", "max_total_tokens": 200, "speculation": {"method": "none"}}
    return RouterState(scheduler, validator, client, metrics, info, max_concurrent, "cpu",
                       validation_workers=validation_workers)


def generate(parameters: dict, inputs: str = "x") -> dict:
    return {"inputs": inputs, "parameters": parameters}


# -- numbers the workers' types cannot hold --------------------------------------------------------------


@pytest.mark.parametrize(("parameters", "field", "limit"), [
    ({"top_k": 4294967296}, "top_k", "at most the vocabulary size (512)"),  # once crashed the batching loop
    ({"top_k": 513}, "top_k", "at most the vocabulary size (512)"),
    ({"temperature": 1e-50}, "temperature", "[1.1754944e-38, 3.4028235e+38] as a float32"),
    ({"temperature": 1e39}, "temperature", "[1.1754944e-38, 3.4028235e+38] as a float32"),
    ({"repetition_penalty": 1e39}, "repetition_penalty", "[1.1754944e-38, 3.4028235e+38] as a float32"),
    ({"top_p": 1e-50}, "top_p", "[1.1754944e-38, 1] as a float32"),
    ({"typical_p": 0.99999999}, "typical_p", "[1.1754944e-38, 0.99999994] as a float32"),
    ({"max_new_tokens": 2**40}, "max_new_tokens", "must be <= 200"),
    ({"seed": 2**64}, "seed", f"<= {2**64 - 1}"),
])
def test_numbers_past_the_wire_types_are_422_and_the_server_keeps_serving(tokenizer, parameters, field, limit):
    async def fn(client):
        r = await client.post("/generate", json=generate(parameters))
        assert r.status_code == 422 and r.json()["error_type"] == "validation"
        assert f"`{field}`" in r.json()["error"] and limit in r.json()["error"], r.json()
        ok = await client.post("/generate", json=generate({"max_new_tokens": 1}))
        assert ok.status_code == 200

    call(build_state(tokenizer), fn)


# -- bodies that cannot be parsed, routes that do not exist ------------------------------------------------


@pytest.mark.parametrize(("body", "message"), [
    (b'{"inputs": "\xff\xfe"}', "the body is not valid UTF-8"),
    (b"[" * 5000 + b"]" * 5000, "the body is nested too deeply"),
    (b'{"inputs": "x", "parameters": {"top_k": ' + b"9" * 5000 + b"}}", "an integer with more than"),
    (b"{not json", "the body is not valid JSON"),
    (b'{"inputs": "a\\ud800b"}',
     "`inputs`: Value error, must be valid Unicode: lone surrogate '\\ud800' at character 1"),
    # /tokenize ignores `stop`; the other routes would have sent it to the workers as a protobuf string.
    (b'{"inputs": "a", "parameters": {"stop": ["\\udfff"]}}', "`parameters.stop`: Value error, must be valid Unicode"),
])
def test_unparsable_bodies_are_422_error_responses(tokenizer, body, message):
    state = build_state(tokenizer)

    async def fn(client):
        for path in ("/generate", "/", "/tokenize")[:2 if b"stop" in body else 3]:
            r = await client.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 422, (path, r.text)
            assert set(r.json()) == {"error", "error_type"} and r.json()["error_type"] == "validation"
            assert message in r.json()["error"], r.json()

    call(state, fn)
    assert state.client.calls == []  # nothing reached the workers


def test_unknown_routes_and_methods_are_error_responses(tokenizer):
    async def fn(client):
        r = await client.get("/nope")
        assert r.status_code == 404 and r.json() == {"error": "Not Found: GET /nope", "error_type": "not_found"}
        r = await client.get("/generate")
        assert r.status_code == 405 and r.json()["error_type"] == "method_not_allowed"
        assert r.headers["allow"] == "POST"
        r = await client.delete("/health")
        assert r.status_code == 405 and set(r.json()) == {"error", "error_type"}

    call(build_state(tokenizer), fn)


# -- JSON never carries NaN or Infinity --------------------------------------------------------------------


class NonFiniteLogprobs(FakeClient):
    """The fake worker, answering like the real one for a first prompt token (NaN) and a -inf logprob."""

    def _run(self):
        response = super()._run()
        for i, generation in enumerate(response.generations):
            tokens = [dataclasses.replace(t, logprob=float("-inf")) for t in generation.tokens]
            prefill = None
            if self.generated[generation.request_id] == 1:
                prefill = [TokenOut(1, "<s>", float("nan"), True), TokenOut(5, "x", -1.0, False)]
            response.generations[i] = dataclasses.replace(generation, tokens=tokens, prefill_tokens=prefill)
        return response


def test_non_finite_logprobs_are_null(tokenizer):
    async def fn(client):
        r = await client.post("/generate", json=generate({"max_new_tokens": 2, "details": True,
                                                          "decoder_input_details": True}))
        assert r.status_code == 200 and "NaN" not in r.text and "Infinity" not in r.text
        details = r.json()["details"]
        assert [t["logprob"] for t in details["prefill"]] == [None, -1.0]
        assert [t["logprob"] for t in details["tokens"]] == [None, None]
        r = await client.post("/generate_stream", json=generate({"max_new_tokens": 2}))
        assert "NaN" not in r.text and "Infinity" not in r.text
        assert [e["token"]["logprob"] for e in sse_events(r)] == [None, None]

    call(build_state(tokenizer, NonFiniteLogprobs()), fn)


# -- /tokenize ---------------------------------------------------------------------------------------------


def test_tokenize_applies_the_input_limits_and_truncate(tokenizer):
    long_text = "def f(x): return x\n" * 50
    ids = tokenizer.encode(long_text).ids
    assert len(ids) > LIMITS.max_input_tokens

    async def fn(client):
        r = await client.post("/tokenize", json={"inputs": long_text})
        assert r.status_code == 422 and r.json() == {
            "error": f"`inputs` must have at most 100 tokens. Given: {len(ids)}", "error_type": "validation"}
        r = await client.post("/tokenize", json={"inputs": long_text, "parameters": {"truncate": 5, "top_k": 3}})
        assert r.status_code == 200 and [t["id"] for t in r.json()] == ids[-5:]
        r = await client.post("/tokenize", json={"inputs": "def f", "add_special_tokens": False})
        assert [t["id"] for t in r.json()] == tokenizer.encode("def f", add_special_tokens=False).ids
        r = await client.post("/tokenize", json={"inputs": "x", "parameters": {"truncate": 101}})
        assert r.status_code == 422 and "`truncate` must be between 1 and 100" in r.json()["error"]

    call(build_state(tokenizer), fn)


class BlockingTokenizer:
    """A tokenizer whose encoding waits for `release`: a stand-in for a multi-second tokenisation."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.started, self.release = threading.Event(), threading.Event()

    def encode_batch(self, inputs, add_special_tokens=True):
        self.started.set()
        assert self.release.wait(30)
        return self.tokenizer.encode_batch(inputs, add_special_tokens=add_special_tokens)

    def get_vocab_size(self, with_added_tokens=True):
        return self.tokenizer.get_vocab_size(with_added_tokens=with_added_tokens)


def test_health_is_served_while_the_validation_workers_are_busy(tokenizer):
    state = build_state(tokenizer, validation_workers=1)
    blocking = BlockingTokenizer(tokenizer)
    state.validator.tokenizer = blocking

    async def fn(client):
        tokenize = asyncio.create_task(client.post("/tokenize", json={"inputs": "hello"}))
        assert await asyncio.to_thread(blocking.started.wait, 10)
        started = time.monotonic()
        assert (await client.get("/health")).status_code == 200
        assert time.monotonic() - started < 2.0  # generous: the point is that it answers at all
        # The pool is bounded: with its one worker busy, a generate waits for validation rather than running.
        queued = asyncio.create_task(client.post("/generate", json=generate({"max_new_tokens": 1})))
        await asyncio.sleep(0.1)
        assert not tokenize.done() and not queued.done()
        blocking.release.set()
        assert (await tokenize).status_code == 200 and (await queued).status_code == 200

    call(state, fn)


def test_a_long_tokenisation_releases_the_gil(tokenizer):
    """`encode` would hold the GIL (and stall the event loop) for the whole encoding; the validator's does not."""
    validator = Validator(tokenizer, LIMITS)
    text = "hello wörld 🙂 def f(x): return x " * 40_000  # ~1.3 MB, about a second of tokenisation
    gaps, done = [], threading.Event()

    def ticker():
        while not done.is_set():
            before = time.perf_counter()
            time.sleep(0.001)
            gaps.append(time.perf_counter() - before)

    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        encoding = validator._encoding(text, add_special_tokens=True)
    finally:
        done.set()
        thread.join()
    assert len(encoding) > LIMITS.max_input_tokens
    assert max(gaps) < 0.5, max(gaps)  # generous: holding the GIL throughout shows as one gap of the full encode


# -- metrics: bounded labels, rendered off the event loop --------------------------------------------------


class MissingAdapters(dict):
    """Every adapter id the fake is asked to load is missing."""

    def get(self, key, default=None):
        return AdapterBehaviour(error=f"adapter `{key}`: repository not found")


def test_client_chosen_adapter_ids_never_become_metric_labels(tokenizer):
    client = FakeClient()
    client.adapters = MissingAdapters()
    state = build_state(tokenizer, client, max_concurrent=256)

    async def send(http, adapter_ids):
        async def one(adapter_id):
            body = generate({"adapter_id": adapter_id, "max_new_tokens": 1})
            return (await http.post("/generate", json=body)).status_code

        for start in range(0, len(adapter_ids), 100):
            statuses = await asyncio.gather(*(one(a) for a in adapter_ids[start:start + 100]))
            assert set(statuses) <= {422, 424}, statuses

    async def fn(http):
        await http.post("/generate", json=generate({"max_new_tokens": 1}))
        await send(http, ["org/missing-0", "org/\u0007bad-0"])  # the first failures create the `other` series
        before = len((await http.get("/metrics")).content)
        # 2,000 distinct ids: 1,800 that fail to load, 200 that fail validation (a control character).
        ids = [f"org/private-repo-{i}" if i % 10 else f"org/\u0007bad-{i}" for i in range(1, 2001)]
        await send(http, ids)
        scrape = asyncio.create_task(http.get("/metrics"))
        started = time.monotonic()
        health = await http.get("/health")  # while that scrape renders
        health_s = time.monotonic() - started
        return before, (await scrape).text, health.status_code, health_s

    before, text, health_status, health_s = call(state, fn)
    assert health_status == 200 and health_s < 1.0  # generous: 4.6 s at p50 before labels were bounded
    assert len(client.adapter_calls) >= 1800  # every well-formed id was tried
    assert len(text.encode()) - before < 2_000, (before, len(text))  # the counts grew, not the series
    assert "private-repo" not in text and "bad-" not in text
    assert 'specula_request_failure_total{adapter="other",err="generation"} 1801.0' in text


def test_adapters_get_labels_once_loaded_up_to_the_cap(tokenizer):
    async def fn(client):
        for adapter_id in ("org/a", "org/b", "org/c"):
            for _ in range(2):
                r = await client.post("/generate", json=generate({"adapter_id": adapter_id, "max_new_tokens": 1}))
                assert r.status_code == 200
        return (await client.get("/metrics")).text

    state = build_state(tokenizer, max_adapter_labels=2)
    text = call(state, fn)
    assert 'specula_request_success_total{adapter="org/a"} 2.0' in text
    assert 'specula_request_success_total{adapter="org/b"} 2.0' in text
    assert 'specula_request_success_total{adapter="other"} 2.0' in text and "org/c" not in text


def test_health_is_served_while_metrics_render(tokenizer):
    state = build_state(tokenizer)
    rendering, release = threading.Event(), threading.Event()
    render = state.metrics.render

    def slow_render():
        rendering.set()
        assert release.wait(30)
        return render()

    state.metrics.render = slow_render

    async def fn(client):
        scrapes = [asyncio.create_task(client.get("/metrics")) for _ in range(3)]
        assert await asyncio.to_thread(rendering.wait, 10)
        started = time.monotonic()
        assert (await client.get("/health")).status_code == 200
        assert time.monotonic() - started < 2.0  # generous: the render is still blocked
        assert not any(s.done() for s in scrapes)
        release.set()
        bodies = [(await s).text for s in scrapes]
        assert all("specula_request_count" in b for b in bodies) and len(set(bodies)) == 1  # one shared render

    call(state, fn)
