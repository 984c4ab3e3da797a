"""Continuous batching changes nothing: a request's tokens do not depend on what it is batched with, when it
joins or leaves, how its KV blocks grow, whether it is preempted and resumed, nor how its prompt is chunked."""

from __future__ import annotations

import gc
import weakref
from dataclasses import replace

import pytest
import torch

from specula_server.batch import _one_decode, _single_token_step, _spans_step
from specula_server.params import FinishReason, SamplingParams
from specula_server.request import RequestUpdate
from specula_testing.worker import (
    BlockPool,
    generate_alone,
    load_test_generator,
    make_spec,
    step,
    stop_ending_inside_a_token,
    token_ids,
    token_texts,
)

SEEDED = SamplingParams(do_sample=True, temperature=0.9, top_k=50, seed=1234)
REQUESTS = [  # (prompt, max_new_tokens, sampling)
    ([1, 50, 60, 70, 80, 90, 100], 20, SamplingParams()),
    ([1, 7, 9], 12, SamplingParams()),
    ([1] + list(range(200, 240)), 16, SEEDED),
    ([1, 11, 12, 13, 14], 24, SamplingParams(do_sample=True, seed=7, repetition_penalty=1.3)),
]
BLOCK = 16


@pytest.fixture(scope="module")
def generator(llama_dir):
    return load_test_generator(llama_dir, num_blocks=128)


@pytest.fixture(scope="module")
def speculative(llama_dir):
    """Prompt lookup, fixed mode: every step verifies what it finds, whatever the machine's speed."""
    return load_test_generator(llama_dir, num_blocks=128, speculative_tokens=4, speculation_mode="fixed")


def alone(generator, i: int) -> list[int]:
    prompt, max_new, sampling = REQUESTS[i]
    spec = make_spec(i, prompt, BlockPool(128, BLOCK), max_new_tokens=max_new, sampling=sampling)
    return token_ids(generate_alone(generator, spec))


