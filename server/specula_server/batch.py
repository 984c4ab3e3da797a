"""The tensors of one forward step, rebuilt from the requests each step.

`build_step` describes each request's new tokens as a span `[start, start + count)` of its positions:

    prefill:  start = positions already computed (a cached prefix, earlier chunks),  count = the rest or a chunk
    decode:   start = num_tokens - 1,  count = 1 + drafts   (the last generated token is fed back)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from specula_kernels.paged_attention import BlockTableInputs, GroupedAttentionInputs, PagedAttentionInputs
from specula_server.request import RequestState
from specula_server.speculation.drafters import Draft


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] long
    positions: torch.Tensor  # [num_tokens] long
    attn: PagedAttentionInputs | GroupedAttentionInputs | BlockTableInputs
    last_rows: torch.Tensor  # [num_seqs] long: row of each request's last new token in the flat list
    row_starts: list[int]  # first flat row of each request
    counts: list[int]  # new tokens of each request


def build_step(
    requests: Sequence[RequestState], starts: Sequence[int], counts: Sequence[int], device: torch.device,
    trees: Sequence[Draft | None] | None = None, split: int | None = None,
) -> StepInputs:
    """Builds one forward step: request i feeds positions `[starts[i], starts[i] + counts[i])`.

    When one-token sequences (plain decodes) sit next to longer ones (drafts being verified), attention runs
    in two groups so the one-token sequences are not padded to the longest draft; the requests from index
    `split` on (prompt chunks, after the decodes) attend in a group of their own.

    `trees[i]`, when given, is a tree of drafts request i verifies: its `counts[i]` tokens are the root and
    the tree's nodes, stored (tokens and KV) at buffer indices `starts[i] + 1 + node` as a chain would be, but
    each node sits at position `starts[i] + depth` and attends to the context and its own ancestors only.
    """
    if all(c == 1 for c in counts):  # a plain decode step
        if len(requests) == 1:
            return _one_decode(requests[0], starts[0], device)
        return _single_token_step(requests, starts, device)  # no per-request tensors
    return _spans_step(requests, starts, counts, device, trees, split)


def build_block_table_step(requests: Sequence[RequestState], starts: Sequence[int], counts: Sequence[int],
                           block_size: int, device: torch.device) -> StepInputs:
    """`build_step` for chains (no trees) as a CUDA graph takes them (`BlockTableInputs`): each request's block
    table instead of a slot per context position, each row causal by its position, no mask.

    Block tables come from the requests' slots (block `b` holds slots `b * block_size ..`), padded with block 0,
    which no row reads: a sequence reads its first `starts[i] + counts[i]` positions only.
    """
    ends = [s + c for s, c in zip(starts, counts)]
    if all(c == 1 for c in counts):
        input_ids = torch.stack([r.token_ids[s] for r, s in zip(requests, starts)]).to(device)
        positions = torch.tensor(starts, dtype=torch.long, device=device)
        slot_mapping = torch.stack([r.slots[s] for r, s in zip(requests, starts)])
    else:
        input_ids = torch.cat([r.token_ids[s:e] for r, s, e in zip(requests, starts, ends)]).to(device)
        positions = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends)]).to(device)
        slot_mapping = torch.cat([r.slots[s:e] for r, s, e in zip(requests, starts, ends)])
    first_slots = pad_sequence([r.slots[:e:block_size] for r, e in zip(requests, ends)], batch_first=True)
    block_table = (first_slots // block_size).to(torch.int32)
    context_lens = torch.tensor(ends, dtype=torch.int32, device=device)
    attn = block_table_inputs(slot_mapping, block_table, block_size, context_lens, positions, counts)
    row_ends = torch.tensor(counts).cumsum(0)
    return StepInputs(input_ids, positions, attn, (row_ends - 1).to(device), (row_ends - torch.tensor(counts)).tolist(),
                      list(counts))


def block_table_inputs(slot_mapping: torch.Tensor, block_table: torch.Tensor, block_size: int,
                       context_lens: torch.Tensor, positions: torch.Tensor, counts: Sequence[int]) -> BlockTableInputs:
    """`BlockTableInputs` of sequences whose `counts[i]` rows lie one after another in the flat token list."""
    device = block_table.device
    counts_t = torch.tensor(counts)
    row_ends = counts_t.cumsum(0)
    q = torch.arange(max(counts))
    query_rows = torch.minimum(row_ends.unsqueeze(1) - counts_t.unsqueeze(1) + q, row_ends.unsqueeze(1) - 1)
    query_valid = q.unsqueeze(0) < counts_t.unsqueeze(1)
    return BlockTableInputs(slot_mapping, block_table, block_size, query_rows.to(device), query_valid.to(device),
                            context_lens, positions)


def _spans_step(
    requests: Sequence[RequestState], starts: Sequence[int], counts: Sequence[int], device: torch.device,
    trees: Sequence[Draft | None] | None = None, split: int | None = None,
) -> StepInputs:
    """`build_step` for any spans: per request, its tokens, positions and slots, then attention metadata."""
    # Chains (one node, no node) need no tree mask; only real trees are kept.
    trees = [t if t is not None and not t.is_chain else None for t in trees] if trees is not None \
        else [None] * len(requests)
    spans = [(r, s, s + c) for r, s, c in zip(requests, starts, counts)]
    input_ids = torch.cat([r.token_ids[s:e] for r, s, e in spans]).to(device)
    positions = torch.cat([
        torch.arange(s, e) if tree is None else s + torch.tensor([0] + tree.depths(), dtype=torch.long)
        for (_, s, e), tree in zip(spans, trees)
    ]).to(device)
    slot_mapping = torch.cat([r.slots[s:e] for r, s, e in spans])
    row_ends = torch.tensor(counts).cumsum(0)
    row_starts = (row_ends - torch.tensor(counts)).tolist()
    split = len(spans) if split is None else split
    kinds = ([i for i in range(split) if counts[i] == 1], [i for i in range(split) if counts[i] > 1],
             list(range(split, len(spans))))
    if sum(1 for members in kinds if members) > 1:
        groups = []
        for members in [members for members in kinds if members]:
            rows = torch.cat([torch.arange(row_starts[i], row_starts[i] + counts[i]) for i in members]).to(device)
            groups.append((rows, _attention_inputs([spans[i] for i in members], slot_mapping, device,
                                                   [trees[i] for i in members])))
        attn = GroupedAttentionInputs(slot_mapping, groups)
    else:
        attn = _attention_inputs(spans, slot_mapping, device, trees)
    return StepInputs(input_ids, positions, attn, (row_ends - 1).to(device), row_starts, list(counts))


def _one_decode(r: RequestState, start: int, device: torch.device) -> StepInputs:
    """`build_step` for one request decoding one token (one stream): views of its buffers and three small
    constants, the inputs the general path builds (one sequence's one row sees its whole context: no mask) in a
    third of its time: 0.07 ms, where its 0.2 ms were 1-3% of a one-stream step of the 135M real model."""
    attn = PagedAttentionInputs(r.slots[start : start + 1], r.slots[: start + 1].unsqueeze(0),
                                torch.zeros(1, 1, dtype=torch.long, device=device),
                                torch.ones(1, 1, dtype=torch.bool, device=device), None)
    return StepInputs(r.token_ids[start : start + 1].to(device), torch.tensor([start], device=device), attn,
                      torch.zeros(1, dtype=torch.long, device=device), [0], [1])


def _single_token_step(requests: Sequence[RequestState], starts: Sequence[int], device: torch.device) -> StepInputs:
    """`build_step` when every request feeds one token (a plain decode step), built with a few batched
    operations instead of several small tensors per request, whose cost the general way grows with the batch.

    Sequence i's context is its slots `[0, starts[i]]`, padded with its own first slot to the longest
    (`_padded_slots`); its one query row is row i and sees positions up to its own.
    """
    num_seqs, ones = len(requests), [1] * len(requests)
    input_ids = torch.stack([r.token_ids[s] for r, s in zip(requests, starts)]).to(device)
    positions = torch.tensor(starts, dtype=torch.long, device=device)
    context_slots = _padded_slots([r.slots[: s + 1] for r, s in zip(requests, starts)])
    rows = torch.arange(num_seqs, device=device)
    slot_mapping = context_slots[rows, positions]
    attn = PagedAttentionInputs(slot_mapping, context_slots, rows.unsqueeze(1),
                                torch.ones(num_seqs, 1, dtype=torch.bool, device=device),
                                _causal_mask(starts, ones, context_slots.shape[1], device))
    return StepInputs(input_ids, positions, attn, rows, list(range(num_seqs)), ones)


def _attention_inputs(spans, slot_mapping: torch.Tensor, device: torch.device,
                      trees: Sequence[Draft | None]) -> PagedAttentionInputs:
    """Attention metadata for `(request, start, end)` spans whose tokens are laid out one after another."""
    starts = [s for _, s, _ in spans]
    counts = [e - s for _, s, e in spans]
    if len(spans) == 1:
        r, s, e = spans[0]
        context_slots = r.slots[:e].unsqueeze(0)
        query_index = torch.arange(e - s, device=device).unsqueeze(0)
    else:
        row_starts = (torch.tensor(counts).cumsum(0) - torch.tensor(counts)).tolist()
        context_slots = _padded_slots([r.slots[:e] for r, _, e in spans])
        query_index = pad_sequence(
            [torch.arange(b, b + c, device=device) for b, c in zip(row_starts, counts)], batch_first=True
        )
    max_query = query_index.shape[1]
    counts_t = torch.tensor(counts, device=device)
    query_valid = torch.arange(max_query, device=device).unsqueeze(0) < counts_t.unsqueeze(1)
    mask = _causal_mask(starts, counts, context_slots.shape[1], device)
    if any(tree is not None for tree in trees):
        mask = mask.clone()
        for i, tree in enumerate(trees):
            if tree is not None:  # a node sees the context, the root and its ancestors, never its siblings
                s, c = starts[i], counts[i]
                mask[i, 0, :c, s : s + c] = tree.ancestors().to(device)
    return PagedAttentionInputs(slot_mapping, context_slots, query_index, query_valid, mask)


def _padded_slots(slots: Sequence[torch.Tensor]) -> torch.Tensor:
    """`[num_seqs, max_context]`: each sequence's context slots, padded with its own first slot.

    The mask hides padding, but a hidden position still enters the product: a masked score is `s + (-inf)`
    and its weight multiplies the value, so a NaN key or value there (`NaN - inf`, `0 * NaN`) turns the whole
    row into NaN. Padding with a slot another request owns (slot 0, say) let one request's non-finite KV
    (or stale KV left in a freed block) poison every shorter sequence of later batches. A sequence's own
    first slot was written by its own prefill, so a row only ever reads what it wrote itself.
    """
    padded = pad_sequence(list(slots), batch_first=True, padding_value=-1)
    return torch.where(padded < 0, padded[:, :1], padded)


def _causal_mask(
    starts: Sequence[int], counts: Sequence[int], max_context: int, device: torch.device
) -> torch.Tensor | None:
    """`[num_seqs, 1, max_query, max_context]`: query q of sequence i sees keys at positions <= starts[i] + q.

    Padded query rows see key 0 only, so no row is fully masked; their outputs are discarded.
    """
    if len(starts) == 1 and counts[0] == 1:
        return None  # a single decoding sequence sees its whole context
    starts_t = torch.tensor(starts, device=device).view(-1, 1, 1)
    counts_t = torch.tensor(counts, device=device).view(-1, 1, 1)
    q = torch.arange(max(counts), device=device).view(1, -1, 1)
    k = torch.arange(max_context, device=device).view(1, 1, -1)
    visible = k <= starts_t + q
    visible = torch.where(q < counts_t, visible, k == 0)
    return visible.unsqueeze(1)
