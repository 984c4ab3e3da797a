"""CUDA graphs for decode and verification steps: buckets, static buffers, capture once, replay.

A decode step on a GPU spends more time launching kernels than running them: each layer is a few dozen small
launches, each paying Python and driver overhead. A CUDA graph records a step's launches once and replays them
as one, but it replays fixed shapes from fixed addresses. So steps are padded to a few shapes (buckets), and the
step's inputs are copied into buffers allocated once per bucket:

    bucket (num_seqs=8, num_query=3)      a step with 5 sequences, draft lengths [2, 0, 1, 2, 0]
    rows   [8 sequences x 3 query rows]   sequence i's rows are i*3 .. i*3+2; its first 1 + draft rows are real
    input_ids, positions, slot_mapping    the real rows copied in, padding rows: token 0, position 0, and the
                                          scratch slot, so their KV writes land where nothing reads
    block_table [8, max_blocks]           the sequences' block tables, padding sequences all scratch
    context_lens [8]                      padding sequences 0: the attention kernel reads nothing for them
    query_valid [8, 3]                    which rows are real; outputs are read back for those only

`GraphBuckets.select` picks the smallest bucket holding the step (batch sizes and draft lengths, each rounded up);
a step that fits none (too many sequences, too long drafts, a prompt) runs eagerly. `draft_lengths_for_bucket`
maps the speculation controller's draft lengths onto the chosen bucket: the padded rows are computed anyway, so
every request may verify up to the bucket's draft length at no extra cost. `GraphRunner` captures one graph per
bucket on first use and replays it; on CPU, and in tests, `EagerReplay` stands in for the graph (it re-runs the
captured function on the same static buffers, which is what a replay computes).

The attention kernel reads `context_lens` and the block table from memory, and a row's causal limit from its
position (`paged_attention.BlockTableInputs`), so one graph serves every context length up to
`max_blocks * block_size`. The worker (`specula_server.generator`) runs its plain decode steps and its
verification of chains of drafts through a `GraphRunner`; prompts, trees of drafts and LoRA batches run eagerly.

Graphs share one memory pool: a graph's intermediate buffers may be another's output, which is safe because
graphs replay one at a time and each replay's outputs are copied out (`GraphRunner.run`) before the next.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specula_kernels.paged_attention import BlockTableInputs


@dataclass(frozen=True, order=True)
class GraphBucket:
    num_seqs: int  # sequences the graph holds (a step's are padded to this)
    num_query: int  # query rows per sequence: 1 + the longest draft the graph verifies

    @property
    def num_rows(self) -> int:
        return self.num_seqs * self.num_query


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to the first that holds `max_num_seqs` (a step pads at most 7 sequences
    past 8).

    Example: `default_batch_sizes(30)` is `[1, 2, 4, 8, 16, 24, 32]`; `default_batch_sizes(3)` is `[1, 2, 4]`."""
    candidates = [1, 2, 4, *range(8, max_num_seqs + 8, 8)]
    return candidates[: bisect.bisect_left(candidates, max_num_seqs) + 1]


class GraphBuckets:
    """The (batch size, draft length) pairs graphs are captured for."""

    def __init__(self, batch_sizes: Sequence[int], draft_lengths: Sequence[int] = (0,)) -> None:
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"batch sizes must be positive, got {list(batch_sizes)}")
        if not draft_lengths or min(draft_lengths) < 0:
            raise ValueError(f"draft lengths must not be negative, got {list(draft_lengths)}")
        self.batch_sizes = sorted(set(batch_sizes))
        self.draft_lengths = sorted(set(draft_lengths))

    def __iter__(self):
        return (GraphBucket(b, 1 + d) for b in self.batch_sizes for d in self.draft_lengths)

    def select(self, num_seqs: int, draft_lengths: Sequence[int]) -> GraphBucket | None:
        """The smallest bucket holding `num_seqs` sequences with these draft lengths; None: run eagerly.

        Example: with batch sizes [1, 2, 4, 8] and draft lengths [0, 2, 4], 5 sequences drafting [2, 0, 1, 2, 0]
        take bucket (8, 3); 9 sequences, or a draft of 5, take none."""
        assert len(draft_lengths) == num_seqs
        longest = max(draft_lengths, default=0)
        b = bisect.bisect_left(self.batch_sizes, num_seqs)
        d = bisect.bisect_left(self.draft_lengths, longest)
        if num_seqs == 0 or b == len(self.batch_sizes) or d == len(self.draft_lengths):
            return None
        return GraphBucket(self.batch_sizes[b], 1 + self.draft_lengths[d])


