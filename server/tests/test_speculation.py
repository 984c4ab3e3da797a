"""Speculative decoding in the worker: exact for greedy and for sampling, and stopping inside a draft block."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from specula_server.params import FinishReason, SamplingParams
from specula_server.speculation.controller import (
    AcceptanceEstimate,
    ConfidenceCalibration,
    RealizedAcceptance,
    StepCostModel,
    choose_draft_lengths,
    drafting_bar,
    expected_accepted,
)
from specula_server.speculation.drafters import Draft, PromptLookupDrafter
from specula_testing.worker import (
    BlockPool,
    generate_alone,
    load_test_generator,
    make_spec,
    stop_ending_inside_a_token,
    token_ids,
    token_texts,
)
from specula_testing.worker import step as one_step

# Prompts with repetition, so prompt lookup finds drafts; the random model also tends to loop, which it copies.
PROMPTS = [
    [1] + [50, 60, 70, 80, 90] * 4,
    [1, 7, 8, 9, 7, 8, 9, 7, 8],
    [1] + list(range(100, 140)) + list(range(100, 120)),
    [1, 300, 301, 302, 303],
]


@pytest.fixture(scope="module")
def plain(llama_dir):
    return load_test_generator(llama_dir)


def memory_bound_costs() -> StepCostModel:
    """A fixed cost profile where extra tokens are cheap (as decode is on a GPU): the adaptive controller's
    choices then depend on acceptance alone, not on how busy the test machine is."""
    cost = StepCostModel(learning=False)
    cost.anchor(1, 0.010)
    cost.anchor(64, 0.012)
    return cost


@pytest.fixture(scope="module", params=["fixed", "adaptive"])
def speculative(llama_dir, request):
    generator = load_test_generator(llama_dir, speculative_tokens=4, speculation_mode=request.param)
    generator.speculator.step_cost = memory_bound_costs()
    return generator


def run(generator, prompt, request_id=0, **kwargs):
    spec = make_spec(request_id, prompt, BlockPool(256, 16), **kwargs)
    return generate_alone(generator, spec)


def test_drafter_finds_the_longest_latest_match():
    drafter = PromptLookupDrafter(min_n=1, max_n=3)
    history = torch.tensor([1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3])
    assert drafter.lookup(history, 2).tolist() == [8, 7]  # latest "1 2 3" was followed by 8 7
    assert PromptLookupDrafter(match="earliest").lookup(history, 2).tolist() == [9, 1]
    assert drafter.lookup(torch.tensor([4, 5, 6]), 3).tolist() == []  # nothing repeats
    assert drafter.lookup(history, 0).tolist() == []
    # In a run, the very latest match has one token after it; the latest one with a full draft wins.
    assert drafter.lookup(torch.tensor([4] + [5] * 8), 3).tolist() == [5, 5, 5]


def reference_lookup(history: torch.Tensor, max_tokens: int, min_n: int, max_n: int, match: str) -> list[int]:
    """Prompt lookup by its definition: every window compared, in tensors."""
    length = history.numel()
    if max_tokens <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = history[: length - 1].unfold(0, n, 1)
        hits = (windows == history[length - n :]).all(dim=1).nonzero().flatten()
        if hits.numel():
            start = int(hits[0]) + n
            full = hits[hits + n + max_tokens <= length]
            if match == "latest" and full.numel():
                start = int(full[-1]) + n
            return history[start : start + max_tokens].tolist()
    return []


def test_drafter_matches_the_definition_on_random_sequences():
    """The byte search finds the same drafts as comparing every window, including where token ids' bytes
    match across token boundaries (small ids with zero high bytes, ids sharing bytes)."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(400):
        vocab = [2, 3, 5, 300, 70000][trial % 5]
        length = int(torch.randint(1, 60, (), generator=gen))
        history = torch.randint(0, vocab, (length,), generator=gen) * [1, 256, 65536][trial % 3]
        k = int(torch.randint(0, 7, (), generator=gen))
        for min_n, max_n, match in ((1, 3, "latest"), (1, 3, "earliest"), (2, 4, "latest")):
            drafter = PromptLookupDrafter(min_n, max_n, match)
            expected = reference_lookup(history, k, min_n, max_n, match)
            assert drafter.lookup(history, k).tolist() == expected, (history.tolist(), k, min_n, max_n, match)


def test_greedy_output_is_identical_with_speculation(plain, speculative):
    drafted = 0
    for prompt in PROMPTS:
        expected = run(plain, prompt, max_new_tokens=40)
        got = run(speculative, prompt, max_new_tokens=40)
        assert token_ids(got) == token_ids(expected)
        assert [t.logprob for o in got for t in o.tokens] == pytest.approx(
            [t.logprob for o in expected for t in o.tokens], abs=1e-4)
        assert got[-1].generated_text.text == expected[-1].generated_text.text
        drafted += sum(o.num_drafted for o in got)
    assert drafted > 0  # speculation really ran


def test_a_failing_drafter_costs_only_its_drafts(llama_dir, plain, caplog):
    """Drafts only save time: a drafter that raises leaves the step to run without them, and the request
    gets exactly the tokens it would have got."""
    generator = load_test_generator(llama_dir, speculative_tokens=4, speculation_mode="fixed")
    drafter = generator.speculation.drafter
    calls = {"n": 0}
    real = drafter.propose

    def flaky(requests, max_tokens):
        calls["n"] += 1
        if calls["n"] % 2:
            raise RuntimeError("drafter bug")
        return real(requests, max_tokens)

    drafter.propose = flaky
    drafted = 0
    for prompt in PROMPTS:
        got = run(generator, prompt, max_new_tokens=30)
        assert token_ids(got) == token_ids(run(plain, prompt, max_new_tokens=30))
        drafted += sum(o.num_drafted for o in got)
    assert calls["n"] > 4 and drafted > 0  # drafts were verified on the other steps
    assert "drafting failed; this step verifies no drafts" in caplog.text


