"""Merged LoRA adapters (LoRAX's `merged_adapters`) in the worker, against transformers + peft's
`add_weighted_adapter` on the same adapters, weights and density.

DARE's drops are random: peft draws them from torch's global generator (after its own weight initialisation of the
new adapter has drawn from it too), the worker from a generator seeded with the merge's seed. The reference runs
peft's `add_weighted_adapter` with `torch.bernoulli` drawing from a generator seeded the same way: peft's own code
and order, the worker's masks.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from test_model_parity import reference_greedy
from test_tensor_parallel import spawn_ranks

from specula_server.adapters.lora import read_lora
from specula_server.adapters.merge import MergeSpec, combine, merge_lora
from specula_server.adapters.sources import AdapterError
from specula_server.models.config import ModelConfig
from specula_testing.adapters import build_lora_adapter, build_medusa_adapter
from specula_testing.worker import (
    BlockPool,
    generate_alone,
    load_test_generator,
    make_spec,
    run_steps,
    token_ids,
)

PROMPTS = [[1, 50, 60, 70, 80, 90, 100], [1, 7, 8, 7, 8, 7, 8, 7], [1] + list(range(100, 130))]
NUM_NEW = 16
# Every strategy on adapters of one rank (merged factor by factor), and on adapters of different ranks (PEFT's
# `cat` for linear, its SVD variants for the others).
MERGES = {
    "linear": MergeSpec(("m1", "m2"), (0.7, 0.5)),
    "ties": MergeSpec(("m1", "m2"), (1.0, 0.6), "ties", density=0.5),
    "ties-frequency": MergeSpec(("m2", "m1"), (0.9, -0.4), "ties", density=0.7, majority_sign_method="frequency"),
    "dare_linear": MergeSpec(("m1", "m2"), (0.8, 0.4), "dare_linear", density=0.6, seed=5),
    "dare_ties": MergeSpec(("m1", "m2"), (0.6, 0.6), "dare_ties", density=0.5, majority_sign_method="frequency",
                           seed=9),
    "linear-ranks": MergeSpec(("m1", "m3"), (0.6, -0.4)),
    "ties-ranks": MergeSpec(("m3", "m1"), (0.5, 0.8), "ties", density=0.6),
    "dare_ties-ranks": MergeSpec(("m1", "m3"), (0.7, 0.7), "dare_ties", density=0.7, seed=3),
}
PEFT_COMBINATION = {("linear", False): "cat", ("ties", False): "ties_svd", ("dare_linear", False): "dare_linear_svd",
                    ("dare_ties", False): "dare_ties_svd"}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, llama_dir):
    """m1 and m2 of one rank on different projections, m3 of a smaller rank; r1 with rslora."""
    root = tmp_path_factory.mktemp("merge-adapters")
    build_lora_adapter(llama_dir, root / "m1", rank=8, alpha=16, seed=11, std=0.08)
    build_lora_adapter(llama_dir, root / "m2", rank=8, alpha=8, seed=12, std=0.08,
                       target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"])
    build_lora_adapter(llama_dir, root / "m3", rank=4, alpha=8, seed=13, std=0.1,
                       target_modules=["q_proj", "v_proj", "up_proj"])
    build_lora_adapter(llama_dir, root / "r1", rank=8, alpha=16, use_rslora=True, seed=14)
    build_medusa_adapter(llama_dir, root / "heads", num_heads=2)
    return root


def peft_merged(llama_dir, root, spec: MergeSpec):
    """transformers + peft with `add_weighted_adapter` of the same adapters (see the module docstring for DARE)."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, root / spec.adapter_ids[0], adapter_name=spec.adapter_ids[0])
    for adapter_id in spec.adapter_ids[1:]:
        model.load_adapter(root / adapter_id, adapter_name=adapter_id)
    ranks = {model.peft_config[a].r for a in spec.adapter_ids}
    combination = PEFT_COMBINATION.get((spec.strategy, len(ranks) == 1), spec.strategy)
    generator, bernoulli = torch.Generator().manual_seed(spec.seed), torch.bernoulli
    with mock.patch("torch.bernoulli", lambda p, *args, **kwargs: bernoulli(p, generator=generator)):
        model.add_weighted_adapter(list(spec.adapter_ids), list(spec.weights), "merged", combination_type=combination,
                                   density=spec.density, majority_sign_method=spec.majority_sign_method)
    model.set_adapter("merged")
    return model.eval()