def draft_lengths_for_bucket(lengths: Sequence[int], available: Sequence[int], bucket: GraphBucket) -> list[int]:
    """The controller's draft lengths raised to what the bucket verifies anyway (capped at what each drafter
    proposed): a graph computes every padded row, so a longer draft costs nothing and may be accepted.

    Example: lengths [2, 0, 1], available [4, 1, 1], bucket num_query 3 (drafts of 2) -> [2, 1, 1]."""
    cap = bucket.num_query - 1
    assert max(lengths, default=0) <= cap, (lengths, bucket)
    return [max(n, min(a, cap)) for n, a in zip(lengths, available)]


@dataclass
class StepInputs:
    """A decode or verification step as the model takes it: sequence i's rows are `counts[i]` consecutive
    rows of the flat lists."""

    input_ids: torch.Tensor  # [num_tokens] long
    positions: torch.Tensor  # [num_tokens] long
    slot_mapping: torch.Tensor  # [num_tokens] long: where each token's key and value are written
    block_table: torch.Tensor  # [num_seqs, num_blocks] int32, any width up to the static one
    context_lens: torch.Tensor  # [num_seqs] int32: positions each sequence attends to, its new tokens included
    counts: list[int]  # query rows per sequence


class StaticInputs:
    """The buffers one bucket's graph reads, allocated once; `fill` copies a step in and pads the rest.

    Padding rows write their keys and values to `scratch_slot` (a slot no sequence owns: the caller reserves
    one), and padding sequences attend to nothing (`context_lens` 0)."""

    def __init__(self, bucket: GraphBucket, max_blocks: int, scratch_slot: int, device: torch.device) -> None:
        self.max_blocks = max_blocks
        self.bucket, self.scratch_slot = bucket, scratch_slot
        rows, seqs = bucket.num_rows, bucket.num_seqs
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), scratch_slot, dtype=torch.long, device=device)
        self.block_table = torch.zeros(seqs, max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(seqs, dtype=torch.int32, device=device)
        self.query_valid = torch.zeros(seqs, bucket.num_query, dtype=torch.bool, device=device)
        # [num_seqs, num_query]: the flat row of each (sequence, query row), fixed: the layout is the bucket's
        self.query_rows = torch.arange(rows, device=device).view(seqs, bucket.num_query)

    def fill(self, step: StepInputs) -> torch.Tensor:
        """Copies `step` in (in place: the graph holds these addresses); returns the static rows of the step's
        tokens, in the step's order (`[num_tokens]`), to read the outputs back with."""
        num_seqs, q = len(step.counts), self.bucket.num_query
        if num_seqs > self.bucket.num_seqs or max(step.counts) > q:
            raise ValueError(f"a step of {num_seqs} sequences with up to {max(step.counts)} rows does not fit "
                             f"bucket {self.bucket}")
        if step.block_table.shape[1] > self.block_table.shape[1]:
            raise ValueError(f"block table of {step.block_table.shape[1]} blocks, the graph holds "
                             f"{self.block_table.shape[1]}")
        device = self.input_ids.device
        counts = torch.tensor(step.counts, device=device)
        valid = torch.arange(q, device=device).unsqueeze(0) < counts.unsqueeze(1)  # [num_seqs, q]
        rows = self.query_rows[:num_seqs][valid]  # the step's tokens in order: sequence-major, as the step lists them
        self.query_valid.zero_()
        self.query_valid[:num_seqs] = valid
        for static, value, pad in ((self.input_ids, step.input_ids, 0), (self.positions, step.positions, 0),
                                   (self.slot_mapping, step.slot_mapping, self.scratch_slot)):
            static.fill_(pad)
            static.index_copy_(0, rows, value.to(device))
        self.block_table.zero_()
        self.block_table[:num_seqs, : step.block_table.shape[1]] = step.block_table.to(device)
        self.context_lens.zero_()
        self.context_lens[:num_seqs] = step.context_lens.to(device)
        return rows

    def attention(self, block_size: int) -> BlockTableInputs:
        """The attention inputs over these buffers (what the captured forward reads)."""
        return BlockTableInputs(self.slot_mapping, self.block_table, block_size, self.query_rows, self.query_valid,
                                self.context_lens, self.positions)


class EagerReplay:
    """Stands in for a CUDA graph where there is none (CPU, tests): replay re-runs the captured function on the
    same static buffers, which is what replaying a graph computes."""

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self.fn = fn
        self.output = fn()

    def replay(self) -> None:
        self.output = self.fn()


class CudaGraphReplay:
    """A CUDA graph of `fn` over static buffers: warmed up on a side stream, captured, then replayed."""

    def __init__(self, fn: Callable[[], object], pool=None) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # lazy initialisation (Triton compiles, cuBLAS workspaces) outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = fn()

    def replay(self) -> None:
        self.graph.replay()


class GraphCaptureError(RuntimeError):
    """A bucket's graph could not be built (an operation a capture does not allow, say): the caller runs the step
    eagerly and should stop using graphs."""


class GraphRunner:
    """Runs steps through one graph per bucket, eagerly where no bucket holds them.

    `forward(static)` computes the model over a bucket's `StaticInputs` (`[num_rows, ...]` outputs) and must read
    nothing else that changes between steps; `eager(step)` runs a step that fits no bucket. `replay_factory`
    builds the graph (`CudaGraphReplay` on CUDA, `EagerReplay` elsewhere)."""

    def __init__(self, buckets: GraphBuckets, forward: Callable[[StaticInputs], torch.Tensor],
                 eager: Callable[[StepInputs], torch.Tensor], max_blocks: int, scratch_slot: int,
                 device: torch.device, replay_factory: Callable[[Callable[[], torch.Tensor]], object] | None = None):
        self.buckets, self.forward, self.eager = buckets, forward, eager
        self.max_blocks, self.scratch_slot, self.device = max_blocks, scratch_slot, device
        if replay_factory is None and device.type == "cuda":
            pool = torch.cuda.graph_pool_handle()  # shared: see the module's docstring

            def replay_factory(fn):
                return CudaGraphReplay(fn, pool)
        self.replay_factory = replay_factory or EagerReplay
        self.graphs: dict[GraphBucket, tuple[StaticInputs, object]] = {}
        self.num_eager = self.num_replayed = 0

    def capture_all(self) -> int:
        """Captures every bucket not captured yet, largest first (the shared pool is sized by the first), over
        buffers of padding only (writes land in the scratch slot); returns how many were captured. A server does
        this before its first request, so no request waits for a capture."""
        missing = [b for b in sorted(self.buckets, reverse=True) if b not in self.graphs]
        for bucket in missing:
            static = StaticInputs(bucket, self.max_blocks, self.scratch_slot, self.device)
            self.graphs[bucket] = (static, self._capture(bucket, static))
        return len(missing)

    def _capture(self, bucket: GraphBucket, static: StaticInputs):
        try:
            return self.replay_factory(lambda: self.forward(static))
        except Exception as error:
            raise GraphCaptureError(f"capturing bucket {bucket} failed: {error!r}") from error

    def fits(self, num_seqs: int, draft_lengths: Sequence[int], num_blocks: int) -> bool:
        """Whether a step of `num_seqs` sequences with these draft lengths, whose block tables reach
        `num_blocks` blocks, replays a graph."""
        return num_blocks <= self.max_blocks and self.buckets.select(num_seqs, draft_lengths) is not None

    def run(self, step: StepInputs):
        """The step's outputs, `[num_tokens, ...]` in the step's row order (each of them, where the forward
        returns several; None stays None)."""
        bucket = self.buckets.select(len(step.counts), [c - 1 for c in step.counts])
        if bucket is None or step.block_table.shape[1] > self.max_blocks:
            self.num_eager += 1
            return self.eager(step)
        entry = self.graphs.get(bucket)
        if entry is None:
            static = StaticInputs(bucket, self.max_blocks, self.scratch_slot, self.device)
            rows = static.fill(step)  # captured with real inputs: any data-dependent warm-up sees a real step
            entry = self.graphs[bucket] = (static, self._capture(bucket, static))
        else:
            rows = entry[0].fill(step)
        static, graph = entry
        graph.replay()
        self.num_replayed += 1
        if isinstance(graph.output, tuple):
            return tuple(None if out is None else out[rows] for out in graph.output)
        return graph.output[rows]
