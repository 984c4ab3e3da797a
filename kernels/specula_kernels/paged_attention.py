"""Paged attention: write new keys/values into a slot-addressed KV cache and attend over it.

The KV cache of one layer is a pair of tensors `[num_slots, num_kv_heads, head_dim]` where
`num_slots = num_blocks * block_size`; the router owns which blocks belong to which request, and the worker
turns a request's block table into slot indices. The cache may store keys and values in a narrower dtype than
the model computes in (bfloat16, float16, float8 under `--kv-cache-dtype`): `write_kv_cache` converts them on
write and attention converts the gathered context back to the query's dtype. A step is described by
`PagedAttentionInputs`:

    sequence 0: 5 cached tokens, 1 new token        sequence 1: 0 cached tokens, 3 new tokens (prefill)
    query rows  [q0]                                 query rows  [q1 q2 q3]
    keys        [k0 k1 k2 k3 k4 | k5]                keys        [k0 k1 k2]
    context_slots padded to the longest context; `mask` hides padding and future positions.

This one formulation covers prefill, decode, and the verification of speculative drafts: a query row sees
every key whose position is at most its own (or, for a tree of drafts, the mask the caller builds).

Four paths, one signature:

- on CUDA, sequences with a few query rows each (decode, verification of drafts, trees included: at most
  `triton_paged_attention.MAX_QUERY`), float32/bfloat16/float16 query and cache, where triton is installed:
  `triton_paged_attention.py`, which reads each visible key and value where it lies in the cache;
- on CPU, sequences with a few query rows each (decode, verification of drafts: at most `NATIVE_MAX_QUERY`), float32
  query and cache, on a CPU where the native kernels build: `csrc/paged_attention.cpp`, which reads each visible
  key and value where it lies in the cache;
- on CPU, prompts (from position 0, or chunks after cached or earlier positions; several in a step, one call each),
  float32, where the native kernels build: `csrc/prompt_attention.cpp`, blocks of query rows against the keys
  transposed once;
- everything else (other prompts, other dtypes and devices): the context gathered into a dense buffer and
  `scaled_dot_product_attention` over it, the plain-PyTorch reference.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specula_kernels import native, triton_paged_attention

# Query rows per sequence up to which the native kernel attends, and so up to which a step can run as one native
# call (`decode_layers.py`): a verification of up to 31 drafts, or a short prompt. It reads a sequence's keys once
# per query row (from cache after the first), where SDPA's blocked kernel computes many rows' scores as one
# product: longer prompts stay on SDPA.
NATIVE_MAX_QUERY = 32


@dataclass
class PagedAttentionInputs:
    """Per-step attention metadata, built once per step and shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] long: cache slot each new token's K/V is written to
    # [num_seqs, max_context] long: slots of every position in context, padded with slots the sequence wrote
    # itself: a masked position still enters the product (NaN + -inf, 0 * NaN), so padding that read another
    # request's slot would carry a non-finite value of that request into this row.
    context_slots: torch.Tensor
    query_index: torch.Tensor  # [num_seqs, max_query] long: row of each padded query in the flat token list
    query_valid: torch.Tensor  # [num_seqs, max_query] bool: which padded query rows are real tokens
    mask: torch.Tensor | None  # [num_seqs, 1, max_query, max_context] bool (True = attend); None = attend all
    # Buffers the layers gather their context's keys and values into: allocated by the first layer, reused by
    # the others (a fresh tens-of-megabytes tensor per layer costs a page fault per page on CPU).
    workspace: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.context_slots.shape[0]


@dataclass
class GroupedAttentionInputs:
    """Sequences split into groups attended separately, so no group pads its queries to another's length.

    A decode step that verifies drafts for some requests has one-token sequences next to (k+1)-token ones;
    padding all of them to k+1 queries would make attention several times costlier than it needs to be.
    """

    slot_mapping: torch.Tensor  # [num_tokens] long, as in PagedAttentionInputs
    groups: list[tuple[torch.Tensor, PagedAttentionInputs]]  # (rows of the flat token list, inputs over them)


