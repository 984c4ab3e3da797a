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
of the weight to read. The inputs are not split across programs, so many rows of a long product read slower than
bfloat16's: left for when a GPU is at hand to tune it.

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


def supports(x: torch.Tensor) -> bool:
    """Whether the kernel serves products of these activations: CUDA, triton installed, a float dtype."""
    return x.is_cuda and triton_available() and x.dtype in FLOAT_DTYPES


def int8_linear_triton(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x [m, in] @ (q * scale)^T` -> `[m, out]` in `x`'s dtype; `q` int8 `[out, in]`, `scale` `[out]`.

    CUDA tensors, or CPU tensors under the interpreter (`TRITON_INTERPRET=1`).
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
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64  # tl.dot takes 16 rows at least
    # Narrow column tiles give few rows many programs; past 32 rows, wide outputs (gate/up, the LM head) read
    # faster in tiles of 64 (benchmark/cuda_int8_linear.py on an H200).
    block_n = 64 if m > 32 and n >= 8192 else 32
    block_k = 128
    grid = (cdiv(m, block_m), cdiv(n, block_n))
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _kernel()[grid](
            x, q, scale, out, m, n, k, x.stride(0), q.stride(0), out.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=not x.is_cuda,
        )
    return out


@functools.cache
def _kernel() -> Any:
    """Builds the jitted kernel on first use, so that importing this module never imports triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def int8_linear_kernel(
        x_ptr, q_ptr, scale_ptr, out_ptr, m, n, k, stride_xm, stride_qn, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < m
        col_ok = cols < n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, k, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            k_ok = ks < k
            a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            codes = tl.load(q_ptr + cols[:, None].to(tl.int64) * stride_qn + ks[None, :],
                            mask=col_ok[:, None] & k_ok[None, :], other=0)
            if UPCAST:  # bfloat16 activations (rounded by the caller) and codes in float32: exact products
                acc += tl.dot(a.to(tl.float32), tl.trans(codes.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(a.to(tl.bfloat16), tl.trans(codes.to(tl.bfloat16)))
        scales = tl.load(scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        result = acc * scales[None, :]
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    return int8_linear_kernel
