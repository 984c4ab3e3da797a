"""Speculative decoding through the whole stack: same greedy text, several tokens per step, LoRAX's
`skipped` flags and counts, and the speculation metrics."""

from __future__ import annotations

import concurrent.futures

import pytest
from wire import generate, generate_stream, metric

PROMPTS = [
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\nfor i in range(10):\n",
    "abc abc abc abc abc abc",
    "def add(a, b):\n    return a + b\n",
]


@pytest.fixture(scope="module")
def speculative_server(model_dir, tmp_path_factory):
    from conftest import _start, _stop

    # fixed: every available draft is verified. The adaptive default decides from measured step times, so on a
    # busy machine it may rightly verify nothing in a short request, and the counts below would not be testable.
    launcher = _start(model_dir, tmp_path_factory.mktemp("spec"),
                      ["--speculative-tokens", "4", "--speculation-mode", "fixed"], "speculative")
    yield launcher
    _stop(launcher)
    launcher.close()


def test_info_reports_speculation(speculative_server):
    import httpx

    info = httpx.get(f"{speculative_server.url}/info").json()["speculation"]
    assert info["method"] == "ngram" and info["max_speculative_tokens"] == 4 and info["mode"] == "fixed"


def test_greedy_text_is_the_same_with_and_without_speculation(base_url, speculative_server):
    for prompt in PROMPTS:
        plain = generate(base_url, prompt, max_new_tokens=48, details=True).json()
        spec = generate(speculative_server.url, prompt, max_new_tokens=48, details=True).json()
        assert spec["generated_text"] == plain["generated_text"]
        assert [t["id"] for t in spec["details"]["tokens"]] == [t["id"] for t in plain["details"]["tokens"]]


def test_concurrent_requests_keep_their_text(base_url, speculative_server):
    expected = [generate(base_url, p, max_new_tokens=32).json()["generated_text"] for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
        got = list(pool.map(lambda p: generate(speculative_server.url, p, max_new_tokens=32).json()["generated_text"],
                            PROMPTS * 2))
    assert got == expected * 2


def test_accepted_tokens_are_skipped_events_and_counted(speculative_server):
    url = speculative_server.url
    accepted_before = metric(url, "specula_spec_decode_num_accepted_tokens_total")
    response, events = generate_stream(url, PROMPTS[1], max_new_tokens=48, details=True)
    tokens = [e["token"] for e in events]
    skipped = sum(t["skipped"] for t in tokens)
    assert len(tokens) == 48 and events[-1]["details"]["generated_tokens"] == 48
    assert skipped > 0 and not tokens[0]["skipped"]
    # TGI's `index` counts tokens, not steps: 1..48 although several came in one step
    assert [e["index"] for e in events] == list(range(1, 49))
    assert events[-1]["details"]["input_length"] == events[-1]["details"]["prompt_tokens"]
    plain = generate(url, PROMPTS[1], max_new_tokens=48, details=True)
    assert int(plain.headers["x-skipped-tokens"]) == plain.json()["details"]["skipped_tokens"] > 0
    accepted = metric(url, "specula_spec_decode_num_accepted_tokens_total") - accepted_before
    assert accepted == skipped + plain.json()["details"]["skipped_tokens"]
    drafted = metric(url, "specula_spec_decode_num_draft_tokens_total")
    assert drafted >= accepted > 0
    assert metric(url, "specula_spec_decode_accepted_tokens_per_pos_total", position="1") > 0
