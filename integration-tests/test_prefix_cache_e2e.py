"""Prefix caching through the whole stack: a cache hit answers exactly what a cache miss does.

The default servers cache prefixes; a server started with --no-prefix-caching prefills every prompt in full.
The same requests (a shared system prompt with distinct questions, and a second chat turn that resends the first
turn's answer) must give the same tokens and log-probabilities on both, with one shard, two shards and
speculation, while the default server's metrics show the hits.
"""

from __future__ import annotations

import httpx
import pytest
from wire import REQUEST_TIMEOUT_S, generate, metric

SYSTEM = "You are a careful assistant. Answer in one short sentence, and never invent facts. " * 3
QUESTIONS = ["What is a list?", "Why sort values?", "How do dicts work?"]


@pytest.fixture(scope="module")
def uncached(model_dir, tmp_path_factory):
    from conftest import _start, _stop

    launcher = _start(model_dir, tmp_path_factory.mktemp("uncached"), ["--no-prefix-caching"], "uncached")
    yield launcher
    _stop(launcher)


@pytest.fixture(scope="module")
def speculating(model_dir, tmp_path_factory):
    from conftest import _start, _stop

    launcher = _start(model_dir, tmp_path_factory.mktemp("speculating"),
                      ["--speculative-tokens", "4", "--speculation-mode", "fixed"], "speculating")
    yield launcher
    _stop(launcher)


def answers(url: str, prompts: list[str], **parameters) -> list[tuple[list[int], list[float]]]:
    out = []
    for prompt in prompts:
        r = generate(url, prompt, max_new_tokens=12, details=True, ignore_eos_token=True, **parameters)
        assert r.status_code == 200, r.text
        tokens = r.json()["details"]["tokens"]
        out.append(([t["id"] for t in tokens], [t["logprob"] for t in tokens]))
    return out


def assert_same(got, expected) -> None:
    for (ids, logprobs), (want_ids, want_logprobs) in zip(got, expected, strict=True):
        assert ids == want_ids
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


def conversation(url: str) -> list[str]:
    """A first turn, then a second that resends it with its answer, as chat clients do."""
    first = SYSTEM + QUESTIONS[0]
    answer = httpx.post(f"{url}/generate", timeout=REQUEST_TIMEOUT_S, json={
        "inputs": first, "parameters": {"max_new_tokens": 24, "ignore_eos_token": True}}).json()["generated_text"]
    return [first, first + answer + " And " + QUESTIONS[1]]


@pytest.mark.parametrize("which", ["server", "tp_server", "speculating"])
def test_a_cache_hit_answers_what_a_full_prefill_does(request, uncached, which):
    cached = request.getfixturevalue(which)
    prompts = [SYSTEM + q for q in QUESTIONS] + conversation(cached.url)
    hits_before = metric(cached.url, "specula_prefix_cache_hits_total")
    got = answers(cached.url, prompts)
    assert metric(cached.url, "specula_prefix_cache_hits_total") > hits_before  # the cache was really used
    r = generate(cached.url, prompts[-1], max_new_tokens=2, details=True)
    assert r.json()["details"]["cached_tokens"] >= len(SYSTEM) // 8, r.json()["details"]  # whole blocks of it
    assert_same(got, answers(uncached.url, prompts))
    assert metric(uncached.url, "specula_prefix_cache_hits_total") == 0


def test_a_seeded_sampled_request_draws_the_same_tokens_with_a_cache_hit(server, uncached):
    prompts = [SYSTEM + q for q in QUESTIONS]
    assert_same(answers(server.url, prompts, do_sample=True, seed=7, temperature=0.9),
                answers(uncached.url, prompts, do_sample=True, seed=7, temperature=0.9))
