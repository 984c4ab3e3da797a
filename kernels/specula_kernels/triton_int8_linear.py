"""`--quantize int8` on CUDA: a weight-only int8 product in Triton.

`out[m, n] = scale[n] * sum_k x[m, k] * q[n, k]`, for the int8 weights and per-row scales of
`quantized_linear.quantize_int8`, read as they are stored (`q` int8 `[out, in]`, one byte per weight: half of
bfloat16's reads, which is what a decode step is made of). Each program computes a `BLOCK_M x BLOCK_N` tile of
the output: it walks the inputs in steps of `BLOCK_K`, widens the codes to bfloat16 in registers (integers up to
127 are exact there), multiplies on the tensor cores with float32 sums, and applies the rows' scales once at the
end, in float32. The activations are rounded to bfloat16 first, as PyTorch's int8 kernels do
(`quantized_linear.int8_linear`); the output comes back in the activations' dtype.

It replaces `aten._weight_int8pack_mm` on CUDA, which is far slower (docs/benchmarks.md, the GPU section). A decode
step has few rows, so the output columns are cut finely (`BLOCK_N` 32) to give every streaming multiprocessor a share
of the weight to read. Where the tiles are still too few for the GPU (a narrow output over long inputs, such as the
MLP's down product), the inputs are split too (`split_k`): each program sums its share of them into a float32
workspace, and the shares are added in a fixed order afterwards (no atomics: the result does not depend on timing).

Tested against `int8_linear_reference` in Triton's interpreter on CPU tensors and compiled for GPU targets without
one (`kernels/tests/test_triton_int8_linear.py`); triton is imported on first launch.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import torch

from specula_kernels.sgmv import cdiv, triton_available

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_K = 128  # inputs per step of a program's loop


def supports(x: torch.Tensor) -> bool:
    """Whether the kernel serves products of these activations: CUDA, triton installed, a float dtype."""
    return x.is_cuda and triton_available() and x.dtype in FLOAT_DTYPES


def int8_linear_triton(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, split_k: int | None = None
                       ) -> torch.Tensor:
    """`x [m, in] @ (q * scale)^T` -> `[m, out]` in `x`'s dtype; `q` int8 `[out, in]`, `scale` `[out]`.

    CUDA tensors, or CPU tensors under the interpreter (`TRITON_INTERPRET=1`). `split_k`: how many programs share
    each tile's inputs (None: as `tiling` chooses for the GPU's size).
    """
    if not triton_available():
        raise RuntimeError("int8_linear_triton needs the triton package (pip install triton)")
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be [m, in] float32/bfloat16/float16, got {tuple(x.shape)} {x.dtype}")
    if q.dim() != 2 or q.dtype != torch.int8 or q.shape[1] != x.shape[1] or q.stride(1) != 1:
        raise ValueError(f"q must be int8 [out, in={x.shape[1]}] with unit stride in its inputs, got "
                         f"{tuple(q.shape)} {q.dtype} strides {q.stride()}")
    if scale.shape != (q.shape[0],) or scale.dtype not in FLOAT_DTYPES:
        raise ValueError(f"scale must be float [out={q.shape[0]}], got {tuple(scale.shape)} {scale.dtype}")
    if len({x.device, q.device, scale.device}) != 1:
        raise ValueError(f"x, q and scale must be on one device, got {x.device}, {q.device}, {scale.device}")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"int8_linear_triton runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1), got "
                         f"{x.device}")
    m, k = x.shape
    n = q.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if not x.is_cuda:  # the interpreter converts to bfloat16 as raw bits: round here, widen in the kernel
        x = x.to(torch.bfloat16)
    if x.stride(1) != 1:
        x = x.contiguous()
    block_m, block_n, auto_split = tiling(m, n, k, x.device)
    split = max(1, min(split_k if split_k is not None else auto_split, cdiv(k, BLOCK_K)))
    k_per_split = cdiv(cdiv(k, split), BLOCK_K) * BLOCK_K  # whole input blocks per program
    split = cdiv(k, k_per_split)
    partial = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    grid = (cdiv(m, block_m), cdiv(n, block_n), split)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _kernel()[grid](
            x, q, scale, partial, m, n, k, k_per_split, x.stride(0), q.stride(0), n, m * n,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, UPCAST=not x.is_cuda, SPLIT=split > 1,
        )
    if split > 1:  # the shares in a fixed order, then the rows' scales, as the unsplit kernel applies them
        out.copy_(partial.sum(0).mul_(scale.float()))
    return out


def tiling(m: int, n: int, k: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, split of the inputs) for an `[m, k] x [k, n]` product on `device`."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64  # tl.dot takes 16 rows at least
    # Narrow column tiles give few rows many programs; past 32 rows, wide outputs (gate/up, the LM head) read
    # faster in tiles of 64 (benchmark/cuda_int8_linear.py on an H200).
    block_n = 64 if m > 32 and n >= 8192 else 32
    if device.type != "cuda":
        return block_m, block_n, 1
    # About two programs per multiprocessor, each summing at least 2,048 inputs: adding the shares up costs a
    # few microseconds, which only long inputs repay (the MLP's down product; benchmark/cuda_int8_linear.py).
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    programs = 2 * _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    return block_m, block_n, max(1, min(programs // tiles, k // (16 * BLOCK_K), 8))


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _kernel() -> Any:
    """Builds the jitted kernel on first use, so that importing this module never imports triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def int8_linear_kernel(
        x_ptr, q_ptr, scale_ptr, out_ptr, m, n, k, k_per_split, stride_xm, stride_qn, stride_om, stride_split,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < m
        col_ok = cols < n
        k_start = tl.program_id(2) * k_per_split
        k_end = tl.minimum(k_start + k_per_split, k)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(k_start, k_end, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            k_ok = ks < k_end
            a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            codes = tl.load(q_ptr + cols[:, None].to(tl.int64) * stride_qn + ks[None, :],
                            mask=col_ok[:, None] & k_ok[None, :], other=0)
            if UPCAST:  # bfloat16 activations (rounded by the caller) and codes in float32: exact products
                acc += tl.dot(a.to(tl.float32), tl.trans(codes.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(a.to(tl.bfloat16), tl.trans(codes.to(tl.bfloat16)))
        ok = row_ok[:, None] & col_ok[None, :]
        if SPLIT:  # this program's share of the sums, unscaled, in its slice of the float32 workspace
            tl.store(out_ptr + tl.program_id(2).to(tl.int64) * stride_split + rows[:, None].to(tl.int64) * stride_om
                     + cols[None, :], acc, mask=ok)
        else:
            scales = tl.load(scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            result = acc * scales[None, :]
            tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
                     result.to(out_ptr.dtype.element_ty), mask=ok)

    return int8_linear_kernel
