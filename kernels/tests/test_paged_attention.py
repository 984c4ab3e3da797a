"""Paged attention against dense per-sequence causal attention on contiguous K/V."""

from __future__ import annotations

import math

import pytest
import torch

from specula_kernels import native
from specula_kernels import paged_attention as paged_attention_module
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


@pytest.fixture(params=["native", "pytorch"])
def attention_path(request, monkeypatch):
    """Each test twice: on the native kernel (where it builds) and on the gathered-context SDPA path."""
    if request.param == "pytorch":
        monkeypatch.setattr(paged_attention_module, "_native_library", lambda *args: None)
    elif native.library() is None:
        pytest.skip("native kernels unavailable here")
    return request.param


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_mixed_prefill_and_decode_match_dense(heads, kv_heads, attention_path):
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


def test_grouped_inputs_equal_one_padded_group(attention_path):
    """Attending one-token and multi-token sequences in separate groups gives the padded result."""
    from specula_kernels.paged_attention import GroupedAttentionInputs

    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, head_dim = 4, 2, 16
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


# --- the native kernel (csrc/paged_attention.cpp) ------------------------------------------------------------------

needs_native = pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")


def random_cache(gen, slots: int, kv_heads: int, head_dim: int):
    return torch.randn(slots, kv_heads, head_dim, generator=gen), torch.randn(slots, kv_heads, head_dim, generator=gen)


@needs_native
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_native_matches_dense_reference(heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = random_cache(gen, 200, kv_heads, head_dim)
    largest = paged_attention_module.NATIVE_MAX_QUERY
    spans = [(9, 1), (40, 1), (5, 3), (0, 1), (17, largest)]  # decode, verify, a first token, the largest native block
    tables = [torch.randperm(200, generator=gen)[: s + c] for s, c in spans]
    inputs = build_inputs(spans, tables)
    assert inputs.query_index.shape[1] <= paged_attention_module.NATIVE_MAX_QUERY
    q = torch.randn(sum(c for _, c in spans), heads, head_dim, generator=gen)
    out = paged_attention(q, k_cache, v_cache, inputs, scale=head_dim**-0.5)
    row = 0
    for (s, c), table in zip(spans, tables):
        expected = dense_reference(q[row : row + c], k_cache[table], v_cache[table], s)
        torch.testing.assert_close(out[row : row + c], expected, rtol=1e-5, atol=1e-5)
        row += c


@needs_native
def test_native_row_is_the_same_bits_in_any_step():
    """A query row's output depends on its own query, keys and values only: attended alone (a decode step) or
    among other sequences with longer contexts, padding and draft rows, the bits are equal."""
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, head_dim = 8, 2, 64
    k_cache, v_cache = random_cache(gen, 300, kv_heads, head_dim)
    tables = [torch.randperm(300, generator=gen)[:n] for n in (23, 120, 57)]
    q = torch.randn(1 + 4 + 1, heads, head_dim, generator=gen)
    together = paged_attention(q, k_cache, v_cache, build_inputs([(20, 1), (100, 4), (56, 1)], tables), 0.125)
    # Sequence 1's third draft row (position 102) alone, as the decode step at that position would attend.
    alone = paged_attention(q[3:4], k_cache, v_cache, build_inputs([(102, 1)], [tables[1]]), 0.125)
    assert torch.equal(alone[0], together[3])
    single = PagedAttentionInputs(tables[0][20:21], tables[0][:21].unsqueeze(0), torch.zeros(1, 1, dtype=torch.long),
                                  torch.ones(1, 1, dtype=torch.bool), None)  # no mask at all
    assert torch.equal(paged_attention(q[:1], k_cache, v_cache, single, 0.125)[0], together[0])


@needs_native
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 16)])
def test_native_gives_the_same_bits_on_any_number_of_threads(heads, kv_heads, head_dim):
    """Attended by one thread, or by more threads than sequences (which then share each row's positions, heads and
    vectors in turn): the same bits, close to the dense reference. Decode rows, a verification of four drafts, two
    sequences of different lengths (padding masked), a context shorter than the threads' share of positions."""
    gen = torch.Generator().manual_seed(8)
    k_cache, v_cache = random_cache(gen, 512, kv_heads, head_dim)
    steps = [[(300, 1)], [(250, 5)], [(40, 1), (100, 3)], [(5, 1)]]
    tables = [[torch.randperm(512, generator=gen)[: s + c] for s, c in spans] for spans in steps]
    queries = [torch.randn(sum(c for _, c in spans), heads, head_dim, generator=gen) for spans in steps]
    threads = torch.get_num_threads()
    try:
        outs = {}
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            outs[n] = [paged_attention(q, k_cache, v_cache, build_inputs(spans, table), head_dim**-0.5)
                       for q, spans, table in zip(queries, steps, tables)]
    finally:
        torch.set_num_threads(threads)
    for n in (2, 3, 4):
        assert all(torch.equal(a, b) for a, b in zip(outs[1], outs[n])), n
    for out, q, spans, table in zip(outs[1], queries, steps, tables):
        row = 0
        for (s, c), slots in zip(spans, table):
            expected = dense_reference(q[row : row + c], k_cache[slots], v_cache[slots], s)
            torch.testing.assert_close(out[row : row + c], expected, rtol=1e-5, atol=1e-5)
            row += c


