"""GGUF's Q8_0, Q4_0 and Q4_1 weights served as the file holds them (`--quantize gguf`): parsed, packed for the
native kernels (`csrc/weight_only.cpp`), multiplied, and dequantized exactly as the `gguf` package's reference
dequantizers do (for devices without the native kernels, and for the tests).

Block layouts (llama.cpp's `ggml-common.h`), 32 weights per block, a row of `in / 32` blocks:

    Q8_0  34 bytes: d (float16), q[32] int8            w = q * d
    Q4_0  18 bytes: d (float16), 16 bytes of codes     w = (c - 8) * d
    Q4_1  20 bytes: d, m (float16), 16 bytes of codes  w = c * d + m

Code byte j holds input j in its low half and input j + 16 in its high half: the native int4 layout's own order,
so packing regroups rows in fours (`quantized_linear.interleave_rows`) and widens the float16 scales to float32,
nothing more. The kernels compute each weight as the reference does (an exact product, or one rounding of
`c * d + m`), so the values multiplied are the file's own; only the order of the float32 sums is the kernels'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specula_kernels.quantized_linear import NATIVE_ROWS, interleave_rows

NATIVE_TYPES = ("Q8_0", "Q4_0", "Q4_1")
BLOCK = 32  # weights per block
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


@dataclass(frozen=True)
class GGUFBlocks:
    """One linear's weight `[out, in]` in a GGUF block type, as the file stores it: `data` uint8
    `[out, in / 32 * block bytes]`."""

    type_name: str
    data: torch.Tensor
    in_features: int

    def __post_init__(self) -> None:
        if self.type_name not in NATIVE_TYPES:
            raise ValueError(f"GGUF blocks of type {self.type_name} are not served natively "
                             f"({', '.join(NATIVE_TYPES)})")
        if self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError(f"GGUF blocks are uint8 [rows, bytes]; got {self.data.dtype} {list(self.data.shape)}")
        if self.in_features % BLOCK or self.data.shape[1] != self.in_features // BLOCK * BLOCK_BYTES[self.type_name]:
            raise ValueError(f"{self.type_name} rows of {self.in_features} inputs take "
                             f"{self.in_features // BLOCK * BLOCK_BYTES[self.type_name]} bytes, not "
                             f"{self.data.shape[1]}")

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @staticmethod
    def cat(parts: Sequence[GGUFBlocks]) -> GGUFBlocks:
        """The rows of `parts` one after another (a fused q/k/v or gate/up product); they share type and inputs."""
        first = parts[0]
        if any((p.type_name, p.in_features) != (first.type_name, first.in_features) for p in parts):
            raise ValueError("fused GGUF blocks need one type and one input width: "
                             + ", ".join(f"{p.type_name} [{p.out_features}, {p.in_features}]" for p in parts))
        return GGUFBlocks(first.type_name, torch.cat([p.data for p in parts]), first.in_features)

    def pad_rows(self, rows: int) -> GGUFBlocks:
        """`rows` more rows of zero bytes: scale 0, so every padded weight is 0."""
        return GGUFBlocks(self.type_name, torch.cat([self.data, self.data.new_zeros(rows, self.data.shape[1])]),
                          self.in_features)

    def fields(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(d float32 `[out, blocks]`, m float32 `[out, blocks]` for Q4_1 else None, the block payloads: Q8_0
        int8 `[out, blocks, 32]`, Q4 code bytes uint8 `[out, blocks, 16]`)."""
        blocks = self.data.reshape(self.out_features, self.in_features // BLOCK, BLOCK_BYTES[self.type_name])

        def half(start: int) -> torch.Tensor:
            return blocks[..., start:start + 2].contiguous().view(torch.float16).squeeze(-1).float()

        if self.type_name == "Q8_0":
            return half(0), None, blocks[..., 2:].contiguous().view(torch.int8)
        if self.type_name == "Q4_0":
            return half(0), None, blocks[..., 2:].contiguous()
        return half(0), half(2), blocks[..., 4:].contiguous()

    def dequantize(self) -> torch.Tensor:
        """The weights as float32 `[out, in]`, the same values as `gguf.quants.dequantize`."""
        d, m, payload = self.fields()
        if self.type_name == "Q8_0":
            values = payload.float() * d[..., None]
        else:
            codes = torch.cat([payload & 15, payload >> 4], dim=-1).float()  # inputs 0-15, then 16-31
            values = (codes - 8) * d[..., None] if m is None else codes * d[..., None] + m[..., None]
        return values.reshape(self.out_features, self.in_features)

    def pack_native(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight, scales) in the native kernels' layout: Q8_0 `[ceil(out / 4), in / 32, 4, 32]` int8 and
        `[ceil(out / 4), in / 32, 4]` float32; Q4 `[ceil(out / 4), in / 32, 4, 16]` uint8 and
        `[ceil(out / 4), in / 32, 4, 2]` float32 (scale, offset)."""
        d, m, payload = self.fields()
        if self.type_name == "Q8_0":
            q = interleave_rows(payload.reshape(self.out_features, self.in_features), BLOCK, 0)
            return q, interleave_rows(d, 1, 0).squeeze(-1).contiguous()
        codes = interleave_rows(payload.reshape(self.out_features, self.in_features // 2), 16, 0)
        pairs = torch.stack([d, torch.zeros_like(d) if m is None else m], dim=-1).flatten(1)  # [out, blocks * 2]
        return codes, interleave_rows(pairs, 2, 0)


def code_bias(type_name: str) -> float:
    """What the Q4 kernels subtract from a code before scaling it: 8 for Q4_0, 0 for Q4_1."""
    return 8.0 if type_name == "Q4_0" else 0.0


def gguf_linear_native(lib, x: torch.Tensor, type_name: str, weight: torch.Tensor, scales: torch.Tensor,
                       out_features: int) -> torch.Tensor:
    """`x [m, in] @ w^T` -> `[m, out]` in `x`'s dtype, for a weight from `GGUFBlocks.pack_native`."""
    assert x.dim() == 2 and weight.dim() == 4 and weight.is_contiguous() and scales.is_contiguous()
    m, k = x.shape
    blocks, lines, rows, width = weight.shape
    assert k == lines * BLOCK and rows == NATIVE_ROWS and blocks == -(-out_features // NATIVE_ROWS)
    assert scales.dtype == torch.float32
    x32 = x.float().contiguous()
    out = x32.new_empty(m, out_features)
    if m:
        if type_name == "Q8_0":
            assert weight.dtype == torch.int8 and width == BLOCK and scales.shape == (blocks, lines, rows)
            lib.specula_q8_0_linear(x32.data_ptr(), m, k, weight.data_ptr(), scales.data_ptr(), out_features,
                                    out.data_ptr(), torch.get_num_threads())
        else:
            assert weight.dtype == torch.uint8 and width == 16 and scales.shape == (blocks, lines, rows, 2)
            lib.specula_q4_linear(x32.data_ptr(), m, k, weight.data_ptr(), scales.data_ptr(), code_bias(type_name),
                                  out_features, out.data_ptr(), torch.get_num_threads())
    return out.to(x.dtype)
