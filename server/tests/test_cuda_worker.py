"""The worker on CUDA: greedy tokens equal CPU's, the Triton attention path's equal the SDPA path's, and
speculation (drafts verified through the Triton kernel) equals plain decoding. Skipped without a GPU; run by
`scripts/gpu_check.sh` (`pytest -m cuda`).

Without a GPU, `test_worker_on_the_interpreted_kernel` runs the same worker on CPU with its attention sent to the
Triton kernel under the interpreter (in a subprocess, as the kernel tests do): the step's real inputs (decode
groups beside verification groups, short prompts) through the kernel, greedy tokens equal to the CPU path's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specula_kernels import paged_attention as paged_attention_module
from specula_kernels import triton_paged_attention
from specula_testing.worker import (
    BlockPool,
    assert_same_greedy_output,
    generate_alone,
    load_test_generator,
    make_spec,
    run_steps,
    token_ids,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Prompts with repetition, so prompt lookup finds drafts (as in test_speculation.py).
PROMPTS = [
    [1] + [50, 60, 70, 80, 90] * 4,
    [1, 7, 8, 9, 7, 8, 9, 7, 8],
    [1] + list(range(100, 140)) + list(range(100, 120)),
]


def run(generator, prompt, request_id=0, max_new_tokens=24, **kwargs):
    spec = make_spec(request_id, prompt, BlockPool(256, 16), max_new_tokens=max_new_tokens, **kwargs)
    return generate_alone(generator, spec)


@pytest.fixture
def kernel_calls(monkeypatch) -> list[int]:
    """The number of query rows per sequence of each Triton kernel launch."""
    calls: list[int] = []
    real = triton_paged_attention.paged_attention_triton

    def counting(query, key_cache, value_cache, block_table, query_rows, *args, **kwargs):
        calls.append(query_rows.shape[1])
        return real(query, key_cache, value_cache, block_table, query_rows, *args, **kwargs)

    monkeypatch.setattr(triton_paged_attention, "paged_attention_triton", counting)
    return calls


def agree_up_to_a_near_tie(got, expected, tolerance: float) -> int:
    """Asserts that two greedy runs of one prompt on different arithmetic (devices, attention paths, dtypes) emit
    the same tokens with log-probabilities within `tolerance`, up to the first position where they chose
    different tokens that were a near tie there: the other run's token among this one's top 2 with a
    log-probability within `tolerance` of the chosen one. Returns how many positions agreed.

    Rounding decides near ties either way, and after one the runs continue different texts, so nothing later is
    compared; an attention bug shows as distributions apart well beyond `tolerance`."""
    a = [(t, top) for o in got for t, top in zip(o.tokens, o.top_tokens)]
    b = [t for o in expected for t in o.tokens]
    for i, ((token, top), other) in enumerate(zip(a, b)):
        if token.id != other.id:
            alternatives = {t.id: t.logprob for t in top}
            assert other.id in alternatives and abs(alternatives[other.id] - token.logprob) <= tolerance, (
                i, token, other, top)
            return i
        assert abs(token.logprob - other.logprob) <= tolerance, (i, token, other)
    return len(a)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_greedy_tokens_equal_cpu(llama_dir, kernel_calls):
    cpu = load_test_generator(llama_dir)
    cuda = load_test_generator(llama_dir, device="cuda")
    assert cuda.device.type == "cuda"
    agreed = [agree_up_to_a_near_tie(run(cuda, p, top_n_tokens=2), run(cpu, p), 1e-3) for p in PROMPTS]
    assert sum(agreed) >= len(PROMPTS) * 12, agreed  # float32: ties within 1e-3 are rare
    assert 1 in kernel_calls  # the decode steps' attention ran on the kernel


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tolerance,min_agreed", [("float32", 1e-3, 36), ("bfloat16", 0.15, 3)])
def test_triton_attention_equals_the_sdpa_path(llama_dir, monkeypatch, dtype, tolerance, min_agreed):
    triton = load_test_generator(llama_dir, device="cuda", dtype=dtype)
    outputs = {tuple(p): run(triton, p, top_n_tokens=2) for p in PROMPTS}
    monkeypatch.setattr(paged_attention_module, "use_triton", lambda *args: False)
    sdpa = load_test_generator(llama_dir, device="cuda", dtype=dtype)
    agreed = [agree_up_to_a_near_tie(outputs[tuple(p)], run(sdpa, p), tolerance) for p in PROMPTS]
    assert sum(agreed) >= min_agreed, agreed


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_speculation_on_cuda_equals_plain_decoding(llama_dir, kernel_calls):
    plain = load_test_generator(llama_dir, device="cuda")
    drafted = load_test_generator(llama_dir, device="cuda", speculative_tokens=4, speculation_mode="fixed")
    results = assert_same_greedy_output(plain, drafted, PROMPTS, run)
    assert sum(o.num_accepted for outputs in results for o in outputs) > 0  # drafts were accepted
    assert max(kernel_calls) > 1  # verification rows ran on the kernel


@pytest.mark.skipif(not INTERPRETED, reason="test_worker_on_the_interpreted_kernel runs this under the interpreter")
def test_interpreted_kernel_serves_the_worker(llama_dir, kernel_calls, monkeypatch):
    plain = load_test_generator(llama_dir)
    expected = {tuple(p): token_ids(run(plain, p, max_new_tokens=12)) for p in PROMPTS[:2]}
    monkeypatch.setattr(paged_attention_module, "use_triton", lambda *args: True)  # CPU tensors, interpreted
    drafted = load_test_generator(llama_dir, speculative_tokens=4, speculation_mode="fixed")
    for prompt in PROMPTS[:2]:
        assert token_ids(run(drafted, prompt, max_new_tokens=12)) == expected[tuple(prompt)], prompt
    assert 1 in kernel_calls and max(kernel_calls) > 1  # decode and verification rows
    pool = BlockPool(256, 16)  # both together: one step holds both sequences
    outputs = run_steps(drafted, [make_spec(i, p, pool, max_new_tokens=12) for i, p in enumerate(PROMPTS[:2])])
    for i, prompt in enumerate(PROMPTS[:2]):
        assert [t.id for o in outputs if o.request_id == i for t in o.tokens] == expected[tuple(prompt)], prompt


@pytest.mark.skipif(INTERPRETED, reason="this test starts the interpreter itself")
def test_worker_on_the_interpreted_kernel():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "test_interpreted"],
        cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert re.match(r"1 passed", result.stdout.strip().splitlines()[-1]), result.stdout[-2000:]
