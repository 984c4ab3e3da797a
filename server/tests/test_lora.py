"""Per-request LoRA adapters in the worker, against transformers + peft on the same weights."""

from __future__ import annotations

import pytest
import torch
from test_model_parity import reference_greedy
from test_tensor_parallel import spawn_ranks

from specula_server.adapters.sources import AdapterError
from specula_server.params import SamplingParams
from specula_testing.adapters import build_lora_adapter, load_peft_reference
from specula_testing.worker import (
    BlockPool,
    generate_alone,
    load_test_generator,
    make_spec,
    run_steps,
    step,
    token_ids,
)

PROMPTS = [[1, 50, 60, 70, 80, 90, 100], [1, 7, 8, 7, 8, 7], [1] + list(range(100, 140))]
NUM_NEW = 24


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, llama_dir):
    """Two adapters of different shapes: rank 4 on q and v; rank 16 with rslora on all seven projections."""
    root = tmp_path_factory.mktemp("adapters")
    build_lora_adapter(llama_dir, root / "small", rank=4, alpha=8, target_modules=["q_proj", "v_proj"], seed=1)
    build_lora_adapter(llama_dir, root / "large", rank=16, alpha=32, use_rslora=True, seed=2)
    return root


@pytest.fixture(scope="module")
def references(llama_dir, adapters):
    """Greedy tokens and logprobs of every prompt: base, and with each adapter (by full forward passes)."""
    import transformers

    models = {"": transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()}
    for name in ("small", "large"):
        models[name] = load_peft_reference(llama_dir, adapters / name)
    return {(name, i): reference_greedy(model, prompt, NUM_NEW)
            for name, model in models.items() for i, prompt in enumerate(PROMPTS)}


def loaded_generator(llama_dir, adapters, **settings):
    generator = load_test_generator(llama_dir, adapter_dirs=(adapters,), **settings)
    for name in ("small", "large"):
        generator.adapters.load(name, "local")
    return generator


def test_each_adapter_alone_matches_peft(llama_dir, adapters, references):
    for name in ("small", "large"):  # the adapters really change the model's choices
        assert any(references[(name, i)][0] != references[("", i)][0] for i in range(len(PROMPTS))), name
    generator = loaded_generator(llama_dir, adapters)
    for name in ("small", "large", ""):
        for i, prompt in enumerate(PROMPTS):
            spec = make_spec(i, prompt, BlockPool(256, 16), max_new_tokens=NUM_NEW, adapter_id=name)
            outputs = generate_alone(generator, spec)
            expected_tokens, expected_logprobs = references[(name, i)]
            assert token_ids(outputs) == expected_tokens, (name, i)
            assert [t.logprob for o in outputs for t in o.tokens] == pytest.approx(expected_logprobs, abs=1e-4)


def run_mixed_batch(generator) -> dict[tuple[str, int], list[int]]:
    """Base requests and both adapters' requests, interleaved in one batch, decoded together."""
    pool = BlockPool(generator.kv_cache.num_blocks, 16)
    order = [(name, i) for i in range(len(PROMPTS)) for name in ("small", "", "large")]
    specs = [make_spec(k, PROMPTS[i], pool, max_new_tokens=NUM_NEW, adapter_id=name, lookahead=4)
             for k, (name, i) in enumerate(order)]
    tokens: dict[int, list[int]] = {k: [] for k in range(len(order))}
    for out in run_steps(generator, specs):
        assert not out.error, out.error
        tokens[out.request_id].extend(t.id for t in out.tokens)
    return {key: tokens[k] for k, key in enumerate(order)}


@pytest.mark.parametrize("settings", [{}, {"speculative_tokens": 3, "speculation_mode": "fixed"}])
def test_mixed_batch_matches_peft(llama_dir, adapters, references, settings):
    """Each request gets its own adapter's tokens whatever shares its batch, with speculation too."""
    generator = loaded_generator(llama_dir, adapters, **settings)
    for key, tokens in run_mixed_batch(generator).items():
        assert tokens == references[key][0], key


def test_requests_need_a_loaded_adapter_and_offload_frees_the_slot(llama_dir, adapters):
    generator = load_test_generator(llama_dir, adapter_dirs=(adapters,), max_active_adapters=1)
    spec = make_spec(0, PROMPTS[0], BlockPool(256, 16), max_new_tokens=4, adapter_id="small")
    (failed,) = step(generator, new=[spec])  # the request fails alone, the step goes on
    assert "adapter `small` is not loaded" in failed.error and failed.request_id == 0 and not failed.tokens
    assert generator.requests == {}
    first = generator.adapters.load("small", "local")
    assert generator.adapters.load("small", "local") is first  # loading twice is a no-op
    with pytest.raises(AdapterError, match="slots are in use") as info:
        generator.adapters.load("large", "local")
    assert info.value.status == 424
    before = token_ids(generate_alone(generator, spec))
    assert generator.adapters.offload("small") and not generator.adapters.offload("small")
    generator.adapters.load("large", "local")  # reuses the slot, with wider stacks
    generator.adapters.offload("large")
    generator.adapters.load("small", "local")
    spec = make_spec(0, PROMPTS[0], BlockPool(256, 16), max_new_tokens=4, adapter_id="small")
    assert token_ids(generate_alone(generator, spec)) == before


def test_sampling_with_an_adapter_is_reproducible(llama_dir, adapters):
    generator = loaded_generator(llama_dir, adapters)
    sampling = SamplingParams(do_sample=True, temperature=0.9, seed=7)
    runs = [token_ids(generate_alone(generator, make_spec(0, PROMPTS[1], BlockPool(256, 16), max_new_tokens=12,
                                                          sampling=sampling, adapter_id="large")))
            for _ in range(2)]
    assert runs[0] == runs[1]


def _rank_main(rank, world_size, port, model_dir, adapters, queue) -> None:
    from specula_server.distributed import init_distributed

    torch.set_num_threads(1)
    group = init_distributed(rank, world_size, "127.0.0.1", port, torch.device("cpu"))
    try:
        generator = load_test_generator(model_dir, group=group, adapter_dirs=(adapters,))
        for name in ("small", "large"):
            generator.adapters.load(name, "local")
        queue.put((rank, run_mixed_batch(generator)))
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_shard_adapters_and_match_peft(llama_dir, adapters, references):
    results = spawn_ranks(_rank_main, 2, llama_dir, adapters, timeout=180)
    for rank in (0, 1):
        for key, tokens in results[rank].items():
            assert tokens == references[key][0], (rank, key)