@pytest.fixture(scope="module")
def references(llama_dir, adapters):
    import transformers

    from specula_testing.adapters import load_peft_reference

    models = {"": transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval(),
              "m1": load_peft_reference(llama_dir, adapters / "m1"),
              "m2": load_peft_reference(llama_dir, adapters / "m2")}
    models.update({name: peft_merged(llama_dir, adapters, spec) for name, spec in MERGES.items()})
    return {(name, i): reference_greedy(model, prompt, NUM_NEW)
            for name, model in models.items() for i, prompt in enumerate(PROMPTS)}


def merged_generator(llama_dir, adapters, **settings):
    generator = load_test_generator(llama_dir, adapter_dirs=(adapters,), max_active_adapters=len(MERGES) + 2,
                                    **settings)
    for name in ("m1", "m2"):
        generator.adapters.load(name, "local")
    for name, spec in MERGES.items():
        generator.adapters.load(name, "local", merge=spec)
    return generator


def test_each_merge_alone_matches_peft(llama_dir, adapters, references):
    generator = merged_generator(llama_dir, adapters)
    for name in MERGES:
        # The merge really changes the model's choices, away from the base model and from each adapter alone.
        for other in ("", "m1", "m2"):
            assert any(references[(name, i)][0] != references[(other, i)][0] for i in range(len(PROMPTS))), (name,
                                                                                                            other)
        for i, prompt in enumerate(PROMPTS):
            spec = make_spec(i, prompt, BlockPool(256, 16), max_new_tokens=NUM_NEW, adapter_id=name)
            outputs = generate_alone(generator, spec)
            expected_tokens, expected_logprobs = references[(name, i)]
            assert token_ids(outputs) == expected_tokens, (name, i)
            assert [t.logprob for o in outputs for t in o.tokens] == pytest.approx(expected_logprobs, abs=1e-4)


def run_mixed_batch(generator, names) -> dict[tuple[str, int], list[int]]:
    """Merged, single-adapter and base requests interleaved in one batch, decoded together."""
    pool = BlockPool(generator.kv_cache.num_blocks, 16)
    order = [(name, i) for i in range(len(PROMPTS)) for name in names]
    specs = [make_spec(k, PROMPTS[i], pool, max_new_tokens=NUM_NEW, adapter_id=name, lookahead=4)
             for k, (name, i) in enumerate(order)]
    tokens: dict[int, list[int]] = {k: [] for k in range(len(order))}
    for out in run_steps(generator, specs):
        assert not out.error, out.error
        tokens[out.request_id].extend(t.id for t in out.tokens)
    return {key: tokens[k] for k, key in enumerate(order)}


@pytest.mark.parametrize("settings", [
    {}, {"speculative_tokens": 3, "speculation_mode": "fixed"},
    {"speculative_tokens": 3, "speculation_mode": "fixed", "speculator": "suffix"},
    {"speculative_tokens": 3, "speculation_mode": "fixed", "speculator": "heads", "draft_tree_width": 2},
], ids=["plain", "prompt-lookup", "suffix", "base-medusa-heads"])
def test_merges_batched_with_single_adapters_and_base_match_peft(llama_dir, adapters, references, settings):
    """Each request gets its own merge's tokens whatever shares its batch, and speculation (prompt lookup, suffix
    trees, the base model's Medusa heads drafting for merged requests too) stays exact."""
    if settings.get("speculator") == "heads":
        settings = {**settings, "speculator": str(adapters / "heads")}
    generator = merged_generator(llama_dir, adapters, **settings)
    for key, tokens in run_mixed_batch(generator, ["linear", "m1", "", "dare_ties", "ties-ranks", "m2"]).items():
        assert tokens == references[key][0], key


