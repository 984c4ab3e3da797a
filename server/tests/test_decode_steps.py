"""Several decode steps in one call (`StepPlan.decode_steps`, the router's --num-scheduler-steps) change nothing
but how tokens are grouped: each request gets the tokens, log-probabilities, texts and ending that one step per
call gives it, the call stops early where a request's blocks end or a prompt is still in chunks, and a request
that finishes or fails inside a call leaves while the others go on."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specula_server.params import SamplingParams
from specula_server.request import RequestUpdate, StepOutput, StepPlan
from specula_testing.worker import BlockPool, load_test_generator, make_spec

BLOCK = 16
REQUESTS = [  # (prompt, max_new_tokens, sampling)
    ([1, 50, 60, 70, 80, 90, 100], 21, SamplingParams()),
    ([1, 7, 9], 6, SamplingParams()),  # ends inside the second call
    ([1] + list(range(200, 240)), 17, SamplingParams(do_sample=True, temperature=0.9, top_k=50, seed=1234)),
    ([1, 11, 12, 13, 14], 25, SamplingParams(do_sample=True, seed=7, repetition_penalty=1.3)),
]


@pytest.fixture(scope="module")
def generator(llama_dir):
    return load_test_generator(llama_dir, num_blocks=128)


@pytest.fixture(scope="module")
def speculative(llama_dir):
    return load_test_generator(llama_dir, num_blocks=128, speculative_tokens=3, speculation_mode="fixed")


def specs(pool: BlockPool, lookahead: int = 0):
    return [make_spec(i, p, pool, max_new_tokens=n, sampling=s, lookahead=lookahead)
            for i, (p, n, s) in enumerate(REQUESTS)]


def run(generator, requests, decode_steps: int) -> tuple[dict[int, StepOutput], list[int]]:
    """Every request to its end, `decode_steps` per call: each request's outputs folded into one, and the number
    of steps each call ran."""
    got: dict[int, StepOutput] = {}
    calls = []
    plan = StepPlan(new=requests, decode_steps=decode_steps)
    while True:
        result = generator.step(plan)
        calls.append(result.steps)
        for out in result.outputs:
            assert not out.error, out.error
            if out.request_id in got:
                got[out.request_id].extend(out)
            else:
                got[out.request_id] = replace(out)
        if not generator.requests:
            return got, calls
        plan = StepPlan(decode_steps=decode_steps)


def summary(outputs: dict[int, StepOutput]):
    """Per request: its tokens, log-probabilities, text, ending, and the tokens of each step (accepted drafts
    share their step)."""
    return {i: ([t.id for t in o.tokens], [t.logprob for t in o.tokens], "".join(t.text for t in o.tokens),
                o.generated_text, o.step_tokens) for i, o in outputs.items()}


@pytest.mark.parametrize("engine", ["plain", "speculative"])
def test_calls_of_several_decode_steps_give_the_tokens_of_one_step_per_call(generator, speculative, engine):
    engine, lookahead = (speculative, 3) if engine == "speculative" else (generator, 0)
    one, calls_one = run(engine, specs(BlockPool(128, BLOCK), lookahead), 1)
    four, calls_four = run(engine, specs(BlockPool(128, BLOCK), lookahead), 4)
    assert summary(four) == summary(one)
    assert set(calls_one) == {1}
    assert calls_four[0] == 4 and max(calls_four) == 4  # the prompts' step, then three decode steps
    assert len(calls_four) < len(calls_one) / 2
    assert all(sum(o.step_tokens) == len(o.tokens) for o in four.values())
    if lookahead:
        assert any(n > 1 for o in four.values() for n in o.step_tokens)  # drafts accepted in a step
        assert sum(o.num_drafted for o in four.values()) == sum(o.num_drafted for o in one.values()) > 0
        assert sum(o.num_accepted for o in four.values()) == sum(o.num_accepted for o in one.values())
        # per step, as one step per call counts them (the speculation metrics count request steps)
        assert {i: (o.step_drafted, o.step_accepted) for i, o in four.items()} == {
            i: (o.step_drafted, o.step_accepted) for i, o in one.items()}
        assert all(sum(o.step_drafted) == o.num_drafted and len(o.step_drafted) == len(o.step_tokens)
                   for o in four.values())


def test_a_call_stops_where_a_request_s_blocks_end_and_goes_on_once_they_grow(generator):
    expected, _ = run(generator, specs(BlockPool(128, BLOCK))[:1], 1)
    pool = BlockPool(128, BLOCK)
    spec = specs(pool)[0]
    prompt = len(spec.input_ids)
    pool.give(spec.blocks)
    spec = replace(spec, blocks=pool.take(prompt + 4))  # one block: positions 0-15, the prompt's 7 and 9 more
    result = generator.step(StepPlan(new=[spec], decode_steps=16))
    # The prompt's step writes positions 0-6, decode step k position 6 + k: the tenth would write position 16.
    assert result.steps == 10 and not result.outputs[0].error
    got = result.outputs[0]
    assert len(got.tokens) == 10
    result = generator.step(StepPlan(updates=[RequestUpdate(0, new_blocks=pool.take(BLOCK * 2))], decode_steps=64))
    got.extend(result.outputs[0])
    assert result.steps == 11 and not generator.requests  # 21 tokens in all: it ends at max_new_tokens
    assert summary({0: got}) == summary(expected)


def test_a_call_runs_one_step_while_a_prompt_is_in_chunks(generator):
    pool = BlockPool(128, BLOCK)
    short, long = specs(pool)[0], make_spec(9, [1] + list(range(300, 347)), pool, max_new_tokens=4)
    try:
        result = generator.step(StepPlan(new=[short, replace(long, prefill_until=BLOCK)], decode_steps=4))
        assert result.steps == 1
        result = generator.step(StepPlan(updates=[RequestUpdate(9, prefill_until=2 * BLOCK)], decode_steps=4))
        assert result.steps == 1  # the long prompt still has a chunk to go
        result = generator.step(StepPlan(updates=[RequestUpdate(9)], decode_steps=4))
        assert result.steps == 4  # its last chunk ran in the first step: then everyone decodes
        assert {o.request_id: len(o.tokens) for o in result.outputs} == {0: 4, 9: 4}
    finally:
        generator.reset()


def test_a_request_that_ends_inside_a_call_leaves_and_the_others_go_on(generator):
    pool = BlockPool(128, BLOCK)
    requests = specs(pool)[:2]
    result = generator.step(StepPlan(new=requests, decode_steps=8))
    assert result.steps == 8
    ended = {o.request_id: o for o in result.outputs}
    assert ended[1].generated_text is not None and len(ended[1].tokens) == 6  # max_new_tokens, in the call
    assert ended[0].generated_text is None and len(ended[0].tokens) == 8
    assert list(generator.requests) == [0]
    generator.reset()


def test_a_failure_inside_a_call_replaces_the_request_s_output():
    out = StepOutput(3, [object()], [[]], num_drafted=2, num_accepted=1, draft_method="ngram")
    out.extend(StepOutput(3, [], [], error="request 3: non-finite logits"))
    assert out.error == "request 3: non-finite logits"
    assert (out.tokens, out.top_tokens, out.num_drafted, out.num_accepted, out.generated_text) == ([], [], 0, 0, None)
    assert (out.step_tokens, out.step_drafted, out.step_accepted) == ([], [], [])


def test_a_call_ends_at_the_next_step_once_newcomers_wait_behind_it(generator):
    expected, _ = run(generator, specs(BlockPool(128, BLOCK))[:1], 1)
    pool = BlockPool(128, BLOCK)
    asked = []

    def newcomers_waiting() -> bool:  # a call with new requests arrives during the call's third step
        asked.append(True)
        return len(asked) >= 3

    result = generator.step(StepPlan(new=specs(pool)[:1], decode_steps=8), newcomers_waiting)
    assert result.steps == 3 and len(result.outputs[0].tokens) == 3
    got = result.outputs[0]
    while generator.requests:
        got.extend(generator.step(StepPlan(decode_steps=8)).outputs[0])
    assert summary({0: got})[0][:4] == summary(expected)[0][:4]
