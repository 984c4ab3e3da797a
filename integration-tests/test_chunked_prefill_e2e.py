"""Chunked prefill through the whole stack: a prompt longer than --max-batch-prefill-tokens is prefilled in
chunks between decode steps, and answers exactly what one prefill answers."""

from __future__ import annotations

import concurrent.futures

import pytest
from wire import generate, metric

LONG = "def process(items):\n    total = 0\n    for item in items:\n        total += item.value * 3\n" * 12


@pytest.fixture(scope="module")
def chunking(model_dir, tmp_path_factory):
    from conftest import _start, _stop

    launcher = _start(model_dir, tmp_path_factory.mktemp("chunking"),
                      ["--max-batch-prefill-tokens", "48", "--no-prefix-caching"], "chunking")
    yield launcher
    _stop(launcher)


def details(url: str, prompt: str, **parameters) -> dict:
    r = generate(url, prompt, max_new_tokens=12, details=True, ignore_eos_token=True, **parameters)
    assert r.status_code == 200, r.text
    return r.json()["details"]


def test_a_long_prompt_prefilled_in_chunks_answers_what_one_prefill_does(server, chunking):
    prompts = [LONG, LONG[7:] + "\n# end", "short prompt"]
    assert details(chunking.url, prompts[0])["prompt_tokens"] > 4 * 48  # several chunks
    for prompt in prompts:
        for parameters in ({}, {"do_sample": True, "seed": 3, "temperature": 0.8}):
            got, want = details(chunking.url, prompt, **parameters), details(server.url, prompt, **parameters)
            assert [t["id"] for t in got["tokens"]] == [t["id"] for t in want["tokens"]]
            assert [t["logprob"] for t in got["tokens"]] == pytest.approx([t["logprob"] for t in want["tokens"]],
                                                                          abs=1e-4)


def test_short_requests_and_a_chunked_long_prompt_served_together_all_complete(chunking):
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(details, chunking.url, p) for p in ("x = 1", LONG, "y = 2")]
        results = [f.result() for f in futures]
    assert all(r["generated_tokens"] == 12 for r in results)
    assert metric(chunking.url, "specula_request_success_total") >= 3


def test_prompt_logprobs_longer_than_one_prefill_are_refused_naming_the_flag(chunking):
    r = generate(chunking.url, LONG, max_new_tokens=2, decoder_input_details=True)
    assert r.status_code == 422 and "--max-batch-prefill-tokens" in r.json()["error"], r.text
