"""Draft-model speculation: a small causal LM with the target's tokenizer drafts, over its own paged KV.

Greedy output must equal decoding without speculation; with the target itself as the draft every greedy draft
is accepted (which fails on any draft-KV bug, e.g. the bonus token's KV not written before drafting from it);
sampling must keep the target's distribution (chi-square, and the same test must reject an inexact rule).
"""

from __future__ import annotations

import gc
import shutil
import weakref
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_speculation import PROMPTS, chi_square_p_value, memory_bound_costs

from specula_server.kv_cache import KVCache
from specula_server.models.config import ModelConfig
from specula_server.params import FinishReason, SamplingParams
from specula_server.speculation.draft_model import DraftModelDrafter
from specula_server.speculation.verify import Verdict
from specula_testing.adapters import build_medusa_adapter
from specula_testing.models import build_tiny_model
from specula_testing.worker import (
    BlockPool,
    assert_same_greedy_output,
    generate_alone,
    load_test_generator,
    make_spec,
    run_steps,
    step,
    token_ids,
)

K = 3  # draft tokens per step in fixed mode


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models gain nothing from a second thread, and on a busy 2-core machine two threads per process
    make every forward wait for a descheduled thread (tens of times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def perturbed_copy(model_dir: Path, out_dir: Path, std: float, seed: int = 0) -> Path:
    """The model with noise on every weight: a draft that agrees with it often, but not always (about 30% of
    its tokens are accepted at std 0.1 on the tiny llama)."""
    shutil.copytree(model_dir, out_dir)
    generator = torch.Generator().manual_seed(seed)
    for path in out_dir.glob("*.safetensors"):
        tensors = {name: t + torch.randn(t.shape, generator=generator) * std * t.std() if t.numel() > 1 else t
                   for name, t in load_file(path).items()}
        save_file(tensors, path, metadata={"format": "pt"})
    return out_dir


@pytest.fixture(scope="module")
def drafts(llama_dir, tmp_path_factory) -> dict[str, Path]:
    """Draft models with the target's tokenizer: a noisy copy of it, and a smaller model of another shape
    (1 layer, one KV head, 32-wide) with fewer positions than the target."""
    root = tmp_path_factory.mktemp("drafts")
    return {
        "noisy": perturbed_copy(llama_dir, root / "noisy", std=0.1),
        "small": build_tiny_model(root / "small", "llama", seed=1, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                  max_position_embeddings=64),
    }


@pytest.fixture(scope="module")
def plain(llama_dir):
    return load_test_generator(llama_dir)


def with_draft(llama_dir, draft_dir, mode="fixed", tokens=K, **settings):
    generator = load_test_generator(llama_dir, speculative_tokens=tokens, speculation_mode=mode,
                                    speculator=str(draft_dir), **settings)
    generator.speculator.step_cost = memory_bound_costs()
    return generator


@pytest.fixture(scope="module")
def self_drafted(llama_dir):
    """The target drafting for itself: q == p, so every draft must be accepted."""
    return with_draft(llama_dir, llama_dir)


def run(generator, prompt, request_id=0, **kwargs):
    return generate_alone(generator, make_spec(request_id, prompt, BlockPool(256, 16), **kwargs))


def run_together(generator, specs):
    return run_steps(generator, specs)


def by_request(outputs) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {}
    for out in outputs:
        got.setdefault(out.request_id, []).extend(t.id for t in out.tokens)
    return got


# --- (a) greedy output is the target's -----------------------------------------------------------------------

@pytest.mark.parametrize("draft", ["noisy", "small"])
def test_greedy_output_is_identical_with_a_draft_model(llama_dir, drafts, plain, draft):
    generator = with_draft(llama_dir, drafts[draft])
    assert generator.speculation.drafter.name == "draft_model"
    drafted = accepted = 0
    for got in assert_same_greedy_output(plain, generator, PROMPTS, run, max_new_tokens=24):
        assert {o.draft_method for o in got if o.num_drafted} == {"draft_model"}
        drafted += sum(o.num_drafted for o in got)
        accepted += sum(o.num_accepted for o in got)
    assert drafted > 0
    if draft == "noisy":
        assert 0 < accepted < drafted  # both acceptance and rejection were exercised


def test_mixed_batch_with_medusa_and_undrafted_requests(llama_dir, drafts, plain, tmp_path_factory):
    """Draft-model chains, per-request Medusa trees, a request that turned speculation off and a seeded
    sampling request in one batch: greedy ones give the plain tokens, the sampled one its tokens alone."""
    medusa = build_medusa_adapter(llama_dir, tmp_path_factory.mktemp("medusa") / "heads", num_heads=3)
    generator = with_draft(llama_dir, drafts["noisy"], adapter_dirs=(medusa.parent,), draft_tree_width=2)
    generator.adapters.load("heads", "local")
    sampled = SamplingParams(do_sample=True, temperature=0.9, top_p=0.95, repetition_penalty=1.1, seed=5)
    kinds = {0: {}, 1: {"adapter_id": "heads"}, 2: {"speculative_tokens": 0}, 3: {}, 4: {"sampling": sampled}}
    prompts = {i: PROMPTS[i % len(PROMPTS)] for i in kinds}
    # The Medusa adapter has heads only, so the plain model's tokens are its tokens.
    alone = {i: token_ids(run(plain, prompts[i], request_id=i, max_new_tokens=20)) for i in kinds if i != 4}
    alone[4] = token_ids(run(generator, prompts[4], request_id=4, max_new_tokens=20, lookahead=8, sampling=sampled))
    pool = BlockPool(256, 16)
    specs = [make_spec(i, prompts[i], pool, max_new_tokens=20, lookahead=8, **kinds[i]) for i in kinds]
    outputs = run_together(generator, specs)
    assert by_request(outputs) == alone
    methods = {i: {o.draft_method for o in outputs if o.request_id == i and o.num_drafted} for i in kinds}
    assert methods[0] == methods[3] == methods[4] == {"draft_model"}
    assert methods[1] == {"medusa"} and methods[2] == set()


# --- (b) the target as its own draft: every draft accepted -----------------------------------------------------

def test_self_drafting_accepts_every_greedy_draft(self_drafted, plain):
    for prompt in PROMPTS:
        outputs = run(self_drafted, prompt, max_new_tokens=23)
        assert token_ids(outputs) == token_ids(run(plain, prompt, max_new_tokens=23))
        steps = outputs[1:]  # after the prefill's token
        assert all(o.num_accepted == o.num_drafted for o in steps)
        # K + 1 tokens a step, until what may still be emitted caps the draft
        assert [len(o.tokens) for o in steps] == [K + 1] * 5 + [2]


def test_self_drafting_in_a_batch_of_uneven_requests(self_drafted, plain):
    """Different prompt lengths, draft caps and ends in one batch: every request's draft KV stays right."""
    caps = [None, 1, 2, None]
    lengths = [17, 9, 23, 5]
    expected = {i: token_ids(run(plain, p, max_new_tokens=n)) for i, (p, n) in enumerate(zip(PROMPTS, lengths))}
    pool = BlockPool(256, 16)
    specs = [make_spec(i, p, pool, max_new_tokens=n, speculative_tokens=c)
             for i, (p, n, c) in enumerate(zip(PROMPTS, lengths, caps))]
    outputs = run_together(self_drafted, specs)
    assert by_request(outputs) == expected
    assert all(o.num_accepted == o.num_drafted for o in outputs)
    assert max(o.num_drafted for o in outputs if o.request_id == 1) == 1


def test_self_drafting_accepts_every_sampled_draft(self_drafted):
    """q is processed exactly like p (penalties with the draft prefix, temperature, top-k/p): with q == p the
    rejection rule accepts everything. A q processed differently would be rejected now and then."""
    params = SamplingParams(do_sample=True, temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.3,
                            frequency_penalty=0.2, seed=11)
    for prompt in PROMPTS:
        outputs = run(self_drafted, prompt, max_new_tokens=23, sampling=params)
        assert len(token_ids(outputs)) == 23
        assert all(o.num_accepted == o.num_drafted for o in outputs)
        assert sum(o.num_drafted for o in outputs) >= 15


def test_max_new_tokens_is_never_overshot(self_drafted):
    for n in (1, 2, 3, 4, 5, 9):
        outputs = run(self_drafted, PROMPTS[0], max_new_tokens=n)
        assert len(token_ids(outputs)) == n
        assert outputs[-1].generated_text.finish_reason is FinishReason.LENGTH


def test_the_draft_model_drafts_only_what_is_verified(llama_dir, plain, monkeypatch):
    """The controller picks the lengths first (adaptive mode trims them), then exactly that many are drafted."""
    generator = with_draft(llama_dir, llama_dir, mode="adaptive", tokens=6)
    drafted = []
    original = DraftModelDrafter.draft

    def counting(self, requests, lengths):
        drafted.append(sum(lengths))
        return original(self, requests, lengths)

    monkeypatch.setattr(DraftModelDrafter, "draft", counting)
    pool = BlockPool(256, 16)
    specs = [make_spec(i, p, pool, max_new_tokens=20) for i, p in enumerate(PROMPTS)]
    outputs = run_together(generator, specs)
    assert by_request(outputs) == {i: token_ids(run(plain, p, max_new_tokens=20)) for i, p in enumerate(PROMPTS)}
    assert sum(drafted) == sum(o.num_drafted for o in outputs) > 0


def test_no_drafting_past_the_draft_models_positions(llama_dir, drafts, plain):
    """The small draft has 64 positions: a request drafts only while its drafts' positions fit."""
    generator = with_draft(llama_dir, drafts["small"])
    prompt = [1] + list(range(100, 160))  # 61 tokens
    outputs = run(generator, prompt, max_new_tokens=12)
    assert token_ids(outputs) == token_ids(run(plain, prompt, max_new_tokens=12))
    num_tokens = len(prompt) + 1
    for out in outputs[1:]:  # drafts at positions num_tokens .. num_tokens + k - 2 must be < 64
        assert out.num_drafted <= max(0, 64 - num_tokens + 1)
        num_tokens += len(out.tokens)
    assert sum(o.num_drafted for o in outputs) > 0 and outputs[-1].num_drafted == 0
    long_prompt = [1] + list(range(100, 170))
    outputs = run(generator, long_prompt, max_new_tokens=6)
    assert sum(o.num_drafted for o in outputs) == 0
    assert token_ids(outputs) == token_ids(run(plain, long_prompt, max_new_tokens=6))


# --- (c) sampling keeps the target's distribution --------------------------------------------------------------

DISTRIBUTION_PROMPT = PROMPTS[3]
NUM_SAMPLES = 1500


def sampling_params(offset: int):
    return lambda seed: SamplingParams(do_sample=True, temperature=1.5, top_k=4, seed=seed + offset)


def sample_prefixes(generator, n: int, length: int, params_for, per_batch: int = 150) -> Counter:
    """The first `length` tokens of `n` seeded requests, run `per_batch` at a time (each request draws with its
    own generator, so batching changes no draw)."""
    counts = Counter()
    for first in range(0, n, per_batch):
        pool = BlockPool(512, 16)
        specs = [make_spec(i, DISTRIBUTION_PROMPT, pool, max_new_tokens=length + K, sampling=params_for(i))
                 for i in range(first, min(first + per_batch, n))]
        for tokens in by_request(run_together(generator, specs)).values():
            counts[tuple(tokens[:length])] += 1
    return counts


@pytest.fixture(scope="module")
def baseline_samples(llama_dir) -> Counter:
    return sample_prefixes(load_test_generator(llama_dir, num_blocks=512), NUM_SAMPLES, 3, sampling_params(0))


@pytest.fixture(scope="module")
def noisy_sampler(llama_dir, drafts):
    return load_test_generator(llama_dir, num_blocks=512, speculative_tokens=K, speculation_mode="fixed",
                               speculator=str(drafts["noisy"]))


def test_sampling_distribution_is_preserved(noisy_sampler, baseline_samples):
    """First 3 tokens (the 2nd and 3rd come out of the first verification), draft model on vs off: one
    distribution (chi-square). The noisy draft's q differs from p, so acceptance and the residual both act.
    Both sides use different seeds, so the samples are independent."""
    speculated = sample_prefixes(noisy_sampler, NUM_SAMPLES, 3, sampling_params(10**6))
    assert chi_square_p_value(speculated, baseline_samples, NUM_SAMPLES) > 1e-3
    probe = run(noisy_sampler, DISTRIBUTION_PROMPT, max_new_tokens=12, sampling=sampling_params(0)(1))
    assert sum(o.num_drafted for o in probe) > sum(o.num_accepted for o in probe) > 0


def accept_every_draft(logprobs, r, draft, start, rows, sampler):
    """Inexact: emits the drafts whatever p says, then the bonus from p."""
    k = len(draft)
    bonus = int(sampler.choose(logprobs[start + k : start + k + 1], [rows[start + k]])[0])
    return Verdict(draft.tokens.tolist() + [bonus], [], list(range(start, start + k + 1)), k, list(range(k)))


def resample_from_p(logprobs, r, draft, start, rows, sampler):
    """Inexact: the right acceptance test, but a rejected draft is replaced by a draw from p, not from the
    residual norm(max(0, p - q)), which over-weights the tokens q already proposes."""
    k = len(draft)
    index, tokens = torch.arange(k), draft.tokens
    p = logprobs[start : start + k].exp()
    accepted = (torch.rand(k, generator=r.generator) * draft.q[index, tokens] < p[index, tokens]).tolist()
    m = accepted.index(False) if False in accepted else k
    token = int(sampler.choose(logprobs[start + m : start + m + 1], [rows[start + m]])[0])
    return Verdict(tokens[:m].tolist() + [token], [], list(range(start, start + m + 1)), k, list(range(m)))


@pytest.mark.parametrize("rule", [accept_every_draft, resample_from_p])
def test_the_distribution_test_detects_inexact_acceptance(noisy_sampler, baseline_samples, monkeypatch, rule):
    import specula_server.speculation.verify as verify_module

    monkeypatch.setattr(verify_module, "_speculative_sampling", rule)
    broken = sample_prefixes(noisy_sampler, NUM_SAMPLES, 3, sampling_params(10**6))
    assert chi_square_p_value(broken, baseline_samples, NUM_SAMPLES) < 1e-3


# --- (d) the draft must share the target's tokenizer -----------------------------------------------------------

def test_a_draft_model_with_another_vocabulary_is_refused(llama_dir, tmp_path):
    other = build_tiny_model(tmp_path / "metaspace-draft", "llama", tokenizer_kind="metaspace", num_hidden_layers=1)
    with pytest.raises(ValueError) as error:
        load_test_generator(llama_dir, speculative_tokens=2, speculator=str(other))
    message = str(error.value)
    assert str(other) in message and str(llama_dir) in message and "tokenizer vocabularies differ" in message


def test_a_draft_model_with_another_vocab_size_is_refused(llama_dir, tmp_path):
    vocab = ModelConfig.from_dir(llama_dir).vocab_size
    padded = build_tiny_model(tmp_path / "padded-draft", "llama", num_hidden_layers=1, vocab_size=vocab + 64)
    with pytest.raises(ValueError, match=rf"vocab_size {vocab} \(target\) vs {vocab + 64} \(draft\)"):
        load_test_generator(llama_dir, speculative_tokens=2, speculator=str(padded))


# --- (e) dropped, finished and reset requests leave nothing behind ---------------------------------------------

def test_dropped_finished_and_reset_requests_leave_no_draft_state(llama_dir, drafts, plain):
    generator = with_draft(llama_dir, drafts["noisy"])
    drafter = generator.draft_model
    drafter_fields = set(vars(drafter))
    pool = BlockPool(64, 16)
    specs = [make_spec(i, p, pool, max_new_tokens=16) for i, p in enumerate(PROMPTS[:3])]
    got = {i: [] for i in range(3)}

    def record(outputs):
        for out in outputs:
            got.setdefault(out.request_id, []).extend(t.id for t in out.tokens)

    record(step(generator, new=specs))
    for _ in range(2):
        record(step(generator))
    dropped = weakref.ref(generator.requests[1])
    cached = dropped().draft_cached
    assert cached > 0
    # Request 1 leaves (the router lists it as finished); a new request reuses its blocks, whose draft KV is
    # stale: it is never read.
    pool.give(specs[1].blocks)
    newcomer = make_spec(3, PROMPTS[3], pool, max_new_tokens=16)
    assert set(newcomer.blocks) & set(specs[1].blocks)
    record(step(generator, finished=[1], new=[newcomer]))
    assert 1 not in generator.requests
    gc.collect()
    assert dropped() is None  # nothing holds the dropped request or its draft bookkeeping
    cleared = False
    while generator.requests:
        record(step(generator))
        if len(got[0]) >= 10 and generator.requests:
            survivors = [weakref.ref(r) for r in generator.requests.values()]
            generator.reset()
            gc.collect()
            assert all(ref() is None for ref in survivors) and not generator.requests
            cleared = True
            break
    assert cleared
    for i in (0, 2, 3):
        expected = token_ids(run(plain, PROMPTS[i], max_new_tokens=16))
        assert got[i] == expected[: len(got[i])] and got[i]
    assert set(vars(drafter)) == drafter_fields  # the drafter keeps no per-request state
    # After a reset the same blocks serve new requests exactly.
    fresh = BlockPool(64, 16)
    assert token_ids(generate_alone(generator, make_spec(0, PROMPTS[1], fresh, max_new_tokens=16))) == \
        token_ids(run(plain, PROMPTS[1], max_new_tokens=16))


# --- (f) the KV memory budget covers the draft's cache ---------------------------------------------------------

def test_the_memory_budget_includes_the_draft_models_kv(llama_dir, drafts):
    from specula_server.warmup import warmup

    generator = with_draft(llama_dir, drafts["small"])
    target, draft = ModelConfig.from_dir(llama_dir), ModelConfig.from_dir(drafts["small"])
    target_bytes = KVCache.bytes_per_block(target.num_layers, target.num_kv_heads, target.head_dim, 16, torch.float32)
    draft_bytes = KVCache.bytes_per_block(draft.num_layers, draft.num_kv_heads, draft.head_dim, 16, torch.float32)
    assert draft_bytes != target_bytes  # another shape: the sum below is not a coincidence
    assert generator.bytes_per_block() == target_bytes + draft_bytes
    budget = 100 * (target_bytes + draft_bytes) + 1234
    num_blocks = warmup(generator, max_input_tokens=40, max_prefill_tokens=80, max_total_tokens=60,
                        kv_cache_memory=budget)
    assert num_blocks == 100
    assert generator.kv_cache.num_blocks == generator.draft_model.kv_cache.num_blocks == 100
    keys, _ = generator.draft_model.kv_cache.layers[0]
    assert len(generator.draft_model.kv_cache.layers) == draft.num_layers
    assert tuple(keys.shape) == (100 * 16, draft.num_kv_heads, draft.head_dim)
    plain_gen = load_test_generator(llama_dir)
    assert plain_gen.bytes_per_block() == target_bytes


# --- tensor parallelism: every rank drafts and accepts the same tokens ------------------------------------------

def test_two_ranks_draft_and_accept_the_same_tokens(llama_dir, drafts):
    """The draft model is sharded like the target; greedy and seeded sampled requests give the same tokens on
    both ranks as on one rank."""
    from test_tensor_parallel import run_requests, run_two_ranks

    settings = {"speculative_tokens": K, "speculation_mode": "fixed", "speculator": str(drafts["noisy"])}
    expected = run_requests(llama_dir, **settings)
    results = run_two_ranks(llama_dir, settings)
    assert results[0] == results[1] == expected
