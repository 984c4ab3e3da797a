"""The worker's decode and verification steps through CUDA graphs (`specula_kernels.cuda_graphs`).

On CPU the graphs are stood in for by `EagerReplay` (it re-runs the captured function on the same static
buffers, which is what a replay computes) and attention by the reference over `BlockTableInputs`, so the
bookkeeping is tested everywhere: padding sequences and rows, buckets of draft lengths, the scratch slot, steps
no graph holds, a capture that fails. On CUDA (`-m cuda`) the same outputs with real graphs.
"""

from __future__ import annotations

import logging

import pytest
import torch

from specula_kernels import cuda_graphs
from specula_kernels.cuda_graphs import GraphBucket, GraphCaptureError
from specula_server.generator import TextGenerator
from specula_server.server import parse_cuda_graphs
from specula_testing.worker import BlockPool, load_test_generator, make_spec, run_steps, token_ids

# Prompts with repetition, so prompt lookup finds drafts (as in test_speculation.py).
PROMPTS = [
    [1] + [50, 60, 70, 80, 90] * 4,
    [1, 7, 8, 9, 7, 8, 9, 7, 8],
    [1] + list(range(100, 140)) + list(range(100, 120)),
    [1, 5, 6, 5, 6, 5, 6, 5],
    [1, 200, 201, 202, 203],
]


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """Graphs wherever the generator runs (on CPU: `EagerReplay`)."""
    monkeypatch.setattr(TextGenerator, "graphs_unavailable", lambda self: None)


def together(generator, prompts, max_new_tokens=16) -> dict[int, list[int]]:
    pool = BlockPool(256, 16)
    outputs = run_steps(generator, [make_spec(i, p, pool, max_new_tokens=max_new_tokens, lookahead=4)
                                    for i, p in enumerate(prompts)])
    return {i: [t.id for o in outputs if o.request_id == i for t in o.tokens] for i in range(len(prompts))}


def test_parse_cuda_graphs():
    assert parse_cuda_graphs("1, 2,4") == (1, 2, 4)
    assert parse_cuda_graphs("0") == ()
    assert parse_cuda_graphs(None) is None
    with pytest.raises(ValueError, match="--cuda-graphs takes batch sizes"):
        parse_cuda_graphs("1,two")


def test_graphs_stay_off_where_they_cannot_run(llama_dir):
    generator = load_test_generator(llama_dir)  # CPU
    assert generator.graphs is None and generator.graphs_unavailable() == "not on CUDA"
    assert generator.kv_cache.layers[0][0].shape[0] == generator.kv_cache.num_slots  # no scratch slot


def test_decode_through_graphs_equals_eager(llama_dir, graphs_on_cpu):
    """Plain decoding, alone and in batches padded to a bucket (3 sequences in a graph of 4), and batches past
    the largest bucket (5 sequences) run eagerly: the same tokens as without graphs."""
    eager = load_test_generator(llama_dir, cuda_graphs=())
    expected = together(eager, PROMPTS)
    graphed = load_test_generator(llama_dir, cuda_graphs=(1, 4))
    assert graphed.graphs is not None
    kv = graphed.kv_cache
    assert kv.layers[0][0].shape[0] == kv.num_slots + 1 and graphed.graphs.scratch_slot == kv.num_slots
    assert together(graphed, PROMPTS[:3]) == {i: expected[i] for i in range(3)}
    assert set(graphed.graphs.graphs) == {GraphBucket(4, 1)}  # the three finish together: no other bucket
    assert together(graphed, PROMPTS) == expected  # 5 sequences: eager until 4 are left
    assert together(graphed, PROMPTS[:1]) == {0: expected[0]}
    assert GraphBucket(1, 1) in graphed.graphs.graphs
    assert graphed.graphs.num_replayed > 0


def test_decode_through_graphs_over_a_float8_cache_equals_eager(llama_dir, graphs_on_cpu):
    """The graphs' static step writes and reads a float8 cache as the eager step does (on CPU through the
    reference attention; on CUDA the kernel reads the bytes, below)."""
    eager = load_test_generator(llama_dir, cuda_graphs=(), kv_cache_dtype="fp8")
    graphed = load_test_generator(llama_dir, cuda_graphs=(1, 4), kv_cache_dtype="fp8")
    assert graphed.kv_cache.dtype == torch.float8_e4m3fn
    assert together(graphed, PROMPTS[:3]) == together(eager, PROMPTS[:3])
    assert graphed.graphs.num_replayed > 0


