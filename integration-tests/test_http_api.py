"""The HTTP API of the real stack (launcher → shard → router), spoken to with raw httpx.

What `router/tests/test_http.py` checks over a fake worker is checked here against a real model: every route,
the SSE framing, every error status, the timing headers, the metrics moving, and the generation semantics that
need real tokens (max_new_tokens, stop sequences, truncate, greedy determinism under continuous batching).
"""

from __future__ import annotations

import concurrent.futures
import json
import math

import httpx
import pytest
from stack import MAX_BATCH_SIZE, MAX_POSITIONS, PAYLOAD_LIMIT
from wire import (
    LONG_GENERATION,
    REQUEST_TIMEOUT_S,
    generate,
    generate_stream,
    metric,
    metric_samples,
    sse_events,
    wait_idle,
)

PROMPT = "The quick brown fox"


def ok_json(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def tokenize(base_url: str, inputs: str) -> list[dict]:
    return ok_json(httpx.post(f"{base_url}/tokenize", json={"inputs": inputs}, timeout=REQUEST_TIMEOUT_S))


# --- informational routes ------------------------------------------------------------------------------------


def test_health_is_200_with_an_empty_body(base_url):
    r = httpx.get(f"{base_url}/health", timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200 and r.content == b""


def test_info_reports_model_limits_and_speculation(server, model_dir):
    info = ok_json(httpx.get(f"{server.url}/info", timeout=REQUEST_TIMEOUT_S))
    assert info["model_id"] == str(model_dir)
    assert info["model_dtype"] == "float32" and info["model_device_type"] == "cpu"
    assert info["max_total_tokens"] == MAX_POSITIONS and info["max_input_tokens"] == MAX_POSITIONS - 1
    assert info["max_input_length"] == info["max_input_tokens"]  # TGI's older name
    assert info["max_batch_prefill_tokens"] == MAX_POSITIONS - 1 + 50
    assert info["max_batch_total_tokens"] >= info["max_total_tokens"]
    assert info["max_concurrent_requests"] == 128 and info["max_best_of"] == 2
    assert info["max_stop_sequences"] == 4 and info["max_top_n_tokens"] == 5
    assert info["num_shard"] == 1 and info["block_size"] == 16 and info["max_batch_size"] == MAX_BATCH_SIZE
    assert info["speculation"]["method"] == "none" and info["speculation"]["max_speculative_tokens"] == 0
    assert isinstance(info["version"], str) and info["version"]


def test_info_follows_launcher_flags(overload_server):
    info = ok_json(httpx.get(f"{overload_server.url}/info", timeout=REQUEST_TIMEOUT_S))
    assert info["max_concurrent_requests"] == 1


def test_docs_and_openapi(base_url):
    docs = httpx.get(f"{base_url}/docs", timeout=REQUEST_TIMEOUT_S)
    assert docs.status_code == 200 and "text/html" in docs.headers["content-type"]
    assert "swagger" in docs.text.lower()
    spec = ok_json(httpx.get(f"{base_url}/api-doc/openapi.json", timeout=REQUEST_TIMEOUT_S))
    assert {"/", "/generate", "/generate_stream", "/tokenize", "/health", "/info", "/metrics"} <= set(spec["paths"])
    assert "post" in spec["paths"]["/generate"] and "get" in spec["paths"]["/info"]
    parameters = spec["components"]["schemas"]["GenerateParameters"]["properties"]
    assert {"max_new_tokens", "stop", "truncate", "top_n_tokens", "adapter_id", "decoder_input_details"} \
        <= set(parameters)


def test_tokenize_gives_ids_offsets_and_the_prompt_the_model_sees(base_url):
    inputs = "héllo wörld"
    tokens = tokenize(base_url, inputs)
    assert tokens[0]["special"] and tokens[0]["text"] == "<s>"  # BOS, covering no input text
    encoded = inputs.encode()
    for t in tokens[1:]:
        assert not t["special"] and 0 <= t["start"] < t["stop"] <= len(encoded)
        assert t["text"] == encoded[t["start"]:t["stop"]].decode()
    assert tokens[-1]["stop"] == len(encoded)
    details = ok_json(generate(base_url, inputs, max_new_tokens=1, details=True, decoder_input_details=True))["details"]
    assert details["prompt_tokens"] == len(tokens)
    assert [p["id"] for p in details["prefill"]] == [t["id"] for t in tokens]


# --- generation ----------------------------------------------------------------------------------------------


def test_generate_details_top_tokens_and_headers(base_url):
    r = generate(base_url, PROMPT, max_new_tokens=12, ignore_eos_token=True, details=True,
                 decoder_input_details=True, top_n_tokens=3)
    body = ok_json(r)
    d = body["details"]
    assert d["finish_reason"] == "length" and d["generated_tokens"] == 12 == len(d["tokens"])
    assert d["skipped_tokens"] == 0 and d["seed"] is None  # greedy: no seed
    assert "".join(t["text"] for t in d["tokens"]) == body["generated_text"]
    assert d["prefill"][0]["logprob"] is None
    assert all(p["logprob"] <= 0 for p in d["prefill"][1:])
    assert len(d["top_tokens"]) == 12
    for token, top in zip(d["tokens"], d["top_tokens"]):
        assert len(top) == 3 and [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert top[0]["id"] == token["id"] and math.isclose(top[0]["logprob"], token["logprob"], abs_tol=1e-5)
        assert [a["id"] for a in token["alternative_tokens"]] == [t["id"] for t in top]  # LoRAX's name for them
        assert token["logprob"] <= 0 and not token["skipped"]
    h = r.headers
    assert h["x-prompt-tokens"] == str(d["prompt_tokens"]) and h["x-generated-tokens"] == "12"
    assert h["x-skipped-tokens"] == "0" and h["x-compute-type"] == "cpu"
    for name in ("x-total-time", "x-validation-time", "x-queue-time", "x-inference-time", "x-time-per-token"):
        assert int(h[name]) >= 0, name
    assert int(h["x-total-time"]) >= int(h["x-inference-time"])
    assert float(h["x-compute-time"]) >= 0


def test_without_details_only_the_text_is_returned(base_url):
    body = ok_json(generate(base_url, PROMPT, max_new_tokens=5))
    assert set(body) == {"generated_text"}


def test_return_full_text_prefixes_the_prompt(base_url):
    plain = ok_json(generate(base_url, PROMPT, max_new_tokens=5))["generated_text"]
    full = ok_json(generate(base_url, PROMPT, max_new_tokens=5, return_full_text=True))["generated_text"]
    assert full == PROMPT + plain


@pytest.mark.parametrize("max_new_tokens", [1, 7, 64])
def test_max_new_tokens_is_exact(base_url, max_new_tokens):
    d = ok_json(generate(base_url, PROMPT, max_new_tokens=max_new_tokens, ignore_eos_token=True, details=True))
    assert d["details"]["generated_tokens"] == max_new_tokens == len(d["details"]["tokens"])
    assert d["details"]["finish_reason"] == "length"
    _, events = generate_stream(base_url, PROMPT, max_new_tokens=max_new_tokens, ignore_eos_token=True, details=True)
    assert len(events) == max_new_tokens and events[-1]["details"]["generated_tokens"] == max_new_tokens


def test_default_max_new_tokens_fills_the_context(base_url):
    """Without max_new_tokens a request may run to max_total_tokens (LoRAX's default)."""
    inputs = "word " * 600  # about 1800 of the 2048 positions
    prompt_tokens = len(tokenize(base_url, inputs))
    d = ok_json(generate(base_url, inputs, ignore_eos_token=True, details=True))["details"]
    assert d["finish_reason"] == "length" and d["generated_tokens"] == MAX_POSITIONS - prompt_tokens


def test_stop_sequence_ends_the_text_where_it_ends_even_inside_a_token(base_url):
    full = ok_json(generate(base_url, PROMPT, max_new_tokens=40, ignore_eos_token=True, details=True))
    pieces = [t["text"] for t in full["details"]["tokens"]]
    ids = [t["id"] for t in full["details"]["tokens"]]
    # A two-character stop across the boundary of tokens k-1 and k (k >= 10), first generated there, that ends
    # after the first character of token k's text: the text is cut inside that token.
    for k in range(10, 40):
        stop = pieces[k - 1][-1:] + pieces[k][:1]
        end = len("".join(pieces[:k])) + 1
        if len(stop) == 2 and len(pieces[k]) >= 2 and "".join(pieces).find(stop) + 2 == end:
            break
    else:
        pytest.fail(f"no token to cut in {pieces!r}")
    text = "".join(pieces)[:end]
    d = ok_json(generate(base_url, PROMPT, max_new_tokens=40, ignore_eos_token=True, details=True,
                         stop=["never-generated", stop]))
    assert d["details"]["finish_reason"] == "stop_sequence"
    assert d["generated_text"] == text and text.endswith(stop)
    # Token ids and counts stay whole tokens; only the last token's text is cut.
    tokens = d["details"]["tokens"]
    assert [t["id"] for t in tokens] == ids[: k + 1] and d["details"]["generated_tokens"] == k + 1
    assert tokens[-1]["text"] == pieces[k][:1] and "".join(t["text"] for t in tokens) == text
    _, events = generate_stream(base_url, PROMPT, max_new_tokens=40, ignore_eos_token=True, details=True, stop=stop)
    assert events[-1]["generated_text"] == text and events[-1]["details"]["finish_reason"] == "stop_sequence"
    assert events[-1]["token"]["text"] == pieces[k][:1]
    assert "".join(e["token"]["text"] for e in events) == text


def test_truncate_keeps_the_last_prompt_tokens(base_url):
    inputs = "one two three four five six seven eight nine ten"
    ids = [t["id"] for t in tokenize(base_url, inputs)]
    r = generate(base_url, inputs, max_new_tokens=3, truncate=5, details=True, decoder_input_details=True)
    d = ok_json(r)["details"]
    assert d["prompt_tokens"] == 5 and r.headers["x-prompt-tokens"] == "5"
    assert [p["id"] for p in d["prefill"]] == ids[-5:]
    # A truncate at or above the prompt length changes nothing.
    same = ok_json(generate(base_url, inputs, max_new_tokens=3, truncate=len(ids)))
    assert same["generated_text"] == ok_json(generate(base_url, inputs, max_new_tokens=3))["generated_text"]


def test_seeded_sampling_is_reproducible(base_url):
    params = dict(max_new_tokens=30, do_sample=True, temperature=1.5, seed=1234, details=True)
    a, b = (ok_json(generate(base_url, PROMPT, **params)) for _ in range(2))
    assert a["generated_text"] == b["generated_text"] and a["details"]["seed"] == 1234
    other = ok_json(generate(base_url, PROMPT, **dict(params, seed=4321)))
    assert other["generated_text"] != a["generated_text"] and other["details"]["seed"] == 4321
    unseeded = [ok_json(generate(base_url, PROMPT, **dict(params, seed=None)))["details"]["seed"] for _ in range(2)]
    assert all(isinstance(s, int) for s in unseeded) and unseeded[0] != unseeded[1]


def test_sampling_parameters_reach_the_worker(base_url):
    """Sampling from the single most likely token is greedy; penalties change a repetitive greedy output."""
    inputs = "a" * 50  # the tiny model answers this with a token repeated over and over
    greedy = ok_json(generate(base_url, inputs, max_new_tokens=30, ignore_eos_token=True, details=True))
    greedy_ids = [t["id"] for t in greedy["details"]["tokens"]]
    assert len(set(greedy_ids)) < len(greedy_ids) // 2, "the prompt no longer makes the model repeat itself"
    top1 = ok_json(generate(base_url, inputs, max_new_tokens=30, ignore_eos_token=True, details=True,
                            do_sample=True, top_k=1, seed=5))
    assert [t["id"] for t in top1["details"]["tokens"]] == greedy_ids
    for penalty in ({"repetition_penalty": 3.0}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        penalized = ok_json(generate(base_url, inputs, max_new_tokens=30, ignore_eos_token=True, **penalty))
        assert penalized["generated_text"] != greedy["generated_text"], penalty


def test_best_of_returns_the_most_likely_of_several_samples(base_url):
    d = ok_json(generate(base_url, PROMPT, max_new_tokens=10, ignore_eos_token=True, details=True,
                         best_of=2, do_sample=True))["details"]
    (other,) = d["best_of_sequences"]
    assert other["generated_tokens"] == len(other["tokens"]) == 10 == d["generated_tokens"]
    assert other["seed"] != d["seed"]
    assert sum(t["logprob"] for t in d["tokens"]) >= sum(t["logprob"] for t in other["tokens"])


def test_outputs_do_not_depend_on_the_rest_of_the_batch(base_url):
    """Continuous batching changes nothing: a request alone and inside a burst of others gives the same tokens.

    Greedy and seeded-sampling requests of different prompt and output lengths run first one at a time, then
    all at once: they prefill together, join a running batch and leave it at different steps, and those beyond
    --max-batch-size wait in the queue for a free row.
    """
    requests = [
        {"inputs": f"{word} " * (1 + i % 5) + PROMPT, "parameters": {
            "max_new_tokens": 8 + 7 * i, "ignore_eos_token": True, "details": True,
            **({"do_sample": True, "seed": i, "top_k": 20} if i % 3 == 2 else {})}}
        for i, word in enumerate(["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta",
                                  "iota", "kappa", "lambda", "mu"])
    ]
    wait_idle(base_url)

    def run(request: dict) -> list[int]:
        body = ok_json(httpx.post(f"{base_url}/generate", json=request, timeout=REQUEST_TIMEOUT_S))
        return [t["id"] for t in body["details"]["tokens"]]

    alone = [run(r) for r in requests]
    prefills, joins = metric(base_url, "specula_batch_next_size_count"), metric(base_url, "specula_batch_concat_total")
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(run, requests))
    # They did share the batch: fewer prefills than requests, or newcomers joined a running batch.
    assert (metric(base_url, "specula_batch_next_size_count") - prefills < len(requests)
            or metric(base_url, "specula_batch_concat_total") > joins)
    for request, a, t in zip(requests, alone, together):
        assert a == t, f"{request['inputs']!r} differs inside a batch"


# --- streaming -----------------------------------------------------------------------------------------------


def test_stream_is_one_sse_event_per_token_ending_with_text_and_details(base_url):
    r = httpx.post(f"{base_url}/generate_stream", timeout=REQUEST_TIMEOUT_S, json={
        "inputs": PROMPT, "parameters": {"max_new_tokens": 20, "ignore_eos_token": True, "details": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)  # asserts the exact `data:{json}\n\n` framing
    assert len(events) == 20
    for e in events[:-1]:
        assert e["generated_text"] is None and e["details"] is None and set(e["token"]) >= {"id", "text", "logprob",
                                                                                           "special"}
    last = events[-1]
    details = dict(last["details"])
    assert 0 <= details.pop("cached_tokens") < details["prompt_tokens"]  # the same prompt may have run before
    assert details.pop("input_length") == details["prompt_tokens"]  # TGI's name for it
    assert details == {"finish_reason": "length", "prompt_tokens": len(tokenize(base_url, PROMPT)),
                       "generated_tokens": 20, "seed": None}
    assert "".join(e["token"]["text"] for e in events) == last["generated_text"]
    plain = ok_json(generate(base_url, PROMPT, max_new_tokens=20, ignore_eos_token=True, details=True))
    assert [e["token"]["id"] for e in events] == [t["id"] for t in plain["details"]["tokens"]]
    assert last["generated_text"] == plain["generated_text"]


def test_stream_without_details_and_with_top_tokens(base_url):
    _, events = generate_stream(base_url, PROMPT, max_new_tokens=4, top_n_tokens=2)
    assert events[-1]["details"] is None and isinstance(events[-1]["generated_text"], str)
    assert all(len(e["top_tokens"]) == 2 and e["top_tokens"][0]["id"] == e["token"]["id"] for e in events)


def test_compat_route_answers_an_array_or_a_stream(base_url):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 6, "details": True}}
    r = httpx.post(f"{base_url}/", json={**body, "stream": False}, timeout=REQUEST_TIMEOUT_S)
    array = ok_json(r)
    assert isinstance(array, list) and len(array) == 1
    assert array[0] == ok_json(httpx.post(f"{base_url}/generate", json=body, timeout=REQUEST_TIMEOUT_S))
    assert r.headers["x-generated-tokens"] == str(array[0]["details"]["generated_tokens"])
    s = httpx.post(f"{base_url}/", json={**body, "stream": True}, timeout=REQUEST_TIMEOUT_S)
    assert s.headers["content-type"].startswith("text/event-stream")
    events = sse_events(s.text)
    assert events[-1]["generated_text"] == array[0]["generated_text"]
    assert [e["token"]["id"] for e in events] == [t["id"] for t in array[0]["details"]["tokens"]]


# --- errors --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("parameters,field", [
    ({"temperature": -1}, "temperature"),
    ({"temperature": 0.0}, "temperature"),
    ({"top_k": 0}, "top_k"),
    ({"top_p": 1.5}, "top_p"),
    ({"typical_p": 1.0}, "typical_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"frequency_penalty": 3.0}, "frequency_penalty"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": MAX_POSITIONS}, "max_new_tokens"),
    ({"top_n_tokens": 6}, "top_n_tokens"),
    ({"return_k_alternatives": 6}, "return_k_alternatives"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"truncate": 0}, "truncate"),
    ({"truncate": MAX_POSITIONS}, "truncate"),
    ({"seed": 2**64}, "seed"),
    ({"best_of": 2}, "best_of"),
    ({"best_of": 2, "do_sample": True, "seed": 1}, "seed"),
    ({"grammar": {"type": "json", "value": {"type": "foo"}}}, "grammar"),
    ({"temperature": "0.5"}, "parameters.temperature"),
    ({"max_new_tokens": 2.5}, "parameters.max_new_tokens"),
])
def test_invalid_parameters_are_422_naming_the_field(base_url, parameters, field):
    r = generate(base_url, PROMPT, **parameters)
    assert r.status_code == 422, r.text
    assert r.json()["error_type"] == "validation" and field in r.json()["error"], r.json()


