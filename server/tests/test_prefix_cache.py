"""A prompt whose first blocks hold a cached prefix: the worker prefills only the rest, and nothing changes.

The router reuses the KV blocks of an earlier request whose tokens a new prompt starts with (`cached_tokens`
leading positions). The output must be exactly the output of the same request prefilled in full: the same
greedy tokens, log-probabilities within 1e-4, base and LoRA, with and without speculation, alone and in a batch.
"""

from __future__ import annotations

import pytest

from specula_server.generator import InvalidRequestError
from specula_server.params import SamplingParams
from specula_server.testing.adapters import build_lora_adapter
from specula_server.testing.worker import BlockPool, generate_alone, load_test_generator, make_spec

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
    generate_alone(generator, first, batch_id=1)  # its blocks now hold the prefix's KV
    for k, tail in enumerate(TAILS):
        prompt = PREFIX + tail
        full = make_spec(10 + k, prompt, pool, max_new_tokens=NUM_NEW, lookahead=4, adapter_id=adapter,
                         sampling=sampling)
        expected = outputs_of(generate_alone(generator, full, batch_id=2))
        pool.give(full.blocks)
        reused = on_cached_prefix(20 + k, prompt, first.blocks, pool, len(PREFIX) // BLOCK, adapter_id=adapter,
                                  sampling=sampling)
        assert_same(outputs_of(generate_alone(generator, reused, batch_id=3)), expected)


def test_cached_and_uncached_prompts_prefill_together(generator):
    pool = BlockPool(512, BLOCK)
    first = make_spec(0, PREFIX + [50], pool, max_new_tokens=NUM_NEW, lookahead=4)
    generate_alone(generator, first, batch_id=1)
    alone = []
    for k, tail in enumerate(TAILS):
        spec = make_spec(10 + k, PREFIX + tail, pool, max_new_tokens=NUM_NEW, lookahead=4)
        alone.append(outputs_of(generate_alone(generator, spec, batch_id=2)))
        pool.give(spec.blocks)
    specs = [on_cached_prefix(20, PREFIX + TAILS[0], first.blocks, pool, 2),
             make_spec(21, PREFIX + TAILS[1], pool, max_new_tokens=NUM_NEW, lookahead=4),  # no cache
             on_cached_prefix(22, PREFIX + TAILS[2], first.blocks, pool, 1)]  # a shorter reuse
    result = generator.prefill(5, specs)
    got = {s.id: [] for s in specs}
    while True:
        for out in result.outputs:
            got[out.request_id] += [(t.id, t.logprob) for t in out.tokens]
        if result.batch is None:
            break
        result = generator.decode([5])
    for spec, expected in zip(specs, alone):
        assert_same(got[spec.id], expected)