def test_verification_through_graphs_equals_plain_decoding(llama_dir, graphs_on_cpu):
    """Chains of drafts verified in graphs of each draft length (drafts padded to the bucket's) emit exactly
    what plain decoding does, and accept drafts."""
    plain = load_test_generator(llama_dir, cuda_graphs=())
    expected = together(plain, PROMPTS[:4])
    drafted = load_test_generator(llama_dir, cuda_graphs=(1, 2, 4), speculative_tokens=4, speculation_mode="fixed")
    assert drafted.graphs.buckets.draft_lengths == [0, 1, 2, 3, 4]
    pool = BlockPool(256, 16)
    outputs = run_steps(drafted, [make_spec(i, p, pool, max_new_tokens=16, lookahead=4)
                                  for i, p in enumerate(PROMPTS[:4])])
    got = {i: [t.id for o in outputs if o.request_id == i for t in o.tokens] for i in range(4)}
    assert got == expected
    assert sum(o.num_accepted for o in outputs) > 0
    assert any(bucket.num_query > 1 for bucket in drafted.graphs.graphs)  # verification rows ran in a graph
    for prompt in PROMPTS[:2]:  # alone: the graph of one sequence
        alone = run_steps(drafted, [make_spec(0, prompt, BlockPool(256, 16), max_new_tokens=16, lookahead=4)])
        assert token_ids(alone) == expected[PROMPTS.index(prompt)]


def test_graphs_captured_ahead_serve_the_steps_that_follow(llama_dir, graphs_on_cpu):
    """Warmup captures every bucket over buffers of padding (their writes go to the scratch slot, which no
    sequence reads): the steps after replay them, with the same tokens as eager steps."""
    eager = load_test_generator(llama_dir, cuda_graphs=())
    expected = together(eager, PROMPTS[:3])
    graphed = load_test_generator(llama_dir, cuda_graphs=(1, 4), speculative_tokens=2, speculation_mode="fixed")
    graphed.capture_graphs()
    assert set(graphed.graphs.graphs) == {GraphBucket(b, q) for b in (1, 4) for q in (1, 2, 3)}
    replayed = graphed.graphs.num_replayed
    assert together(graphed, PROMPTS[:3]) == expected
    assert graphed.graphs.num_replayed > replayed and len(graphed.graphs.graphs) == 6


def test_a_capture_that_fails_turns_graphs_off_and_the_step_runs_eagerly(llama_dir, graphs_on_cpu, monkeypatch,
                                                                          caplog):
    eager = load_test_generator(llama_dir, cuda_graphs=())
    expected = together(eager, PROMPTS[:2])
    graphed = load_test_generator(llama_dir, cuda_graphs=(2,))

    def fail(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    graphed.graphs.replay_factory = fail
    with caplog.at_level(logging.WARNING, logger="specula.generator"):
        assert together(graphed, PROMPTS[:2]) == expected
    assert graphed.graphs is None
    assert "CUDA graphs turned off" in caplog.text and "operation not permitted" in caplog.text


def test_graph_runner_reports_a_failed_capture():
    runner = cuda_graphs.GraphRunner(cuda_graphs.GraphBuckets([1]), lambda static: static.input_ids,
                                     lambda step: step.input_ids, max_blocks=2, scratch_slot=99,
                                     device=torch.device("cpu"), replay_factory=lambda fn: 1 / 0)
    step = cuda_graphs.StepInputs(torch.tensor([5]), torch.tensor([3]), torch.tensor([3]),
                                  torch.zeros(1, 1, dtype=torch.int32), torch.tensor([4], dtype=torch.int32), [1])
    with pytest.raises(GraphCaptureError, match="ZeroDivisionError"):
        runner.run(step)


# --- on a GPU ---------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_equal_eager_on_cuda(llama_dir):
    """Real graphs (captured on first use of each bucket) against the eager worker, float32: plain decoding in
    batches and alone, then speculation through graphs against plain decoding."""
    eager = load_test_generator(llama_dir, device="cuda", cuda_graphs=())
    assert eager.graphs is None
    expected = together(eager, PROMPTS)
    graphed = load_test_generator(llama_dir, device="cuda")
    assert graphed.graphs is not None, graphed.graphs_unavailable()
    assert together(graphed, PROMPTS) == expected
    assert together(graphed, PROMPTS[:1]) == {0: expected[0]}
    replays = [graph for _, graph in graphed.graphs.graphs.values()]
    assert replays and all(isinstance(g, cuda_graphs.CudaGraphReplay) for g in replays)
    drafted = load_test_generator(llama_dir, device="cuda", speculative_tokens=4, speculation_mode="fixed")
    assert together(drafted, PROMPTS) == expected
    assert any(bucket.num_query > 1 for bucket in drafted.graphs.graphs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU that converts float8 (compute capability 8.9 or later)")
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_cuda_graphs_over_a_float8_cache_equal_eager(llama_dir, kv_cache_dtype):
    """A float8 KV cache keeps the graphs (the attention kernel reads its bytes): the same tokens as the eager
    worker over the same cache dtype, plain and with drafts."""
    eager = load_test_generator(llama_dir, device="cuda", cuda_graphs=(), kv_cache_dtype=kv_cache_dtype)
    expected = together(eager, PROMPTS)
    graphed = load_test_generator(llama_dir, device="cuda", kv_cache_dtype=kv_cache_dtype)
    assert graphed.graphs is not None, graphed.graphs_unavailable()
    assert together(graphed, PROMPTS) == expected
    drafted = load_test_generator(llama_dir, device="cuda", speculative_tokens=4, speculation_mode="fixed",
                                  kv_cache_dtype=kv_cache_dtype)
    assert together(drafted, PROMPTS) == expected
