"""The engine under KV pressure, through the whole stack: blocks grow with the sequences, requests are preempted
when they run out, and nobody notices but the clock.

`tight` is served with a KV cache of 40 blocks of 16 tokens (512 bytes of KV per token on the tiny model):
room for two requests of its whole 256-token budget, or for every request's prompt and the first part of its
answer. Reserving whole budgets would run two requests at a time; growing blocks runs all of them and preempts
(and later recomputes) the newest when the blocks run out. It runs one decode step per call
(`--num-scheduler-steps 1`): the answers are still those of `base_url`, which runs up to 4 (the default).
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import httpx
import pytest
from wire import REQUEST_TIMEOUT_S, generate, metric

KV_BLOCKS = 40
KV_BYTES = KV_BLOCKS * 16 * 512
PROMPTS = [f"Request {i}: the quick brown fox jumps over the lazy dog {i * 7}" for i in range(8)]


@pytest.fixture(scope="module")
def tight(model_dir, tmp_path_factory):
    from conftest import _start, _stop

    launcher = _start(model_dir, tmp_path_factory.mktemp("tight"),
                      ["--kv-cache-memory", str(KV_BYTES), "--max-total-tokens", "256", "--max-input-tokens", "64",
                       "--max-batch-prefill-tokens", "512", "--num-scheduler-steps", "1"], "tight")
    yield launcher
    _stop(launcher)


def ids_and_text(response: httpx.Response) -> tuple[list[int], str]:
    assert response.status_code == 200, response.text
    body = response.json()
    return [t["id"] for t in body["details"]["tokens"]], body["generated_text"]


def test_more_requests_than_blocks_all_complete_with_their_solo_outputs(base_url, tight):
    solo = [ids_and_text(generate(base_url, p, max_new_tokens=180, ignore_eos_token=True, details=True))
            for p in PROMPTS]
    preempted_before = metric(tight.url, "specula_request_preemptions_total")
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: ids_and_text(generate(tight.url, p, max_new_tokens=180, ignore_eos_token=True,
                                                            details=True)), PROMPTS))
    assert got == solo
    # 8 requests of up to 16 blocks in 40 blocks: some were preempted and recomputed.
    assert metric(tight.url, "specula_request_preemptions_total") > preempted_before


def test_a_preempted_stream_has_every_token_once(base_url, tight):
    """Streams under preemption: each token event arrives once, in order, and the events add up to the answer."""
    expected = [ids_and_text(generate(base_url, p, max_new_tokens=180, ignore_eos_token=True, details=True))
                for p in PROMPTS]

    def stream(prompt: str) -> tuple[list[int], str, list[int]]:
        with httpx.stream("POST", f"{tight.url}/generate_stream", timeout=REQUEST_TIMEOUT_S, json={
                "inputs": prompt, "parameters": {"max_new_tokens": 180, "ignore_eos_token": True}}) as r:
            events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
        ids = [e["token"]["id"] for e in events]
        return ids, "".join(e["token"]["text"] for e in events), [e["index"] for e in events]

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        streamed = list(pool.map(stream, PROMPTS))
    for (ids, text, indexes), (want_ids, want_text) in zip(streamed, expected, strict=True):
        assert ids == want_ids and text == want_text
        assert indexes == list(range(1, len(want_ids) + 1))


def test_requests_with_large_budgets_that_stop_early_run_together(base_url, tight):
    """Six requests whose budget (190 new tokens, 13 blocks each) would fill the cache three times over, but that
    stop after about 60 tokens: more than three hold blocks at once. Reserving whole budgets ran three at most
    (40 blocks / 13)."""
    stops = []
    for prompt in PROMPTS[:6]:
        tokens = generate(base_url, prompt, max_new_tokens=64, ignore_eos_token=True,
                          details=True).json()["details"]["tokens"]
        stops.append("".join(t["text"] for t in tokens[57:60]))  # generation ends by token 60
    spans: dict[int, list[float]] = {}
    # The six are sent at one moment: a client made inside each thread (an SSL context each, under the GIL) once
    # delayed one request past the ~0.2 s the first three took to finish, and only three then overlapped.
    clients = [httpx.Client(timeout=REQUEST_TIMEOUT_S) for _ in range(6)]
    together = threading.Barrier(6)

    def stream(i: int) -> str:
        together.wait()
        with clients[i].stream("POST", f"{tight.url}/generate_stream", json={
                "inputs": PROMPTS[i], "parameters": {"max_new_tokens": 190, "stop": [stops[i]], "details": True,
                                                     "ignore_eos_token": True}}) as r:
            assert r.status_code == 200
            events = []
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
                    spans.setdefault(i, [time.monotonic()])
        spans[i].append(time.monotonic())
        return events[-1]["details"]["finish_reason"]

    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            reasons = list(pool.map(stream, range(6)))
    finally:
        for client in clients:
            client.close()
    assert reasons == ["stop_sequence"] * 6
    # The most requests between their first token and their end at one moment (each holds blocks then).
    most = max(sum(start <= t <= end for start, end in spans.values()) for t, _ in spans.values())
    assert most > 3, spans


def test_default_limits_are_lowered_to_the_kv_cache(model_dir, tmp_path):
    """No token limit given and a cache smaller than the model's 2048 positions: the server starts with the
    limits lowered to the cache (TGI 3's defaults), instead of failing at warmup."""
    from conftest import _start, _stop

    launcher = _start(model_dir, tmp_path, ["--kv-cache-memory", str(KV_BYTES)], "small-cache")
    try:
        info = httpx.get(f"{launcher.url}/info", timeout=10).json()
        assert info["max_total_tokens"] == KV_BLOCKS * 16 and info["max_input_tokens"] == KV_BLOCKS * 16 - 1
        assert "max_total_tokens 2048 -> 640" in launcher.output()
        assert generate(launcher.url, PROMPTS[0], max_new_tokens=8).status_code == 200
    finally:
        _stop(launcher)
        launcher.close()
