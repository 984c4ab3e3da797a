"""A step's decodes and prompt chunks share one forward: the same tokens, log-probabilities, drafts and
acceptances as one forward each (`TextGenerator.one_forward = False`) and as each request alone."""

from __future__ import annotations

import pytest
import torch
from test_speculation import PROMPTS

from specula_kernels.paged_attention import GroupedAttentionInputs
from specula_server import step_rows
from specula_server.batch import build_step
from specula_server.params import SamplingParams
from specula_server.request import RequestUpdate
from specula_server.speculative_step import place_drafts
from specula_testing.eagle3 import build_echo_eagle3
from specula_testing.worker import BlockPool, generate_alone, load_test_generator, make_spec, step, token_ids

SEEDED = SamplingParams(do_sample=True, temperature=0.9, top_k=50, seed=1234)
LONG = [1] + list(range(200, 240)) + list(range(300, 342))  # 83 tokens


@pytest.fixture(scope="module")
def plain(llama_dir):
    return load_test_generator(llama_dir, num_blocks=128)


@pytest.fixture(scope="module")
def lookup(llama_dir):
    """Prompt lookup, fixed mode: every step verifies what it finds."""
    return load_test_generator(llama_dir, num_blocks=128, speculative_tokens=4, speculation_mode="fixed")


class Forwards:
    """Counts the model's forwards and the rows of each."""

    def __init__(self, generator, monkeypatch) -> None:
        self.rows: list[int] = []
        original = generator.model.forward_with_aux

        def counted(input_ids, *args, **kwargs):
            self.rows.append(input_ids.shape[0])
            return original(input_ids, *args, **kwargs)

        monkeypatch.setattr(generator.model, "forward_with_aux", counted)


def mixed_run(generator, one_forward: bool) -> tuple[dict, dict, dict]:
    """Two requests decode while a third joins whole (asking for its prompt's log-probabilities and top tokens)
    and a fourth's prompt runs in three chunks; returns per request its (token, logprob) pairs, its (drafted,
    accepted) per output, and the third's prompt log-probabilities."""
    generator.one_forward = one_forward
    pool = BlockPool(128, 16)
    specs = [make_spec(0, PROMPTS[0], pool, max_new_tokens=14, lookahead=8),
             make_spec(1, PROMPTS[1], pool, max_new_tokens=14, lookahead=8),
             make_spec(2, PROMPTS[2], pool, max_new_tokens=10, lookahead=8, prefill_logprobs=True, top_n_tokens=2),
             make_spec(3, LONG, pool, max_new_tokens=10, lookahead=8, sampling=SEEDED, prefill_until=30)]
    tokens: dict[int, list[tuple[int, float]]] = {i: [] for i in range(4)}
    drafts: dict[int, list[tuple[int, int]]] = {i: [] for i in range(4)}
    prefill: dict[int, list[float]] = {}
    plan = [dict(new=specs[:2]), {}, dict(new=[specs[2], specs[3]]), dict(updates=[RequestUpdate(3, prefill_until=60)]),
            dict(updates=[RequestUpdate(3)])]
    for i in range(200):
        outputs = step(generator, **(plan[i] if i < len(plan) else {}))
        for out in outputs:
            assert not out.error, out.error
            tokens[out.request_id] += [(t.id, t.logprob) for t in out.tokens]
            drafts[out.request_id].append((out.num_drafted, out.num_accepted))
            if out.prefill_tokens is not None:
                prefill[out.request_id] = [t.logprob for t in out.prefill_tokens]
            for top in out.top_tokens:
                assert len(top) == (2 if out.request_id == 2 else 0)
        if i >= len(plan) and not generator.requests:
            break
    generator.one_forward = True
    return tokens, drafts, prefill


def assert_same_tokens(got: dict, expected: dict) -> None:
    assert {i: [t for t, _ in v] for i, v in got.items()} == {i: [t for t, _ in v] for i, v in expected.items()}
    for i in expected:
        assert [lp for _, lp in got[i]] == pytest.approx([lp for _, lp in expected[i]], abs=1e-4)


