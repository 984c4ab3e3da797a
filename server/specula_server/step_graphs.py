"""The worker's CUDA graphs: which steps replay one, in what form, and over which model and cache.

`specula_kernels.cuda_graphs` holds the bookkeeping (buckets, static buffers, capture and replay); this module
binds it to the worker. A plain decode step or the verification of chains of drafts whose batch fits a bucket is
built as `BlockTableInputs` (`batch.build_block_table_step`) and replayed; prompts and chunks, trees of drafts
(they need a mask), batches with a LoRA adapter and batches past the largest bucket take the general path.
Graphs are off where `unavailable` says why: off CUDA, under tensor parallelism (its all-reduce is not
captured), without triton, over a cache or a head size the attention kernel does not serve (float8 before compute
capability 8.9).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from specula_kernels import triton_paged_attention
from specula_kernels.cuda_graphs import GraphBuckets, GraphCaptureError, GraphRunner, StaticInputs, default_batch_sizes
from specula_kernels.cuda_graphs import StepInputs as GraphStepInputs
from specula_kernels.paged_attention import BlockTableInputs
from specula_kernels.sgmv import triton_available
from specula_server.batch import StepInputs, block_table_inputs, build_block_table_step
from specula_server.distributed import ShardGroup
from specula_server.kv_cache import KVCache
from specula_server.models.llama import LlamaForCausalLM
from specula_server.request import RequestState
from specula_server.speculation.drafters import Draft

logger = logging.getLogger("specula.step_graphs")

# By default graphs are captured for batches of 1, 2, 4, then multiples of 8 up to this.
DEFAULT_MAX_GRAPH_BATCH = 128


def default_graph_batch_sizes() -> tuple[int, ...]:
    return tuple(default_batch_sizes(DEFAULT_MAX_GRAPH_BATCH))


def unavailable(device: torch.device, group: ShardGroup, kv_cache_dtype: torch.dtype, head_dim: int) -> str | None:
    """Why a worker's steps cannot replay CUDA graphs (None: they can)."""
    if device.type != "cuda":
        return "not on CUDA"
    if group.world_size > 1:
        return "tensor parallel (its all-reduce is not captured)"
    if not triton_available():
        return "triton is not installed (the graphs replay its attention kernel)"
    if not triton_paged_attention.reads_cache(kv_cache_dtype, device):
        return f"a {kv_cache_dtype} KV cache on this GPU (the attention kernel reads float8 from sm_89 on)"
    if head_dim > triton_paged_attention.MAX_HEAD_DIM:
        return f"head size {head_dim} (over {triton_paged_attention.MAX_HEAD_DIM})"
    return None


class StepGraphs(GraphRunner):
    """One graph per (batch size, draft length) bucket of the model's forward over `kv_cache`.

    The KV cache must hold one slot past its blocks (`KVCache.allocate(extra_slots=1)`): padding rows write there.
    `aux_layer_ids()` are the layers whose outputs the forward also returns (an EAGLE-3 drafter's; fixed once a
    graph is captured)."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, batch_sizes: Sequence[int], max_draft: int,
                 aux_layer_ids: Callable[[], tuple[int, ...]], device: torch.device) -> None:
        self.model, self.kv_cache, self.aux_layer_ids = model, kv_cache, aux_layer_ids
        self.block_size = kv_cache.block_size
        max_draft = min(max_draft, triton_paged_attention.MAX_QUERY - 1)
        max_blocks = min(kv_cache.num_blocks, -(-model.config.max_position_embeddings // self.block_size))
        super().__init__(GraphBuckets(batch_sizes, range(max_draft + 1)), self._forward_static, self._forward_eager,
                         max_blocks, scratch_slot=kv_cache.num_slots, device=device)

    def build_step(self, reqs: Sequence[RequestState], counts: Sequence[int],
                   trees: Sequence[Draft | None] | None = None) -> StepInputs | None:
        """The step (each request feeding its last token and `counts[i] - 1` drafts) in the form a graph replays,
        or None where no graph holds it (trees, LoRA adapters, a batch or draft past the buckets)."""
        if trees is not None and any(t is not None and not t.is_chain for t in trees):
            return None
        if any(r.spec.adapter_id for r in reqs):
            return None
        starts = [r.num_tokens - 1 for r in reqs]
        num_blocks = -(-max(s + c for s, c in zip(starts, counts)) // self.block_size)
        if not self.fits(len(reqs), [c - 1 for c in counts], num_blocks):
            return None
        return build_block_table_step(reqs, starts, counts, self.block_size, self.model.norm.weight.device)

    def run_step(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final hidden states and auxiliary ones of a step `build_step` built. Raises `GraphCaptureError`."""
        attn = step.attn
        assert isinstance(attn, BlockTableInputs)
        return self.run(GraphStepInputs(step.input_ids, step.positions, attn.slot_mapping, attn.block_table,
                                        attn.context_lens, step.counts))

    def _forward_static(self, static: StaticInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a graph captures: the model over a bucket's static buffers (no LoRA: such steps are not graphed)."""
        return self.model.forward_with_aux(static.input_ids, static.positions, self.kv_cache.layers,
                                           static.attention(self.block_size), None, self.aux_layer_ids())

    def _forward_eager(self, step: GraphStepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A block-table step no graph holds, run as it is (`build_step` builds such steps only where one does)."""
        attn = block_table_inputs(step.slot_mapping, step.block_table, self.block_size, step.context_lens,
                                  step.positions, step.counts)
        return self.model.forward_with_aux(step.input_ids, step.positions, self.kv_cache.layers, attn, None,
                                           self.aux_layer_ids())


def capture_all_or_none(graphs: StepGraphs) -> StepGraphs | None:
    """`graphs` with every graph captured now (a server's warmup, so that no request waits for one), or None,
    with a warning, when a capture fails (every step then runs eagerly)."""
    start = time.perf_counter()
    try:
        count = graphs.capture_all()
    except GraphCaptureError as error:
        logger.warning("CUDA graphs turned off, every step runs eagerly: %s", error)
        return None
    logger.info("captured %d CUDA graphs (batch sizes %s, draft lengths %s) in %.1f s", count,
                graphs.buckets.batch_sizes, graphs.buckets.draft_lengths, time.perf_counter() - start)
    return graphs