@needs_native
def test_native_tree_mask_and_groups_match_the_pytorch_path(monkeypatch):
    from specula_kernels.paged_attention import GroupedAttentionInputs

    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim = 4, 2, 32
    k_cache, v_cache = random_cache(gen, 128, kv_heads, head_dim)
    spans = [(6, 1), (30, 5), (9, 1)]  # decode, a tree of 4 drafts after its root, decode
    tables = [torch.randperm(128, generator=gen)[: s + c] for s, c in spans]
    multi = build_inputs([spans[1]], [tables[1]])
    multi.mask[0, 0, :, 30:35] = torch.tensor([  # root; two children of the root; a child of each child
        [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]], dtype=torch.bool)
    grouped = GroupedAttentionInputs(torch.zeros(7, dtype=torch.long), [
        (torch.tensor([0, 6]), build_inputs([spans[0], spans[2]], [tables[0], tables[2]])),
        (torch.tensor([1, 2, 3, 4, 5]), multi),
    ])
    q = torch.randn(7, heads, head_dim, generator=gen)
    out = paged_attention(q, k_cache, v_cache, grouped, scale=0.2)
    monkeypatch.setattr(paged_attention_module, "_native_library", lambda *args: None)
    torch.testing.assert_close(out, paged_attention(q, k_cache, v_cache, grouped, scale=0.2), rtol=1e-5, atol=1e-5)


@needs_native
def test_native_reads_no_masked_slot():
    """A NaN in a position the mask hides (padding, another request's slot) reaches no row: the kernel skips
    masked positions rather than weighting them by zero."""
    gen = torch.Generator().manual_seed(6)
    k_cache, v_cache = random_cache(gen, 64, 2, 16)
    spans = [(3, 1), (20, 2)]
    tables = [torch.arange(0, 4), torch.arange(30, 52)]
    inputs = build_inputs(spans, tables)
    inputs.context_slots[0, 4:] = 63  # padding pointing at a slot no sequence owns
    q = torch.randn(3, 4, 16, generator=gen)
    clean = paged_attention(q, k_cache, v_cache, inputs, scale=0.25)
    k_cache[63], v_cache[63] = math.nan, math.nan
    assert torch.equal(paged_attention(q, k_cache, v_cache, inputs, scale=0.25), clean)
    assert torch.isfinite(clean).all()


def test_prompts_and_other_dtypes_skip_the_decode_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(paged_attention_module, "_attend_native", lambda *args: calls.append(args))
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache = random_cache(gen, 64, 2, 16)
    rows = paged_attention_module.NATIVE_MAX_QUERY + 1
    prompt = build_inputs([(0, rows)], [torch.arange(rows)])
    paged_attention(torch.randn(rows, 4, 16, generator=gen), k_cache, v_cache, prompt, scale=0.25)
    decode = build_inputs([(5, 1)], [torch.arange(6)])
    paged_attention(torch.randn(1, 4, 16, generator=gen).bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), decode,
                    scale=0.25)
    paged_attention(torch.randn(1, 4, 8, generator=gen), k_cache[..., :8].contiguous(),
                    v_cache[..., :8].contiguous(), decode, scale=0.25)  # a head size the kernel does not take
    assert calls == []


def spy_on_prompt_kernel(monkeypatch) -> list:
    calls, real = [], paged_attention_module.attend_prompt_native
    monkeypatch.setattr(paged_attention_module, "attend_prompt_native",
                        lambda *args: calls.append(args[1].shape[0]) or real(*args))
    return calls