def test_several_tokens_per_step_are_accepted(speculative):
    outputs = run(speculative, PROMPTS[0], max_new_tokens=40)
    assert sum(o.num_accepted for o in outputs) > 0
    assert len(outputs) < 40  # fewer steps than tokens
    assert all(len(o.tokens) == o.num_accepted + 1 for o in outputs[:-1])


def test_mixed_batch_with_speculation_matches_alone(plain, speculative):
    expected = {i: token_ids(run(plain, p, request_id=i, max_new_tokens=24)) for i, p in enumerate(PROMPTS)}
    pool = BlockPool(256, 16)
    specs = [make_spec(i, p, pool, max_new_tokens=24) for i, p in enumerate(PROMPTS)]
    got = {i: [] for i in range(len(PROMPTS))}
    outputs = one_step(speculative, new=specs[:2])
    outputs += one_step(speculative, new=specs[2:])  # two join while the first two decode
    while speculative.requests:
        outputs += one_step(speculative)
    for out in outputs:
        got[out.request_id] += [t.id for t in out.tokens]
    assert got == expected


def test_max_new_tokens_is_never_overshot(speculative):
    for n in (1, 2, 3, 5, 9):
        outputs = run(speculative, PROMPTS[0], max_new_tokens=n)
        assert len(token_ids(outputs)) == n
        assert outputs[-1].generated_text.finish_reason is FinishReason.LENGTH


def test_stop_sequence_inside_an_accepted_block(plain, speculative):
    full = run(plain, PROMPTS[0], max_new_tokens=40)[-1].generated_text.text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    expected = run(plain, PROMPTS[0], max_new_tokens=40, stop_sequences=[stop])
    got = run(speculative, PROMPTS[0], max_new_tokens=40, stop_sequences=[stop])
    assert token_ids(got) == token_ids(expected)
    assert got[-1].generated_text.finish_reason is FinishReason.STOP_SEQUENCE
    assert got[-1].generated_text.text == expected[-1].generated_text.text
    assert got[-1].generated_text.text.endswith(stop)


@pytest.mark.parametrize("span_tokens", [False, True], ids=["inside-a-token", "across-tokens"])
def test_a_stop_ending_inside_an_accepted_token_cuts_its_text(plain, speculative, span_tokens):
    unstopped = run(speculative, PROMPTS[0], max_new_tokens=40)
    # Look for the stop from the second token of the first block of several tokens, so it ends in a draft.
    first = next(sum(len(o.tokens) for o in unstopped[:i]) + 1 for i, o in enumerate(unstopped) if len(o.tokens) > 1)
    pieces = token_texts(unstopped)
    stop, k, cut = stop_ending_inside_a_token(pieces, span_tokens, first)
    expected = run(plain, PROMPTS[0], max_new_tokens=40, stop_sequences=[stop])
    got = run(speculative, PROMPTS[0], max_new_tokens=40, stop_sequences=[stop])
    assert len(got[-1].tokens) > 1, "the stop ends in a block of accepted tokens"
    assert token_ids(got) == token_ids(expected) == token_ids(unstopped)[: k + 1]
    assert token_texts(got) == token_texts(expected) == pieces[:k] + [pieces[k][:cut]]
    final = got[-1].generated_text
    assert final.finish_reason is FinishReason.STOP_SEQUENCE and final.generated_tokens == k + 1
    assert final.text == expected[-1].generated_text.text == "".join(pieces[:k]) + pieces[k][:cut]
    assert final.text.endswith(stop)


def test_eos_inside_an_accepted_block(plain, speculative):
    tokens = token_ids(run(plain, PROMPTS[0], max_new_tokens=30))
    eos = tokens[12]
    for generator in (plain, speculative):
        generator.eos_token_ids = frozenset({eos})
    try:
        expected = run(plain, PROMPTS[0], max_new_tokens=30, ignore_eos_token=False)
        got = run(speculative, PROMPTS[0], max_new_tokens=30, ignore_eos_token=False)
    finally:
        for generator in (plain, speculative):
            generator.eos_token_ids = frozenset({2})
    assert token_ids(got) == token_ids(expected) == tokens[: tokens.index(eos) + 1]
    assert got[-1].generated_text.finish_reason is FinishReason.EOS_TOKEN


def test_request_at_the_position_limit(llama_dir):
    """Drafts never reach past the request's KV blocks or the model's positions."""
    spec_gen = load_test_generator(llama_dir, speculative_tokens=6, speculation_mode="fixed")
    plain_gen = load_test_generator(llama_dir)
    limit = spec_gen.model.config.max_position_embeddings
    prompt = ([1] + [50, 60, 70, 80] * 200)[: limit - 10]
    for gen in (spec_gen, plain_gen):
        gen.allocate_kv_cache(64)
    pool = BlockPool(64, 16)
    expected = token_ids(generate_alone(plain_gen, make_spec(0, prompt, pool, max_new_tokens=10)))
    pool = BlockPool(64, 16)
    got = token_ids(generate_alone(spec_gen, make_spec(0, prompt, pool, max_new_tokens=10)))
    assert got == expected and len(got) == 10


def test_penalties_see_the_draft_prefix(plain, speculative):
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)
    for prompt in PROMPTS[:2]:
        expected = run(plain, prompt, max_new_tokens=30, sampling=params)
        got = run(speculative, prompt, max_new_tokens=30, sampling=params)
        assert token_ids(got) == token_ids(expected)


def test_seeded_sampling_is_reproducible_and_independent_of_speculation(plain, speculative):
    params = SamplingParams(do_sample=True, temperature=0.7, seed=1234)
    expected = token_ids(run(plain, PROMPTS[0], max_new_tokens=30, sampling=params))
    assert token_ids(run(speculative, PROMPTS[0], max_new_tokens=30, sampling=params)) == expected
    assert token_ids(run(speculative, PROMPTS[0], max_new_tokens=30, sampling=params)) == expected


