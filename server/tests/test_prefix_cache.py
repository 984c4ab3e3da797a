"""A prompt whose first blocks hold a cached prefix: the worker prefills only the rest, and nothing changes.

The router reuses the KV blocks of an earlier request whose tokens a new prompt starts with (`cached_tokens`
leading positions). The output must be exactly the output of the same request prefilled in full: the same
greedy tokens, log-probabilities within 1e-4, base and LoRA, with and without speculation, alone and in a batch.
"""

from __future__ import annotations

import re

import pytest

from specula_server.params import SamplingParams
from specula_server.request import RequestUpdate
from specula_testing.adapters import build_lora_adapter
from specula_testing.worker import BlockPool, generate_alone, load_test_generator, make_spec, run_steps, step

BLOCK = 16
PREFIX = [1] + [(7 * i) % 200 + 20 for i in range(44)]  # 45 tokens: two whole blocks and a part of one
TAILS = ([31, 32, 33, 34, 35], [90, 91, 92], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17])
NUM_NEW = 20
SETTINGS = [{}, {"speculative_tokens": 4, "speculation_mode": "fixed"}]


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory, llama_dir):
    root = tmp_path_factory.mktemp("adapters")
    build_lora_adapter(llama_dir, root / "lora", rank=4, alpha=8, seed=1)
    return root


@pytest.fixture(scope="module", params=SETTINGS, ids=["plain", "speculative"])
def generator(request, llama_dir, adapter_root):
    generator = load_test_generator(llama_dir, block_size=BLOCK, adapter_dirs=(adapter_root,), **request.param)
    generator.adapters.load("lora", "local")
    return generator


def outputs_of(result_outputs) -> list[tuple[int, float]]:
    return [(t.id, t.logprob) for o in result_outputs for t in o.tokens]


def assert_same(got, expected) -> None:
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in expected], abs=1e-4)


def on_cached_prefix(request_id, prompt, owner_blocks, pool, num_cached_blocks, **kwargs):
    """A request whose first `num_cached_blocks` blocks are another request's, holding its prompt's KV."""
    spec = make_spec(request_id, prompt, pool, max_new_tokens=NUM_NEW, lookahead=4, **kwargs)
    pool.give(spec.blocks[:num_cached_blocks])  # replaced by the owner's
    blocks = tuple(owner_blocks[:num_cached_blocks]) + spec.blocks[num_cached_blocks:]
    return type(spec)(**{**spec.__dict__, "blocks": blocks, "cached_tokens": num_cached_blocks * BLOCK})


@pytest.mark.parametrize("adapter", ["", "lora"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(do_sample=True, temperature=0.8, seed=4)],
                         ids=["greedy", "sampled"])
def test_a_cached_prefix_gives_the_output_of_a_full_prefill(generator, adapter, sampling):
    pool = BlockPool(512, BLOCK)
    first = make_spec(0, PREFIX + [50], pool, max_new_tokens=NUM_NEW, lookahead=4, adapter_id=adapter,
                      sampling=sampling)
    generate_alone(generator, first)  # its blocks now hold the prefix's KV
    for k, tail in enumerate(TAILS):
        prompt = PREFIX + tail
        full = make_spec(10 + k, prompt, pool, max_new_tokens=NUM_NEW, lookahead=4, adapter_id=adapter,
                         sampling=sampling)
        expected = outputs_of(generate_alone(generator, full))
        pool.give(full.blocks)
        reused = on_cached_prefix(20 + k, prompt, first.blocks, pool, len(PREFIX) // BLOCK, adapter_id=adapter,
                                  sampling=sampling)
        assert_same(outputs_of(generate_alone(generator, reused)), expected)


