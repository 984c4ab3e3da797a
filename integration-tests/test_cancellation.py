"""Clients that go away: the request is dropped, its KV blocks come back, and the server keeps serving.

The router notices a disconnect, marks the request cancelled, lists it as finished in the next step it sends,
and frees its KV blocks. Observed from outside through /metrics: `specula_request_failure{err="cancelled"}`
counts dropped requests and `specula_batch_current_max_tokens` is the KV held by running requests, which must
return to 0 once nothing runs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib

import httpx
import pytest
from stack import MAX_BATCH_SIZE
from wire import LONG_GENERATION, REQUEST_TIMEOUT_S, generate, metric, wait_idle, wait_until

PROMPT = "Once upon a time"


def cancelled(base_url: str) -> float:
    return metric(base_url, "specula_request_failure_total", err="cancelled")


def succeeded(base_url: str) -> float:
    return metric(base_url, "specula_request_success_total")


def stream_then_disconnect(base_url: str, inputs: str, num_events: int, path: str = "/generate_stream") -> None:
    """Starts a long stream, reads `num_events` events, then closes the connection."""
    body = {"inputs": inputs, "parameters": LONG_GENERATION}
    if path == "/":
        body["stream"] = True
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        with client.stream("POST", f"{base_url}{path}", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            read = 0
            while read < num_events:
                read += next(lines).startswith("data:")


def greedy_text(base_url: str) -> str:
    r = generate(base_url, PROMPT, max_new_tokens=24, ignore_eos_token=True)
    assert r.status_code == 200, r.text
    return r.json()["generated_text"]


@pytest.mark.parametrize("path", ["/generate_stream", "/"])
def test_stream_disconnect_drops_the_request(base_url, path):
    wait_idle(base_url)
    reference = greedy_text(base_url)
    before_cancelled, before_success = cancelled(base_url), succeeded(base_url)

    stream_then_disconnect(base_url, PROMPT, num_events=3, path=path)

    wait_until(lambda: cancelled(base_url) == before_cancelled + 1, what="the request to be cancelled")
    wait_idle(base_url)
    assert succeeded(base_url) == before_success  # dropped, not run to the end
    assert greedy_text(base_url) == reference  # and the server keeps serving, unchanged


def test_burst_of_disconnects_leaks_nothing(base_url):
    """Many clients leave at different points of their streams, while other requests run to completion."""
    wait_idle(base_url)
    reference = greedy_text(base_url)
    before = cancelled(base_url)
    num_streams = 16

    def leave(i: int) -> None:
        stream_then_disconnect(base_url, f"story {i}: {PROMPT}", num_events=1 + i % 4)

    with concurrent.futures.ThreadPoolExecutor(num_streams + 2) as pool:
        finishing = [pool.submit(greedy_text, base_url) for _ in range(2)]
        for future in [pool.submit(leave, i) for i in range(num_streams)]:
            future.result(timeout=REQUEST_TIMEOUT_S)
        assert [f.result(timeout=REQUEST_TIMEOUT_S) for f in finishing] == [reference, reference]

    wait_until(lambda: cancelled(base_url) == before + num_streams, what="every stream to be cancelled")
    wait_idle(base_url)  # no KV blocks (batch_current_max_tokens), running or queued requests left behind
    assert metric(base_url, "specula_kv_blocks_used") == 0
    assert metric(base_url, "specula_kv_blocks_free") == metric(base_url, "specula_kv_blocks_capacity") > 0
    assert greedy_text(base_url) == reference


def test_non_streaming_disconnect_drops_the_request(base_url):
    wait_idle(base_url)
    before_cancelled, before_success = cancelled(base_url), succeeded(base_url)
    with pytest.raises(httpx.TimeoutException):  # the client gives up long before 1500 tokens are generated
        httpx.post(f"{base_url}/generate", json={"inputs": PROMPT, "parameters": LONG_GENERATION}, timeout=0.5)
    wait_until(lambda: cancelled(base_url) + succeeded(base_url) > before_cancelled + before_success,
               what="the request to end")
    assert (cancelled(base_url), succeeded(base_url)) == (before_cancelled + 1, before_success)


def leave_from_the_queue(base_url: str) -> dict[str, float]:
    """Fills the batch (--max-batch-size) with long streams, queues one more and disconnects it while it waits,
    then the others; returns how much the request counters moved."""
    wait_idle(base_url)
    names = {"count": "specula_request_count_total", "success": "specula_request_success_total"}
    before = {key: metric(base_url, name) for key, name in names.items()} | {"cancelled": cancelled(base_url)}
    body = {"inputs": PROMPT, "parameters": LONG_GENERATION}
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client, contextlib.ExitStack() as running:
        for _ in range(MAX_BATCH_SIZE):
            lines = running.enter_context(client.stream("POST", f"{base_url}/generate_stream", json=body)).iter_lines()
            running.callback(lines.close)
            assert next(lines).startswith("data:")
        with client.stream("POST", f"{base_url}/generate_stream", json=body) as queued:
            assert queued.status_code == 200
            wait_until(lambda: metric(base_url, "specula_queue_size") == 1, what="the newcomer to be queued")
        wait_until(lambda: metric(base_url, "specula_queue_size") == 0, what="the queue to be emptied")
        assert metric(base_url, "specula_batch_current_size") == MAX_BATCH_SIZE  # the others still run
    wait_idle(base_url)
    after = {key: metric(base_url, name) for key, name in names.items()} | {"cancelled": cancelled(base_url)}
    return {key: after[key] - before[key] for key in after}


def test_disconnect_while_queued_removes_the_request_before_it_runs(base_url):
    moved = leave_from_the_queue(base_url)
    assert moved["count"] == MAX_BATCH_SIZE + 1 and moved["success"] == 0


def test_a_request_dropped_from_the_queue_is_counted(base_url):
    moved = leave_from_the_queue(base_url)
    assert moved["cancelled"] == MAX_BATCH_SIZE + 1
