"""Non-finite values stay contained: adapters with NaN or infinite weights are refused at load, and a request
whose logits are not finite fails alone, never its neighbours in the batch or the requests after it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from specula_kernels.paged_attention import paged_attention, write_kv_cache
from specula_proto import generate_pb2 as pb
from specula_server.adapters import AdapterError, load_lora, load_medusa
from specula_server.batch import build_step
from specula_server.models.config import ModelConfig
from specula_server.nonfinite import kept_rows, nonfinite_requests
from specula_server.params import SamplingParams
from specula_server.request import StepOutput
from specula_server.service import TextGenerationService, generation_to_pb
from specula_server.speculation.drafters import PromptLookupDrafter
from specula_testing.adapters import build_lora_adapter, medusa_tensors
from specula_testing.worker import BlockPool, load_test_generator, make_spec, step

SHORT, MEDIUM, LONG = [1, 50, 60, 70, 80, 90, 100], [1, 7, 8, 7, 8, 7, 8, 7, 8, 7, 8], [1] + list(range(100, 140))
NUM_NEW = 12
SAMPLED = SamplingParams(do_sample=True, temperature=0.8, top_k=50, seed=11)
# Healthy rows: base and LoRA, greedy and sampled, contexts shorter and longer than the poisoned rows'.
HEALTHY = [("", SHORT, None), ("good", SHORT, None), ("", LONG, None), ("good", LONG, SAMPLED), ("", MEDIUM, SAMPLED)]
SPECULATION = [{}, {"speculative_tokens": 3, "speculation_mode": "fixed"}]


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory, llama_dir):
    root = tmp_path_factory.mktemp("adapters")
    build_lora_adapter(llama_dir, root / "good", rank=4, alpha=8, target_modules=["q_proj", "v_proj"], seed=1)
    build_lora_adapter(llama_dir, root / "poison", rank=4, alpha=8, seed=3)
    return root


def generator_with_adapters(llama_dir, adapter_root, **settings):
    generator = load_test_generator(llama_dir, adapter_dirs=(adapter_root,), **settings)
    for name in ("good", "poison"):
        generator.adapters.load(name, "local")
    return generator


def poison(generator, where: str) -> None:
    """Writes NaN into the loaded `poison` adapter's weights, past the load-time check (which would refuse
    them): "kv" in layer 0's q_proj A, so layer 1's keys and values go NaN too (in the request's KV slots);
    "logits" in the last layer's down_proj B, so only the final hidden state and the logits do."""
    registry = generator.adapters
    slot = registry.adapters["poison"].slot
    last = generator.model.config.num_layers - 1
    stack, key = (registry.stacks.a, (0, "q_proj")) if where == "kv" else (registry.stacks.b, (last, "down_proj"))
    stack[key][slot].fill_(math.nan)


def specs_for(rows, pool: BlockPool, first_id: int = 0):
    return [make_spec(first_id + k, prompt, pool, max_new_tokens=NUM_NEW, sampling=sampling, adapter_id=adapter,
                      lookahead=4) for k, (adapter, prompt, sampling) in enumerate(rows)]


def run_batch(generator, specs) -> tuple[dict[int, list], dict[int, str]]:
    """Runs requests started together to their end: each request's tokens, and the error of each request that
    failed. Checks that a failed request is reported once, with nothing but its error, and leaves the worker
    that step."""
    outputs = step(generator, new=specs)
    tokens: dict[int, list] = {s.id: [] for s in specs}
    errors: dict[int, str] = {}
    while True:
        for out in outputs:
            assert out.request_id not in errors, "a failed request was reported again"
            if out.error:
                assert not out.tokens and not out.top_tokens and out.generated_text is None
                errors[out.request_id] = out.error
            tokens[out.request_id].extend((t.id, t.logprob) for t in out.tokens)
        assert not set(generator.requests) & set(errors)
        if not generator.requests:
            break
        outputs = step(generator)
    return tokens, errors


def assert_same_tokens(got: list, expected: list) -> None:
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in expected], abs=1e-4)
    assert all(math.isfinite(lp) for _, lp in got)