def test_a_merge_of_one_adapter_with_weight_one_is_that_adapter(llama_dir, adapters):
    generator = load_test_generator(llama_dir, adapter_dirs=(adapters,))
    for adapter_id in ("m1", "r1"):  # r1 with rslora: PEFT would scale its merge by sqrt(r); we do not
        generator.adapters.load(adapter_id, "local")
        generator.adapters.load(f"merge of {adapter_id}", "local", merge=MergeSpec((adapter_id,), (1.0,), "ties", 0.3))
        for i, prompt in enumerate(PROMPTS):
            alone, merged = (generate_alone(generator, make_spec(i, prompt, BlockPool(256, 16), max_new_tokens=NUM_NEW,
                                                                 adapter_id=name))
                             for name in (adapter_id, f"merge of {adapter_id}"))
            assert token_ids(merged) == token_ids(alone), (adapter_id, i)
            assert ([t.logprob for o in merged for t in o.tokens]
                    == pytest.approx([t.logprob for o in alone for t in o.tokens], abs=1e-5))


def test_dare_merges_depend_on_the_seed_only(llama_dir, adapters):
    config = ModelConfig.from_dir(llama_dir)
    sources = [read_lora(adapters / name, config)[:2] for name in ("m1", "m2")]
    spec = MERGES["dare_linear"]

    def merged(seed):
        return merge_lora(MergeSpec(spec.adapter_ids, spec.weights, spec.strategy, spec.density, seed=seed), sources)

    (config_a, a), (_, b), (_, c) = merged(5), merged(5), merged(6)
    assert config_a.rank == 8 and config_a.scaling == 1.0
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k][0], b[k][0]) and torch.equal(a[k][1], b[k][1]) for k in a)
    assert not all(torch.equal(a[k][0], c[k][0]) for k in a)


def test_combine_worked_example():
    tensors, spec = [torch.tensor([[1.0, -2.0]]), torch.tensor([[3.0, 1.0]])], MergeSpec(("a", "b"), (1.0, 1.0))
    merged = combine(tensors, [1.0, 1.0], "ties", spec, torch.Generator())
    assert merged.tolist() == [[2.0, -2.0]]
    assert combine(tensors, [0.5, 2.0], "linear", spec, torch.Generator()).tolist() == [[6.5, 1.0]]


def test_only_lora_adapters_merge(llama_dir, adapters):
    generator = load_test_generator(llama_dir, adapter_dirs=(adapters,))
    with pytest.raises(AdapterError, match="adapter `heads`: only LoRA adapters can be merged") as info:
        generator.adapters.load("merged", "local", merge=MergeSpec(("m1", "heads"), (1.0, 1.0)))
    assert info.value.status == 424 and "merged" not in generator.adapters.adapters
    with pytest.raises(AdapterError, match="adapter `missing`"):
        generator.adapters.load("merged", "local", merge=MergeSpec(("m1", "missing"), (1.0, 1.0)))
    with pytest.raises(ValueError, match=r"density must be in \(0, 1\] for ties"):
        MergeSpec(("m1",), (1.0,), "ties", density=0.0)


def _rank_main(rank, world_size, port, model_dir, adapters, queue) -> None:
    from specula_server.distributed import init_distributed

    torch.set_num_threads(1)
    group = init_distributed(rank, world_size, "127.0.0.1", port, torch.device("cpu"))
    try:
        generator = load_test_generator(model_dir, group=group, adapter_dirs=(adapters,),
                                        max_active_adapters=len(MERGES) + 2)
        generator.adapters.load("m1", "local")
        for name in ("ties", "dare_ties", "linear-ranks", "dare_ties-ranks"):
            generator.adapters.load(name, "local", merge=MERGES[name])
        queue.put((rank, run_mixed_batch(generator, ["ties", "m1", "dare_ties", "", "linear-ranks",
                                                     "dare_ties-ranks"])))
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_merge_alike_and_match_peft(llama_dir, adapters, references):
    results = spawn_ranks(_rank_main, 2, llama_dir, adapters, timeout=300)
    for rank in (0, 1):
        for key, tokens in results[rank].items():
            assert tokens == references[key][0], (rank, key)