@dataclass
class BlockTableInputs:
    """Decode and verification rows in a fixed layout: what a CUDA graph replays (`specula_kernels.cuda_graphs`).

    Unlike `PagedAttentionInputs`, no tensor's shape depends on the step's context lengths: each sequence's
    context is read through its block table up to `context_lens`, and a row sees the positions up to its own
    (`positions`), which is causal for a chain of drafts (trees need a mask: they take `PagedAttentionInputs`).
    Padding rows (`query_valid` False) are computed and their outputs ignored; padding sequences have
    `context_lens` 0. Rows are `query_rows[i, j]`: sequence-major, one sequence's rows one after another.
    """

    slot_mapping: torch.Tensor  # [num_tokens] long: cache slot each row's K/V is written to
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32: the KV block of each block of positions
    block_size: int
    query_rows: torch.Tensor  # [num_seqs, max_query] long: row of each (sequence, query) in the flat token list
    query_valid: torch.Tensor  # [num_seqs, max_query] bool
    context_lens: torch.Tensor  # [num_seqs] int32: positions each sequence reads, its new rows included
    positions: torch.Tensor  # [num_tokens] long: the position of each row

    @property
    def num_seqs(self) -> int:
        return self.block_table.shape[0]

    def as_context_slots(self) -> PagedAttentionInputs:
        """The same attention as `PagedAttentionInputs` (slot of every position, a causal mask): the reference
        path's form, used off CUDA. Padding positions read the sequence's first slot, hidden by the mask."""
        width = self.block_table.shape[1] * self.block_size
        p = torch.arange(width, device=self.block_table.device)
        slots = self.block_table[:, p // self.block_size].long() * self.block_size + p % self.block_size
        row_pos = torch.where(self.query_valid, self.positions[self.query_rows], -1)  # [num_seqs, max_query]
        mask = (p.view(1, 1, -1) <= row_pos.unsqueeze(2)) & (p < self.context_lens.view(-1, 1, 1))
        mask[:, :, 0] |= ~self.query_valid  # padding rows see one position, so that no row is fully masked
        return PagedAttentionInputs(self.slot_mapping, slots, self.query_rows, self.query_valid, mask.unsqueeze(1))


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] long
) -> None:
    """Stores the step's keys and values at their slots (in place), in the cache's storage dtype.

    A cache narrower than the keys (fp8, float16 under a float32 or bfloat16 model) stores them converted with a
    scale of 1.0, clamped to its finite range first (`to_storage`): an outlier saturates rather than becoming
    inf or NaN.
    """
    assert key.shape == value.shape and key.shape[1:] == key_cache.shape[1:], (key.shape, key_cache.shape)
    assert slot_mapping.shape[0] == key.shape[0]
    for new, cache in ((key, key_cache), (value, value_cache)):
        stored = to_storage(new, cache.dtype)
        if cache.element_size() == 1:  # float8: CPU has no float8 index_copy_; the bytes are the same
            cache, stored = cache.view(torch.uint8), stored.view(torch.uint8)
        cache.index_copy_(0, slot_mapping, stored)