@pytest.mark.parametrize("where", ["kv", "logits"])
@pytest.mark.parametrize("settings", SPECULATION, ids=["plain", "speculative"])
def test_nonfinite_rows_fail_alone_and_leave_healthy_rows_exact(llama_dir, adapter_root, where, settings):
    """A NaN-producing adapter (poisoned after load) shares a batch with base and LoRA requests, greedy and
    sampled: its requests fail in their first step with an error naming the adapter; every other request
    emits exactly the tokens it emits without them, and so do requests of a later batch that reuse their
    KV blocks."""
    generator = generator_with_adapters(llama_dir, adapter_root, **settings)
    expected, errors = run_batch(generator, specs_for(HEALTHY, BlockPool(generator.kv_cache.num_blocks, 16)))
    assert not errors
    poison(generator, where)

    pool = BlockPool(generator.kv_cache.num_blocks, 16)
    # The first poisoned request holds block 0 from position 0: slot 0 is where padded contexts used to read.
    first = specs_for([("poison", SHORT, None)], pool, first_id=100)[0]
    first = dataclasses.replace(first, blocks=tuple(sorted(first.blocks)))
    assert first.blocks[0] == 0
    second = specs_for([("poison", MEDIUM, SAMPLED)], pool, first_id=101)[0]
    healthy = specs_for(HEALTHY, pool)
    tokens, errors = run_batch(generator, [first] + healthy[:2] + [second] + healthy[2:])
    assert set(errors) == {100, 101}
    assert all("non-finite logits" in e and "adapter `poison`" in e for e in errors.values())
    for spec in healthy:
        assert_same_tokens(tokens[spec.id], expected[spec.id])

    # Later requests on the blocks the poisoned ones wrote (the first one's slots become their padding).
    later, errors = run_batch(generator, specs_for(HEALTHY, BlockPool(generator.kv_cache.num_blocks, 16)))
    assert not errors
    for k in expected:
        assert_same_tokens(later[k], expected[k])


@pytest.mark.parametrize("settings", SPECULATION, ids=["plain", "speculative"])
def test_a_request_turning_nonfinite_mid_generation_leaves_its_batch(llama_dir, adapter_root, settings):
    """Failing in a decode step (one that verifies drafts, when speculating): the batch goes on without the
    request; when it was the last, the batch ends."""
    generator = generator_with_adapters(llama_dir, adapter_root, **settings)
    base = specs_for([("", MEDIUM, None)], BlockPool(generator.kv_cache.num_blocks, 16))[0]
    expected, _ = run_batch(generator, [base])

    pool = BlockPool(generator.kv_cache.num_blocks, 16)
    good, bad = specs_for([("", MEDIUM, None), ("poison", MEDIUM, None)], pool)
    outputs = step(generator, new=[good, bad])
    assert sorted(generator.requests) == [good.id, bad.id]
    got = [(t.id, t.logprob) for o in outputs if o.request_id == good.id for t in o.tokens]
    lookup = PromptLookupDrafter()  # the server's default drafter: whether the next step will verify drafts
    while settings and not any(len(lookup.lookup(r.history, 3)) for r in generator.requests.values()):
        outputs = step(generator)
        got += [(t.id, t.logprob) for o in outputs if o.request_id == good.id for t in o.tokens]
    poison(generator, "logits")
    outputs = step(generator)
    failed = [o for o in outputs if o.error]
    assert [o.request_id for o in failed] == [bad.id] and sorted(generator.requests) == [good.id]
    while True:
        got += [(t.id, t.logprob) for o in outputs if o.request_id == good.id for t in o.tokens]
        if not generator.requests:
            break
        outputs = step(generator)
    assert_same_tokens(got, expected[base.id])

    alone = specs_for([("poison", SHORT, None)], BlockPool(generator.kv_cache.num_blocks, 16))
    outputs = step(generator, new=alone)
    assert generator.requests == {} and [bool(o.error) for o in outputs] == [True]
    assert step(generator) == []  # nothing runs, as when every request finished


def test_nonfinite_prompt_logprobs_fail_only_that_request(llama_dir):
    """Prompt log-probabilities that would be NaN fail their request; the other prompt in the batch goes on."""
    generator = load_test_generator(llama_dir)
    pool = BlockPool(generator.kv_cache.num_blocks, 16)
    specs = [make_spec(k, prompt, pool, max_new_tokens=4, prefill_logprobs=True)
             for k, prompt in enumerate([SHORT, LONG])]
    compute_logits = generator.model.compute_logits

    def broken_for_the_long_prompt(hidden):
        logits = compute_logits(hidden)
        if hidden.shape[0] == len(LONG) - 1:  # the long prompt's rows: one position overflows
            logits[3, 5] = math.inf
        return logits

    generator.model.compute_logits = broken_for_the_long_prompt
    by_id = {o.request_id: o for o in step(generator, new=specs)}
    assert "non-finite prompt logits" in by_id[1].error and not by_id[1].tokens
    assert len(by_id[0].prefill_tokens) == len(SHORT) and all(math.isfinite(t.logprob)
                                                              for t in by_id[0].prefill_tokens[1:])
    assert sorted(generator.requests) == [0]


# --- the pieces -----------------------------------------------------------------------------------------------


def test_nonfinite_requests_and_kept_rows():
    logits = torch.zeros(6, 4)
    assert nonfinite_requests(logits, [2, 1, 3]) == []
    logits[3, 1] = math.nan
    logits[1, 0] = -math.inf
    assert nonfinite_requests(logits, [2, 1, 3]) == [0, 2]
    assert nonfinite_requests(logits, [1] * 6) == [1, 3]
    assert nonfinite_requests(torch.tensor([[0.0, math.inf], [1.0, 2.0]]), [1, 1]) == [0]
    assert kept_rows([2, 1, 3], [1]) == ([2], [0])
    assert kept_rows([2, 1, 3], [0, 2]) == ([0, 1, 3, 4, 5], [0, 2])