def test_per_request_override_turns_speculation_off(speculative):
    outputs = run(speculative, PROMPTS[0], max_new_tokens=20, speculative_tokens=0)
    assert sum(o.num_drafted for o in outputs) == 0 and len(outputs) == 20


def chi_square_p_value(observed: Counter, expected: Counter, n: int) -> float:
    """Pearson chi-square test of two samples of equal size (homogeneity), via the regularised gamma."""
    keys = set(observed) | set(expected)
    stat = sum((observed[k] - expected[k]) ** 2 / (observed[k] + expected[k]) for k in keys
               if observed[k] + expected[k] > 0)
    dof = max(len(keys) - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.fixture(scope="module")
def copy_prompt(plain) -> list[int]:
    """The model's own continuation appended to a prompt: tokens it samples next often occur earlier, so
    prompt lookup has drafts, some of which the model accepts."""
    base = PROMPTS[3]
    return base + token_ids(run(plain, base, max_new_tokens=12))


def sample_prefixes(generator, prompt, n: int, length: int, params_for) -> Counter:
    pool = BlockPool(256, 16)
    counts = Counter()
    for seed in range(n):
        # Generate past `length`, so the draft cap (what may still be emitted) does not shorten the drafts.
        spec = make_spec(0, prompt, pool, max_new_tokens=length + 3, sampling=params_for(seed))
        counts[tuple(token_ids(generate_alone(generator, spec))[:length])] += 1
        pool.give(spec.blocks)
    return counts


def test_sampling_distribution_is_preserved(llama_dir, copy_prompt):
    """Speculation on vs off: the distribution of the first 3 sampled tokens is the same (chi-square).

    Both sides draw with different seeds so the samples are independent; under exact acceptance the two
    samples come from one distribution and the test passes; an inexact rule (see below) fails it.
    """
    plain = load_test_generator(llama_dir)
    spec = load_test_generator(llama_dir, speculative_tokens=3, speculation_mode="fixed")
    params = lambda offset: lambda seed: SamplingParams(do_sample=True, temperature=1.5, top_k=4,  # noqa: E731
                                                        seed=seed + offset)
    n = 1500
    baseline = sample_prefixes(plain, copy_prompt, n, 3, params(0))
    speculated = sample_prefixes(spec, copy_prompt, n, 3, params(10**6))
    assert chi_square_p_value(speculated, baseline, n) > 1e-3
    probe = run(spec, copy_prompt, max_new_tokens=8, sampling=params(0)(1))
    assert sum(o.num_drafted for o in probe) > 0


def test_the_distribution_test_detects_inexact_acceptance(llama_dir, copy_prompt, monkeypatch):
    """Accepting every draft regardless of the target (an inexact rule) must fail the same test."""
    import specula_server.speculation.verify as verify_module

    def accept_all(logits, requests, drafts, row_starts, sampler):
        verdicts, processed = original(logits, requests, drafts, row_starts, sampler)
        for v, d, start in zip(verdicts, drafts, row_starts):
            if len(d):  # emit the drafts (chains) as they are, whatever the target says
                v.token_ids, v.logprobs, v.rows = d.tokens.tolist(), [0.0] * len(d), list(range(start, start + len(d)))
                v.path = list(range(len(d)))
        return verdicts, processed

    original = verify_module.verify
    import specula_server.speculation.speculator as speculator_module  # the speculator runs the acceptance
    monkeypatch.setattr(speculator_module, "verify", accept_all)
    plain = load_test_generator(llama_dir)
    spec = load_test_generator(llama_dir, speculative_tokens=3, speculation_mode="fixed")
    params = lambda offset: lambda seed: SamplingParams(do_sample=True, temperature=1.5, top_k=4,  # noqa: E731
                                                        seed=seed + offset)
    baseline = sample_prefixes(plain, copy_prompt, 1500, 3, params(0))
    broken = sample_prefixes(spec, copy_prompt, 1500, 3, params(10**6))
    assert chi_square_p_value(broken, baseline, 1500) < 1e-3


def fitted(t0: float, t1: float) -> StepCostModel:
    """Plain steps over 1..8 sequences cost `t0 + t1 * S`, and a token in a calibration forward `t1`."""
    cost = StepCostModel()
    for n in (1, 4, 16, 64):
        cost.anchor(n, t0 + t1 * n)
    for n in (1, 2, 4, 8) * 10:
        cost.observe(n, t0 + t1 * n)
    return cost


def test_adaptive_controller_grants_drafts_only_when_they_pay():
    cost = fitted(0.020, 0.002)
    assert 0.5 > drafting_bar(1, cost) and not 0.05 > drafting_bar(1, cost)
    assert not 0.5 > drafting_bar(64, fitted(0.020, 0.002))  # at batch 64 a token costs 0.128 / 0.148 of a step
    assert choose_draft_lengths([4, 4], [0.9, 0.05], cost, "adaptive") == [4, 0]
    assert choose_draft_lengths([4, 4], [0.9, 0.05], cost, "fixed") == [4, 4]
    assert choose_draft_lengths([0, 0], [0.9, 0.9], cost, "adaptive") == [0, 0]
    # An extra token costs half a step: worth it at 60% acceptance (1.6 tokens for 1.5x the time), not at 40%.
    expensive = fitted(0.020, 0.020)
    assert choose_draft_lengths([4], [0.6], expensive, "adaptive")[0] >= 1
    assert choose_draft_lengths([4], [0.4], expensive, "adaptive") == [0]


def test_acceptance_counts_trials_up_to_the_first_rejection():
    fresh = AcceptanceEstimate()
    assert fresh.value == 0.5
    hit, miss = AcceptanceEstimate(), AcceptanceEstimate()
    hit.observe(4, 4)
    miss.observe(4, 0)
    assert hit.value > 0.5 > miss.value
    # Copying: full blocks with an occasional mismatch keep the estimate high (one failure per miss, not k).
    copy = AcceptanceEstimate()
    for step in range(20):
        copy.observe(6, 2 if step % 5 == 4 else 6)
    assert copy.value > 0.85
    # No drafts: the evidence fades and the estimate drifts back toward 0.5.
    before = miss.value
    for _ in range(50):
        miss.observe(0, 0)
    assert before < miss.value < 0.5


def test_a_fixed_verification_overhead_turns_marginal_drafts_off():
    cost = fitted(0.020, 0.002)
    assert choose_draft_lengths([2, 2], [0.5, 0.5], cost, "adaptive") != [0, 0]
    for _ in range(30):  # verifying 4 drafts costs 50 ms more than a plain step over the 2 sequences
        cost.observe_speculative(2, cost.plain(2) + 0.05, 4)
    assert cost.overhead > 0.04
    assert choose_draft_lengths([2, 2], [0.5, 0.5], cost, "adaptive") == [0, 0]
    assert choose_draft_lengths([4], [0.99], cost, "adaptive") == [4]  # near-certain drafts still pay


def test_anchors_give_the_slope_that_decode_steps_cannot():
    cost = StepCostModel()
    for n in (1, 4, 16, 64):
        cost.anchor(n, 0.010 + 0.002 * n)
    for _ in range(200):  # many recent steps, all of one size, on a machine 20% slower now
        cost.observe(32, 1.2 * (0.010 + 0.002 * 32))
    t0, t1 = cost.coefficients()
    assert 0.0015 < t1 < 0.003 and cost.plain(32) > 0.074


def test_calibration_anchors_the_cost_model(speculative):
    from specula_server.warmup import calibrate_step_cost

    fixed, speculative.speculator.step_cost = speculative.speculator.step_cost, StepCostModel()
    try:
        calibrate_step_cost(speculative, sizes=(1, 8, 32), repeats=1)
        t0, t1 = speculative.speculator.step_cost.coefficients()
    finally:
        speculative.speculator.step_cost = fixed
    assert t0 > 0 and t1 > 0


def test_cost_model_fits_the_slope_and_falls_back_to_a_prior():
    t0, t1 = fitted(0.020, 0.001).coefficients()
    assert math.isclose(t1, 0.001, rel_tol=1e-6) and math.isclose(t0, 0.020, rel_tol=1e-6)
    same_size = StepCostModel()  # one batch size, no anchors
    for _ in range(10):
        same_size.observe(1, 0.017)
    t0, t1 = same_size.coefficients()
    assert math.isclose(t0 + t1, 0.017) and math.isclose(t1, t0 * same_size.prior_ratio)


def test_a_draft_is_priced_apart_from_a_sequence():
    """Concurrency 32 on the demo model: a sequence's share of a plain step is several times what a draft adds
    (attention over its context), so drafts that a per-token price would decline pay."""
    cost = StepCostModel()
    for n in (1, 4, 16, 64):
        cost.anchor(n, 0.004 + 0.0001 * n)
    for s in range(32, 0, -1):  # a batch draining: plain steps over 32 .. 1 sequences
        cost.observe(s, 0.004 + 0.0006 * s)
    for d in (10, 20, 40, 15, 30) * 4:  # verifying d drafts adds 4 ms + 0.13 ms per draft
        cost.observe_speculative(32, cost.plain(32) + 0.004 + 0.00013 * d, d)
    v0, per_draft = cost.verification_cost()
    assert math.isclose(cost.plain(32), 0.0232, rel_tol=1e-6)
    assert math.isclose(v0, 0.004, rel_tol=1e-6) and math.isclose(per_draft, 0.00013, rel_tol=1e-6)
    assert all(k > 0 for k in choose_draft_lengths([16] * 32, [0.5] * 32, cost, "adaptive"))
    assert choose_draft_lengths([16] * 32, [0.2] * 32, cost, "adaptive") == [0] * 32  # v0 is not covered
    assert not cost.plain_is_stale  # steps that cost what the fit says never ask for a plain step


def test_a_plain_cost_fitted_at_a_heavier_load_is_measured_again():
    """32 streams of long summaries (244 ms plain steps), then open questions: a plain step takes 94 ms, a draft
    adds 2.2 ms, and every step verifies. The verifying steps, faster than the stale P or fitted below it at 0
    drafts, ask for plain steps, which bring P down to what it is; the price of a draft is measured all along.
    With excesses raised to 0 (as before), drafts read as free and were verified at 18% acceptance."""
    cost = StepCostModel()
    for n in (1, 4, 16, 64):
        cost.anchor(n, 0.004 + 0.0015 * n)
    for _ in range(30):
        cost.observe(32, 0.244)
    plain_steps = 0
    for d in (40, 55, 66, 45, 60) * 6:
        if cost.plain_is_stale:  # as the speculator does: the next step is plain
            cost.plain_is_stale = False
            plain_steps += 1
            cost.observe(32, 0.094)
            continue
        cost.observe_speculative(32, 0.094 + 0.0022 * d, d)
    assert 1 <= plain_steps <= 5
    assert math.isclose(cost.plain(32), 0.094, rel_tol=0.05)
    assert math.isclose(cost.verification_cost()[1], 0.0022, rel_tol=0.05)
    assert choose_draft_lengths([4] * 32, [0.2] * 32, cost, "adaptive") == [0] * 32
    assert choose_draft_lengths([4] * 32, [0.5] * 32, cost, "adaptive") == [0] * 32  # 0.5 / 2.2 ms < 32 / 94 ms
    assert all(k > 0 for k in choose_draft_lengths([4] * 32, [0.9] * 32, cost, "adaptive"))


def test_tokens_priced_one_by_one_are_granted_while_their_chain_pays():
    """Acceptance given per token (a model drafter's rated chain): a chain is granted up to the token whose
    chance of being reached and accepted no longer pays for its row, and not at all when its first token does
    not; the expected tokens are the products along the chain."""
    cost = fitted(0.020, 0.002)  # a draft pays above 9% (`drafting_bar`)
    assert choose_draft_lengths([3, 3, 3], [[0.9, 0.8, 0.05], [0.05, 0.99, 0.99], [0.9, 0.9, 0.9]], cost,
                                "adaptive") == [2, 0, 3]
    assert choose_draft_lengths([1], [[0.9, 0.8]], cost, "adaptive") == [1]  # never past what is available
    assert expected_accepted([0.5, 0.5, 0.2], 3) == pytest.approx(0.5 + 0.25 + 0.05)
    assert expected_accepted(0.5, 2) == pytest.approx(0.75)


def expensive_verification(cost: StepCostModel, num_drafts: int, steps: int = 20) -> None:
    """Verifying steps that each take seconds: the fit, which lets each step's sample double its prediction at
    most, reaches four plain steps of fixed cost (the most a sample counts for)."""
    for _ in range(steps):
        cost.observe_speculative(1, 10.0, num_drafts)


def test_a_spike_in_verification_overhead_does_not_stop_speculation_for_good():
    cost = StepCostModel()
    for n in (1, 4, 16, 64):
        cost.anchor(n, 0.004 + 0.0001 * n)
    cost.observe_speculative(1, 10.0, 6)  # the first verifying step paused for seconds: counted near the prior
    assert choose_draft_lengths([6], [0.85], cost, "adaptive") == [6]
    expensive_verification(cost, 6)  # every step did: the overhead estimate is past what drafts can pay
    assert choose_draft_lengths([6], [0.85], cost, "adaptive") == [0]
    # Declined steps bring it back until drafting is tried (and measured) again.
    steps = 0
    while choose_draft_lengths([6], [0.85], cost, "adaptive") == [0]:
        cost.declined()
        steps += 1
    assert 0 < steps < 200


def test_a_pause_inside_one_verifying_step_does_not_enter_the_fit_whole():
    """Once verifying has a fit, a step timed across a pause counts as at most twice the prediction (plus a
    quarter of a plain step): drafts keep paying the step after it. A real rise in cost is still learned within
    a few steps."""
    cost = StepCostModel()
    for n in (1, 4, 16, 64):
        cost.anchor(n, 0.004 + 0.0001 * n)
    for _ in range(30):
        cost.observe(64, 0.014)
    for d in (60, 100, 80, 120) * 3:  # verifying d drafts adds 2 ms + 0.05 ms per draft
        cost.observe_speculative(64, 0.014 + 0.002 + 0.00005 * d, d)
    assert all(k > 0 for k in choose_draft_lengths([6] * 64, [0.8] * 64, cost, "adaptive"))
    assert all(k > 0 for k in choose_draft_lengths([6] * 64, [0.6] * 64, cost, "adaptive"))
    cost.observe_speculative(64, 0.014 + 0.050, 100)  # paused 50 ms, all of it kept under four plain steps
    v0, per_draft = cost.verification_cost()
    assert v0 + per_draft * 100 < 0.010, (v0, per_draft)  # 7 ms predicted before; 14 ms if taken whole
    assert all(k > 0 for k in choose_draft_lengths([6] * 64, [0.6] * 64, cost, "adaptive"))
    for _ in range(8):  # verifying really costs 20 ms more now
        cost.observe_speculative(64, 0.014 + 0.020 + 0.00005 * 100, 100)
    v0, per_draft = cost.verification_cost()
    assert v0 + per_draft * 100 > 0.015, (v0, per_draft)


def slow_spell_then_normal(first_normal_steps_plain: int) -> StepCostModel:
    """One stream on the real model: a slow spell of the machine (every step 60 times slower: a cold start, or
    another process on both cores) in which steps verify 3 drafts or run plain, then normal steps: 18 ms plain,
    verifying 3 drafts adds 2 + 1.2 ms a draft. The first normal steps are plain (declined or backing off)."""
    cost = StepCostModel()
    for n in (1, 4, 16, 64):
        cost.anchor(n, 0.020 + 0.0003 * n)
    for i in range(8):
        if i % 2:
            cost.observe(1, 1.25)
        else:
            cost.observe_speculative(1, 1.5, 3)
    for _ in range(first_normal_steps_plain):
        cost.declined()
        cost.observe(1, 0.018)
    return cost


@pytest.mark.parametrize("plain_steps", [0, 12])
def test_a_slow_spell_of_the_machine_does_not_keep_drafts_off_after_it(plain_steps):
    """Steps measured in a slow spell carry seconds of excess over the plain step of after it. Taken as seconds
    they declined drafts accepted at 43% for hundreds of steps (an overhead of 0.9 s against 18 ms plain steps,
    worn down by declines); as shares of the plain step they were measured beside, or dropped once a verifying
    step finds P stale, they let drafts that pay be verified within a few steps."""
    cost = slow_spell_then_normal(plain_steps)
    verified = []
    for _ in range(40):
        if cost.plain_is_stale:  # as the speculator does: the next step is plain
            cost.plain_is_stale = False
            cost.observe(1, 0.018)
            verified.append(0)
            continue
        k = choose_draft_lengths([3], [0.43], cost, "adaptive")[0]
        verified.append(k)
        if k:
            cost.observe_speculative(1, 0.018 + 0.002 + 0.0012 * k, k)
        else:
            cost.declined()
            cost.observe(1, 0.018)
    assert sum(k > 0 for k in verified[10:]) == 30, verified
    v0, per_draft = cost.verification_cost()
    assert v0 + 3 * per_draft < 0.010 and cost.plain(1) < 1.2 * 0.018  # P is measured on plain steps alone


def test_verifying_steps_count_what_they_add_to_a_plain_step_as_it_is_known_now():
    """Load rises from 4 to 64 streams and the first steps at 64 verify: their excess is taken over a plain step
    fitted at 4 streams (an underestimate), but once plain steps at 64 are measured, the verification cost is
    what verifying adds to those, and drafts that pay are granted again. Excesses fixed when measured kept the
    estimate's error in v0, above a whole plain step."""
    cost = StepCostModel()
    for n in (1, 4, 16, 64):
        cost.anchor(n, 0.004 + 0.00005 * n)
    for _ in range(30):  # 4 streams: 5 ms steps
        cost.observe(4, 0.005)
    assert cost.plain(64) < 0.009
    for d in (40, 80, 60) * 2:  # at 64 streams: a 14 ms plain step, and verifying adds 1 ms + 0.03 ms a draft
        cost.observe_speculative(64, 0.014 + 0.001 + 0.00003 * d, d)
    for s in (64, 60, 62) * 10:  # plain steps at 64 streams
        cost.observe(s, 0.014 - 0.0001 * (64 - s))
    assert math.isclose(cost.plain(64), 0.014, rel_tol=0.02)
    v0, per_draft = cost.verification_cost()
    assert v0 + 60 * per_draft < 0.005, (v0, per_draft)  # 2.8 ms; fixed when measured, 8.8 ms
    assert all(k > 0 for k in choose_draft_lengths([6] * 64, [0.7] * 64, cost, "adaptive"))


def test_anchors_timed_on_a_slower_machine_do_not_keep_copying_requests_from_drafting():
    """Calibration forwards timed while the machine was 5x slower: a borrowed per-token slope steeper than
    the plain steps allow, and a per-draft prior that puts the bar above any request. Declines wear the
    prior down until drafts are tried; once measured, the measurement bounds it."""
    cost = StepCostModel()
    for n in (1, 4, 16, 64):
        cost.anchor(n, 5 * (0.0035 + 0.00018 * n))
    for _ in range(20):  # the batch holds 32 sequences, plain steps take 24 ms
        cost.observe(32, 0.024)
    assert math.isclose(cost.plain(32), 0.024, rel_tol=1e-6)  # the line goes through what was measured
    copying = 0.8
    assert drafting_bar(32, cost) > copying
    steps = 0
    while drafting_bar(32, cost) > copying:
        cost.declined()
        steps += 1
    assert 0 < steps < 100
    for _ in range(4):  # verifying 16 drafts adds 2 ms + 0.13 ms per draft, every time 16
        cost.observe_speculative(32, cost.plain(32) + 0.002 + 0.00013 * 16, 16)
    _, per_draft = cost.verification_cost()
    assert per_draft <= (0.002 + 0.00013 * 16) / 16 + 1e-9  # at most the measured excess per draft
    assert drafting_bar(32, cost) < 0.4


def test_repeated_declines_back_off_proposing_drafts(llama_dir, plain):
    """Steps whose drafts are all declined propose less and less often (1 in 1, 2, 4, then 8 steps), and the
    output stays the output without speculation."""
    spec = load_test_generator(llama_dir, speculative_tokens=4, speculation_mode="adaptive")
    cost = StepCostModel()
    for n in (1, 4, 16, 64):
        cost.anchor(n, 0.004 + 0.0001 * n)
    expensive_verification(cost, 4)  # verifying costs four plain steps: 4 drafts can never pay for it
    cost.learning = False  # and stays so
    spec.speculator.step_cost = cost
    proposals = []

    def propose(reqs, caps):  # drafts every time it is asked
        proposals.append(caps[0])
        return [Draft(torch.full((cap,), 7)) for cap in caps]

    spec.speculation.drafter.propose = propose
    prompt = PROMPTS[0]
    outputs = run(spec, prompt, max_new_tokens=24)
    assert token_ids(outputs) == token_ids(run(plain, prompt, max_new_tokens=24))
    assert all(o.num_drafted == 0 for o in outputs)
    assert 3 <= len(proposals) <= 6, proposals  # 23 decode steps; without the back-off, 23 proposals
    assert all(cap > 0 for cap in proposals)  # every proposal had drafts to offer, all declined


def test_while_backing_off_only_requests_at_their_first_decode_step_are_asked(llama_dir):
    """Backing off after declines, the drafter is asked for a newcomer at its first decode step, not for the
    requests whose drafts it kept declining (asking everyone whenever a request joined ended the back-off at
    every join, and under load one joins at most steps)."""
    spec = load_test_generator(llama_dir, speculative_tokens=4, speculation_mode="adaptive")
    cost = StepCostModel()
    for n in (1, 4, 16, 64):
        cost.anchor(n, 0.004 + 0.0001 * n)
    expensive_verification(cost, 4)  # verifying costs four plain steps: 4 drafts can never pay for it
    cost.learning = False
    spec.speculator.step_cost = cost
    asked: list[list[int]] = []

    def propose(reqs, caps):
        asked.append([r.id for r, cap in zip(reqs, caps) if cap > 0])
        return [Draft(torch.full((cap,), 7)) for cap in caps]

    spec.speculation.drafter.propose = propose
    pool = BlockPool(256, 16)
    one_step(spec, new=[make_spec(0, PROMPTS[0], pool, max_new_tokens=40)])
    for _ in range(12):  # declined at once, then backing off: 1 in 8 steps at most asks
        one_step(spec)
    asked.clear()
    one_step(spec, new=[make_spec(1, PROMPTS[1], pool, max_new_tokens=40)])  # prefill: not yet decoding
    one_step(spec)  # the newcomer's first decode step
    one_step(spec)
    assert asked == [[1]], asked  # request 0 still backing off (5 of its 7 steps without proposals done)


@pytest.mark.parametrize("ask_ms", [0.0, 1.2])
def test_the_back_off_grows_past_eight_steps_only_where_asking_costs_more_than_its_budget(llama_dir, plain, ask_ms):
    """A drafter whose drafts are always declined is asked 1 step in 8 when asking is cheap; when every ask
    takes 1.2 ms (under the anchors a plain step takes 4.1 ms: 0.29 of a step per ask), the back-off keeps
    doubling, so asking stays near its budget (`ASK_BUDGET`) of the time. The output is the plain one."""
    spec = load_test_generator(llama_dir, speculative_tokens=4, speculation_mode="adaptive")
    cost = StepCostModel()
    for n in (1, 4, 16, 64):
        cost.anchor(n, 0.004 + 0.0001 * n)
    expensive_verification(cost, 4)  # 4 drafts never pay for verifying
    cost.learning = False
    spec.speculator.step_cost = cost
    now = [0]
    spec.speculator.clock = lambda: now[0]  # the time asking takes is what the drafter says
    asked = []

    def propose(reqs, caps):
        now[0] += int(ask_ms * 1e6)
        asked.append(len(asked))
        return [Draft(torch.full((cap,), 7)) for cap in caps]

    spec.speculation.drafter.propose = propose
    outputs = run(spec, PROMPTS[0], max_new_tokens=100)
    assert token_ids(outputs) == token_ids(run(plain, PROMPTS[0], max_new_tokens=100))
    # 99 decode steps: asked at steps 1, 2, 4, 8, then 1 in 8 (15 asks); or at 1, 2, 4, 8, 16, 32, 64 (7).
    assert len(asked) == (15 if ask_ms == 0 else 7), asked


def test_confidences_are_calibrated_by_what_their_drafts_achieved():
    calibration = ConfidenceCalibration()
    assert calibration.value("suffix", 0.65) == 0.65 and calibration.ceiling("suffix") == 1.0  # nothing known
    for _ in range(20):  # drafts that said 0.6-0.7 were rejected at once; those that said 0.9+ were accepted
        calibration.observe("suffix", 0.65, 4, 0)
        calibration.observe("suffix", 0.95, 4, 4)
    assert calibration.value("suffix", 0.62) < 0.1 < 0.9 < calibration.value("suffix", 0.99)
    assert calibration.value("suffix", 0.35) == 0.35  # a bin without a record: the confidence itself
    assert calibration.value("ngram", 0.65) == 0.65  # per method
    assert calibration.ceiling("suffix") > 0.9
    for _ in range(200):  # now the 0.9+ drafts fail too: no confidence is worth asking for
        calibration.observe("suffix", 0.95, 4, 0)
    assert calibration.ceiling("suffix") < 0.2
    # Not asked, the records fade: drafting is tried again some steps later, not never.
    steps = 0
    while calibration.ceiling("suffix") < 0.5:
        calibration.drift("suffix")
        steps += 1
    assert 20 < steps < 300, steps


def test_granted_drafts_are_judged_by_the_tokens_they_were_accepted_for():
    """Drafts granted on high estimates that accept half what was expected have their gains halved: a draft
    worth granting at face value no longer is; drafts doing better than expected keep their estimates."""
    realized = RealizedAcceptance()
    assert realized.factor("ngram") == 1.0
    for _ in range(100):
        realized.observe("ngram", 2.0, 1)
        realized.observe("suffix", 1.0, 3)
    assert 0.45 < realized.factor("ngram") < 0.55 and realized.factor("suffix") == 1.0
    expensive = fitted(0.020, 0.020)  # an extra token costs half a step: worth it at 60% acceptance, not 30%
    assert choose_draft_lengths([4], [0.6], expensive, "adaptive")[0] >= 1
    assert choose_draft_lengths([4], [0.6], expensive, "adaptive", [realized.factor("ngram")]) == [0]
    assert choose_draft_lengths([4], [0.6], expensive, "adaptive", [realized.factor("suffix")])[0] >= 1


def test_confident_drafts_that_fail_stop_being_asked_for(llama_dir, plain):
    """A drafter that claims 0.9 confidence for drafts that are always wrong is verified for fewer drafts at
    each step, then not at all and rarely asked (its confidence is judged by what its drafts achieved); the
    output is the plain one."""
    spec = load_test_generator(llama_dir, speculative_tokens=4, speculation_mode="adaptive")
    cost = StepCostModel(learning=False)  # a draft costs a tenth of a step: worth it above 10% acceptance
    for n in (1, 4, 16, 64):
        cost.anchor(n, 0.004 + 0.0004 * n)
    spec.speculator.step_cost = cost
    proposals = []

    def propose(reqs, caps):
        proposals.append(caps[0])
        return [Draft(torch.full((cap,), 7), confidence=0.9) for cap in caps]

    spec.speculation.drafter.propose = propose
    spec.speculation.drafter.confident = True
    prompt = PROMPTS[0]
    outputs = run(spec, prompt, max_new_tokens=96)
    assert token_ids(outputs) == token_ids(run(plain, prompt, max_new_tokens=96))
    asked = [cap for cap in proposals if cap > 0]
    assert len(asked) <= 48, proposals  # 95 decode steps; trusting the confidence, every one was asked
    verified = [o.num_drafted for o in outputs if o.num_drafted]
    assert len(verified) <= 30 and not any(o.num_drafted for o in outputs[-40:]), verified


def test_a_cost_fit_that_withholds_every_draft_wears_off(llama_dir, plain):
    """A verification cost fitted far too high (one step's excess read as a per-draft cost) puts the bar above
    every request and above the best a confident drafter's drafts achieved, so it is not even asked for drafts.
    Those steps count as declined: the fitted excess fades, drafts are asked for within some steps, and once
    measured at what they really cost they keep being verified. Before, nothing was proposed, so nothing was
    declined, and the bar stayed where one step had put it."""
    spec = load_test_generator(llama_dir, speculative_tokens=4, speculation_mode="adaptive")
    spec.speculator.agreed_seconds = lambda nanoseconds: 0.010  # every step takes 10 ms, verifying or not
    cost = StepCostModel()
    for n in (1, 4, 16, 64):
        cost.anchor(n, 0.004 + 0.0001 * n)
    for _ in range(20):
        cost.observe(1, 0.010)
    for d in (3, 1) * 10:  # read as 12 ms per draft: the bar is 1.2, once the fit has grown to it
        cost.observe_speculative(1, 0.010 + 0.012 * d, d)
    spec.speculator.step_cost = cost
    assert drafting_bar(1, cost) > 1.0
    prompt = PROMPTS[3]
    expected = token_ids(run(plain, prompt, max_new_tokens=64))
    for _ in range(20):  # its confident drafts were accepted in full
        spec.speculator.calibration.observe("ngram", 0.95, 4, 4)

    def propose(reqs, caps):  # the plain output's next tokens, confidently
        return [Draft(torch.tensor(expected[r.num_generated:r.num_generated + cap]), confidence=0.95)
                for r, cap in zip(reqs, caps)]

    spec.speculation.drafter.propose = propose
    spec.speculation.drafter.confident = True
    outputs = run(spec, prompt, max_new_tokens=64)
    assert token_ids(outputs) == expected
    verifying = [i for i, o in enumerate(outputs) if o.num_drafted]
    assert verifying and verifying[0] < 30, verifying
    assert len(verifying) >= 8 and verifying[-1] >= len(outputs) - 2, verifying  # once measured, drafts pay


def test_a_stale_plain_cost_makes_the_next_step_plain(llama_dir, plain, monkeypatch):
    """Every verifying step here reports P as stale: the step after each runs without drafts (and is measured),
    and output is unchanged."""
    spec = load_test_generator(llama_dir, speculative_tokens=4, speculation_mode="adaptive")
    prompt = PROMPTS[3]
    expected = token_ids(run(plain, prompt, max_new_tokens=48))

    def propose(reqs, caps):  # the plain output's next tokens
        return [Draft(torch.tensor(expected[r.num_generated:r.num_generated + cap])) for r, cap in zip(reqs, caps)]

    spec.speculation.drafter.propose = propose
    cost = spec.speculator.step_cost
    real_observe = cost.observe_speculative

    def observe_speculative(num_sequences, seconds, num_drafts):
        real_observe(num_sequences, seconds, num_drafts)
        cost.plain_is_stale = True

    monkeypatch.setattr(cost, "observe_speculative", observe_speculative)
    outputs = run(spec, prompt, max_new_tokens=48)
    assert token_ids(outputs) == expected
    verifying = [i for i, o in enumerate(outputs) if o.num_drafted]
    assert len(verifying) >= 3 and all(b - a >= 2 for a, b in zip(verifying, verifying[1:])), verifying


def test_the_cost_of_a_verifying_step_includes_choosing_its_tokens(llama_dir, monkeypatch):
    """Drawing and checking a token at every verified position is part of what drafts cost: a verifying step
    is timed up to its accepted tokens, as a plain step is up to its sampled ones. With the acceptance made
    30 ms slower, every verifying step reports at least those 30 ms to the cost model (it used to be timed at
    the end of the forward, a few milliseconds)."""
    import time

    import specula_server.speculation.speculator as speculator_module  # the speculator runs the acceptance

    slow_by = 0.03
    real_verify = speculator_module.verify

    def slow_verify(*args, **kwargs):
        time.sleep(slow_by)
        return real_verify(*args, **kwargs)

    monkeypatch.setattr(speculator_module, "verify", slow_verify)
    spec = load_test_generator(llama_dir, speculative_tokens=4, speculation_mode="fixed")
    reported = []
    real_observe = spec.speculator.step_cost.observe_speculative

    def observe_speculative(num_sequences, seconds, num_drafts):
        reported.append(seconds)
        real_observe(num_sequences, seconds, num_drafts)

    monkeypatch.setattr(spec.speculator.step_cost, "observe_speculative", observe_speculative)
    outputs = run(spec, PROMPTS[0], max_new_tokens=24)
    assert sum(o.num_drafted for o in outputs) > 0
    assert reported and min(reported) >= slow_by, reported


def test_a_plain_step_is_priced_without_the_ask_that_found_nothing_worth_verifying(llama_dir, plain, monkeypatch):
    """A drafter that takes 200 ms to propose drafts the controller then declines: the ask's time is weighed as an
    ask (the back-off's measured cost), and the plain cost model sees the step without it. Counted as a plain
    step, a costly first ask (suffix trees built over 32 new prompts) made P three times what a step costs,
    and drafts look free beside such a P. (The ask is far longer than a step of the test model, ~1-4 ms, so that
    a step the machine happens to stall for tens of milliseconds is not taken for one that included it.)"""
    import time

    spec = load_test_generator(llama_dir, speculative_tokens=4, speculation_mode="adaptive")
    cost = StepCostModel()
    for n in (1, 4, 16, 64):
        cost.anchor(n, 0.004 + 0.0001 * n)
    expensive_verification(cost, 4)  # the drafts are always declined
    spec.speculator.step_cost = cost
    ask_s = 0.2

    def propose(reqs, caps):
        time.sleep(ask_s)
        return [Draft(torch.full((cap,), 7)) for cap in caps]

    spec.speculation.drafter.propose = propose
    plain_steps = []
    real_observe = cost.observe
    monkeypatch.setattr(cost, "observe", lambda n, seconds: (plain_steps.append(seconds), real_observe(n, seconds)))
    outputs = run(spec, PROMPTS[0], max_new_tokens=24)
    assert token_ids(outputs) == token_ids(run(plain, PROMPTS[0], max_new_tokens=24))
    assert sum(o.num_drafted for o in outputs) == 0
    assert len(plain_steps) >= 20 and max(plain_steps) < ask_s, plain_steps  # the test model's steps take ~ms
    assert spec.speculator._ask_cost is not None and spec.speculator._ask_cost > 5  # in plain steps of ~1-4 ms
