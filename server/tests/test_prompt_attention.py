"""A prompt's attention on the native prompt kernel (`csrc/prompt_attention.cpp`) along every path a prompt takes.

A model whose head size the kernel takes on both builds (64), so prompts of more than 32 rows run on it: one
prefill, chunks (the first from position 0, later ones after earlier chunks), the rest of a prompt after a cached
prefix, a preempted request's recompute, and several prompts in one step. Each path's greedy tokens must equal the
plain request's token for token (log-probabilities within 1e-4), and the plain request's must equal those of the
same request with prompts on PyTorch's SDPA path.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from specula_kernels import native
from specula_kernels import paged_attention as paged_attention_module
from specula_server.request import RequestUpdate
from specula_testing.worker import BlockPool, generate_alone, load_test_generator, make_spec, run_steps, step

pytestmark = pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")

BLOCK = 16
PROMPTS = ([1] + [(7 * i) % 200 + 20 for i in range(119)],  # 120 tokens
           [1] + [(11 * i) % 180 + 30 for i in range(74)])  # 75
NUM_NEW = 16


@pytest.fixture(scope="module")
def generator(wide_llama_dir):
    return load_test_generator(wide_llama_dir, block_size=BLOCK)


@pytest.fixture
def kernel_rows(monkeypatch) -> list[int]:
    """The rows of each call of the prompt kernel."""
    calls, real = [], paged_attention_module.attend_prompt_native
    monkeypatch.setattr(paged_attention_module, "attend_prompt_native",
                        lambda *args: calls.append(args[1].shape[0]) or real(*args))
    return calls


def outputs_of(outputs) -> list[tuple[int, float]]:
    return [(t.id, t.logprob) for o in outputs for t in o.tokens]


def assert_same(got, expected) -> None:
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in expected], abs=1e-4)


def alone(generator, prompt) -> list[tuple[int, float]]:
    return outputs_of(generate_alone(generator, make_spec(0, prompt, BlockPool(64, BLOCK), max_new_tokens=NUM_NEW)))


def test_a_prefill_on_the_kernel_gives_the_sdpa_paths_output(generator, kernel_rows, monkeypatch):
    expected = alone(generator, PROMPTS[0])
    assert kernel_rows and set(kernel_rows) == {120}
    kernel_rows.clear()
    monkeypatch.setattr(paged_attention_module, "_native_prompts", lambda query, inputs: None)
    assert_same(alone(generator, PROMPTS[0]), expected)
    assert kernel_rows == []


@pytest.mark.parametrize("chunk", [48, 80])
def test_chunks_on_the_kernel_give_the_output_of_one_prefill(generator, kernel_rows, chunk):
    """Chunks of 48 (from 0, then after 48 rows, then 24 rows on the decode kernel) or 80 then 40."""
    expected = alone(generator, PROMPTS[0])
    kernel_rows.clear()
    spec = make_spec(1, PROMPTS[0], BlockPool(64, BLOCK), max_new_tokens=NUM_NEW, prefill_until=chunk)
    outputs = step(generator, new=[spec])
    done = chunk
    while done:
        done = done + chunk if len(PROMPTS[0]) - done > chunk else 0
        outputs += step(generator, updates=[RequestUpdate(1, prefill_until=done)])
    while generator.requests:
        outputs += step(generator)
    assert_same(outputs_of(outputs), expected)
    assert set(kernel_rows) == ({48} if chunk == 48 else {80, 40})


def test_the_rest_after_a_cached_prefix_on_the_kernel_gives_the_output_of_a_full_prefill(generator, kernel_rows):
    expected = alone(generator, PROMPTS[0])  # in blocks the request below then takes (its own pool)
    pool = BlockPool(64, BLOCK)
    first = make_spec(0, PROMPTS[0][:40], pool, max_new_tokens=4)
    generate_alone(generator, first)  # its first two blocks now hold the prompt's first 32 positions
    kernel_rows.clear()
    spec = make_spec(1, PROMPTS[0], pool, max_new_tokens=NUM_NEW)
    pool.give(spec.blocks[:2])
    reused = replace(spec, blocks=first.blocks[:2] + spec.blocks[2:], cached_tokens=2 * BLOCK)
    assert_same(outputs_of(generate_alone(generator, reused)), expected)
    assert set(kernel_rows) == {120 - 2 * BLOCK}


def test_a_preempted_request_recomputed_on_the_kernel_goes_on_as_if_uninterrupted(generator, kernel_rows):
    expected = alone(generator, PROMPTS[1])
    pool = BlockPool(64, BLOCK)
    spec = make_spec(0, PROMPTS[1], pool, max_new_tokens=NUM_NEW)
    got = outputs_of(step(generator, new=[spec]))
    for _ in range(5):
        got += outputs_of(step(generator))
    step(generator, finished=[0])  # preempted
    pool.give(spec.blocks)
    kernel_rows.clear()
    resumed = replace(spec, generated_ids=tuple(t for t, _ in got), blocks=pool.take(len(PROMPTS[1]) + NUM_NEW))
    outputs = step(generator, new=[resumed])  # the prompt and the six tokens recomputed in one prefill
    while generator.requests:
        outputs += step(generator)
    assert_same(got + outputs_of(outputs), expected)
    assert kernel_rows and set(kernel_rows) == {len(PROMPTS[1]) + len(got)}


def test_prompts_sharing_a_step_on_the_kernel_each_give_their_output_alone(generator, kernel_rows):
    expected = [alone(generator, prompt) for prompt in PROMPTS]
    kernel_rows.clear()
    pool = BlockPool(64, BLOCK)
    specs = [make_spec(i, prompt, pool, max_new_tokens=NUM_NEW) for i, prompt in enumerate(PROMPTS)]
    got = {spec.id: [] for spec in specs}
    for out in run_steps(generator, specs):
        got[out.request_id] += [(t.id, t.logprob) for t in out.tokens]
    for spec, want in zip(specs, expected):
        assert_same(got[spec.id], want)
    assert sorted(set(kernel_rows)) == [75, 120]