def request_on_blocks(blocks, num_tokens: int, block_size: int = 4) -> SimpleNamespace:
    """What `build_step` reads of a request: its token ids and KV slots (and here its length)."""
    slots = (torch.tensor(blocks).unsqueeze(1) * block_size + torch.arange(block_size)).flatten()
    return SimpleNamespace(token_ids=torch.ones(slots.numel(), dtype=torch.long), slots=slots, num_tokens=num_tokens)


@pytest.mark.parametrize("counts", [[1, 1, 1], [3, 1, 2]], ids=["decode", "spans"])
def test_attention_reads_only_slots_a_sequence_owns(counts):
    """Padding of shorter contexts reads the sequence's own slots, so a NaN in a slot no sequence of the step
    owns (here slot 0: stale KV of a request that failed) reaches no row."""
    requests = [request_on_blocks([3, 4], 6), request_on_blocks([1], 2), request_on_blocks([5, 2], 5)]
    starts = [r.num_tokens - c for r, c in zip(requests, counts)]
    step = build_step(requests, starts, counts, torch.device("cpu"))
    for attn in [group for _, group in step.attn.groups] if hasattr(step.attn, "groups") else [step.attn]:
        for context in attn.context_slots.tolist():  # padded, yet within one request's slots (none owns slot 0)
            assert any(set(context) <= set(r.slots.tolist()) for r in requests), context

    torch.manual_seed(0)
    cache = torch.randn(2, 6 * 4, 2, 8)  # keys, values: 6 blocks of 4 slots, 2 KV heads of 8
    num_tokens = sum(counts)
    query, key, value = torch.randn(num_tokens, 4, 8), torch.randn(num_tokens, 2, 8), torch.randn(num_tokens, 2, 8)
    write_kv_cache(key, value, cache[0], cache[1], step.attn.slot_mapping)
    clean = paged_attention(query, cache[0], cache[1], step.attn, 8**-0.5)
    cache[:, 0] = math.nan
    poisoned = paged_attention(query, cache[0], cache[1], step.attn, 8**-0.5)
    assert torch.equal(poisoned, clean)


# --- adapters with non-finite weights are refused at load ---------------------------------------------------------


def nan_in(path, tensor_name: str, value: float = math.nan) -> None:
    file = next(path.glob("*.safetensors"))
    tensors = load_file(file)
    tensors[tensor_name][0, 0] = value
    save_file(tensors, file)


def test_lora_with_nonfinite_weights_is_refused(llama_dir, adapter_root, tmp_path):
    import shutil

    config = ModelConfig.from_dir(llama_dir)
    path = shutil.copytree(adapter_root / "good", tmp_path / "nan")
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    nan_in(path, name)
    with pytest.raises(AdapterError) as info:
        load_lora(path, config, adapter_id="nan")
    assert info.value.status == 424
    assert str(info.value) == f"adapter `nan`: tensor {name} has non-finite values"

    # Finite in the file, infinite once cast to the serving dtype.
    path = shutil.copytree(adapter_root / "good", tmp_path / "huge")
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    nan_in(path, name, 1e6)
    load_lora(path, config, adapter_id="huge")  # float32 holds it
    with pytest.raises(AdapterError, match=f"tensor {name} has non-finite values in torch.float16"):
        load_lora(path, config, dtype=torch.float16, adapter_id="huge")


def test_medusa_with_nonfinite_weights_is_refused(llama_dir, tmp_path):
    config = ModelConfig.from_dir(llama_dir)
    tensors = medusa_tensors(config.hidden_size, config.vocab_size, 2, 1, own_heads=True)
    tensors["1.1.weight"][4, 2] = math.inf
    tmp_path.joinpath("config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    save_file(tensors, tmp_path / "medusa_lm_head.safetensors")
    with pytest.raises(AdapterError, match=r"adapter `m`: tensor 1\.1\.weight has non-finite values") as info:
        load_medusa(tmp_path, config, adapter_id="m")
    assert info.value.status == 424


def test_load_adapter_answers_424_for_nonfinite_weights(llama_dir, adapter_root, tmp_path):
    import shutil

    root = tmp_path / "adapters"
    shutil.copytree(adapter_root / "good", root / "nan")
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    nan_in(root / "nan", name)
    generator = load_test_generator(llama_dir, adapter_dirs=(root,))
    service = TextGenerationService(generator, None)  # LoadAdapter reads nothing of the shard's info
    answer = asyncio.run(service.LoadAdapter(pb.LoadAdapterRequest(adapter_id="nan", adapter_source="local"), None))
    assert not answer.loaded and answer.error_status == 424
    assert answer.error == f"adapter `nan`: tensor {name} has non-finite values"
    assert "nan" not in generator.adapters.adapters  # no slot taken


def test_a_failed_request_reaches_the_router_as_its_error_alone():
    gen = generation_to_pb(StepOutput(7, [], [], error="the model produced non-finite logits for this request"))
    assert gen.request_id == 7 and gen.error.startswith("the model produced")
    assert [f.name for f, _ in gen.ListFields()] == ["request_id", "error"]