def test_a_later_turn_reuses_the_earlier_turns_generated_tokens(generator):
    """A chat's next turn resends the conversation: the first turn's prompt and answer, then more."""
    pool = BlockPool(512, BLOCK)
    first = make_spec(0, PREFIX[:20], pool, max_new_tokens=40, lookahead=4)
    answer = [t for t, _ in outputs_of(generate_alone(generator, first, batch_id=1))]
    written = PREFIX[:20] + answer[:-1]  # every position fed back to the model
    prompt = PREFIX[:20] + answer + [60, 61, 62]
    full = make_spec(1, prompt, pool, max_new_tokens=NUM_NEW, lookahead=4)
    expected = outputs_of(generate_alone(generator, full, batch_id=2))
    pool.give(full.blocks)
    reused = on_cached_prefix(2, prompt, first.blocks, pool, len(written) // BLOCK)
    assert reused.cached_tokens >= 48
    assert_same(outputs_of(generate_alone(generator, reused, batch_id=3)), expected)


@pytest.mark.parametrize("cached,logprobs", [(8, False), (len(PREFIX) + 3, False), (48, False), (16, True)])
def test_a_cached_prefix_must_be_whole_blocks_shorter_than_the_prompt(generator, cached, logprobs):
    pool = BlockPool(512, BLOCK)
    spec = make_spec(0, PREFIX + [1, 2, 3], pool, max_new_tokens=4, prefill_logprobs=logprobs)
    spec = type(spec)(**{**spec.__dict__, "cached_tokens": cached})
    with pytest.raises(InvalidRequestError, match="cached_tokens"):
        generator.prefill(9, [spec])


def test_cached_positions_are_read_not_computed(generator):
    """The other side of exactness: blocks holding another prefix's KV change the output, so the worker really
    takes the first `cached_tokens` positions from the blocks instead of prefilling them again."""
    pool = BlockPool(512, BLOCK)
    other = make_spec(0, [1] + [300 - t for t in PREFIX[1:]] + [50], pool, max_new_tokens=NUM_NEW, lookahead=4)
    generate_alone(generator, other, batch_id=1)
    prompt = PREFIX + TAILS[0]
    full = make_spec(1, prompt, pool, max_new_tokens=NUM_NEW, lookahead=4)
    expected = outputs_of(generate_alone(generator, full, batch_id=2))
    pool.give(full.blocks)
    wrong = on_cached_prefix(2, prompt, other.blocks, pool, 2)
    got = outputs_of(generate_alone(generator, wrong, batch_id=3))
    assert [lp for _, lp in got] != pytest.approx([lp for _, lp in expected], abs=1e-4)


# --- chunked prefill: the same mechanism, the earlier positions written by the request's own chunks ---------


def chunked(generator, spec, chunk: int, first_batch_id: int) -> list[tuple[int, float]]:
    """Runs `spec` with its prompt prefilled `chunk` tokens at a time, as the router sends a long prompt."""
    replace = lambda **fields: type(spec)(**{**spec.__dict__, **fields})  # noqa: E731
    done, batch_id = 0, first_batch_id
    while len(spec.input_ids) - done > chunk:
        result = generator.prefill(batch_id, [replace(cached_tokens=done, prefill_until=done + chunk)])
        assert result.outputs == [] and result.batch is None and batch_id not in generator.batches
        done, batch_id = done + chunk, batch_id + 1
    return outputs_of(generate_alone(generator, replace(cached_tokens=done), batch_id=batch_id))


@pytest.mark.parametrize("adapter", ["", "lora"])
@pytest.mark.parametrize("chunk", [16, 32])
def test_a_prompt_prefilled_in_chunks_gives_the_output_of_one_prefill(generator, adapter, chunk):
    pool = BlockPool(512, BLOCK)
    prompt = PREFIX + TAILS[2] + PREFIX[5:30]  # 83 tokens: several chunks and a last part
    sampling = SamplingParams(do_sample=True, temperature=0.7, seed=9)
    whole = make_spec(0, prompt, pool, max_new_tokens=NUM_NEW, lookahead=4, adapter_id=adapter, sampling=sampling)
    expected = outputs_of(generate_alone(generator, whole, batch_id=1))
    pool.give(whole.blocks)
    spec = make_spec(1, prompt, pool, max_new_tokens=NUM_NEW, lookahead=4, adapter_id=adapter, sampling=sampling)
    assert_same(chunked(generator, spec, chunk, first_batch_id=10), expected)


def test_chunks_and_whole_prompts_do_not_share_a_prefill(generator):
    pool = BlockPool(512, BLOCK)
    long = make_spec(0, PREFIX, pool, max_new_tokens=4)
    chunk = type(long)(**{**long.__dict__, "prefill_until": 16})
    with pytest.raises(InvalidRequestError, match="chunks"):
        generator.prefill(30, [chunk, make_spec(1, PREFIX[:5], pool, max_new_tokens=4)])
    with pytest.raises(InvalidRequestError, match="prefill_until"):
        generator.prefill(31, [type(long)(**{**long.__dict__, "prefill_until": len(PREFIX) + 1})])
