"""Suffix decoding in the worker (`--speculator suffix`): exact for greedy and for sampling, and a repeated
request drafts from the output of the first."""

from __future__ import annotations

import pytest
from test_speculation import PROMPTS, chi_square_p_value, sample_prefixes

from specula_server.params import SamplingParams
from specula_server.speculation import suffix_native
from specula_testing.worker import (
    BlockPool,
    assert_same_greedy_output,
    generate_alone,
    load_test_generator,
    make_spec,
    token_ids,
)

# Both suffix tree backends (the native one where arctic-inference is installed); the sampling test runs on the
# default one (native where installed).
BACKENDS = ["python", pytest.param("native", marks=pytest.mark.skipif(
    not suffix_native.AVAILABLE, reason="arctic-inference is not installed"))]


def load_suffix(llama_dir, backend, **kwargs):
    with pytest.MonkeyPatch.context() as patch:  # the drafter reads it when it is built
        patch.setenv("SPECULA_SUFFIX_BACKEND", backend)
        generator = load_test_generator(llama_dir, speculator="suffix", **kwargs)
    assert generator.speculation.drafter.fallback.backend == backend
    return generator


@pytest.fixture(scope="module")
def plain(llama_dir):
    return load_test_generator(llama_dir)


@pytest.fixture(scope="module", params=BACKENDS)
def suffix(llama_dir, request):
    return load_suffix(llama_dir, request.param, speculative_tokens=4, speculation_mode="fixed")


def run(generator, prompt, request_id=0, **kwargs):
    return generate_alone(generator, make_spec(request_id, prompt, BlockPool(256, 16), **kwargs))


def test_suffix_decoding_leaves_greedy_output_unchanged(plain, suffix):
    assert suffix.speculation.drafter.name == "suffix"
    # Twice each: the second time the global tree holds the first answer.
    assert_same_greedy_output(plain, suffix, PROMPTS + PROMPTS, run, max_new_tokens=24)


@pytest.mark.parametrize("backend", BACKENDS)
def test_adaptive_suffix_decoding_leaves_greedy_output_unchanged(llama_dir, plain, backend):
    """As served: adaptive draft lengths (which read the drafts' confidence), prompt lookup behind."""
    adaptive = load_suffix(llama_dir, backend, speculative_tokens=6, speculation_mode="adaptive")
    assert_same_greedy_output(plain, adaptive, PROMPTS + PROMPTS, run, max_new_tokens=24)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_second_identical_request_drafts_the_first_ones_answer(llama_dir, plain, backend):
    generator = load_suffix(llama_dir, backend, speculative_tokens=4, speculation_mode="fixed")
    prompt = [1, 300, 301, 302, 303]  # nothing to copy from the prompt itself
    first = run(generator, prompt, max_new_tokens=32)
    second = run(generator, prompt, request_id=1, max_new_tokens=32)
    assert token_ids(first) == token_ids(second) == token_ids(run(plain, prompt, max_new_tokens=32))
    assert sum(o.num_accepted for o in second) > sum(o.num_accepted for o in first)
    assert len(second) < len(first)  # fewer steps: the answer comes back several tokens per step
    assert {o.draft_method for o in second if o.num_drafted} == {"suffix"}
    # From its first decode step: the cached answer follows the prompt's end it shares with the first request.
    assert second[1].num_drafted == 4 and second[1].num_accepted == 4
    cache = generator.speculation.drafter.fallback.cache
    # Each answer with its prompt (5 tokens, shorter than the trees' depth) before it.
    assert cache.num_tokens == 2 * (5 + 32) and not generator.speculation.drafter.fallback._requests


def test_sampling_distribution_is_preserved_with_suffix_trees(llama_dir):
    """Suffix drafts (trees, once the global tree holds varied answers) keep the sampling distribution."""
    plain = load_test_generator(llama_dir)
    suffix = load_test_generator(llama_dir, speculative_tokens=3, speculation_mode="fixed", speculator="suffix")
    params = lambda offset: lambda seed: SamplingParams(do_sample=True, temperature=1.5, top_k=4,  # noqa: E731
                                                        seed=seed + offset)
    prompt = PROMPTS[3]
    n = 800
    baseline = sample_prefixes(plain, prompt, n, 3, params(0))
    speculated = sample_prefixes(suffix, prompt, n, 3, params(10**6))
    assert chi_square_p_value(speculated, baseline, n) > 1e-3
    probe = generate_alone(suffix, make_spec(0, prompt, BlockPool(64, 16), max_new_tokens=8,
                                             sampling=params(0)(1)))
    assert sum(o.num_drafted for o in probe) > 0
