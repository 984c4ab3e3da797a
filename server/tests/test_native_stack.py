"""A decode step's layers in one native call (`specula_kernels.decode_layers`) against the layer-by-layer path: the
same tokens and log-probabilities, bit for bit, batched, with drafts verified, sampling seeded, in float32, int8, w8a8,
int4 and a GGUF file's own blocks; models it cannot run keep the layer-by-layer path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specula_kernels import native
from specula_kernels.decode_layers import NativeStack, _groups
from specula_server.batch import build_step
from specula_server.kv_cache import KVCache
from specula_server.params import SamplingParams
from specula_server.speculation.drafters import Draft
from specula_testing.worker import BlockPool, load_test_generator, make_spec, run_steps

pytestmark = pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")

REQUESTS = [  # (prompt, max_new_tokens, sampling): prompts that repeat give prompt lookup drafts to verify
    ([1, 50, 60, 70, 80, 50, 60, 70, 80, 50, 60], 20, SamplingParams()),
    ([1, 7, 9], 12, SamplingParams()),
    ([1] + list(range(200, 240)), 16, SamplingParams(do_sample=True, temperature=0.9, top_k=50, seed=1234)),
]
SETTINGS = {"float32": {}, "int8": {"quantize": "int8"}, "int4": {"quantize": "int4", "quantize_group_size": 32},
            "w8a8": {"quantize": "w8a8"},
            "gguf": {"quantize": "gguf"},  # a Q4_1 file's own blocks
            "long drafts": {"speculative_tokens": 24}}  # verifications of more than 16 rows a sequence


@pytest.fixture(scope="module", params=sorted(SETTINGS))
def generator(llama_dir, gguf_files, request):
    model = gguf_files["Q4_1"] if request.param == "gguf" else llama_dir
    settings = {"speculative_tokens": 4, **SETTINGS[request.param]}
    return load_test_generator(model, num_blocks=128, speculation_mode="fixed", **settings)


def run_batch(generator) -> dict[int, list[tuple[int, float]]]:
    pool = BlockPool(128, 16)
    lookahead = generator.speculation.max_tokens
    specs = [make_spec(i, prompt, pool, max_new_tokens=new, sampling=sampling, lookahead=lookahead)
             for i, (prompt, new, sampling) in enumerate(REQUESTS)]
    tokens: dict[int, list[tuple[int, float]]] = {}
    for output in run_steps(generator, specs):
        tokens.setdefault(output.request_id, []).extend((t.id, t.logprob) for t in output.tokens)
    return tokens


def test_the_stack_gives_the_layers_bits(generator, monkeypatch):
    stack = generator.model._native_stack()
    assert stack is not None
    calls, widest = [], []
    run = NativeStack.run

    def counted(self, hidden, cos, sin, kv_caches, attn, *keeping):
        calls.append(hidden.shape[0])
        widest.append(max(group.query_index.shape[1] for _, group in _groups(attn)))
        return run(self, hidden, cos, sin, kv_caches, attn, *keeping)

    monkeypatch.setattr(NativeStack, "run", counted)
    if generator.speculation.max_tokens > 16:  # drafts as long as allowed: the last token again, k times
        monkeypatch.setattr(generator.speculation.drafter, "propose", lambda requests, most: [
            Draft(r.history[-1:].repeat(k)) for r, k in zip(requests, most)])
    fused = run_batch(generator)
    assert calls and max(calls) > len(REQUESTS), "no verification step ran on the stack"
    if generator.speculation.max_tokens > 16:
        assert max(widest) > 17, "no verification of more than 16 drafts ran on the stack"
    generator.model._stack = None  # the layer-by-layer path
    try:
        layered = run_batch(generator)
    finally:
        generator.model._stack = stack
    assert fused == layered
    assert all(len(fused[i]) == new for i, (_, new, _) in enumerate(REQUESTS))


def test_timing_the_operators_changes_no_bit(generator):
    """The stack's clock (`NativeStack.time_operators`, what benchmark/decode_profile.py reads inside the one call):
    every operator gets its time, the tokens stay the same."""
    from specula_kernels.decode_layers import OPERATORS

    stack = generator.model._native_stack()
    plain = run_batch(generator)
    stack.time_operators()
    try:
        timed = run_batch(generator)
        seconds = stack.operator_seconds.clone()
    finally:
        stack.time_operators(False)
    assert timed == plain
    assert seconds.shape == (len(OPERATORS),) and bool((seconds > 0).all()), seconds
    assert float(seconds.sum()) < 60


def test_auxiliary_states_from_the_stack_are_the_layers_bits(generator, monkeypatch):
    """The residual stream after chosen layers, which an EAGLE-3 drafter reads: the stack runs the layers between
    them as one native call each, and gives the layer-by-layer path's bits for them and for the final state."""
    model = generator.model
    stack = model._native_stack()
    ids = torch.tensor(REQUESTS[0][0])
    step = build_step([SimpleNamespace(token_ids=ids, slots=torch.arange(len(ids)))], [0], [len(ids)],
                      torch.device("cpu"))
    num_layers = len(model.layers)
    layer_ids = (num_layers - 1, 0, num_layers)  # in the order an EAGLE-3 checkpoint may name them
    runs = []
    run = NativeStack.run
    monkeypatch.setattr(NativeStack, "run", lambda self, *args: runs.append(args[-1]) or run(self, *args))

    def forward():
        kv = KVCache.allocate(4, 16, num_layers, model.num_kv_heads, model.config.head_dim, torch.float32,
                              torch.device("cpu"))
        with torch.inference_mode():
            return model.forward_with_aux(step.input_ids, step.positions, kv.layers, step.attn, None, layer_ids)

    fused_hidden, fused_aux = forward()
    assert runs == [layer_ids], "the step did not run on the stack"
    model._stack = None  # the layer-by-layer path
    try:
        hidden, aux = forward()
    finally:
        model._stack = stack
    assert torch.equal(fused_hidden, hidden)
    assert torch.equal(fused_aux, aux)
    assert not torch.equal(aux[:, : aux.shape[1] // 3], aux[:, aux.shape[1] // 3 : 2 * aux.shape[1] // 3])


def test_models_the_stack_cannot_run_keep_the_layers(model_dirs, monkeypatch):
    qwen2 = load_test_generator(model_dirs["qwen2"], num_blocks=16)  # q/k/v biases
    assert qwen2.model._native_stack() is None
    monkeypatch.setenv("SPECULA_NATIVE_STACK", "0")
    llama = load_test_generator(model_dirs["llama"], num_blocks=16)
    assert llama.model._native_stack() is None