@needs_native
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32)])
def test_native_prompt_matches_dense_reference(heads, kv_heads, head_dim, monkeypatch):
    """Prompts on the native prompt kernel: from position 0 (row counts around its blocks), and chunks after cached
    or earlier positions; keys and values scattered over the cache as a block table leaves them."""
    calls = spy_on_prompt_kernel(monkeypatch)
    gen = torch.Generator().manual_seed(9)
    k_cache, v_cache = random_cache(gen, 700, kv_heads, head_dim)
    for start, count in [(0, 33), (0, 37), (0, 100), (0, 350), (50, 40), (200, 150), (1, 64)]:
        table = torch.randperm(700, generator=gen)[: start + count]
        q = torch.randn(count, heads, head_dim, generator=gen)
        out = paged_attention(q, k_cache, v_cache, build_inputs([(start, count)], [table]), scale=head_dim**-0.5)
        expected = dense_reference(q, k_cache[table], v_cache[table], start)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert calls == [33, 37, 100, 350, 40, 150, 64]


@needs_native
def test_native_prompt_gives_the_same_bits_on_any_number_of_threads():
    gen = torch.Generator().manual_seed(10)
    k_cache, v_cache = random_cache(gen, 400, 3, 64)
    table = torch.randperm(400, generator=gen)[:300]
    inputs = build_inputs([(70, 230)], [table])
    q = torch.randn(230, 9, 64, generator=gen)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(paged_attention(q, k_cache, v_cache, inputs, scale=0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs_native
def test_native_prompt_beside_decode_rows_and_not_for_trees(monkeypatch):
    """A prompt's group beside decode rows (a mixed step) takes the prompt kernel; a sequence's many rows under a
    mask other than the causal one (a tree) do not, and both match the PyTorch path."""
    from specula_kernels.paged_attention import GroupedAttentionInputs

    calls = spy_on_prompt_kernel(monkeypatch)
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache = random_cache(gen, 300, 2, 64)
    tables = [torch.randperm(300, generator=gen)[:n] for n in (10, 120, 20)]
    grouped = GroupedAttentionInputs(torch.zeros(3 + 100 - 1, dtype=torch.long), [
        (torch.tensor([0, 101]), build_inputs([(9, 1), (19, 1)], [tables[0], tables[2]])),
        (torch.arange(1, 101), build_inputs([(20, 100)], [tables[1]])),
    ])
    q = torch.randn(102, 8, 64, generator=gen)
    tree = build_inputs([(20, 100)], [tables[1]])
    tree.mask[0, 0, 50, 60:70] = False  # row 50 skips ten positions: not a prompt's mask
    out, tree_out = paged_attention(q, k_cache, v_cache, grouped, 0.125), paged_attention(
        q[1:101], k_cache, v_cache, tree, 0.125)
    assert calls == [100]
    monkeypatch.setattr(paged_attention_module, "_native_library", lambda *args: None)
    torch.testing.assert_close(out, paged_attention(q, k_cache, v_cache, grouped, 0.125), rtol=1e-5, atol=1e-5)
    tree = build_inputs([(20, 100)], [tables[1]])
    tree.mask[0, 0, 50, 60:70] = False
    torch.testing.assert_close(tree_out, paged_attention(q[1:101], k_cache, v_cache, tree, 0.125), rtol=1e-5,
                               atol=1e-5)


@needs_native
def test_native_prompt_serves_several_prompts_of_a_step(monkeypatch):
    """Prompt chunks of several requests in one step (one padded group): one call each, each sequence matching
    the dense reference; a group where one sequence's mask is a tree's goes to the PyTorch path whole."""
    calls = spy_on_prompt_kernel(monkeypatch)
    gen = torch.Generator().manual_seed(12)
    k_cache, v_cache = random_cache(gen, 600, 3, 64)
    spans = [(0, 100), (30, 50), (0, 33), (7, 1)]
    tables = [torch.randperm(600, generator=gen)[: s + c] for s, c in spans]
    q = torch.randn(sum(c for _, c in spans), 9, 64, generator=gen)
    out = paged_attention(q, k_cache, v_cache, build_inputs(spans, tables), scale=0.125)
    assert calls == [100, 50, 33, 1]
    row = 0
    for (s, c), table in zip(spans, tables):
        expected = dense_reference(q[row : row + c], k_cache[table], v_cache[table], s)
        torch.testing.assert_close(out[row : row + c], expected, rtol=1e-5, atol=1e-5)
        row += c
    tree = build_inputs(spans, tables)
    tree.mask[1, 0, 40, 31:35] = False
    paged_attention(q, k_cache, v_cache, tree, scale=0.125)
    assert calls == [100, 50, 33, 1]
