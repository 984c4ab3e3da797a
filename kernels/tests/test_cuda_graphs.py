"""CUDA graph bookkeeping against eager steps: buckets, static buffers, one capture per bucket, eager outside.

On CPU the graph is `EagerReplay`, which re-runs the captured function on the static buffers: a replay computes
exactly that, so the bookkeeping (what is copied where, what padding writes and reads, which rows come back) is
what these tests check. The `cuda` tests capture real graphs, around a stand-in model and around the Triton
attention kernel."""

from __future__ import annotations

import pytest
import torch

from specula_kernels.cuda_graphs import (
    EagerReplay,
    GraphBucket,
    GraphBuckets,
    GraphRunner,
    StaticInputs,
    StepInputs,
    default_batch_sizes,
    draft_lengths_for_bucket,
)
from specula_kernels.sgmv import triton_available

BLOCK_SIZE, NUM_BLOCKS, DIM, MAX_BLOCKS = 4, 64, 8, 6
SCRATCH_SLOT = NUM_BLOCKS * BLOCK_SIZE - 1  # in the last block, which no sequence is given


def test_default_batch_sizes():
    assert default_batch_sizes(30) == [1, 2, 4, 8, 16, 24, 32]
    assert default_batch_sizes(3) == [1, 2, 4]
    assert default_batch_sizes(8) == [1, 2, 4, 8]
    assert default_batch_sizes(1) == [1]
    assert default_batch_sizes(64)[-1] == 64


def test_select_rounds_batch_and_draft_length_up():
    buckets = GraphBuckets([1, 2, 4, 8], [0, 2, 4])
    assert buckets.select(5, [2, 0, 1, 2, 0]) == GraphBucket(8, 3)
    assert buckets.select(1, [0]) == GraphBucket(1, 1)
    assert buckets.select(3, [3, 0, 0]) == GraphBucket(4, 5)
    assert buckets.select(9, [0] * 9) is None  # more sequences than any graph
    assert buckets.select(2, [5, 0]) is None  # a longer draft than any graph
    assert buckets.select(0, []) is None
    assert len(list(buckets)) == 12
    with pytest.raises(ValueError, match="batch sizes"):
        GraphBuckets([0, 2])
    with pytest.raises(ValueError, match="draft lengths"):
        GraphBuckets([1], [-1])


def test_draft_lengths_fill_the_bucket_up_to_what_was_proposed():
    bucket = GraphBucket(4, 3)
    assert draft_lengths_for_bucket([2, 0, 1], [4, 1, 1], bucket) == [2, 1, 1]
    assert draft_lengths_for_bucket([0, 0], [0, 5], bucket) == [0, 2]


# --- a stand-in model over a paged cache --------------------------------------------------------------------


