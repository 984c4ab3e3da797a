"""`--quantize`: the setting, and the weight formats the model's linear layers hold.

The tensor-parallel linears and the LM head (`tensor_parallel.py`) hand their rank's float slice to
`build_linear`, which returns the product they call: `DenseLinear` (float weights packed for threads), or
`Int8Linear` / `Int4Linear`, which quantize the slice at load time and multiply on the native weight-only kernels
(`specula_kernels.native`, CPUs with AVX2 or AVX-512), on Triton for int8 on CUDA, or else on PyTorch's packed kernels
(`specula_kernels.quantized_linear`), or `W8A8Linear`: int8's weights by activations quantized per block of 32
inputs at each product, on the native integer dot-product kernel. Every product maps activations `[m, in]` to
`[m, out]` in the model's dtype, so what acts on activations around it (LoRA deltas, Medusa heads, speculation, the
all-reduce) is unchanged.

Tensor parallelism quantizes exactly as one shard would: every quantized layer's shard holds whole rows (the
row-parallel layers split their outputs when quantized, `RowParallelLinear`), and int8 scales and int4 groups
lie within a row, so each shard quantizes its own slice to the very values one unsharded model holds.

`--quantize gguf` serves a GGUF file's Q8_0, Q4_0 and Q4_1 tensors as the file holds them (`GGUFLinear`, on the
native kernels through `specula_kernels.gguf_blocks`): no float round trip, no requantization, the very weights
llama.cpp multiplies. The reader hands those layers `GGUFBlocks` instead of float slices (`Weights.get_linear`);
tensors of other types, and every tensor where the native kernels do not serve, arrive as float (the file's
values dequantized to `--dtype`) and become `DenseLinear`s.

Checkpoints that are already quantized (GPTQ, AWQ, bitsandbytes, FP8, ...) are refused with a pointer to
`--quantize` (`check_float_checkpoint`): Specula quantizes float checkpoints itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specula_kernels import native, triton_int8_linear
from specula_kernels.gguf_blocks import GGUFBlocks, gguf_linear_native
from specula_kernels.linear import (
    default_num_parts,
    linear,
    onednn_linear,
    onednn_pack,
    onednn_supports,
    pack_panels,
    pack_weight,
    panel_linear,
    panels_supported,
)
from specula_kernels.quantized_linear import (
    INT4_GROUP_SIZES,
    INT8_IN_MULTIPLE,
    KERNEL_DTYPE,
    int4_linear,
    int4_linear_native,
    int8_linear,
    int8_linear_native,
    pack_int4,
    pack_int4_native,
    pack_int8_native,
    pack_w8a8_native,
    quantize_int4,
    quantize_int8,
    w8a8_linear_native,
    w8a8_linear_reference,
)
from specula_proto.choices import QuantizeMethod, quantize_method, values

DEFAULT_GROUP_SIZE = 64
# Tensor names that only a pre-quantized checkpoint has (GPTQ/AWQ `qweight`, bitsandbytes `absmax`/`quant_map`,
# FP8 and compressed-tensors `weight_scale`).
_QUANTIZED_TENSOR_SUFFIXES = (".qweight", ".qzeros", ".g_idx", ".weight_scale", ".absmax", ".quant_map", ".SCB")


@dataclass(frozen=True)
class Quantization:
    """Weight-only quantization of the model's linear layers; `group_size`: inputs per int4 scale and zero;
    `flag`: the setting that asked for it, as errors name it (`--speculator-quantize` for an EAGLE-3 drafter's)."""

    method: str
    group_size: int = DEFAULT_GROUP_SIZE
    flag: str = "--quantize"

    def __post_init__(self) -> None:
        quantize_method(self.method)  # a ValueError naming the supported methods
        _check_group_size(self.group_size)

    @classmethod
    def parse(cls, value: str | None, group_size: int = DEFAULT_GROUP_SIZE, flag: str = "--quantize"
              ) -> Quantization | None:
        """The `--quantize` flag (or `flag`): None or "" for float weights, else a validated setting."""
        _check_group_size(group_size)
        return cls(value.strip().lower(), group_size, flag) if value and value.strip() else None


def _check_group_size(group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"--quantize-group-size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}; "
                         f"got {group_size}")


class DenseLinear(nn.Module):
    """Float weights: float32 in Specula's panel layout where the native kernels are built, else in oneDNN's packed
    layout where it serves their dtype on this CPU, else packed as one column block per CPU thread
    (`specula_kernels.linear` has all three, and the measurements that chose between them)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.kind = ("panels" if panels_supported(weight.dtype, weight.device) else
                     "onednn" if onednn_supports(weight.dtype, weight.device) else "blocks")
        if self.kind == "panels":
            self.register_buffer("packed", pack_panels(weight))  # [out / P, in, P]
        elif self.kind == "onednn":
            self.register_buffer("packed", onednn_pack(weight))  # opaque; `in` features on dim 1
        else:
            parts = default_num_parts(weight.shape[0], weight.device)
            self.weight = nn.Parameter(pack_weight(weight, parts), requires_grad=False)  # [parts, in, out/parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "panels":
            return panel_linear(x, self.packed, self.out_features)
        return onednn_linear(x, self.packed) if self.kind == "onednn" else linear(x, self.weight)


def _native_kernels(device: torch.device):
    """The native weight-only kernels where they serve this device (CPU, built for this machine), else None."""
    return native.library() if device.type == "cpu" else None


class Int8Linear(nn.Module):
    """int8 weights with one scale per output row; on the native kernels where they are built, on the Triton
    kernel on CUDA (`triton_int8_linear`), else PyTorch's."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        q, scale = quantize_int8(weight)
        self.out_features, self.in_features = weight.shape
        self.native = _native_kernels(weight.device)
        if self.native:  # in tiles of output rows, each with its rows' scales (float32: they are bfloat16-exact)
            self.register_buffer("tiles", pack_int8_native(q, scale, native.vector_lanes()))
        else:
            self.register_buffer("qweight", q)  # int8 [out, in]
            self.register_buffer("scale", scale.to(KERNEL_DTYPE))  # [out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return int8_linear_native(self.native, x, self.tiles, self.out_features)
        if triton_int8_linear.supports(x):
            return triton_int8_linear.int8_linear_triton(x, self.qweight, self.scale)
        return int8_linear(x, self.qweight, self.scale)


class W8A8Linear(nn.Module):
    """int8 weights with one scale per output row (`Int8Linear`'s values) by activations quantized to int8 per row
    and block of 32 inputs at each product (`quantized_linear.w8a8_linear_reference`); on the native kernel where it
    is built, else on that reference in PyTorch (exact, slow: for tests and machines without the kernels)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        q, scale = quantize_int8(weight)
        self.out_features, self.in_features = weight.shape
        self.native = _native_kernels(weight.device)
        if self.native:  # in tiles of 16 output rows, each with its rows' scales
            self.register_buffer("tiles", pack_w8a8_native(q, scale))
        else:
            self.register_buffer("qweight", q)  # int8 [out, in]
            self.register_buffer("scale", scale)  # float32 [out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return w8a8_linear_native(self.native, x, self.tiles, self.out_features)
        return w8a8_linear_reference(x, self.qweight, self.scale)


class Int4Linear(nn.Module):
    """int4 weights with a scale and a zero per output row and group of `group_size` inputs; on the native
    kernels where they are built, else PyTorch's (each has its own packed layout)."""

    def __init__(self, weight: torch.Tensor, group_size: int) -> None:
        super().__init__()
        self.out_features, self.group_size = weight.shape[0], group_size
        self.native = _native_kernels(weight.device)
        q, scale, zero = quantize_int4(weight, group_size)
        if self.native:  # in tiles of output rows, each group with its rows' scales and zeros
            self.register_buffer("tiles", pack_int4_native(q, scale, zero, native.vector_lanes()))
        else:
            packed, scales_and_zeros = pack_int4(q, scale, zero)
            self.register_buffer("packed", packed)  # about [out, in / 2] bytes
            self.register_buffer("scales_and_zeros", scales_and_zeros)  # the scale and zero of each row's groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return int4_linear_native(self.native, x, self.tiles, self.group_size, self.out_features)
        return int4_linear(x, self.packed, self.scales_and_zeros, self.group_size, self.out_features)


class GGUFLinear(nn.Module):
    """A GGUF file's Q8_0, Q4_0 or Q4_1 weight, as the file holds it, on the native kernels (`Weights.get_linear`
    hands out blocks only where they are built)."""

    def __init__(self, blocks: GGUFBlocks) -> None:
        super().__init__()
        self.type_name, self.out_features, self.in_features = blocks.type_name, *blocks.shape
        self.native = _native_kernels(blocks.data.device)
        if not self.native:
            raise ValueError(f"GGUF {blocks.type_name} blocks need the native kernels, which do not serve "
                             f"{blocks.data.device} here")
        # the file's scales and codes, in tiles of output rows
        self.register_buffer("weight", blocks.pack_native(native.vector_lanes()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gguf_linear_native(self.native, x, self.type_name, self.weight, self.out_features)


def gguf_blocks_served(device: torch.device) -> bool:
    """Whether `--quantize gguf` keeps a file's blocks on `device` (else they are dequantized to the model's
    dtype)."""
    return _native_kernels(device) is not None


def build_linear(weight: torch.Tensor | GGUFBlocks, quantization: Quantization | None, name: str) -> nn.Module:
    """The product `x @ weight^T` for this rank's slice `weight` `[out, in]` of layer `name`.

    Raises ValueError, naming the flag and the layer, when the weight does not fit the format.
    """
    if isinstance(weight, GGUFBlocks):
        return GGUFLinear(weight)
    if quantization is None or quantization.method == "gguf":
        return DenseLinear(weight)
    in_features = weight.shape[1]
    if quantization.method == "w8a8":
        return W8A8Linear(weight)
    if quantization.method == "int8":
        if in_features % INT8_IN_MULTIPLE:
            raise ValueError(f"{quantization.flag} int8 needs every linear's inputs to be a multiple of "
                             f"{INT8_IN_MULTIPLE}; {name} has {in_features}")
        return Int8Linear(weight)
    if in_features % quantization.group_size:
        raise ValueError(f"{quantization.flag} int4 with --quantize-group-size {quantization.group_size} needs every "
                         f"linear's inputs to be whole groups; {name} has {in_features}")
    return Int4Linear(weight, quantization.group_size)


def check_float_checkpoint(raw_config: dict[str, Any], tensor_names: Iterable[str]) -> None:
    """Refuses a pre-quantized checkpoint (a `quantization_config` in config.json, or quantized tensors) with a
    ValueError that says what to serve instead."""
    method = (raw_config.get("quantization_config") or {}).get("quant_method")
    if method is None:
        odd = next((n for n in tensor_names if n.endswith(_QUANTIZED_TENSOR_SUFFIXES)), None)
        if odd is None:
            return
        method = f"a quantized format (tensor {odd})"
    raise ValueError(f"the checkpoint is already quantized ({method}); Specula loads float checkpoints (float32, "
                     f"bfloat16, float16) and quantizes them itself at load time with --quantize "
                     f"{'|'.join(values(QuantizeMethod))}: serve the float checkpoint with --quantize instead")