@pytest.mark.parametrize("fixture", ["plain", "lookup"])
def test_decodes_and_prompt_chunks_share_one_forward(fixture, request, monkeypatch):
    generator = request.getfixturevalue(fixture)
    forwards = Forwards(generator, monkeypatch)
    one, one_drafts, one_prefill = mixed_run(generator, one_forward=True)
    merged_rows = list(forwards.rows)
    forwards.rows.clear()
    two, two_drafts, two_prefill = mixed_run(generator, one_forward=False)
    # Steps 2-4 hold decodes and prompt chunks: one forward each instead of two, as many rows in all.
    assert len(merged_rows) == len(forwards.rows) - 3 and sum(merged_rows) == sum(forwards.rows)
    assert_same_tokens(one, two)
    assert one_drafts == two_drafts
    if fixture == "lookup":
        assert sum(d for steps in one_drafts.values() for d, _ in steps) > 0
    assert one_prefill[2] == pytest.approx(two_prefill[2], abs=1e-4, nan_ok=True)
    alone = {i: token_ids(generate_alone(generator, make_spec(i, p, BlockPool(128, 16), max_new_tokens=n)))
             for i, (p, n) in enumerate([(PROMPTS[0], 14), (PROMPTS[1], 14), (PROMPTS[2], 10)])}
    assert {i: [t for t, _ in one[i]] for i in alone} == alone


def test_a_mixed_step_leaves_the_draft_cost_model_alone(lookup, monkeypatch):
    """The decodes of a step that also ran prompt chunks were not timed alone: the controller does not learn
    draft costs from them, while every other verifying step still informs it."""
    observed: list[int] = []
    cost = lookup.speculator.step_cost
    monkeypatch.setattr(cost, "observe_speculative", lambda n, seconds, drafts: observed.append(n))
    monkeypatch.setattr(cost, "observe", lambda n, seconds: observed.append(n))
    pool = BlockPool(128, 16)
    step(lookup, new=[make_spec(0, PROMPTS[0], pool, max_new_tokens=12, lookahead=8)])
    step(lookup)
    assert len(observed) == 1
    step(lookup, new=[make_spec(1, PROMPTS[1], pool, max_new_tokens=12, lookahead=8)])  # decodes + a prompt
    assert len(observed) == 1
    step(lookup)
    assert len(observed) == 2
    step(lookup, finished=[0, 1])
    assert not lookup.requests


def test_eagle3_reads_the_auxiliary_rows_of_its_own_request(llama_dir, tmp_path, monkeypatch):
    """EAGLE-3 drafts from the target's auxiliary hidden states: in a shared forward each request's rows (its
    decode row, or its prompt chunk after the decodes) reach it as in forwards of their own, so it drafts and
    is accepted alike."""
    generator = load_test_generator(llama_dir, num_blocks=128, speculative_tokens=3, speculation_mode="fixed",
                                    speculator=str(build_echo_eagle3(tmp_path / "echo", llama_dir)))
    drafted: list[list[list[int]]] = []

    def recorded(reqs, drafts):
        drafted.append([d.tokens.tolist() for d in drafts])
        return place_drafts(reqs, drafts)

    monkeypatch.setattr(step_rows, "place_drafts", recorded)
    one, one_drafts, _ = mixed_run(generator, one_forward=True)
    one_drafted = list(drafted)
    drafted.clear()
    two, two_drafts, _ = mixed_run(generator, one_forward=False)
    assert_same_tokens(one, two)
    assert one_drafts == two_drafts
    assert one_drafted == drafted and sum(len(d) for step_drafts in drafted for d in step_drafts) > 0


def test_prompt_chunks_attend_in_a_group_of_their_own(plain):
    """Decodes, drafts being verified and a prompt chunk: three attention groups, so neither the one-token rows
    nor the drafts are padded to the chunk's length."""
    pool = BlockPool(128, 16)
    for spec in [make_spec(0, PROMPTS[0], pool), make_spec(1, PROMPTS[1], pool)]:
        step(plain, new=[spec])
    chunk = make_spec(2, LONG, pool, prefill_until=40)
    step(plain, new=[chunk])  # its first chunk computed: it is held, 40 positions done
    a, b, c = (plain.requests[i] for i in range(3))
    built = build_step([a, b, c], [a.num_tokens - 1, b.num_tokens - 3, 40], [1, 3, 30], torch.device("cpu"),
                       split=2)
    assert isinstance(built.attn, GroupedAttentionInputs)
    assert [group.query_index.shape[1] for _, group in built.attn.groups] == [1, 3, 30]
    assert [rows.tolist() for rows, _ in built.attn.groups] == [[0], [1, 2, 3], list(range(4, 34))]
    step(plain, finished=[0, 1, 2])