def to_storage(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` converted to the KV cache's storage `dtype`, saturating at that dtype's largest finite value.

    Without the clamp, float32 -> float8_e5m2 or float16 overflows to inf, and float8_e4m3fn (no inf) may give
    NaN depending on the device and torch version; a NaN is kept (the worker fails requests with non-finite
    logits)."""
    if x.dtype == dtype:
        return x
    limit = torch.finfo(dtype).max
    if limit < torch.finfo(x.dtype).max:
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    inputs: PagedAttentionInputs | GroupedAttentionInputs | BlockTableInputs,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Scaled dot-product attention of each sequence's new tokens over its cached context.

    The new tokens' keys and values must already be in the cache (`write_kv_cache`).
    """
    if isinstance(inputs, BlockTableInputs):
        return _attend_block_table(query, key_cache, value_cache, inputs, scale)
    if use_triton(query, key_cache, value_cache):
        return _paged_attention_triton(query, key_cache, value_cache, inputs, scale)
    lib = _native_library(query, key_cache, value_cache)
    if isinstance(inputs, GroupedAttentionInputs):
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        for rows, group in inputs.groups:
            if lib is not None and group.query_index.shape[1] <= NATIVE_MAX_QUERY:
                _attend_native(lib, query, key_cache, value_cache, group, scale, out, step_rows(rows, group))
            elif lib is not None and (spans := _native_prompts(query, group)) is not None:
                out[rows] = _attend_prompts(lib, query[rows], key_cache, value_cache, group, spans, scale)
            else:
                out[rows] = _attend(query[rows], key_cache, value_cache, group, scale)
        return out
    if lib is not None and inputs.query_index.shape[1] <= NATIVE_MAX_QUERY:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        _attend_native(lib, query, key_cache, value_cache, inputs, scale, out, inputs.query_index)
        return out
    if lib is not None and (spans := _native_prompts(query, inputs)) is not None:
        return _attend_prompts(lib, query, key_cache, value_cache, inputs, spans, scale)
    return _attend(query, key_cache, value_cache, inputs, scale)


def _native_prompts(query: torch.Tensor, inputs: PagedAttentionInputs) -> list[tuple[int, int, int]] | None:
    """Where the native prompt kernel serves these rows (the native kernels serve the tensors), each sequence's
    `(first row, rows, context)`: every sequence's rows lie one after another in the flat token list, at its last
    positions, each seeing every position up to its own (a prompt, or a chunk of one after its cached or earlier
    positions), and the head size is a multiple of two of the build's vectors. None where one sequence does not
    fit (a tree of drafts). Decided once per step (kept in the inputs' workspace): the mask is read to rule out
    trees."""
    spans = inputs.workspace.get("native.prompts")
    if spans is None:
        fits = inputs.mask is not None and query.shape[-1] % (2 * native.vector_lanes()) == 0
        spans = inputs.workspace["native.prompts"] = (_prompt_spans(inputs) if fits else None) or False
    return spans or None


def _prompt_spans(inputs: PagedAttentionInputs) -> list[tuple[int, int, int]] | None:
    spans = []
    positions = torch.arange(inputs.context_slots.shape[1]).unsqueeze(0)
    for i, count in enumerate(inputs.query_valid.sum(1).tolist()):
        first = int(inputs.query_index[i, 0])
        seen = inputs.mask[i, 0, :count]
        context = int(seen[count - 1].sum()) if count else 0
        if (count == 0 or context < count
                or not torch.equal(inputs.query_index[i, :count], torch.arange(first, first + count))
                or not torch.equal(seen, positions <= torch.arange(context - count, context).unsqueeze(1))):
            return None
        spans.append((first, count, context))
    return spans


def _attend_prompts(lib, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    inputs: PagedAttentionInputs, spans: list[tuple[int, int, int]], scale: float) -> torch.Tensor:
    """`_attend` on the native prompt kernel, one call per sequence of `spans` (`_native_prompts`)."""
    if query.stride(2) != 1 or query.stride(1) != query.shape[2]:
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=torch.float32)
    for i, (first, count, context) in enumerate(spans):
        attend_prompt_native(lib, query[first : first + count], key_cache, value_cache,
                             inputs.context_slots[i, :context], scale, out[first : first + count])
    return out


def use_triton(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether decode and verification rows go to the Triton kernel: CUDA tensors it serves, triton installed."""
    return triton_paged_attention.supports(query, key_cache, value_cache)


def _attend_block_table(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        inputs: BlockTableInputs, scale: float) -> torch.Tensor:
    """`paged_attention` of `BlockTableInputs`: the Triton kernel reading the block table, no host sync (a CUDA
    graph captures it); elsewhere the reference over `as_context_slots`, every row returned (padding rows zero)."""
    if use_triton(query, key_cache, value_cache):
        if query.stride(2) != 1:
            query = query.contiguous()
        return triton_paged_attention.paged_attention_triton(
            query, key_cache, value_cache, inputs.block_table, inputs.query_rows, inputs.query_valid, None,
            inputs.context_lens, scale, out=torch.zeros_like(query), block_size=inputs.block_size,
            positions=inputs.positions)
    attended = _attend(query, key_cache, value_cache, inputs.as_context_slots(), scale).to(query.dtype)
    if attended.shape[0] == query.shape[0]:  # one row per sequence, or one sequence: every row, in order
        return attended
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    out[inputs.query_rows[inputs.query_valid]] = attended
    return out


def _paged_attention_triton(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            inputs: PagedAttentionInputs | GroupedAttentionInputs, scale: float) -> torch.Tensor:
    """`paged_attention` on CUDA: groups of at most `MAX_QUERY` rows per sequence on the Triton kernel, the
    others (prompts) on the gathered-context SDPA path, a whole prompt of one sequence as causal SDPA."""
    groups = inputs.groups if isinstance(inputs, GroupedAttentionInputs) else [(None, inputs)]
    if query.stride(2) != 1:  # the kernel reads each head's vector in one piece
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    for rows, group in groups:
        if group.query_index.shape[1] > triton_paged_attention.MAX_QUERY:
            attend = _attend_whole_prompt if _is_whole_prompt(group) else _attend
            if rows is None:
                return attend(query, key_cache, value_cache, group, scale)
            out[rows] = attend(query[rows], key_cache, value_cache, group, scale)
            continue
        # Per step, shared by every layer: each padded query's row of the whole step, each sequence's length.
        step_rows = group.workspace.get("triton.rows")
        if step_rows is None:
            step_rows = group.query_index if rows is None else rows[group.query_index]
            group.workspace["triton.rows"] = step_rows
        lengths = group.workspace.get("triton.lengths")
        if lengths is None:
            lengths = triton_paged_attention.context_lengths(group.context_slots, group.mask)
            group.workspace["triton.lengths"] = lengths
        triton_paged_attention.paged_attention_triton(
            query, key_cache, value_cache, group.context_slots, step_rows, group.query_valid, group.mask, lengths,
            scale, out=out)  # the context slots are a block table of one-slot blocks
    return out


def _is_whole_prompt(inputs: PagedAttentionInputs) -> bool:
    """One sequence whose every position is new this step (a prompt from position 0, no cached prefix, no earlier
    chunk): its mask is the plain causal one, known from the shapes without reading it. Trees of drafts never
    match, they follow a context."""
    return inputs.num_seqs == 1 and inputs.context_slots.shape[1] == inputs.query_index.shape[1]


def _attend_whole_prompt(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         inputs: PagedAttentionInputs, scale: float) -> torch.Tensor:
    """`_attend` for `_is_whole_prompt` inputs, as causal SDPA: with no mask tensor, CUDA's flash kernel takes it
    (bfloat16, float16), where a boolean mask leaves only the slower memory-efficient and math kernels."""
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[1]
    keys = _gather(key_cache, inputs, "keys", query.dtype)[0]  # [num_tokens, num_kv_heads, head_dim]
    values = _gather(value_cache, inputs, "values", query.dtype)[0]
    # [1, heads, num_tokens, head_dim]: SDPA's fused kernels take four dimensions only
    out = F.scaled_dot_product_attention(*(x.transpose(0, 1).unsqueeze(0) for x in (query, keys, values)),
                                         is_causal=True, scale=scale, enable_gqa=num_heads != num_kv_heads)
    return out[0].transpose(0, 1)  # [num_tokens, num_heads, head_dim]


def step_rows(rows: torch.Tensor, group: PagedAttentionInputs) -> torch.Tensor:
    """Each padded query's row of the whole step, for a group of a `GroupedAttentionInputs` over step rows `rows`:
    the same for every layer, so mapped once per step (kept in the group's workspace)."""
    mapped = group.workspace.get("native.rows")
    if mapped is None:
        mapped = group.workspace["native.rows"] = rows[group.query_index].contiguous()
    return mapped


def native_serves(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether decode and verification rows of this attention go to the native kernel (`paged_attention` decides
    the same way): not to Triton, and tensors the native kernel serves."""
    return not use_triton(query, key_cache, value_cache) and _native_library(query, key_cache, value_cache) is not None


def _native_library(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor):
    """The native kernels where they serve this attention (CPU, float32 query and cache, contiguous caches, a
    head size the kernel's registers hold), else None."""
    head_dim = query.shape[-1]
    if (query.device.type != "cpu" or query.dtype != torch.float32 or key_cache.dtype != torch.float32
            or value_cache.dtype != torch.float32 or head_dim % 16 or head_dim > 256
            or not (key_cache.is_contiguous() and value_cache.is_contiguous())):
        return None
    return native.library()


def _attend_native(lib, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   inputs: PagedAttentionInputs, scale: float, out: torch.Tensor, query_rows: torch.Tensor) -> None:
    """`_attend` on the native kernel, writing each valid query's row of `out` (`query_rows`: the row of `query`
    and `out` each padded query stands for, `[num_seqs, max_query]`)."""
    num_heads, head_dim = query.shape[1:]
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        query = query.contiguous()
    slots = inputs.context_slots.contiguous()
    rows = query_rows.contiguous()
    valid = inputs.query_valid.contiguous()
    mask = None if inputs.mask is None else inputs.mask.contiguous()
    num_seqs, max_query = rows.shape
    lib.specula_paged_attention(
        query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), key_cache.shape[1],
        slots.data_ptr(), num_seqs, slots.shape[1], rows.data_ptr(), valid.data_ptr(), max_query,
        None if mask is None else mask.data_ptr(), num_heads, head_dim, ctypes.c_float(scale), out.data_ptr(),
        out.stride(0), torch.get_num_threads())


def attend_prompt_native(lib, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         slots: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a prompt's `query` rows `[tokens, num_heads, head_dim]` at the last `tokens` of the
    positions whose cache slots are `slots` `[context]`, on the native kernel, into `out` (or a new tensor) `[tokens,
    num_heads, head_dim]`, which it returns. Float32 caches, query and out, head_dim a multiple of two of the
    build's vectors; rows may be strided, each row's heads contiguous."""
    tokens, num_heads, head_dim = query.shape
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        query = query.contiguous()
    slots = slots.contiguous()
    if out is None:
        out = torch.empty(tokens, num_heads, head_dim, dtype=torch.float32)
    assert out.stride(2) == 1 and out.stride(1) == head_dim, out.stride()
    lib.specula_prompt_attention(
        query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), key_cache.shape[1],
        slots.data_ptr(), slots.shape[0], tokens, num_heads, head_dim, ctypes.c_float(scale), out.data_ptr(),
        out.stride(0), torch.get_num_threads())
    return out


def _attend(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, inputs: PagedAttentionInputs,
    scale: float,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads (GQA)"
    num_seqs, max_query = inputs.query_index.shape

    # [num_seqs, max_context, num_kv_heads, head_dim], in the query's dtype whatever the cache stores
    keys = _gather(key_cache, inputs, "keys", query.dtype)
    values = _gather(value_cache, inputs, "values", query.dtype)
    # Without padding the flat token list is the queries as they are: one sequence, or one token per sequence
    # (a decode step), laid out in order. Otherwise each sequence's rows are gathered and padded.
    one_sequence = num_seqs == 1 and max_query == num_tokens
    one_token_each = max_query == 1 and num_seqs == num_tokens
    if one_sequence:
        queries = query.unsqueeze(0)
    elif one_token_each:
        queries = query.unsqueeze(1)
    else:
        queries = query[inputs.query_index]  # [num_seqs, max_query, num_heads, head_dim]

    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),  # [num_seqs, num_heads, max_query, head_dim]
        keys.transpose(1, 2),  # [num_seqs, num_kv_heads, max_context, head_dim]
        values.transpose(1, 2),
        attn_mask=inputs.mask,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    ).transpose(1, 2)  # [num_seqs, max_query, num_heads, head_dim]

    if one_sequence:
        return out[0]
    if one_token_each:
        return out[:, 0]
    return out[inputs.query_valid]  # padded rows dropped; order matches the flat token list


def _gather(cache: torch.Tensor, inputs: PagedAttentionInputs, name: str,
            dtype: torch.dtype | None = None) -> torch.Tensor:
    """`cache[inputs.context_slots].to(dtype)`, as one `index_select` over the flattened slots into a reused
    buffer (and, for a cache stored in another dtype than `dtype`, one conversion into a second reused buffer).

    Advanced indexing with a 2-D index runs a general gather and allocates a tensor per layer, far slower on CPU
    than one `index_select` into a reused buffer. A narrower cache (fp8, bfloat16) is gathered
    as stored, then converted: only the context is converted, and the gather moves fewer bytes.
    """
    dtype = dtype or cache.dtype
    slots = inputs.context_slots
    shape = (*slots.shape, *cache.shape[1:])
    raw = _buffer(inputs, name if dtype == cache.dtype else f"{name}.stored", shape, cache.dtype, cache.device)
    source, into = cache, raw.view(-1, *cache.shape[1:])
    if cache.element_size() == 1:  # float8, gathered as its bytes: every device selects uint8 (as fast on CPU)
        source, into = cache.view(torch.uint8), into.view(torch.uint8)
    torch.index_select(source, 0, slots.reshape(-1), out=into)
    if dtype == cache.dtype:
        return raw
    out = _buffer(inputs, name, shape, dtype, cache.device)
    table = _float8_values(cache.dtype, dtype, cache.device)
    if table is None:
        out.copy_(raw)
    else:  # a float8 byte indexes its value: faster than the cast on CPU, and as exact (NaN included)
        index = _buffer(inputs, f"{name}.index", shape, torch.int32, cache.device)
        index.copy_(raw.view(torch.uint8))
        torch.index_select(table, 0, index.view(-1), out=out.view(-1))
    return out


_FLOAT8_VALUES: dict[tuple[torch.dtype, torch.dtype], torch.Tensor] = {}


def _float8_values(storage: torch.dtype, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """On CPU, the 256 values of float8 `storage` in `dtype`, indexed by their bytes; None elsewhere.

    A lookup in this table is faster than torch's CPU cast from float8 (docs/benchmarks.md#kv-cache-dtype). CUDA
    casts natively.
    """
    if device.type != "cpu" or storage not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return None
    table = _FLOAT8_VALUES.get((storage, dtype))
    if table is None:
        table = _FLOAT8_VALUES[(storage, dtype)] = torch.arange(256, dtype=torch.uint8).view(storage).to(dtype)
    return table


def _buffer(inputs: PagedAttentionInputs, name: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """The workspace buffer `name`, allocated anew only when its shape, dtype or device changed."""
    out = inputs.workspace.get(name)
    if out is None or out.shape != shape or out.dtype != dtype or out.device != device:
        out = inputs.workspace[name] = torch.empty(shape, dtype=dtype, device=device)
    return out
