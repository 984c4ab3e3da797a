"""OpenAI's `logit_bias` in the worker: the sampler adds it before everything else, and every consumer of the
processed distribution (greedy choice, sampling, reported log-probs, speculative verification, the draft model)
sees the same biased logits, so greedy output with speculation equals greedy output without it."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_speculation import PROMPTS, memory_bound_costs
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from specula_proto import generate_pb2 as pb
from specula_server.generator import InvalidRequestError
from specula_server.params import SamplingParams
from specula_server.sampling import Sampler, SamplingRow
from specula_server.service import request_from_pb
from specula_testing.worker import (
    BlockPool,
    assert_same_greedy_output,
    generate_alone,
    load_test_generator,
    make_spec,
    token_ids,
)

VOCAB = 16


def logits_of(num_rows: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, VOCAB, generator=generator) * 3  # [num_rows, VOCAB]


def row(bias: dict[int, float] | None = None, history: tuple[int, ...] = (), **params) -> SamplingRow:
    sampling = SamplingParams(logit_bias=tuple(sorted((bias or {}).items())), **params)
    generator = None if sampling.is_greedy else torch.Generator().manual_seed(sampling.seed)
    return SamplingRow(sampling, torch.tensor(history, dtype=torch.long), generator)


def biased(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    out = logits.clone()
    for token, value in bias.items():
        out[..., token] += value
    return out


# --- the sampler -----------------------------------------------------------------------------------------------

def test_minus_100_on_the_greedy_token_chooses_the_runner_up_and_reports_biased_logprobs():
    logits = logits_of(4)
    best, runner_up = logits.topk(2, dim=-1).indices.unbind(dim=-1)  # [4] each
    rows = [row({int(best[i]): -100.0}) for i in range(4)]
    result = Sampler()(logits, rows, num_top=3)
    assert torch.equal(result.token_ids, runner_up)
    expected = torch.stack([torch.log_softmax(biased(logits[i], {int(best[i]): -100.0}), dim=-1) for i in range(4)])
    torch.testing.assert_close(result.logprobs, expected.gather(1, runner_up[:, None])[:, 0])
    torch.testing.assert_close(result.top_logprobs, expected.topk(3, dim=-1).values)
    assert not (result.top_ids == best[:, None]).any()  # the banned token is not even an alternative


def test_plus_100_forces_a_token_greedy_or_sampled():
    logits = logits_of(1)
    least = int(logits.argmin())
    rows = [row({least: 100.0})] + [row({least: 100.0}, do_sample=True, temperature=1.5, seed=s) for s in range(64)]
    result = Sampler()(logits.expand(len(rows), -1), rows)
    assert result.token_ids.tolist() == [least] * len(rows)
    assert result.logprobs.max() <= 0 and result.logprobs.min() > -1e-6  # probability ~1


def test_the_bias_comes_before_the_penalties_and_touches_only_its_rows():
    logits = logits_of(3, seed=1)
    history = (2, 5, 5)
    bias = {5: 2.0, 9: -3.5}
    rows = [row(bias, history, repetition_penalty=1.3), row(None, history, repetition_penalty=1.3), row()]
    processed = Sampler().process(logits, rows)
    penalty = RepetitionPenaltyLogitsProcessor(1.3)
    ids = torch.tensor([history])
    first = penalty(ids, biased(logits[0:1], bias))[0]  # bias first, as vLLM orders them
    second = penalty(ids, logits[1:2].clone())[0]
    torch.testing.assert_close(processed[0], torch.log_softmax(first, dim=-1))
    torch.testing.assert_close(processed[1], torch.log_softmax(second, dim=-1))
    torch.testing.assert_close(processed[2], torch.log_softmax(logits[2], dim=-1))


def test_ids_past_the_logits_are_skipped():
    """A draft model's LM head may be narrower than the target's, whose vocabulary the router checks ids against."""
    logits = logits_of(1)
    processed = Sampler().process(logits, [row({3: 1.0, VOCAB: 50.0, VOCAB + 7: -50.0})])
    torch.testing.assert_close(processed[0], torch.log_softmax(biased(logits[0], {3: 1.0}), dim=-1))


def test_sampled_frequencies_follow_the_biased_distribution():
    num_draws = 20_000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.2, -2.0]])  # [1, 8]
    bias = {0: -1.5, 4: 2.5, 7: 3.0}
    generator = torch.Generator().manual_seed(4321)
    rows = [SamplingRow(SamplingParams(do_sample=True, logit_bias=tuple(sorted(bias.items())), seed=4321 + i),
                        torch.tensor([], dtype=torch.long), generator) for i in range(num_draws)]  # one seed each
    counts = torch.bincount(Sampler()(logits.expand(num_draws, -1), rows).token_ids, minlength=8).float()
    with_bias = torch.softmax(biased(logits[0], bias), dim=-1)
    without = torch.softmax(logits[0], dim=-1)

    def chi_square(probs: torch.Tensor) -> float:
        expected = probs * num_draws
        return ((counts - expected) ** 2 / expected).sum().item()

    # 7 degrees of freedom: 24.3 is the critical value at p = 0.001; the seed is fixed, so this is deterministic.
    assert chi_square(with_bias) < 30.0
    assert chi_square(without) > 1000.0  # and the unbiased distribution is clearly not what was drawn


# --- the gRPC edge ---------------------------------------------------------------------------------------------

def test_the_workers_message_becomes_sorted_pairs_and_bad_biases_are_refused(plain):
    def parsed(bias: dict[int, float]) -> tuple:
        message = pb.Request(id=7, input_ids=[1, 2], parameters=pb.NextTokenChooserParameters(logit_bias=bias),
                             stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=1))
        return request_from_pb(message, plain).sampling.logit_bias

    assert parsed({9: -100.0, 3: 0.5}) == ((3, 0.5), (9, -100.0))
    assert parsed({}) == ()
    vocab = plain.model.config.vocab_size
    for bad in ({vocab: 1.0}, {3: float("nan")}, {3: 101.0}, {3: float("-inf")}):
        with pytest.raises(InvalidRequestError, match="logit_bias"):
            parsed(bad)


# --- generation, with and without speculation ------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain(llama_dir):
    return load_test_generator(llama_dir)


@pytest.fixture(scope="module")
def speculative(llama_dir):
    generator = load_test_generator(llama_dir, speculative_tokens=4, speculation_mode="fixed")
    generator.speculator.step_cost = memory_bound_costs()
    return generator


def run(generator, prompt, **kwargs):
    return generate_alone(generator, make_spec(0, prompt, BlockPool(256, 16), **kwargs))


def most_common_tokens(generator, prompt, n: int = 30) -> list[int]:
    """The tokens greedy decoding emits most often: the ones prompt lookup drafts, so banning them makes the
    target reject drafts that the unbiased target would accept."""
    return [t for t, _ in Counter(token_ids(run(generator, prompt, max_new_tokens=n))).most_common(2)]


def test_banning_the_first_greedy_token_changes_the_first_token(plain):
    unbiased = run(plain, PROMPTS[1], max_new_tokens=1, top_n_tokens=2)
    first, runner_up = (t.id for t in unbiased[0].top_tokens[0])
    assert unbiased[0].tokens[0].id == first
    got = token_ids(run(plain, PROMPTS[1], max_new_tokens=5, sampling=SamplingParams(logit_bias=((first, -100.0),))))
    assert got[0] == runner_up and first not in got


def test_greedy_output_with_a_bias_is_identical_with_speculation(plain, speculative):
    drafted = changed = 0
    for prompt in PROMPTS:
        common = most_common_tokens(plain, prompt)
        sampling = SamplingParams(logit_bias=((common[0], -100.0), (common[-1], 1.5), (300, 4.0)))
        outputs = assert_same_greedy_output(plain, speculative, [prompt], run, max_new_tokens=30, sampling=sampling)
        drafted += sum(o.num_drafted for o in outputs[0])
        assert common[0] not in token_ids(outputs[0])
        changed += token_ids(outputs[0]) != token_ids(run(plain, prompt, max_new_tokens=30))
    assert drafted > 0 and changed == len(PROMPTS)  # speculation ran, and the bias changed every output


def test_seeded_sampling_with_a_bias_is_independent_of_speculation(plain, speculative):
    prompt = PROMPTS[0]
    bias = tuple(sorted((t, -100.0) for t in most_common_tokens(plain, prompt)))
    # A low temperature, so prompt lookup's drafts are verified and some accepted.
    sampling = SamplingParams(do_sample=True, temperature=0.05, seed=99, logit_bias=bias)
    expected = token_ids(run(plain, prompt, max_new_tokens=30, sampling=sampling))
    outputs = run(speculative, prompt, max_new_tokens=30, sampling=sampling)
    assert sum(o.num_drafted for o in outputs) > 0 and sum(o.num_accepted for o in outputs) > 0
    assert token_ids(outputs) == expected and not {t for t, _ in bias} & set(expected)


def test_a_self_drafting_draft_model_sees_the_bias_so_every_greedy_draft_is_accepted(llama_dir, plain):
    """With the target as its own draft model, drafts are accepted only if the draft biases its logits too."""
    self_drafted = load_test_generator(llama_dir, speculative_tokens=3, speculation_mode="fixed",
                                       speculator=str(llama_dir))
    for prompt in PROMPTS[:2]:
        sampling = SamplingParams(logit_bias=tuple(sorted((t, -100.0) for t in most_common_tokens(plain, prompt))))
        outputs = assert_same_greedy_output(plain, self_drafted, [prompt], run, max_new_tokens=20,
                                            sampling=sampling)[0]
        assert all(o.num_accepted == o.num_drafted for o in outputs)
        assert sum(o.num_drafted for o in outputs) > 0