@pytest.mark.parametrize("body,field", [
    ({"inputs": ""}, "inputs"),
    ({"parameters": {}}, "inputs"),
    ({"inputs": "word " * MAX_POSITIONS}, "inputs"),
])
def test_invalid_inputs_are_422(base_url, body, field):
    r = httpx.post(f"{base_url}/generate", json=body, timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 422 and r.json()["error_type"] == "validation" and field in r.json()["error"]


def test_stream_validation_errors_are_422_not_an_event_stream(base_url):
    for parameters, field in (({"decoder_input_details": True}, "decoder_input_details"),
                              ({"best_of": 2, "do_sample": True}, "best_of"), ({"top_p": 0}, "top_p")):
        r = httpx.post(f"{base_url}/generate_stream", json={"inputs": PROMPT, "parameters": parameters},
                       timeout=REQUEST_TIMEOUT_S)
        assert r.status_code == 422 and field in r.json()["error"], r.text


def test_malformed_json_is_422_and_counted(base_url):
    before = metric(base_url, "specula_request_failure_total", err="validation")
    r = httpx.post(f"{base_url}/generate", content=b"{not json", headers={"content-type": "application/json"},
                   timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    assert metric(base_url, "specula_request_failure_total", err="validation") == before + 1


def test_body_over_the_payload_limit_is_413(base_url):
    big = {"inputs": "x" * (PAYLOAD_LIMIT + 1), "parameters": {"max_new_tokens": 1}}
    r = httpx.post(f"{base_url}/generate", json=big, timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 413 and r.json()["error_type"] == "payload_limit"
    small = {"inputs": "x" * 100, "parameters": {"max_new_tokens": 1}}
    assert httpx.post(f"{base_url}/generate", json=small, timeout=REQUEST_TIMEOUT_S).status_code == 200


def test_chunked_body_over_the_payload_limit_is_413(base_url):
    data = json.dumps({"inputs": "x" * (PAYLOAD_LIMIT + 1), "parameters": {"max_new_tokens": 1}}).encode()

    def chunks():  # no Content-Length: the limit must be enforced while the body arrives
        for i in range(0, len(data), 4096):
            yield data[i:i + 4096]

    r = httpx.post(f"{base_url}/generate", content=chunks(), headers={"content-type": "application/json"},
                   timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 413 and r.json()["error_type"] == "payload_limit"


@pytest.mark.parametrize("path,stream", [("/generate", None), ("/generate_stream", None), ("/", False), ("/", True)])
def test_a_hub_adapter_that_cannot_be_fetched_is_424(base_url, path, stream):
    body = {"inputs": PROMPT, "parameters": {"adapter_id": "org/some-lora", "max_new_tokens": 2}}
    if stream is not None:
        body["stream"] = stream
    r = httpx.post(f"{base_url}{path}", json=body, timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 424 and r.json()["error_type"] == "generation" and "org/some-lora" in r.json()["error"]
    # An empty adapter id is LoRAX's way of asking for the base model.
    body["parameters"]["adapter_id"] = ""
    assert httpx.post(f"{base_url}{path}", json=body, timeout=REQUEST_TIMEOUT_S).status_code == 200


def test_over_max_concurrent_requests_is_429_at_once(overload_server):
    url = overload_server.url
    wait_idle(url)
    overloaded = metric(url, "specula_request_failure_total", err="overloaded")
    long_request = {"inputs": PROMPT, "parameters": LONG_GENERATION}
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        with client.stream("POST", f"{url}/generate_stream", json=long_request) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()  # kept: dropping the iterator would close the connection
            assert next(lines).startswith("data:")  # the first token arrived: the request is in flight
            for path in ("/generate", "/generate_stream", "/"):
                r = httpx.post(f"{url}{path}", json={"inputs": "hi", "parameters": {"max_new_tokens": 1}},
                               timeout=REQUEST_TIMEOUT_S)
                assert r.status_code == 429, r.text
                assert r.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
    assert metric(url, "specula_request_failure_total", err="overloaded") == overloaded + 3
    wait_idle(url)  # the disconnected stream is dropped, freeing the one slot
    assert generate(url, "hi", max_new_tokens=1).status_code == 200


# --- metrics -------------------------------------------------------------------------------------------------


def test_metrics_exist_and_count_requests(base_url):
    wait_idle(base_url)
    names = ("specula_request_count", "specula_request_success", "specula_request_time_to_first_token",
             "specula_request_inter_token_latency", "specula_batch_inference_duration",
             "specula_request_generated_tokens", "specula_request_input_length", "specula_queue_size",
             "specula_batch_current_size", "specula_batch_current_max_tokens", "specula_request_duration")
    samples = {n for n, _ in metric_samples(base_url)}
    for name in names:
        assert any(s == name or s.startswith(name + "_") for s in samples), name

    def snapshot() -> dict[str, float]:
        return {
            "count": metric(base_url, "specula_request_count_total"),
            "success": metric(base_url, "specula_request_success_total"),
            "ttft": metric(base_url, "specula_request_time_to_first_token_count"),
            "itl": metric(base_url, "specula_request_inter_token_latency_count"),
            "prefill": metric(base_url, "specula_batch_inference_duration_count", method="prefill"),
            "decode": metric(base_url, "specula_batch_inference_duration_count", method="decode"),
            "generated": metric(base_url, "specula_request_generated_tokens_sum"),
            "input_length": metric(base_url, "specula_request_input_length_sum"),
        }

    before = snapshot()
    num_tokens = 5
    ok_json(generate(base_url, PROMPT, max_new_tokens=num_tokens, ignore_eos_token=True))
    generate_stream(base_url, PROMPT, max_new_tokens=num_tokens, ignore_eos_token=True)
    after = snapshot()
    prompt_tokens = len(tokenize(base_url, PROMPT))
    assert after["count"] == before["count"] + 2 and after["success"] == before["success"] + 2
    assert after["ttft"] == before["ttft"] + 2
    assert after["itl"] == before["itl"] + 2 * (num_tokens - 1)  # one gap per token after the first
    assert after["prefill"] >= before["prefill"] + 1 and after["decode"] >= before["decode"] + num_tokens - 1
    assert after["generated"] == before["generated"] + 2 * num_tokens
    assert after["input_length"] == before["input_length"] + 2 * prompt_tokens
    wait_idle(base_url)
