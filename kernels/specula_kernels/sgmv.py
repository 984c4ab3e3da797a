"""Segmented gather matrix multiply (SGMV): many LoRA adapters in one batch.

A step's tokens are laid out request after request, so the rows of `x` come in segments; segment s is rows
`seg_starts[s]:seg_starts[s + 1]` and multiplies by the stacked weight `weight[seg_slots[s]]`, or produces
zeros when its slot is -1 (no adapter):

    x [n, d_in]              seg_starts = [0, 3, 3, 4, 6]      seg_slots = [2, 0, -1, 2]
    rows 0..2  @ weight[2]   (segment 0)
    (no rows)                (segment 1 is empty)
    row  3     -> 0          (segment 2 has no adapter)
    rows 4..5  @ weight[2]   (segment 3)
                                                         -> y [n, d_out]

A LoRA delta is two such products over the same segments, shrink then expand (`add_lora`):
`y += (x @ A[slot]) @ B[slot]`, with `A [num_slots, d_in, r_max]` and `B [num_slots, r_max, d_out]`; ranks
below `r_max` are zero-padded and the LoRA scaling is folded into B by the caller.

`sgmv_reference` is the plain definition and the CPU path: it groups the segments by slot and runs one
float32 matrix product per distinct slot. `sgmv_triton` is a segmented GEMM: one program per (row tile of a
segment, column tile of `d_out`), each looping over `d_in` with a float32 accumulator. The grid depends on
shapes only (`n // BLOCK_M + num_segments` row tiles, the spare ones exit), so a launch never reads the
segments on the host and can be captured in a CUDA graph. Both accept int32 or int64 index tensors. Only
`sgmv_reference` checks index values (it reads them on the host anyway); the Triton path trusts them.

The same kernel serves both LoRA sides: shrink (`d_out = r_max`, 8..128) is one column tile and a long `d_in`
loop; expand (`d_in = r_max`) is one or two `d_in` steps over many column tiles. triton is optional (imported
on first launch); the kernel closes over `tl`, which `@triton.jit` resolves from triton 3.4 on (tested: 3.9).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def sgmv(x: torch.Tensor, weight: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> torch.Tensor:
    """`y[rows of s] = x[rows of s] @ weight[seg_slots[s]]` (zeros where the slot is -1); returns `[n, d_out]`.

    Runs the Triton kernel for CUDA tensors when triton is installed, the reference otherwise.
    """
    check_inputs(x, weight, seg_starts, seg_slots)
    if x.is_cuda and triton_available():
        return _launch(x, weight, seg_starts, seg_slots)
    return _reference(x, weight, seg_starts, seg_slots)


def add_lora(
    y: torch.Tensor,  # [n, d_out], updated in place
    x: torch.Tensor,  # [n, d_in]
    lora_a: torch.Tensor,  # [num_slots, d_in, r_max]
    lora_b: torch.Tensor,  # [num_slots, r_max, d_out], scaling folded in
    seg_starts: torch.Tensor,  # [num_segments + 1]
    seg_slots: torch.Tensor,  # [num_segments]
) -> torch.Tensor:
    """`y += (x @ A[slot]) @ B[slot]` per segment, in place; returns `y`. Rows with slot -1 are unchanged."""
    if lora_a.dim() != 3 or lora_b.dim() != 3 or lora_a.shape[::2] != lora_b.shape[:2]:
        raise ValueError(f"lora_a {tuple(lora_a.shape)} and lora_b {tuple(lora_b.shape)} must be "
                         "[num_slots, d_in, r_max] and [num_slots, r_max, d_out]")
    if y.shape != (x.shape[0], lora_b.shape[2]) or y.dtype != x.dtype:
        raise ValueError(f"y is {tuple(y.shape)} {y.dtype}; expected {(x.shape[0], lora_b.shape[2])} {x.dtype}")
    shrunk = sgmv(x, lora_a, seg_starts, seg_slots)  # [n, r_max]
    return y.add_(sgmv(shrunk, lora_b, seg_starts, seg_slots))


def segments_from_slots(slots_per_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token slot ids `[n]` (-1: none) -> `(seg_starts, seg_slots)`, merging runs of equal slots.

    Example: `[1, 1, -1, 0, 0, 1]` -> `seg_starts = [0, 2, 3, 5, 6]`, `seg_slots = [1, -1, 0, 1]` (both int32).
    """
    if slots_per_token.dim() != 1 or slots_per_token.dtype not in INDEX_DTYPES:
        raise ValueError(f"slots_per_token must be a 1-D int32/int64 tensor, got {tuple(slots_per_token.shape)} "
                         f"{slots_per_token.dtype}")
    seg_slots, counts = torch.unique_consecutive(slots_per_token, return_counts=True)
    seg_starts = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=slots_per_token.device)
    torch.cumsum(counts, 0, out=seg_starts[1:])
    return seg_starts, seg_slots.to(torch.int32)