class Recorder:
    """Tokens per request id over the steps it is fed, and each request's last output."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.texts: dict[int, list[str]] = {}
        self.last: dict[int, object] = {}

    def __call__(self, outputs):
        for out in outputs:
            self.tokens.setdefault(out.request_id, []).extend(t.id for t in out.tokens)
            self.texts.setdefault(out.request_id, []).extend(t.text for t in out.tokens)
            self.last[out.request_id] = out
        return outputs


def test_requests_joining_mid_flight_keep_their_solo_outputs(generator):
    expected = {i: alone(generator, i) for i in range(len(REQUESTS))}
    pool = BlockPool(128, BLOCK)
    specs = [make_spec(i, p, pool, max_new_tokens=n, sampling=s) for i, (p, n, s) in enumerate(REQUESTS)]
    got = Recorder()
    got(step(generator, new=[specs[0]]))  # request 0 starts alone
    for _ in range(3):
        got(step(generator))
    got(step(generator, new=[specs[1], specs[2]]))  # two join mid-flight: request 0 decodes in their step
    assert sorted(generator.requests) == [0, 1, 2]
    got(step(generator, new=[specs[3]]))
    assert sorted(generator.requests) == [0, 1, 2, 3]
    while generator.requests:
        got(step(generator))
    assert got.tokens == expected
    assert generator.requests == {}


def test_finished_drops_a_request_without_affecting_others(generator):
    expected = alone(generator, 0)
    pool = BlockPool(128, BLOCK)
    specs = [make_spec(i, p, pool, max_new_tokens=n, sampling=s) for i, (p, n, s) in enumerate(REQUESTS[:2])]
    outputs = step(generator, new=specs)
    tokens = [next(o for o in outputs if o.request_id == 0).tokens[0].id]
    dropped = weakref.ref(generator.requests[1])
    outputs = step(generator, finished=[1, 999])  # request 1 is cancelled; 999 is unknown: ignored
    assert [o.request_id for o in outputs] == [0] and sorted(generator.requests) == [0]
    gc.collect()
    assert dropped() is None  # its state (tensors, generator, detokenizer) is released
    tokens += token_ids(outputs)
    while generator.requests:
        outputs = step(generator)
        assert [o.request_id for o in outputs] == [0]
        tokens += token_ids(outputs)
    assert tokens == expected


def test_finished_requests_leave_on_their_own(generator):
    pool = BlockPool(128, BLOCK)
    short = make_spec(0, [1, 5, 6], pool, max_new_tokens=2)
    long = make_spec(1, [1, 8, 9], pool, max_new_tokens=5)
    step(generator, new=[short, long])
    outputs = step(generator)
    done = {o.request_id: o.generated_text for o in outputs}
    assert done[0] is not None and done[0].generated_tokens == 2 and done[0].finish_reason.value == "length"
    assert done[1] is None
    assert sorted(generator.requests) == [1]
    generator.reset()
    assert generator.requests == {}


def test_steps_ignore_requests_that_ended_and_a_duplicate_id_fails_alone(generator):
    pool = BlockPool(128, BLOCK)
    spec = make_spec(0, [1, 5, 6], pool, max_new_tokens=2)
    step(generator, new=[spec])
    outputs = step(generator)  # the request finishes and leaves
    assert outputs[-1].generated_text is not None and generator.requests == {}
    # A pipelined step that still names it (finished, or an update) is answered with nothing.
    assert step(generator, finished=[0, 999], updates=[RequestUpdate(0, new_blocks=pool.take(BLOCK))]) == []
    assert step(generator) == []  # nothing runs
    first = make_spec(1, [1, 7], pool, max_new_tokens=4)
    again = make_spec(1, [1, 8], pool, max_new_tokens=4)  # the same id while it runs
    other = make_spec(2, [1, 8], pool, max_new_tokens=4)
    step(generator, new=[first])
    outputs = step(generator, new=[again, other])
    errors = {o.request_id: o.error for o in outputs if o.error}
    assert list(errors) == [1] and "request 1 is already running" in errors[1]
    assert sorted(generator.requests) == [1, 2]  # the running request 1 and the newcomer go on
    assert {o.request_id for o in outputs if o.tokens} == {1, 2}
    generator.reset()
    assert generator.requests == {}


def test_a_plain_decode_step_builds_the_inputs_the_general_path_builds(generator):
    """The batched construction of a decode step's inputs (every request one token) against the per-request
    one, on requests of different context lengths."""
    pool = BlockPool(128, BLOCK)
    specs = [make_spec(i, p, pool, max_new_tokens=n, sampling=s) for i, (p, n, s) in enumerate(REQUESTS)]
    step(generator, new=specs)
    try:
        requests = list(generator.requests.values())
        starts = [r.num_tokens - 1 for r in requests]
        fast = _single_token_step(requests, starts, generator.device)
        general = _spans_step(requests, starts, [1] * len(requests), generator.device)
        for name in ("input_ids", "positions", "last_rows"):
            assert torch.equal(getattr(fast, name), getattr(general, name)), name
        assert fast.row_starts == general.row_starts and fast.counts == general.counts
        for name in ("slot_mapping", "context_slots", "query_index", "query_valid", "mask"):
            assert torch.equal(getattr(fast.attn, name), getattr(general.attn, name)), name
    finally:
        generator.reset()


def test_one_decoding_request_builds_the_inputs_the_general_path_builds(generator):
    """One stream's decode step (views of the request's buffers, no mask) against the per-request construction."""
    pool = BlockPool(128, BLOCK)
    step(generator, new=[make_spec(0, REQUESTS[2][0], pool, max_new_tokens=8)])
    step(generator)
    try:
        (r,) = generator.requests.values()
        start = r.num_tokens - 1
        fast, general = _one_decode(r, start, generator.device), _spans_step([r], [start], [1], generator.device)
        for name in ("input_ids", "positions", "last_rows"):
            assert torch.equal(getattr(fast, name), getattr(general, name)), name
        assert fast.row_starts == general.row_starts == [0] and fast.counts == general.counts == [1]
        for name in ("slot_mapping", "context_slots", "query_index", "query_valid"):
            assert torch.equal(getattr(fast.attn, name), getattr(general.attn, name)), name
        assert fast.attn.mask is None and general.attn.mask is None
    finally:
        generator.reset()


# --- the per-step contract: blocks that grow, failures alone, preemption, prompt chunks ------------------------


GROWING = [  # prompts with repetition, so prompt lookup finds drafts
    [1] + [50, 60, 70, 80, 90] * 3,  # 16 tokens: a whole block, its first step's token needs another
    [1, 7, 8, 9, 7, 8, 9, 7, 8],
    [1] + list(range(100, 130)) + list(range(100, 110)),
]


@pytest.mark.parametrize("speculating", [False, True])
def test_blocks_given_just_in_time_give_the_tokens_of_blocks_given_up_front(generator, speculative, speculating):
    """The router admits a request with blocks for its prompt and its first step, and before each step
    appends what that step may write (1 + lookahead positions past its tokens, within its budget), one block
    at a time: the tokens are those of a request that had all its blocks from the start."""
    engine, lookahead = (speculative, 4) if speculating else (generator, 0)
    max_new = 40
    pool = BlockPool(128, BLOCK)
    full = [make_spec(i, p, pool, max_new_tokens=max_new, lookahead=lookahead) for i, p in enumerate(GROWING)]
    expected = {s.id: token_ids(generate_alone(engine, s)) for s in full}
    if speculating:  # exact: the same tokens as plain greedy decoding
        assert expected == {s.id: token_ids(generate_alone(generator, s)) for s in full}
    for s in full:
        pool.give(s.blocks)
    specs = []
    for i, prompt in enumerate(GROWING):
        spec = make_spec(10 + i, prompt, pool, max_new_tokens=max_new, lookahead=lookahead)
        pool.give(spec.blocks)
        specs.append(replace(spec, blocks=pool.take(len(prompt) + 1 + lookahead)))  # its prompt and first step
    blocks = {s.id: list(s.blocks) for s in specs}
    got = Recorder()
    got(step(engine, new=specs))
    grown = drafted = 0
    while engine.requests:
        updates = []
        for i in engine.requests:
            num_tokens = len(GROWING[i - 10]) + len(got.tokens[i])
            need = min(num_tokens + 1 + lookahead, len(GROWING[i - 10]) + max_new + lookahead)
            if len(blocks[i]) * BLOCK < need:
                new = pool.take(BLOCK)  # one block is enough: a step writes at most 1 + lookahead < BLOCK
                blocks[i] += new
                updates.append(RequestUpdate(i, new_blocks=new))
                grown += 1
            assert len(blocks[i]) * BLOCK >= need
        outputs = got(step(engine, updates=updates))
        assert not any(o.error for o in outputs), [o.error for o in outputs if o.error]
        drafted += sum(o.num_drafted for o in outputs)
    assert grown >= len(GROWING) * 2
    assert {i - 10: t for i, t in got.tokens.items()} == expected
    if speculating:
        assert drafted > 0


def test_a_request_whose_blocks_miss_its_next_position_fails_alone(generator):
    pool = BlockPool(128, BLOCK)
    expected = {i: alone(generator, i) for i in (0, 1)}
    specs = [make_spec(i, p, pool, max_new_tokens=n, sampling=s) for i, (p, n, s) in enumerate(REQUESTS[:2])]
    short = make_spec(5, list(range(1, BLOCK)), pool, max_new_tokens=8)
    short = replace(short, blocks=short.blocks[:1])  # 16 positions, never grown
    got = Recorder()
    try:
        outputs = got(step(generator, new=specs + [short]))
        assert {o.request_id for o in outputs} == {0, 1, 5} and not any(o.error for o in outputs)
        outputs = got(step(generator))  # it writes position 15, its last
        assert {o.request_id for o in outputs} == {0, 1, 5} and not any(o.error for o in outputs)
        outputs = got(step(generator))  # its next step would write position 16, which no block holds
        failed = [o for o in outputs if o.error]
        assert [o.request_id for o in failed] == [5] and "request 5" in failed[0].error
        assert "position 16" in failed[0].error and not failed[0].tokens
        assert 5 not in generator.requests and sorted(generator.requests) == [0, 1]
        while generator.requests:
            outputs = got(step(generator))
            assert not any(o.error for o in outputs)
        assert {i: got.tokens[i] for i in (0, 1)} == expected
    finally:
        generator.reset()


def resumed(spec, generated: list[int], pool: BlockPool, max_new: int):
    """`spec` re-sent after a preemption: the tokens it got so far, and fresh blocks for its whole budget."""
    blocks = pool.take(len(spec.input_ids) + max_new)
    return replace(spec, generated_ids=tuple(generated), blocks=blocks)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(do_sample=True, temperature=0.9, seed=77)],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [1, 5])
def test_a_preempted_request_resumed_with_its_tokens_goes_on_as_if_uninterrupted(generator, sampling, k):
    prompt, max_new = REQUESTS[0][0], 20
    pool = BlockPool(128, BLOCK)
    uninterrupted = generate_alone(generator, make_spec(0, prompt, pool, max_new_tokens=max_new, sampling=sampling))
    expected = token_ids(uninterrupted)
    spec = make_spec(0, prompt, pool, max_new_tokens=max_new, sampling=sampling)
    other = make_spec(1, REQUESTS[1][0], pool, max_new_tokens=30)  # a batch-mate all along
    got = Recorder()
    got(step(generator, new=[spec, other]))
    for _ in range(k - 1):
        got(step(generator))
    assert len(got.tokens[0]) == k
    got(step(generator, finished=[0]))  # preempted: its state and blocks are gone
    assert 0 not in generator.requests
    pool.give(spec.blocks)
    before = list(got.tokens.pop(0))
    got.texts.pop(0)
    assert before == expected[:k]
    outputs = got(step(generator, new=[resumed(spec, before, pool, max_new)]))
    assert not any(o.error for o in outputs)
    first = next(o for o in outputs if o.request_id == 0)
    assert len(first.tokens) == 1  # the recomputed tokens are not emitted again
    while 0 in generator.requests:
        got(step(generator))
    generator.reset()
    assert before + got.tokens[0] == expected
    text = got.last[0].generated_text
    assert text.text == uninterrupted[-1].generated_text.text
    assert text.finish_reason is FinishReason.LENGTH and text.generated_tokens == max_new  # the earlier ones count
    assert got.texts[0] == token_texts(uninterrupted)[k:]  # the text goes on where it was cut


def test_a_resumed_request_finds_a_stop_sequence_across_the_preemption(generator):
    prompt, max_new = REQUESTS[0][0], 20
    pool = BlockPool(128, BLOCK)
    plain = generate_alone(generator, make_spec(0, prompt, pool, max_new_tokens=max_new))
    stop, k, _ = stop_ending_inside_a_token(token_texts(plain), span_tokens=True, first=3)
    expected = generate_alone(generator, make_spec(0, prompt, pool, max_new_tokens=max_new, stop_sequences=[stop]))
    assert len(token_ids(expected)) == k + 1
    assert expected[-1].generated_text.finish_reason is FinishReason.STOP_SEQUENCE
    spec = make_spec(3, prompt, pool, max_new_tokens=max_new, stop_sequences=[stop])
    got = Recorder()
    got(step(generator, new=[spec]))
    for _ in range(k - 1):
        got(step(generator))
    before = got.tokens.pop(3)
    assert before == token_ids(expected)[:k] and 3 in generator.requests  # the stop starts in these tokens
    step(generator, finished=[3])
    outputs = got(step(generator, new=[resumed(spec, before, pool, max_new)]))
    assert generator.requests == {}  # the first token after the preemption ends the stop sequence
    (out,) = outputs
    assert [t.id for t in out.tokens] == token_ids(expected)[k:]
    assert out.tokens[0].text == expected[-1].tokens[-1].text
    assert out.generated_text == expected[-1].generated_text
    assert out.generated_text.text.endswith(stop)


def test_a_resumed_request_reuses_its_written_blocks_and_recomputes_the_rest_in_chunks(generator):
    """As the router resumes a request: its full blocks written before the preemption are a cached prefix
    (`cached_tokens`), and the rest of its context (prompt and generated tokens) is computed in chunks whose
    `prefill_until` counts positions over both."""
    prompt, max_new, sampling = REQUESTS[0][0], 20, SamplingParams(do_sample=True, temperature=0.9, seed=5)
    pool = BlockPool(128, BLOCK)
    expected = token_ids(generate_alone(generator, make_spec(0, prompt, pool, max_new_tokens=max_new,
                                                             sampling=sampling)))
    spec = make_spec(0, prompt, pool, max_new_tokens=max_new, sampling=sampling)
    got = Recorder()
    got(step(generator, new=[spec]))
    for _ in range(11):
        got(step(generator))
    before = got.tokens.pop(0)  # 12 tokens: positions 0 .. 17 written, the first block full
    assert before == expected[:12]
    step(generator, finished=[0])
    pool.give(spec.blocks[1:])
    fresh = pool.take(len(prompt) + max_new - BLOCK)
    again = replace(spec, generated_ids=tuple(before), blocks=spec.blocks[:1] + fresh, cached_tokens=BLOCK,
                    prefill_until=BLOCK + 1)
    assert again.context_len == len(prompt) + 12 == 19
    assert got(step(generator, new=[again])) == [] and generator.requests[0].prefilled == BLOCK + 1
    assert got(step(generator, updates=[RequestUpdate(0, prefill_until=18)])) == []
    outputs = got(step(generator, updates=[RequestUpdate(0)]))  # position 18: its next token
    assert [len(o.tokens) for o in outputs] == [1]
    while generator.requests:
        got(step(generator))
    assert before + got.tokens[0] == expected
    assert got.last[0].generated_text.generated_tokens == max_new


def test_resuming_with_max_new_tokens_already_spent_fails_alone(generator):
    pool = BlockPool(128, BLOCK)
    spec = make_spec(0, REQUESTS[0][0], pool, max_new_tokens=3)
    outputs = step(generator, new=[resumed(spec, [5, 6, 7], pool, 3), make_spec(1, [1, 7], pool, max_new_tokens=2)])
    errors = {o.request_id: o.error for o in outputs if o.error}
    assert list(errors) == [0] and "max_new_tokens" in errors[0]
    assert sorted(generator.requests) == [1]
    generator.reset()


def test_a_prompt_computed_in_chunks_across_steps_equals_one_prefill(generator):
    """A long prompt's chunks run in separate steps (its state kept in between, another request decoding in
    each), and one step with no chunk for it: its tokens are those of the prompt prefilled at once."""
    long_prompt = [1] + list(range(200, 240)) + list(range(300, 342))  # 83 tokens
    pool = BlockPool(128, BLOCK)
    whole = generate_alone(generator, make_spec(0, long_prompt, pool, max_new_tokens=12, sampling=SEEDED))
    expected_other = alone(generator, 1)
    other = make_spec(1, REQUESTS[1][0], pool, max_new_tokens=REQUESTS[1][1])
    chunked = make_spec(2, long_prompt, pool, max_new_tokens=12, sampling=SEEDED, prefill_until=30)
    got = Recorder()
    got(step(generator, new=[other]))
    outputs = got(step(generator, new=[chunked]))  # the first chunk, while request 1 decodes
    assert [o.request_id for o in outputs] == [1] and generator.requests[2].prefilled == 30
    outputs = got(step(generator))  # no chunk named: it waits
    assert [o.request_id for o in outputs] == [1] and generator.requests[2].prefilled == 30
    outputs = got(step(generator, updates=[RequestUpdate(2, prefill_until=60)]))
    assert [o.request_id for o in outputs] == [1] and generator.requests[2].prefilled == 60
    outputs = got(step(generator, updates=[RequestUpdate(2)]))  # the rest: its first token
    assert sorted(o.request_id for o in outputs) == [1, 2]
    while generator.requests:
        got(step(generator))
    assert got.tokens[2] == token_ids(whole)
    assert [t.logprob for o in whole for t in o.tokens][-1] == pytest.approx(got.last[2].tokens[-1].logprob, abs=1e-4)
    assert got.last[2].generated_text == whole[-1].generated_text
    assert got.tokens[1] == expected_other


def test_an_invalid_chunk_fails_its_request_alone(generator):
    pool = BlockPool(128, BLOCK)
    chunked = make_spec(0, list(range(1, 41)), pool, max_new_tokens=4, prefill_until=16)
    other = make_spec(1, [1, 7, 9], pool, max_new_tokens=8)
    step(generator, new=[chunked, other])
    outputs = step(generator, updates=[RequestUpdate(0, prefill_until=10)])  # behind what is computed
    errors = {o.request_id: o.error for o in outputs if o.error}
    assert list(errors) == [0] and "prefill_until (10)" in errors[0]
    assert sorted(generator.requests) == [1]
    generator.reset()
