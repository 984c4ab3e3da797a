"""Continuous batching changes nothing: a request's tokens do not depend on what it is batched with."""

from __future__ import annotations

import pytest
import torch

from specula_server.batch import _single_token_step, _spans_step
from specula_server.params import SamplingParams
from specula_server.testing.worker import BlockPool, generate_alone, load_test_generator, make_spec, token_ids

SEEDED = SamplingParams(do_sample=True, temperature=0.9, top_k=50, seed=1234)
REQUESTS = [  # (prompt, max_new_tokens, sampling)
    ([1, 50, 60, 70, 80, 90, 100], 20, SamplingParams()),
    ([1, 7, 9], 12, SamplingParams()),
    ([1] + list(range(200, 240)), 16, SEEDED),
    ([1, 11, 12, 13, 14], 24, SamplingParams(do_sample=True, seed=7, repetition_penalty=1.3)),
]


@pytest.fixture(scope="module")
def generator(llama_dir):
    return load_test_generator(llama_dir, num_blocks=128)


def alone(generator, i: int) -> list[int]:
    prompt, max_new, sampling = REQUESTS[i]
    spec = make_spec(i, prompt, BlockPool(128, 16), max_new_tokens=max_new, sampling=sampling)
    return token_ids(generate_alone(generator, spec, batch_id=100 + i))


def test_staggered_prefill_concatenate_and_filter(generator):
    expected = {i: alone(generator, i) for i in range(len(REQUESTS))}
    pool = BlockPool(128, 16)
    specs = [
        make_spec(i, p, pool, max_new_tokens=n, sampling=s) for i, (p, n, s) in enumerate(REQUESTS)
    ]
    got: dict[int, list[int]] = {i: [] for i in range(len(REQUESTS))}

    def record(result):
        for out in result.outputs:
            got[out.request_id].extend(t.id for t in out.tokens)
        return result.batch

    live = record(generator.prefill(1, [specs[0]]))  # request 0 starts alone
    for _ in range(3):
        live = record(generator.decode([live.id]))
    second = record(generator.prefill(2, [specs[1], specs[2]]))  # two join mid-flight, in another batch
    live = record(generator.decode([live.id, second.id]))  # the batches are concatenated
    assert sorted(live.request_ids) == [0, 1, 2]
    third = record(generator.prefill(3, [specs[3]]))
    live = record(generator.decode([third.id, live.id]))
    while live is not None:
        live = record(generator.decode([live.id]))
    assert got == expected
    assert generator.batches == {}


def test_filter_drops_a_request_without_affecting_others(generator):
    expected = alone(generator, 0)
    pool = BlockPool(128, 16)
    specs = [make_spec(i, p, pool, max_new_tokens=n, sampling=s) for i, (p, n, s) in enumerate(REQUESTS[:2])]
    result = generator.prefill(5, specs)
    tokens = [result.outputs[0].tokens[0].id]
    batch = generator.filter(5, [0])  # request 1 is cancelled
    assert batch.request_ids == [0]
    while result.batch is not None:
        result = generator.decode([5])
        assert [o.request_id for o in result.outputs] == [0]
        tokens.extend(t.id for o in result.outputs for t in o.tokens)
    assert tokens == expected


def test_finished_requests_leave_the_batch(generator):
    pool = BlockPool(128, 16)
    short = make_spec(0, [1, 5, 6], pool, max_new_tokens=2)
    long = make_spec(1, [1, 8, 9], pool, max_new_tokens=5)
    result = generator.prefill(9, [short, long])
    result = generator.decode([9])
    done = {o.request_id: o.generated_text for o in result.outputs}
    assert done[0] is not None and done[0].generated_tokens == 2 and done[0].finish_reason.value == "length"
    assert done[1] is None
    assert result.batch.request_ids == [1]
    generator.clear()
    assert generator.batches == {}


def test_decode_skips_batches_that_ended_but_rejects_unknown_ones(generator):
    from specula_server.generator import BatchNotFoundError

    pool = BlockPool(128, 16)
    result = generator.prefill(20, [make_spec(0, [1, 5, 6], pool, max_new_tokens=2)])
    assert result.batch is not None
    result = generator.decode([20])  # the request finishes: batch 20 ends
    assert result.batch is None
    again = generator.decode([20])  # a pipelined Decode that named it is answered empty
    assert again.outputs == [] and again.batch is None
    with pytest.raises(BatchNotFoundError, match="unknown batch ids \\[999\\]"):
        generator.decode([20, 999])
    assert generator.prefill(21, [make_spec(1, [1, 7], pool, max_new_tokens=4)]).batch.id == 21
    assert generator.prefill(22, [make_spec(2, [1, 8], pool, max_new_tokens=4)]).batch.id == 22
    merged = generator.decode([21, 22])
    assert merged.batch.id == 21 and sorted(merged.batch.request_ids) == [1, 2]
    assert generator.decode([22, 21]).batch.id == 21  # 22 was merged into 21: skipped
    generator.clear()


def test_a_plain_decode_step_builds_the_inputs_the_general_path_builds(generator):
    """The batched construction of a decode step's inputs (every request one token) against the per-request
    one, on requests of different context lengths."""
    pool = BlockPool(128, 16)
    specs = [make_spec(i, p, pool, max_new_tokens=n, sampling=s) for i, (p, n, s) in enumerate(REQUESTS)]
    generator.prefill(7, specs)
    try:
        requests = generator.batches[7].requests
        starts = [r.num_tokens - 1 for r in requests]
        fast = _single_token_step(requests, starts, generator.device)
        general = _spans_step(requests, starts, [1] * len(requests), generator.device)
        for name in ("input_ids", "positions", "last_rows"):
            assert torch.equal(getattr(fast, name), getattr(general, name)), name
        assert fast.row_starts == general.row_starts and fast.counts == general.counts
        for name in ("slot_mapping", "context_slots", "query_index", "query_valid", "mask"):
            assert torch.equal(getattr(fast.attn, name), getattr(general.attn, name)), name
    finally:
        generator.clear(7)