def test_cached_and_uncached_prompts_prefill_together(generator):
    pool = BlockPool(512, BLOCK)
    first = make_spec(0, PREFIX + [50], pool, max_new_tokens=NUM_NEW, lookahead=4)
    generate_alone(generator, first)
    alone = []
    for k, tail in enumerate(TAILS):
        spec = make_spec(10 + k, PREFIX + tail, pool, max_new_tokens=NUM_NEW, lookahead=4)
        alone.append(outputs_of(generate_alone(generator, spec)))
        pool.give(spec.blocks)
    specs = [on_cached_prefix(20, PREFIX + TAILS[0], first.blocks, pool, 2),
             make_spec(21, PREFIX + TAILS[1], pool, max_new_tokens=NUM_NEW, lookahead=4),  # no cache
             on_cached_prefix(22, PREFIX + TAILS[2], first.blocks, pool, 1)]  # a shorter reuse
    got = {s.id: [] for s in specs}
    for out in run_steps(generator, specs):
        got[out.request_id] += [(t.id, t.logprob) for t in out.tokens]
    for spec, expected in zip(specs, alone):
        assert_same(got[spec.id], expected)


def test_a_later_turn_reuses_the_earlier_turns_generated_tokens(generator):
    """A chat's next turn resends the conversation: the first turn's prompt and answer, then more."""
    pool = BlockPool(512, BLOCK)
    first = make_spec(0, PREFIX[:20], pool, max_new_tokens=40, lookahead=4)
    answer = [t for t, _ in outputs_of(generate_alone(generator, first))]
    written = PREFIX[:20] + answer[:-1]  # every position fed back to the model
    prompt = PREFIX[:20] + answer + [60, 61, 62]
    full = make_spec(1, prompt, pool, max_new_tokens=NUM_NEW, lookahead=4)
    expected = outputs_of(generate_alone(generator, full))
    pool.give(full.blocks)
    reused = on_cached_prefix(2, prompt, first.blocks, pool, len(written) // BLOCK)
    assert reused.cached_tokens >= 48
    assert_same(outputs_of(generate_alone(generator, reused)), expected)


@pytest.mark.parametrize("cached,logprobs", [(8, False), (len(PREFIX) + 3, False), (48, False), (16, True)])
def test_a_cached_prefix_must_be_whole_blocks_shorter_than_the_prompt(generator, cached, logprobs):
    pool = BlockPool(512, BLOCK)
    spec = make_spec(0, PREFIX + [1, 2, 3], pool, max_new_tokens=4, prefill_logprobs=logprobs)
    spec = type(spec)(**{**spec.__dict__, "cached_tokens": cached})
    (failed,) = step(generator, new=[spec])  # the request fails alone, with its error
    assert failed.request_id == 0 and not failed.tokens
    assert re.search("cached_tokens|cached prefix", failed.error), failed.error
    assert generator.requests == {}


def test_cached_positions_are_read_not_computed(generator):
    """The other side of exactness: blocks holding another prefix's KV change the output, so the worker really
    takes the first `cached_tokens` positions from the blocks instead of prefilling them again."""
    pool = BlockPool(512, BLOCK)
    other = make_spec(0, [1] + [300 - t for t in PREFIX[1:]] + [50], pool, max_new_tokens=NUM_NEW, lookahead=4)
    generate_alone(generator, other)
    prompt = PREFIX + TAILS[0]
    full = make_spec(1, prompt, pool, max_new_tokens=NUM_NEW, lookahead=4)
    expected = outputs_of(generate_alone(generator, full))
    pool.give(full.blocks)
    wrong = on_cached_prefix(2, prompt, other.blocks, pool, 2)
    got = outputs_of(generate_alone(generator, wrong))
    assert [lp for _, lp in got] != pytest.approx([lp for _, lp in expected], abs=1e-4)


# --- chunked prefill: the same mechanism, the earlier positions written by the request's own chunks ---------


def chunked(generator, spec, chunk: int) -> list[tuple[int, float]]:
    """Runs `spec` with its prompt prefilled `chunk` tokens at a time, as the router sends a long prompt: the
    request joins with its first chunk and keeps its state in the worker; each later step names its next chunk
    (`RequestUpdate.prefill_until`, 0 for the rest)."""
    done = spec.cached_tokens + chunk  # a cached prefix is read, never computed: the chunks start after it
    assert len(spec.input_ids) > done
    outputs = step(generator, new=[type(spec)(**{**spec.__dict__, "prefill_until": done})])
    while True:
        assert outputs == [] and generator.requests[spec.id].prefilled == done  # no token before the last chunk
        until = done + chunk if len(spec.input_ids) - done > chunk else 0
        outputs = step(generator, updates=[RequestUpdate(spec.id, prefill_until=until)])
        if not until:
            break
        done = until
    assert [o.request_id for o in outputs] == [spec.id] and len(outputs[0].tokens) == 1  # the first token
    while generator.requests:
        outputs += step(generator)
    return outputs_of(outputs)


@pytest.mark.parametrize("adapter", ["", "lora"])
@pytest.mark.parametrize("chunk", [16, 32])
def test_a_prompt_prefilled_in_chunks_gives_the_output_of_one_prefill(generator, adapter, chunk):
    pool = BlockPool(512, BLOCK)
    prompt = PREFIX + TAILS[2] + PREFIX[5:30]  # 83 tokens: several chunks and a last part
    sampling = SamplingParams(do_sample=True, temperature=0.7, seed=9)
    whole = make_spec(0, prompt, pool, max_new_tokens=NUM_NEW, lookahead=4, adapter_id=adapter, sampling=sampling)
    expected = outputs_of(generate_alone(generator, whole))
    pool.give(whole.blocks)
    spec = make_spec(1, prompt, pool, max_new_tokens=NUM_NEW, lookahead=4, adapter_id=adapter, sampling=sampling)
    assert_same(chunked(generator, spec, chunk), expected)


def test_chunks_after_a_cached_prefix_give_the_output_of_one_prefill(generator):
    pool = BlockPool(512, BLOCK)
    first = make_spec(0, PREFIX + [50], pool, max_new_tokens=NUM_NEW, lookahead=4)
    generate_alone(generator, first)  # its blocks now hold the prefix's KV
    prompt = PREFIX + TAILS[2] + PREFIX[5:30]
    full = make_spec(1, prompt, pool, max_new_tokens=NUM_NEW, lookahead=4)
    expected = outputs_of(generate_alone(generator, full))
    pool.give(full.blocks)
    reused = on_cached_prefix(2, prompt, first.blocks, pool, 2)
    assert reused.cached_tokens == 32
    assert_same(chunked(generator, reused, 16), expected)


def test_a_chunk_and_whole_prompts_share_a_step_and_a_bad_chunk_fails_alone(generator):
    """A chunk's request keeps its state, so a chunk and whole prompts run in one step, each exact; a
    `prefill_until` outside the prompt fails its request alone (on joining or in a later chunk)."""
    pool = BlockPool(512, BLOCK)
    expected = {}
    for k, prompt in enumerate([PREFIX, PREFIX[:5]]):
        alone = make_spec(k, prompt, pool, max_new_tokens=4)
        expected[k] = outputs_of(generate_alone(generator, alone))
        pool.give(alone.blocks)
    long = make_spec(0, PREFIX, pool, max_new_tokens=4)
    chunk = type(long)(**{**long.__dict__, "prefill_until": 16})
    short = make_spec(1, PREFIX[:5], pool, max_new_tokens=4)
    past_the_end = make_spec(2, PREFIX, pool, max_new_tokens=4, prefill_until=len(PREFIX) + 1)
    outputs = step(generator, new=[chunk, short, past_the_end])
    errors = {o.request_id: o.error for o in outputs if o.error}
    assert list(errors) == [2] and "prefill_until" in errors[2]
    assert [o.request_id for o in outputs if o.tokens] == [1]  # the whole prompt's first token; none for the chunk
    assert sorted(generator.requests) == [0, 1]
    outputs += step(generator, updates=[RequestUpdate(0, prefill_until=len(PREFIX) + 1)])  # past its end
    errors = {o.request_id: o.error for o in outputs if o.error}
    assert list(errors) == [2, 0] and "prefill_until" in errors[0] and sorted(generator.requests) == [1]
    while generator.requests:
        outputs += step(generator)
    assert_same(outputs_of(o for o in outputs if o.request_id == 1), expected[1])

    # The same chunk, then the rest while request 1 decodes: both exact.
    chunk = make_spec(0, PREFIX, pool, max_new_tokens=4, prefill_until=16)
    short = make_spec(1, PREFIX[:5], pool, max_new_tokens=4)
    outputs = step(generator, new=[chunk, short])
    outputs += step(generator, updates=[RequestUpdate(0)])
    while generator.requests:
        outputs += step(generator)
    for k in (0, 1):
        assert_same(outputs_of(o for o in outputs if o.request_id == k), expected[k])
