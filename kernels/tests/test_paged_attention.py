"""Paged attention against dense per-sequence causal attention on contiguous K/V."""

from __future__ import annotations

import math

import pytest
import torch

from specula_kernels.paged_attention import PagedAttentionInputs, paged_attention, write_kv_cache


def dense_reference(q, k, v, start: int) -> torch.Tensor:
    """q: [n_new, H, D] at positions start.., k/v: [ctx, Hkv, D] for positions 0..ctx-1."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    pos_q = torch.arange(start, start + q.shape[0]).unsqueeze(1)
    pos_k = torch.arange(k.shape[0]).unsqueeze(0)
    scores = scores.masked_fill(pos_k > pos_q, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def build_inputs(spans, slot_tables) -> PagedAttentionInputs:
    """spans: (start, count) per sequence; slot_tables: slots of every position per sequence."""
    starts, counts = zip(*spans)
    slot_mapping = torch.cat([t[s : s + c] for t, (s, c) in zip(slot_tables, spans)])
    max_ctx, max_q = max(s + c for s, c in spans), max(counts)
    context_slots = torch.zeros(len(spans), max_ctx, dtype=torch.long)
    query_index = torch.zeros(len(spans), max_q, dtype=torch.long)
    mask = torch.zeros(len(spans), 1, max_q, max_ctx, dtype=torch.bool)
    row = 0
    for i, (s, c) in enumerate(spans):
        context_slots[i, : s + c] = slot_tables[i][: s + c]
        query_index[i, :c] = torch.arange(row, row + c)
        for q in range(max_q):
            mask[i, 0, q, : s + q + 1] = True if q < c else False
            if q >= c:
                mask[i, 0, q, 0] = True
        row += c
    valid = torch.arange(max_q).unsqueeze(0) < torch.tensor(counts).unsqueeze(1)
    return PagedAttentionInputs(slot_mapping, context_slots, query_index, valid, mask)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_mixed_prefill_and_decode_match_dense(heads, kv_heads):
    gen = torch.Generator().manual_seed(0)
    head_dim, block_size, num_blocks = 16, 4, 32
    k_cache = torch.zeros(num_blocks * block_size, kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    # Sequence 0 decodes one token after 9 cached; sequence 1 prefills 6; sequence 2 verifies 3 after 5.
    spans = [(9, 1), (0, 6), (5, 3)]
    block_tables = [torch.tensor([7, 2, 11]), torch.tensor([0, 5]), torch.tensor([30, 1])]
    slot_tables = [(b.unsqueeze(1) * block_size + torch.arange(block_size)).flatten() for b in block_tables]
    full_k = [torch.randn(s + c, kv_heads, head_dim, generator=gen) for s, c in spans]
    full_v = [torch.randn(s + c, kv_heads, head_dim, generator=gen) for s, c in spans]
    for (s, _), table, k, v in zip(spans, slot_tables, full_k, full_v):  # earlier steps' cache contents
        write_kv_cache(k[:s], v[:s], k_cache, v_cache, table[:s])
    q = torch.randn(sum(c for _, c in spans), heads, head_dim, generator=gen)
    inputs = build_inputs(spans, slot_tables)
    new_k = torch.cat([k[s:] for (s, _), k in zip(spans, full_k)])
    new_v = torch.cat([v[s:] for (s, _), v in zip(spans, full_v)])
    write_kv_cache(new_k, new_v, k_cache, v_cache, inputs.slot_mapping)
    out = paged_attention(q, k_cache, v_cache, inputs, scale=head_dim**-0.5)
    row = 0
    for (s, c), k, v in zip(spans, full_k, full_v):
        torch.testing.assert_close(out[row : row + c], dense_reference(q[row : row + c], k, v, s))
        row += c


def test_single_decoding_sequence_needs_no_mask():
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(32, 2, 8, generator=gen), torch.randn(32, 2, 8, generator=gen)
    slots = torch.tensor([12, 13, 14, 15, 4, 5])
    q = torch.randn(1, 4, 8, generator=gen)
    inputs = PagedAttentionInputs(slots[-1:], slots.unsqueeze(0), torch.zeros(1, 1, dtype=torch.long),
                                  torch.ones(1, 1, dtype=torch.bool), None)
    out = paged_attention(q, k_cache, v_cache, inputs, scale=8**-0.5)
    torch.testing.assert_close(out, dense_reference(q, k_cache[slots], v_cache[slots], start=5))


def test_grouped_inputs_equal_one_padded_group():
    """Attending one-token and multi-token sequences in separate groups gives the padded result."""
    from specula_kernels.paged_attention import GroupedAttentionInputs

    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, head_dim = 4, 2, 8
    k_cache = torch.randn(64, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(64, kv_heads, head_dim, generator=gen)
    spans = [(6, 1), (3, 4), (9, 1)]  # decode, verify 3 drafts, decode
    tables = [torch.arange(0, 12), torch.arange(20, 32), torch.arange(40, 52)]
    q = torch.randn(6, heads, head_dim, generator=gen)
    padded = paged_attention(q, k_cache, v_cache, build_inputs(spans, tables), scale=0.3)
    singles, multi = [0, 2], [1]
    rows_singles, rows_multi = torch.tensor([0, 5]), torch.tensor([1, 2, 3, 4])
    grouped = GroupedAttentionInputs(torch.zeros(6, dtype=torch.long), [
        (rows_singles, build_inputs([spans[i] for i in singles], [tables[i] for i in singles])),
        (rows_multi, build_inputs([spans[i] for i in multi], [tables[i] for i in multi])),
    ])
    torch.testing.assert_close(paged_attention(q, k_cache, v_cache, grouped, scale=0.3), padded)
