"""Medusa drafting in the worker: per-request and server-wide heads, chains and trees, exact verification."""

from __future__ import annotations

import pytest
import torch
from test_speculation import PROMPTS, memory_bound_costs

from specula_server.params import SamplingParams
from specula_server.speculation.drafters import Draft
from specula_server.speculation.medusa import best_first_tree
from specula_testing.adapters import build_medusa_adapter
from specula_testing.worker import (
    BlockPool,
    assert_same_greedy_output,
    generate_alone,
    load_test_generator,
    make_spec,
    run_steps,
    token_ids,
)


@pytest.fixture(scope="module")
def plain(llama_dir):
    return load_test_generator(llama_dir)


@pytest.fixture(scope="module")
def medusa_dir(llama_dir, tmp_path_factory):
    return build_medusa_adapter(llama_dir, tmp_path_factory.mktemp("medusa") / "heads", num_heads=3)


def speculative(llama_dir, **settings):
    generator = load_test_generator(llama_dir, speculative_tokens=4, speculation_mode="fixed", **settings)
    generator.speculator.step_cost = memory_bound_costs()
    return generator


def run(generator, prompt, request_id=0, **kwargs):
    return generate_alone(generator, make_spec(request_id, prompt, BlockPool(256, 16), lookahead=8, **kwargs))


def run_together(generator, specs):
    """Runs the requests as one batch to completion; returns every step's outputs."""
    return run_steps(generator, specs)


def test_best_first_tree_takes_the_most_likely_nodes_parents_first():
    logprobs = torch.log(torch.tensor([[0.9, 0.1], [0.5, 0.4], [0.99, 0.01]]))
    ids = torch.tensor([[10, 11], [20, 21], [30, 31]])
    tree = best_first_tree(logprobs, ids, budget=4)
    # 10 (0.9), 10-20 (0.45), 10-20-30 (0.4455), 10-21 (0.36): the spine first, then the best alternative.
    assert tree.tokens.tolist() == [10, 20, 30, 21]
    assert tree.parents.tolist() == [-1, 0, 1, 0]
    assert tree.depths() == [1, 2, 3, 2]
    assert best_first_tree(logprobs[:, :1], ids[:, :1], budget=5).is_chain  # width 1: the top-1 chain
    assert best_first_tree(logprobs[:, :1], ids[:, :1], budget=5).tokens.tolist() == [10, 20, 30]
    assert len(best_first_tree(logprobs, ids, budget=0)) == 0


def test_tree_ancestor_mask():
    tree = Draft(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, 0, 0, 1]))
    seen = tree.ancestors()
    # rows/columns: root, 5, 6, 7 (a sibling of 6), 8 (under 6)
    assert seen.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 1, 0],
                                   [1, 1, 1, 0, 1]]


class OracleTreeDrafter:
    """Knows each request's greedy continuation and hides it in a tree: the first child of every node is a
    wrong token and the right one is its sibling, so every accepted node is off the first branch and its KV
    must be moved into place. Exercises the tree mask, positions and compaction independently of any heads."""

    name = "oracle"

    def __init__(self, continuations: dict[int, list[int]], vocab: int) -> None:
        self.continuations = continuations
        self.vocab = vocab

    def method_for(self, request) -> str:
        return self.name

    def propose(self, requests, max_tokens):
        drafts = []
        for r, budget in zip(requests, max_tokens):
            future = self.continuations[r.id][r.num_generated:]
            tokens, parents, parent = [], [], -1
            for right in future:
                if len(tokens) + 2 > budget:
                    break
                wrong = (right + 1) % self.vocab
                tokens += [wrong, right]
                parents += [parent, parent]
                parent = len(tokens) - 1
            drafts.append(Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long)))
        return drafts


def run_oracle(llama_dir, plain, drafter_class, max_new_tokens):
    """Every prompt in one batch, drafted by an oracle tree drafter; returns the plain greedy tokens, the
    tokens generated with the trees, and every step's outputs."""
    expected = {i: token_ids(run(plain, p, max_new_tokens=max_new_tokens)) for i, p in enumerate(PROMPTS)}
    generator = speculative(llama_dir)
    generator.speculation = generator.speculator.config = type(generator.speculation)(
        drafter_class(expected, generator.model.config.vocab_size), max_tokens=8, mode="fixed")
    pool = BlockPool(256, 16)
    specs = [make_spec(i, p, pool, max_new_tokens=max_new_tokens, lookahead=8) for i, p in enumerate(PROMPTS)]
    got = {i: [] for i in expected}
    outputs = run_together(generator, specs)
    for out in outputs:
        got[out.request_id] += [t.id for t in out.tokens]
    return expected, got, outputs


