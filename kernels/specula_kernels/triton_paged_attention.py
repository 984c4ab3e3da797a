"""Paged attention in Triton: decode and verification rows attend over the KV cache where it lies.

The CUDA counterpart of the native CPU kernel (`csrc/paged_attention.cpp`), with the same inputs as
`paged_attention.PagedAttentionInputs`: no context is gathered into a dense buffer, each program reads the
keys and values of its sequence at their slots. One program per (sequence, KV head, tile of query rows):

    query rows of sequence s   q0 q1 q2 (a decode has one, a verification 1 + drafts)
    heads sharing KV head g    h = g * group .. g * group + group - 1   (GQA: group = num_heads // num_kv_heads)
    the program's rows         m = q * group + (h - g * group), BLOCK_M of them: every query row of the
                               sequence times every query head of the group, so each key tile is read once
                               for all of them
    context positions          0 .. context_lens[s] - 1 in tiles of BLOCK_N; position p is read from slot
                               block_table[s, p // block_size] * block_size + p % block_size
    visibility                 mask[s, 0, q, p] (causal within a verification's drafts, a tree's ancestors,
                               padding hidden); or, given `positions`, p <= positions[row] (a chain of drafts
                               is causal by position, so no mask of the context's width is needed: what a CUDA
                               graph replays); neither: every position up to context_lens[s]

with an online softmax in float32 (flash-attention's recurrence), so a row's output depends only on its own
query, keys and values. The worker's context slots are a block table with `block_size = 1`; a real block table
(one entry per KV block) works as well and reads `block_size` times fewer indices. A sequence's context is read
by one program per KV head, not split across programs as flash-decoding does: a batch of sequences fills a GPU,
one long sequence does not (left for after measurements on a GPU).

Since the mask is read as given, trees of drafts (Medusa, MLP speculators, suffix decoding) run on this kernel as
chains do. A float8 cache (`--kv-cache-dtype fp8`) is read as its bytes and converted in registers, on GPUs with
float8 conversions (compute capability 8.9 and later: Ada, Hopper, Blackwell). What it does not serve,
`paged_attention` sends to the gathered-context SDPA path: prompts (more than `MAX_QUERY` rows per sequence),
float8 caches on older GPUs, head sizes over 256.

Tested against that reference in Triton's interpreter on CPU tensors (`TRITON_INTERPRET=1`) and compiled for a
GPU target without one (`kernels/tests/test_triton_paged_attention.py`); triton is imported on first launch.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import torch

from specula_kernels.sgmv import cdiv, next_power_of_2, triton_available

# Query rows per sequence this kernel serves (decode, verification of up to 15 drafts); longer spans are prompts.
MAX_QUERY = 16
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
CACHE_DTYPES = FLOAT_DTYPES + FLOAT8_DTYPES
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256


def supports(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the kernel serves this attention on CUDA: triton present, a cache it reads, a head size it holds."""
    return (query.is_cuda and triton_available() and query.dtype in FLOAT_DTYPES
            and reads_cache(key_cache.dtype, query.device) and value_cache.dtype == key_cache.dtype
            and query.shape[-1] <= MAX_HEAD_DIM and query.shape[1] % key_cache.shape[1] == 0)