def toy_forward(cache, weights, input_ids, positions, slot_mapping, block_table, context_lens, row_seq):
    """Writes each row's value at its slot, then each row averages the values at its sequence's visible
    positions (up to its own position and below the context length), read through the block table."""
    x = weights[input_ids] + positions.unsqueeze(1).to(weights.dtype) * 0.01  # [rows, DIM]
    cache.index_copy_(0, slot_mapping, x)
    p = torch.arange(block_table.shape[1] * BLOCK_SIZE, device=cache.device)
    slots = block_table[row_seq].long()[:, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE  # [rows, max_pos]
    visible = (p.unsqueeze(0) <= positions.unsqueeze(1)) & (p.unsqueeze(0) < context_lens[row_seq].unsqueeze(1))
    values = cache[slots] * visible.unsqueeze(-1)
    return x + values.sum(1) / visible.sum(1, keepdim=True).clamp(min=1)


def eager_forward(cache, weights, step: StepInputs) -> torch.Tensor:
    row_seq = torch.repeat_interleave(torch.arange(len(step.counts)), torch.tensor(step.counts)).to(cache.device)
    return toy_forward(cache, weights, step.input_ids, step.positions, step.slot_mapping, step.block_table,
                       step.context_lens, row_seq)


def static_forward(cache, weights, static: StaticInputs) -> torch.Tensor:
    row_seq = static.query_rows // static.bucket.num_query  # [num_seqs, num_query]: each row's sequence
    return toy_forward(cache, weights, static.input_ids, static.positions, static.slot_mapping, static.block_table,
                       static.context_lens, row_seq.flatten())


class Sequences:
    """Sequences growing by their accepted tokens, with block tables from a shuffled free list."""

    def __init__(self, gen: torch.Generator, num_seqs: int) -> None:
        self.gen = gen
        free = torch.randperm(NUM_BLOCKS - 1, generator=gen).tolist()  # the last block holds the scratch slot
        self.tables = [free[i * MAX_BLOCKS : (i + 1) * MAX_BLOCKS] for i in range(num_seqs)]  # 24 positions each
        self.lengths = [int(torch.randint(1, 12, (1,), generator=gen)) for _ in range(num_seqs)]

    def step(self, seqs: list[int], drafts: list[int], device) -> StepInputs:
        counts = [1 + d for d in drafts]
        starts = [self.lengths[s] - 1 for s in seqs]  # the last token is fed back, its drafts after it
        positions = torch.cat([torch.arange(b, b + c) for b, c in zip(starts, counts)])
        seq_of_row = torch.repeat_interleave(torch.tensor(seqs), torch.tensor(counts))
        tables = torch.tensor([self.tables[s] for s in seqs], dtype=torch.int32)
        width = max(-(-(self.lengths[s] + c) // BLOCK_SIZE) for s, c in zip(seqs, counts))
        slot_mapping = torch.tensor([self.tables[s][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                                     for s, p in zip(seq_of_row.tolist(), positions.tolist())])
        input_ids = torch.randint(0, 50, (len(positions),), generator=self.gen)
        context_lens = torch.tensor([self.lengths[s] - 1 + c for s, c in zip(seqs, counts)], dtype=torch.int32)
        for s in seqs:
            self.lengths[s] += 1
        return StepInputs(input_ids.to(device), positions.to(device), slot_mapping.to(device),
                          tables[:, :width].contiguous().to(device), context_lens.to(device), counts)


def run_against_eager(device: torch.device, replay_factory=None, num_steps: int = 12):
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(50, DIM, generator=gen).to(device)
    graph_cache = torch.randn(NUM_BLOCKS * BLOCK_SIZE, DIM, generator=gen).to(device)
    eager_cache = graph_cache.clone()
    captured = []

    def factory(fn):
        captured.append(1)
        return (replay_factory or EagerReplay)(fn)

    runner = GraphRunner(GraphBuckets([1, 2, 4, 8], [0, 2]), lambda s: static_forward(graph_cache, weights, s),
                         lambda step: eager_forward(graph_cache, weights, step), max_blocks=MAX_BLOCKS,
                         scratch_slot=SCRATCH_SLOT, device=device, replay_factory=factory)
    sequences = Sequences(gen, 10)
    plan = [([0], [0]), ([0, 1, 2], [0, 2, 1]), ([3, 4, 5, 6, 7], [0, 0, 0, 0, 0]), ([0, 1], [2, 2]),
            (list(range(10)), [0] * 10), ([2, 4, 6], [1, 0, 3]), ([1, 3, 5], [0, 0, 0]), ([0], [0])]
    for seqs, drafts in plan[: num_steps]:
        step = sequences.step(seqs, drafts, device)
        got = runner.run(step)
        expected = eager_forward(eager_cache, weights, step)
        torch.testing.assert_close(got, expected)
        keep = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
        keep[SCRATCH_SLOT] = False
        torch.testing.assert_close(graph_cache[keep], eager_cache[keep])  # padding wrote the scratch slot only
    return runner, captured


def test_runner_equals_eager_steps_with_one_capture_per_bucket():
    runner, captured = run_against_eager(torch.device("cpu"))
    # (1,1) (4,3) (8,1) (2,3) eager (4,5 -> none: draft 3) (4,1) (1,1 again)
    assert set(runner.graphs) == {GraphBucket(1, 1), GraphBucket(4, 3), GraphBucket(8, 1), GraphBucket(2, 3),
                                  GraphBucket(4, 1)}
    assert len(captured) == len(runner.graphs)
    assert runner.num_eager == 2  # 10 sequences, and a draft of 3


def test_static_inputs_pad_rows_to_the_scratch_slot_and_sequences_to_nothing():
    static = StaticInputs(GraphBucket(4, 3), max_blocks=5, scratch_slot=99, device=torch.device("cpu"))
    step = StepInputs(torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10, 11, 3]), torch.tensor([41, 42, 43, 7]),
                      torch.tensor([[10, 11, 12], [1, 0, 0]], dtype=torch.int32), torch.tensor([12, 4],
                                                                                             dtype=torch.int32), [3, 1])
    rows = static.fill(step)
    assert rows.tolist() == [0, 1, 2, 3]
    step2 = StepInputs(torch.tensor([1, 2]), torch.tensor([4, 5]), torch.tensor([17, 18]),
                       torch.tensor([[4, 4]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32), [2])
    assert static.fill(step2).tolist() == [0, 1]  # refilled: nothing of the first step is left
    assert static.slot_mapping.tolist() == [17, 18] + [99] * 10
    assert static.input_ids.tolist() == [1, 2] + [0] * 10
    assert static.context_lens.tolist() == [6, 0, 0, 0]
    assert static.block_table[0].tolist() == [4, 4, 0, 0, 0] and not static.block_table[1:].any()
    assert static.query_valid.tolist() == [[True, True, False]] + [[False] * 3] * 3
    with pytest.raises(ValueError, match="does not fit"):
        static.fill(StepInputs(*[torch.zeros(4, dtype=torch.long)] * 3, torch.zeros(1, 1, dtype=torch.int32),
                               torch.zeros(1, dtype=torch.int32), [4]))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@needs_cuda
def test_cuda_graphs_replay_the_eager_steps():
    from specula_kernels.cuda_graphs import CudaGraphReplay

    runner, captured = run_against_eager(torch.device("cuda"), replay_factory=CudaGraphReplay)
    assert len(captured) == len(runner.graphs) == 5


@pytest.mark.cuda
@needs_cuda
@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_the_attention_kernel_replays_in_a_cuda_graph():
    """The Triton kernel reads lengths and block tables from memory: one graph serves changing contexts."""
    from specula_kernels.cuda_graphs import CudaGraphReplay
    from specula_kernels.paged_attention import PagedAttentionInputs, _attend
    from specula_kernels.triton_paged_attention import paged_attention_triton

    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, head_dim, bucket = 8, 2, 64, GraphBucket(4, 1)
    key_cache = torch.randn(NUM_BLOCKS * BLOCK_SIZE, kv_heads, head_dim, generator=gen).cuda().bfloat16()
    value_cache = torch.randn(NUM_BLOCKS * BLOCK_SIZE, kv_heads, head_dim, generator=gen).cuda().bfloat16()
    static = StaticInputs(bucket, max_blocks=MAX_BLOCKS, scratch_slot=SCRATCH_SLOT, device=torch.device("cuda"))
    query = torch.zeros(bucket.num_rows, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    graph = CudaGraphReplay(lambda: paged_attention_triton(
        query, key_cache, value_cache, static.block_table, static.query_rows, static.query_valid, None,
        static.context_lens, head_dim**-0.5, out=torch.zeros_like(query), block_size=BLOCK_SIZE))
    sequences = Sequences(gen, 4)
    for _ in range(3):
        step = sequences.step([0, 1, 2], [0, 0, 0], "cuda")
        rows = static.fill(step)
        query[rows] = torch.randn(len(rows), heads, head_dim, generator=gen).cuda().bfloat16()
        graph.replay()
        for i in range(3):  # each sequence against the SDPA reference over its own slots
            n = int(step.context_lens[i])
            p = torch.arange(n, device="cuda")
            slots = step.block_table[i].long()[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            inputs = PagedAttentionInputs(slots[:1], slots.unsqueeze(0), torch.zeros(1, 1, dtype=torch.long,
                                          device="cuda"), torch.ones(1, 1, dtype=torch.bool, device="cuda"), None)
            expected = _attend(query[rows[i : i + 1]].float(), key_cache.float(), value_cache.float(), inputs,
                               head_dim**-0.5)
            torch.testing.assert_close(graph.output[rows[i : i + 1]].float(), expected, rtol=3e-2, atol=3e-2)
