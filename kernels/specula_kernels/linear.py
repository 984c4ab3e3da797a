"""Dense linear layers with weights packed for bandwidth-bound decoding.

A decode step multiplies a handful of activation rows by every weight matrix once, so its speed is the speed
at which weights stream from memory. On CPU, MKL runs such a skinny GEMM (`[1, in] @ [in, out]`) on a single
thread, which leaves most of the memory bandwidth unused. Packing the weight as `num_parts` contiguous
column blocks `[num_parts, in, out / num_parts]` turns the product into a batched GEMM whose batches run on
separate threads:

    x [m, in] --expand--> [parts, m, in] @ packed [parts, in, out/parts] -> [parts, m, out/parts] -> [m, out]

Each output element is still one dot product over the full input, so results equal `F.linear` up to the
GEMM's summation order. On CUDA one block is used.

On CPUs where PyTorch ships oneDNN (every x86 build), the float layers use oneDNN's own packed format instead
(`onednn_pack` / `onednn_linear`: the weight reordered once at load time into the blocked layout its GEMM
kernels read, as torch.compile's CPU backend does for frozen weights): float32 batches run faster on it than on
the column blocks, and bfloat16 faster than float32 on a CPU with native bfloat16 kernels, where bfloat16 through
plain `matmul` is slower than float32 (`benchmark/linear_kernels.py`; figures in
docs/benchmarks.md#decode-in-the-worker). oneDNN is used for bfloat16 only where
it reports native support (`torch.ops.mkldnn._is_mkldnn_bf16_supported()`); elsewhere bfloat16 and float16 keep
the column blocks.

Where the native kernels are built (`native.py`), float32 layers use neither: `pack_panels` / `panel_linear` hold the
weight in Specula's own panel layout and multiply on `csrc/float_linear.cpp`, which takes one decoded row at the
memory's pace (oneDNN's one-row product reads weights at about two thirds of it) and a prompt's hundreds of rows at
oneDNN's rate, from the one copy (`benchmark/linear_kernels.py`).

`linear_reference` is the plain definition the packed forms are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specula_kernels import native


def default_num_parts(out_features: int, device: torch.device) -> int:
    """One block per CPU thread when the output splits evenly; a single block on accelerators."""
    if device.type != "cpu":
        return 1
    threads = torch.get_num_threads()
    return threads if threads > 1 and out_features % threads == 0 else 1


def pack_weight(weight: torch.Tensor, num_parts: int) -> torch.Tensor:
    """`[out, in]` (checkpoint layout) -> `[num_parts, in, out / num_parts]`, contiguous."""
    out_features, in_features = weight.shape
    if out_features % num_parts:
        raise ValueError(f"cannot split {out_features} output features into {num_parts} blocks")
    return weight.t().reshape(in_features, num_parts, out_features // num_parts).permute(1, 0, 2).contiguous()


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_weight`: back to `[out, in]`."""
    num_parts, in_features, block = packed.shape
    return packed.permute(1, 0, 2).reshape(in_features, num_parts * block).t()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W^T + bias` for `x` `[m, in]` and a packed weight; returns `[m, out]`."""
    assert x.dim() == 2 and x.shape[1] == packed.shape[1], (x.shape, packed.shape)
    assert x.dtype == packed.dtype, (x.dtype, packed.dtype)
    num_parts, in_features, block = packed.shape
    if num_parts == 1:
        out = torch.matmul(x, packed[0])
    else:
        out = torch.bmm(x.unsqueeze(0).expand(num_parts, -1, -1), packed)  # [parts, m, block]
        out = out.transpose(0, 1).reshape(x.shape[0], num_parts * block)
    return out if bias is None else out + bias


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def onednn_supports(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `onednn_pack` serves weights of `dtype` on `device`: CPU with oneDNN, float32 always, bfloat16 where
    oneDNN has native bfloat16 kernels for this CPU."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


# The row count oneDNN is told to expect when it picks the packed layout (any row count works with any layout).
# Told 1, it picks a layout for matrix-vector products that float32 batches and speculative verifies pay for,
# while a single row costs the same either way (`benchmark/linear_kernels.py --pack-hint 1 64`;
# docs/benchmarks.md#decode-in-the-worker). Every hint from 16 to 256 measured alike;
# bfloat16 did not depend on it.
PACK_ROWS_HINT = 64


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """`[out, in]` -> oneDNN's blocked layout for `onednn_linear` (an opaque `torch._mkldnn` tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W^T + bias` for `x` `[m, in]` and a weight packed by `onednn_pack`; returns `[m, out]`."""
    assert x.dim() == 2 and x.shape[1] == packed.shape[1], (x.shape, packed.shape)
    assert x.dtype == packed.dtype, (x.dtype, packed.dtype)
    out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")
    return out if bias is None else out + bias


def panels_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `pack_panels` serves weights of `dtype` on `device`: float32 on a CPU where the kernels are built."""
    return device.type == "cpu" and dtype == torch.float32 and native.library() is not None


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """`[out, in]` -> `[ceil(out / P), in, P]` float32, P the build's panel width (`csrc/float_linear.cpp`): each
    group of P rows stored input by input, the last group padded with zero rows."""
    rows = native.library().specula_float_panel_rows()
    out_features, in_features = weight.shape
    num_panels = -(-out_features // rows)
    padded = weight.new_zeros(num_panels * rows, in_features)
    padded[:out_features] = weight
    return padded.view(num_panels, rows, in_features).transpose(1, 2).contiguous()


def unpack_panels(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """Inverse of `pack_panels`: back to `[out, in]`."""
    num_panels, in_features, rows = panels.shape
    return panels.transpose(1, 2).reshape(num_panels * rows, in_features)[:out_features]


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W^T + bias` for `x` `[m, in]` float32 and a weight packed by `pack_panels`; returns `[m, out]`."""
    assert x.dim() == 2 and x.shape[1] == panels.shape[1], (x.shape, panels.shape)
    assert x.dtype == panels.dtype == torch.float32, (x.dtype, panels.dtype)
    x = x.contiguous()
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    if x.shape[0]:
        native.library().specula_float_linear(x.data_ptr(), x.shape[0], x.shape[1], panels.data_ptr(),
                                              None if bias is None else bias.contiguous().data_ptr(), out_features,
                                              out.data_ptr(), torch.get_num_threads())
    return out
