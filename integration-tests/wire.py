"""Small readers of the HTTP API's wire formats for the integration tests: SSE events and Prometheus metrics.

Kept strict on purpose: `sse_events` fails on anything that is not a `data:{json}` event followed by a blank
line, so the tests check the exact framing the published clients rely on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

REQUEST_TIMEOUT_S = 60.0
# Parameters of a request that stays in flight for seconds on the tiny model (about 3 ms a token on 2 cores).
LONG_GENERATION = {"max_new_tokens": 1500, "ignore_eos_token": True}
T = TypeVar("T")


def sse_events(body: str) -> list[dict]:
    """The JSON payloads of an SSE body made only of `data:{...}\\n\\n` events."""
    assert body.endswith("\n\n"), f"SSE body must end with a blank line: {body[-80:]!r}"
    events = []
    for chunk in body[:-2].split("\n\n"):
        assert chunk.startswith("data:") and "\n" not in chunk, f"not one `data:` line: {chunk!r}"
        events.append(json.loads(chunk[len("data:"):]))
    return events


def metric_samples(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics parsed: {(sample name, sorted labels): value}."""
    r = httpx.get(f"{base_url}/metrics", timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200, r.text
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def metric(base_url: str, name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels` (0 when there are none)."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in metric_samples(base_url).items() if n == name and wanted <= set(ls))


def wait_until(check: Callable[[], T], timeout: float = 30.0, what: str = "condition", interval: float = 0.1) -> T:
    """Polls `check` until it returns something truthy, and returns that; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: T = check()
    while not last:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")
        time.sleep(interval)
        last = check()
    return last


def wait_idle(base_url: str, timeout: float = 30.0) -> None:
    """Waits until the server holds no request: empty running batch, no KV reserved, empty queue."""
    def idle() -> bool:
        return (metric(base_url, "specula_batch_current_size") == 0
                and metric(base_url, "specula_batch_current_max_tokens") == 0
                and metric(base_url, "specula_queue_size") == 0)

    wait_until(idle, timeout, "the server to be idle")


def generate(base_url: str, inputs: str, path: str = "/generate", **parameters) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json={"inputs": inputs, "parameters": parameters},
                      timeout=REQUEST_TIMEOUT_S)


def generate_stream(base_url: str, inputs: str, **parameters) -> tuple[httpx.Response, list[dict]]:
    r = httpx.post(f"{base_url}/generate_stream", json={"inputs": inputs, "parameters": parameters},
                   timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r, sse_events(r.text)