def reads_cache(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel reads a cache stored in `dtype` on `device`: float caches anywhere; float8 on GPUs of
    compute capability 8.9 or later (Triton converts float8 there) and under the interpreter."""
    if dtype in FLOAT_DTYPES:
        return True
    if dtype not in FLOAT8_DTYPES:
        return False
    return device.type != "cuda" or _converts_float8(device.index if device.index is not None else
                                                     torch.cuda.current_device())


@functools.cache
def _converts_float8(device_index: int) -> bool:
    """Compute capability 8.9 or later (asked once per GPU: `supports` runs for every layer of every step)."""
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def context_lengths(context_slots: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """`[num_seqs]` int32: positions each sequence's rows may see, the last visible one plus one.

    Example: a mask row `[1 1 1 0 0]` (3 of 5 positions, the rest padding) gives 3; no mask, the whole width.
    Computed once per step (`paged_attention` keeps it in the step's workspace) and shared by every layer.
    """
    num_seqs, max_context = context_slots.shape
    if mask is None:
        return torch.full((num_seqs,), max_context, dtype=torch.int32, device=context_slots.device)
    visible = mask[:, 0].any(dim=1)  # [num_seqs, max_context]
    positions = torch.arange(1, max_context + 1, device=mask.device, dtype=torch.int32)
    return (visible * positions).amax(dim=1).to(torch.int32)


def check_inputs(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_table: torch.Tensor, query_rows: torch.Tensor, query_valid: torch.Tensor,
                 mask: torch.Tensor | None, context_lens: torch.Tensor, out: torch.Tensor) -> None:
    """Shapes, dtypes, strides and devices; raises `ValueError` naming the argument."""
    if query.dim() != 3 or query.dtype not in FLOAT_DTYPES or query.stride(2) != 1:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim] float32/bfloat16/float16 with unit "
                         f"stride in head_dim, got {tuple(query.shape)} {query.dtype} strides {query.stride()}")
    num_heads, head_dim = query.shape[1:]
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 3 or cache.shape[2] != head_dim or cache.stride(2) != 1:
            raise ValueError(f"{name} must be [num_slots, num_kv_heads, head_dim={head_dim}] with unit stride in "
                             f"head_dim, got {tuple(cache.shape)} strides {cache.stride()}")
        if cache.dtype not in CACHE_DTYPES:
            raise ValueError(f"{name} must be float32/bfloat16/float16/float8_e4m3fn/float8_e5m2, got {cache.dtype}")
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError(f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} must share "
                         "shape and strides")
    if num_heads % key_cache.shape[1]:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={key_cache.shape[1]} (GQA)")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim={head_dim} is over {MAX_HEAD_DIM}")
    num_seqs, max_query = query_rows.shape if query_rows.dim() == 2 else (-1, -1)
    if query_rows.dim() != 2 or query_rows.dtype not in INDEX_DTYPES or max_query > MAX_QUERY:
        raise ValueError(f"query_rows must be [num_seqs, max_query <= {MAX_QUERY}] int32/int64, got "
                         f"{tuple(query_rows.shape)} {query_rows.dtype}")
    if query_valid.shape != query_rows.shape or query_valid.dtype != torch.bool:
        raise ValueError(f"query_valid must be bool {tuple(query_rows.shape)}, got {query_valid.dtype} "
                         f"{tuple(query_valid.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != num_seqs or block_table.dtype not in INDEX_DTYPES:
        raise ValueError(f"block_table must be [num_seqs={num_seqs}, max_blocks] int32/int64, got "
                         f"{tuple(block_table.shape)} {block_table.dtype}")
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[:3] != (num_seqs, 1, max_query)):
        raise ValueError(f"mask must be bool [num_seqs={num_seqs}, 1, max_query={max_query}, max_context], got "
                         f"{mask.dtype} {tuple(mask.shape)}")
    if context_lens.shape != (num_seqs,) or context_lens.dtype not in INDEX_DTYPES:
        raise ValueError(f"context_lens must be [num_seqs={num_seqs}] int32/int64, got {tuple(context_lens.shape)} "
                         f"{context_lens.dtype}")
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(query.shape)} {query.dtype} with unit stride in head_dim, got "
                         f"{tuple(out.shape)} {out.dtype}")
    tensors = [query, key_cache, value_cache, block_table, query_rows, query_valid, context_lens, out]
    devices = {t.device for t in tensors + ([] if mask is None else [mask])}
    if len(devices) != 1:
        raise ValueError(f"every tensor must be on one device, got {sorted(map(str, devices))}")


def paged_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_seqs, max_blocks]: KV block of each block of positions (slots: block_size 1)
    query_rows: torch.Tensor,  # [num_seqs, max_query]: row of query/out each padded query stands for
    query_valid: torch.Tensor,  # [num_seqs, max_query] bool
    mask: torch.Tensor | None,  # [num_seqs, 1, max_query, >= max context] bool (True = attend); None = all
    context_lens: torch.Tensor,  # [num_seqs]: positions each sequence reads (`context_lengths`)
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]; rows of no valid query are left as they are
    block_size: int = 1,
    positions: torch.Tensor | None = None,  # [num_tokens]: each row sees the positions up to its own (with no mask)
) -> torch.Tensor:
    """Attention of each sequence's query rows over its paged context, written into `out` (returned).

    CUDA tensors, or CPU tensors under the interpreter (`TRITON_INTERPRET=1`). The new tokens' keys and values
    must already be in the cache (`paged_attention.write_kv_cache`).
    """
    if not triton_available():
        raise RuntimeError("paged_attention_triton needs the triton package (pip install triton)")
    if out is None:
        out = torch.empty_like(query)
    check_inputs(query, key_cache, value_cache, block_table, query_rows, query_valid, mask, context_lens, out)
    if positions is not None and (mask is not None or positions.shape != query.shape[:1]
                                  or positions.dtype not in INDEX_DTYPES or positions.device != query.device):
        raise ValueError(f"positions must be [num_tokens={query.shape[0]}] int32/int64 on {query.device}, and "
                         f"given without a mask; got {tuple(positions.shape)} {positions.dtype}")
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    if not query.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"paged_attention_triton runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1), "
                         f"got {query.device}")
    _launch(query, key_cache, value_cache, block_table, query_rows, query_valid, mask, context_lens, scale, out,
            block_size, positions)
    return out


def _launch(query, key_cache, value_cache, block_table, query_rows, query_valid, mask, context_lens, scale, out,
            block_size, positions) -> None:
    num_seqs, max_query = query_rows.shape
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads
    if num_seqs == 0 or max_query == 0:
        return
    rows = max_query * group
    block_m = min(64, max(16, next_power_of_2(rows)))  # tl.dot takes 16 rows at least
    block_d = max(16, next_power_of_2(head_dim))
    block_n = 64 if block_d <= 64 else 32  # keeps a key tile and a value tile in registers at head_dim 128-256
    grid = (num_seqs, num_kv_heads, cdiv(rows, block_m))
    # The interpreter multiplies bfloat16 tiles as their raw bits (as sgmv.py notes); float32 products of them
    # are exact, so upcasting there gives the sums the GPU's bfloat16 dot does.
    upcast = not query.is_cuda and query.dtype != torch.float32
    input_precision = "ieee" if query.dtype == torch.float32 else "tf32"
    has_mask = mask is not None
    mask_arg = mask if has_mask else query_valid  # any tensor: never read without HAS_MASK
    mask_strides = mask.stride() if has_mask else (0, 0, 0, 0)
    with torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext():
        _kernel()[grid](
            query, key_cache, value_cache, out, block_table, query_rows, query_valid.view(torch.uint8),
            mask_arg.view(torch.uint8), context_lens, positions if positions is not None else query_rows,
            float(scale), max_query, head_dim,
            query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), out.stride(0), out.stride(1),
            block_table.stride(0), block_table.stride(1), query_rows.stride(0), query_rows.stride(1),
            query_valid.stride(0), query_valid.stride(1), mask_strides[0], mask_strides[2], mask_strides[3],
            GROUP=group, BLOCK_SIZE=block_size, HAS_MASK=has_mask, CAUSAL=positions is not None,
            BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_D=block_d, UPCAST=upcast, INPUT_PRECISION=input_precision,
            KV_FLOAT8=key_cache.dtype in FLOAT8_DTYPES, enable_fp_fusion=True,
        )


@functools.cache
def _kernel() -> Any:
    """Builds the jitted kernel on first use, so that importing this module never imports triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, rows_ptr, valid_ptr, mask_ptr, lens_ptr, pos_ptr,
        scale, max_query, head_dim,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh,
        stride_bs, stride_bb, stride_rs, stride_rq, stride_vs, stride_vq, stride_ms, stride_mq, stride_mk,
        GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        KV_FLOAT8: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # row = query row * GROUP + head in the group
        q_idx = m // GROUP
        head = kv_head * GROUP + m % GROUP
        in_range = q_idx < max_query
        valid = tl.load(valid_ptr + seq * stride_vs + q_idx * stride_vq, mask=in_range, other=0) != 0
        token = tl.load(rows_ptr + seq * stride_rs + q_idx * stride_rq, mask=valid, other=0).to(tl.int64)
        ds = tl.arange(0, BLOCK_D)
        d_ok = ds < head_dim
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + ds[None, :],
                    mask=valid[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)

        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        context_len = tl.load(lens_ptr + seq)
        if CAUSAL:
            row_pos = tl.load(pos_ptr + token, mask=valid, other=0)
        kv_base = kv_head.to(tl.int64) * stride_kh
        for start in range(0, context_len, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pos_ok = pos < context_len
            block = tl.load(table_ptr + seq * stride_bs + (pos // BLOCK_SIZE) * stride_bb, mask=pos_ok, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            kv_offsets = kv_base + slot[:, None] * stride_ks + ds[None, :]
            kv_ok = pos_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_offsets, mask=kv_ok, other=0.0)
            if KV_FLOAT8:  # float8 -> float32 is exact; then the compute dtype, as the gathered path converts
                k = k.to(tl.float32)
            k = k.to(q.dtype)
            scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale  # [BLOCK_M, BLOCK_N]
            visible = valid[:, None] & pos_ok[None, :]
            if HAS_MASK:
                seen = tl.load(mask_ptr + seq * stride_ms + q_idx[:, None] * stride_mq + pos[None, :] * stride_mk,
                               mask=visible, other=0)
                visible = visible & (seen != 0)
            if CAUSAL:
                visible = visible & (pos[None, :] <= row_pos[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at 0
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_offsets, mask=kv_ok, other=0.0)
            if KV_FLOAT8:
                v = v.to(tl.float32)
            v = v.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=INPUT_PRECISION)
            m_i = m_new
        result = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + ds[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=valid[:, None] & d_ok[None, :])

    return paged_attention_kernel