def test_tree_verification_with_off_branch_acceptance_is_exact(llama_dir, plain):
    expected, got, outputs = run_oracle(llama_dir, plain, OracleTreeDrafter, max_new_tokens=24)
    assert got == expected
    # Every tree holds the right continuation: each step accepts its whole right path.
    decodes = [o for o in outputs if o.num_drafted]
    assert decodes and sum(o.num_accepted for o in decodes) >= 2 * len(decodes)


@pytest.mark.parametrize("width", [1, 3])
def test_server_wide_medusa_keeps_greedy_output(llama_dir, plain, medusa_dir, width):
    generator = speculative(llama_dir, speculator=str(medusa_dir), draft_tree_width=width)
    assert generator.speculation.drafter.name == "medusa"
    drafted = 0
    for got in assert_same_greedy_output(plain, generator, PROMPTS, run, max_new_tokens=20):
        drafted += sum(o.num_drafted for o in got)
        assert {o.draft_method for o in got if o.num_drafted} <= {"medusa"}
    assert drafted > 0


def test_per_request_medusa_adapter_beside_prompt_lookup(llama_dir, plain, medusa_dir):
    generator = speculative(llama_dir, adapter_dirs=(medusa_dir.parent,), draft_tree_width=2)
    loaded = generator.adapters.load("heads", "local")
    assert loaded.kind == "medusa" and loaded.medusa is not None and not loaded.projections
    expected = {i: token_ids(run(plain, p, max_new_tokens=20)) for i, p in enumerate(PROMPTS)}
    pool = BlockPool(256, 16)
    specs = [make_spec(i, p, pool, max_new_tokens=20, lookahead=8, adapter_id="heads" if i % 2 else "")
             for i, p in enumerate(PROMPTS)]
    got = {i: [] for i in expected}
    methods = {i: set() for i in expected}
    for out in run_together(generator, specs):
        got[out.request_id] += [t.id for t in out.tokens]
        if out.num_drafted:
            methods[out.request_id].add(out.draft_method)
    assert got == expected
    assert methods[1] == methods[3] == {"medusa"}
    assert methods[0] <= {"ngram"} and methods[2] <= {"ngram"} and methods[0] | methods[2]


def test_medusa_sampling_is_reproducible_with_a_seed(llama_dir, medusa_dir):
    """Sampling with a seed gives the same tokens with tree drafts as without any (one draw per emitted
    token, from the same distribution)."""
    plain_gen = load_test_generator(llama_dir)
    generator = speculative(llama_dir, speculator=str(medusa_dir), draft_tree_width=3)
    params = SamplingParams(temperature=0.8, top_k=20, seed=7, do_sample=True)
    for prompt in PROMPTS[:2]:
        expected = token_ids(run(plain_gen, prompt, max_new_tokens=16, sampling=params))
        assert token_ids(run(generator, prompt, max_new_tokens=16, sampling=params)) == expected


def test_speculator_must_be_medusa_heads(llama_dir, tmp_path):
    from specula_testing.adapters import build_lora_adapter

    lora = build_lora_adapter(llama_dir, tmp_path / "lora", rank=4)
    with pytest.raises(ValueError, match="--speculator .*: a lora adapter"):
        load_test_generator(llama_dir, speculative_tokens=2, speculator=str(lora))


class UnevenTreeDrafter(OracleTreeDrafter):
    """The oracle's trees cut to 0, 1 and many nodes in one batch, as the adaptive controller cuts them under
    load: an empty tree and a one-node tree must verify like chains beside a real tree."""

    def propose(self, requests, max_tokens):
        drafts = super().propose(requests, [8] * len(requests))
        return [d.truncated((0, 1, 8, 5)[r.id % 4]) for r, d in zip(requests, drafts)]


def test_trees_cut_to_no_node_or_one_node_beside_real_trees(llama_dir, plain):
    expected, got, _ = run_oracle(llama_dir, plain, UnevenTreeDrafter, max_new_tokens=16)
    assert got == expected