def check_inputs(x: torch.Tensor, weight: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> None:
    """Shapes, dtypes and devices; raises `ValueError` naming the argument."""
    if x.dim() != 2:
        raise ValueError(f"x must be [n, d_in], got shape {tuple(x.shape)}")
    if weight.dim() != 3 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be [num_slots, d_in={x.shape[1]}, d_out], got shape {tuple(weight.shape)}")
    if x.dtype not in FLOAT_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a float32/bfloat16/float16 dtype, got {x.dtype} and {weight.dtype}")
    if seg_starts.dim() != 1 or seg_starts.numel() < 1 or seg_starts.dtype not in INDEX_DTYPES:
        raise ValueError(f"seg_starts must be a non-empty 1-D int32/int64 tensor, got {tuple(seg_starts.shape)} "
                         f"{seg_starts.dtype}")
    if seg_slots.dim() != 1 or seg_slots.dtype not in INDEX_DTYPES:
        raise ValueError(f"seg_slots must be a 1-D int32/int64 tensor, got {tuple(seg_slots.shape)} {seg_slots.dtype}")
    if seg_slots.numel() != seg_starts.numel() - 1:
        raise ValueError(f"{seg_slots.numel()} seg_slots for {seg_starts.numel() - 1} segments "
                         f"(seg_starts has {seg_starts.numel()} entries)")
    devices = {t.device for t in (x, weight, seg_starts, seg_slots)}
    if len(devices) != 1:
        raise ValueError(f"x, weight, seg_starts and seg_slots must be on one device, got {sorted(map(str, devices))}")


def sgmv_reference(
    x: torch.Tensor, weight: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor
) -> torch.Tensor:
    """The plain definition of `sgmv`: one float32 matrix product per distinct slot."""
    check_inputs(x, weight, seg_starts, seg_slots)
    return _reference(x, weight, seg_starts, seg_slots)


def _reference(
    x: torch.Tensor, weight: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor
) -> torch.Tensor:
    # Grouping runs on host lists: a decode step calls this twice per adapted projection and layer, and a few
    # hundred segments cost microseconds in Python where each small tensor op costs about as much.
    n, num_slots = x.shape[0], weight.shape[0]
    starts, slots = seg_starts.tolist(), seg_slots.tolist()
    if starts[0] != 0 or starts[-1] != n or any(b > e for b, e in zip(starts, starts[1:])):
        raise ValueError(f"seg_starts must rise from 0 to n={n} without decreasing, got {starts}")
    if slots and not -1 <= min(slots) <= max(slots) < num_slots:
        raise ValueError(f"seg_slots must be -1 or below num_slots={num_slots}, got {slots}")
    ranges: dict[int, list[tuple[int, int]]] = {}  # slot -> its segments' row ranges
    for slot, begin, end in zip(slots, starts, starts[1:]):
        if slot >= 0 and end > begin:
            ranges.setdefault(slot, []).append((begin, end))

    out = torch.zeros(n, weight.shape[2], dtype=x.dtype, device=x.device)  # [n, d_out]
    for slot, slot_ranges in ranges.items():
        w = weight[slot].float()  # [d_in, d_out]
        if len(slot_ranges) == 1:
            begin, end = slot_ranges[0]
            if end - begin == n:  # one adapter for the whole batch
                return torch.matmul(x.float(), w).to(x.dtype)
            out[begin:end] = torch.matmul(x[begin:end].float(), w)
        else:
            rows = torch.tensor([r for begin, end in slot_ranges for r in range(begin, end)], device=x.device)
            out.index_copy_(0, rows, torch.matmul(x.index_select(0, rows).float(), w).to(x.dtype))
    return out


# --- grouped LoRA on the CPU ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotGroups:
    """The rows of a step grouped by adapter slot, padded to the largest group: one batched product per side
    of a LoRA instead of one per slot. Built once per step and segment layout (`slot_groups`)."""

    rows: torch.Tensor  # [num_groups, max_rows] long: row indices of each slot's tokens, n marks padding
    slots: torch.Tensor  # [num_groups] long, ascending
    num_rows: int  # n
    first_slot: int | None = None  # set when the slots are consecutive: the weights are a slice, not a gather


def slot_groups(seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> SlotGroups | None:
    """Groups the segments' rows by slot (rows with slot -1 left out); None when no row has an adapter."""
    starts, slots = seg_starts.tolist(), seg_slots.tolist()
    members: dict[int, list[int]] = {}
    for slot, begin, end in zip(slots, starts, starts[1:]):
        if slot >= 0 and end > begin:
            members.setdefault(slot, []).extend(range(begin, end))
    if not members:
        return None
    n = starts[-1]
    order = sorted(members)
    width = max(len(rows) for rows in members.values())
    rows = torch.full((len(members), width), n, dtype=torch.long)
    for g, slot in enumerate(order):
        rows[g, : len(members[slot])] = torch.tensor(members[slot], dtype=torch.long)
    device = seg_starts.device
    consecutive = order == list(range(order[0], order[0] + len(order)))
    return SlotGroups(rows.to(device), torch.tensor(order, dtype=torch.long, device=device), n,
                      order[0] if consecutive else None)


def lora_delta_grouped(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, groups: SlotGroups) -> torch.Tensor:
    """`(x @ A[slot]) @ B[slot]` of every row, zeros for rows without an adapter: `[n, d_out]`.

    Gathers each slot's rows into one padded batch and runs two batched products in float32, so the number of
    operations does not grow with the number of adapters or segments (the per-slot loop of `sgmv_reference`
    costs a few tensor operations per adapter, per projection, per layer).
    """
    n, d_in = x.shape
    padded = torch.cat([x, x.new_zeros(1, d_in)])  # row n: the padding rows read zeros
    gathered = padded[groups.rows].float()  # [G, m, d_in]
    if groups.first_slot is not None:  # e.g. every loaded adapter in the step: views, no copy of the weights
        a = lora_a[groups.first_slot : groups.first_slot + len(groups.slots)]
        b = lora_b[groups.first_slot : groups.first_slot + len(groups.slots)]
    else:
        a, b = lora_a[groups.slots], lora_b[groups.slots]
    shrunk = torch.bmm(gathered, a.float())  # [G, m, r]
    expanded = torch.bmm(shrunk, b.float())  # [G, m, d_out]
    out = torch.zeros(n + 1, lora_b.shape[2], dtype=torch.float32, device=x.device)
    out.index_copy_(0, groups.rows.flatten(), expanded.flatten(0, 1))  # padding lands on row n, dropped
    return out[:n].to(x.dtype)


# --- Triton ---------------------------------------------------------------------------------------------------


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def sgmv_triton(
    x: torch.Tensor, weight: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor
) -> torch.Tensor:
    """`sgmv` by the Triton kernel: CUDA tensors, or CPU tensors under the interpreter (`TRITON_INTERPRET=1`)."""
    if not triton_available():
        raise RuntimeError("sgmv_triton needs the triton package (pip install triton)")
    check_inputs(x, weight, seg_starts, seg_slots)
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"sgmv_triton runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1), got {x.device}")
    return _launch(x, weight, seg_starts, seg_slots)


def _launch(
    x: torch.Tensor, weight: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor
) -> torch.Tensor:
    n, d_in = x.shape
    d_out = weight.shape[2]
    num_segments = seg_slots.numel()
    out = torch.empty(n, d_out, dtype=x.dtype, device=x.device)  # each program writes its tile, zeros included
    if n == 0 or d_out == 0:
        return out
    # Row tiles fit the average segment (decode: 1 row, prefill: hundreds) without reading lengths on the host.
    # Segment s owns cdiv(len_s, BLOCK_M) <= len_s // BLOCK_M + 1 row tiles, so n // BLOCK_M + num_segments
    # programs cover every segment; the spare ones find no segment and return.
    rows_per_segment = n // max(num_segments, 1)
    block_m = 64 if rows_per_segment >= 64 else 32 if rows_per_segment >= 32 else 16
    block_n = min(128, max(16, next_power_of_2(d_out)))  # shrink: the whole rank in one tile
    block_k = min(64, max(16, next_power_of_2(d_in)))  # expand: the whole rank in one step
    grid = (n // block_m + num_segments, cdiv(d_out, block_n))
    # The interpreter multiplies bfloat16 tiles as their raw bits; products of bfloat16 values are exact in
    # float32, so upcasting there computes the same sums the GPU's bfloat16 dot does.
    upcast_bf16 = not x.is_cuda and x.dtype == torch.bfloat16
    input_precision = "ieee" if x.dtype == torch.float32 else "tf32"  # float32: exact products, like the reference
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # launch on x's GPU
        _kernel()[grid](
            x, weight, out, seg_starts, seg_slots,
            num_segments, d_in, d_out,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), weight.stride(2),
            out.stride(0), out.stride(1),
            SEG_BLOCK=max(16, next_power_of_2(num_segments)), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            INPUT_PRECISION=input_precision, UPCAST_BF16=upcast_bf16,
            enable_fp_fusion=True,  # Triton's default today, stated so that it neither warns nor changes under us
        )
    return out


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(v: int) -> int:
    return 1 << max(v - 1, 0).bit_length()


@functools.cache
def _kernel() -> Any:
    """Builds the jitted kernel on first use, so that importing this module never imports triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def sgmv_kernel(
        x_ptr, w_ptr, out_ptr, seg_starts_ptr, seg_slots_ptr,
        num_segments, d_in, d_out,
        stride_xm, stride_xk, stride_ws, stride_wk, stride_wn, stride_om, stride_on,
        SEG_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        INPUT_PRECISION: tl.constexpr, UPCAST_BF16: tl.constexpr,
    ):
        tile = tl.program_id(0)  # index in the list of (segment, row tile) pairs, segment-major
        pid_n = tl.program_id(1)  # column tile of d_out

        # Segment s owns tiles [tiles_through[s] - num_tiles[s], tiles_through[s]); this tile's segment is the
        # number of segments whose tiles all come before it. Programs past the last tile find none and exit.
        segs = tl.arange(0, SEG_BLOCK)
        is_real = segs < num_segments
        begins = tl.load(seg_starts_ptr + segs, mask=is_real, other=0)
        ends = tl.load(seg_starts_ptr + segs + 1, mask=is_real, other=0)
        num_tiles = (ends - begins + BLOCK_M - 1) // BLOCK_M
        tiles_through = tl.cumsum(num_tiles, 0)
        seg = tl.sum((tiles_through <= tile).to(tl.int32), 0)
        if seg < num_segments:
            is_seg = segs == seg
            first_tile = tl.sum(tl.where(is_seg, tiles_through - num_tiles, 0), 0)
            row_begin = tl.sum(tl.where(is_seg, begins, 0), 0) + (tile - first_tile) * BLOCK_M
            row_end = tl.sum(tl.where(is_seg, ends, 0), 0)
            slot = tl.load(seg_slots_ptr + seg)

            # 64-bit scalar bases and 32-bit offsets within the tile: 64-bit offset tensors cost twice the registers.
            tile_rows = tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            ks = tl.arange(0, BLOCK_K)
            row_ok = tile_rows < row_end - row_begin
            col_ok = cols < d_out
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if slot >= 0:  # slot -1 (no adapter) writes zeros
                x_tile = x_ptr + row_begin.to(tl.int64) * stride_xm
                w_tile = w_ptr + slot.to(tl.int64) * stride_ws
                x_offsets = tile_rows[:, None] * stride_xm + ks[None, :] * stride_xk
                w_offsets = ks[:, None] * stride_wk + cols[None, :] * stride_wn
                for k in range(0, tl.cdiv(d_in, BLOCK_K)):
                    k_ok = ks < d_in - k * BLOCK_K
                    a = tl.load(x_tile + x_offsets, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                    b = tl.load(w_tile + w_offsets, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                    if UPCAST_BF16:
                        a, b = a.to(tl.float32), b.to(tl.float32)
                    acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
                    x_tile += BLOCK_K * stride_xk
                    w_tile += BLOCK_K * stride_wk
            out_tile = out_ptr + row_begin.to(tl.int64) * stride_om
            out_offsets = tile_rows[:, None] * stride_om + cols[None, :] * stride_on
            tl.store(out_tile + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    return sgmv_kernel
