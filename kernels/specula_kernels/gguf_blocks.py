"""GGUF's Q8_0, Q4_0 and Q4_1 weights served as the file holds them (`--quantize gguf`): parsed, packed for the
native kernels (`csrc/tiled_linear.cpp`), multiplied, and dequantized exactly as the `gguf` package's reference
dequantizers do (for devices without the native kernels, and for the tests).

Block layouts (llama.cpp's `ggml-common.h`), 32 weights per block, a row of `in / 32` blocks:

    Q8_0  34 bytes: d (float16), q[32] int8            w = q * d
    Q4_0  18 bytes: d (float16), 16 bytes of codes     w = (c - 8) * d
    Q4_1  20 bytes: d, m (float16), 16 bytes of codes  w = c * d + m

The native kernels (`csrc/tiled_linear.cpp`) take the blocks in panels of output rows, input by input, as the
float32 kernels do: `pack_native` moves codes and scales there (widening the float16 scales to float32) and nothing
more. The kernels compute each weight as the reference does (an exact product, or one rounding of `c * d + m`), so
the values multiplied are the file's own; only the order of the float32 sums is the kernels'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specula_kernels.quantized_linear import int4_linear_native, native_product, pack_q4_tiles, tile_bytes, to_tiles

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

    def pack_native(self, lanes: int) -> torch.Tensor:
        """The weight as the native kernels read it (`csrc/tiled_linear.cpp`) in a build of `lanes`-float vectors:
        uint8 `[tiles, in / 32, block bytes]`, a tile being two panels of P = 2 * lanes output rows. Each block of
        32 inputs holds its panels' scales (float32 d, and m for Q4: `[2 panels][P]` each) and then, input by
        input, each panel's codes: Q4 `lanes` bytes (`quantized_linear.pack_q4_tiles`), Q8_0 `P` int8."""
        d, m, payload = self.fields()
        if self.type_name != "Q8_0":
            codes = torch.cat([payload & 15, payload >> 4], dim=-1).reshape(self.out_features, self.in_features)
            return pack_q4_tiles(codes, d, torch.zeros_like(d) if m is None else m, BLOCK, lanes)
        panel = 2 * lanes
        scales = to_tiles(d, panel)  # [tiles, blocks, 2, P]
        codes = to_tiles(payload, panel).movedim(2, 3)  # [tiles, blocks, 32 inputs, 2 panels, P]
        return torch.cat([tile_bytes(scales), tile_bytes(codes)], dim=-1).contiguous()


def code_bias(type_name: str) -> int:
    """What the Q4 kernels subtract from a code before scaling it: 8 for Q4_0, 0 for Q4_1."""
    return 8 if type_name == "Q4_0" else 0


def gguf_linear_native(lib, x: torch.Tensor, type_name: str, tiles: torch.Tensor, out_features: int) -> torch.Tensor:
    """`x [m, in] @ w^T` -> `[m, out]` in `x`'s dtype, for a weight from `GGUFBlocks.pack_native`."""
    assert x.dim() == 2 and tiles.dtype == torch.uint8 and tiles.dim() == 3 and tiles.is_contiguous()
    m, k = x.shape
    if type_name != "Q8_0":
        return int4_linear_native(lib, x, tiles, BLOCK, out_features, code_bias(type_name))
    lanes = tiles.shape[2] // (16 + BLOCK * 4)  # the build's, which packed them
    assert tiles.shape == (-(-out_features // (4 * lanes)), k // BLOCK, 16 * lanes + BLOCK * 4 * lanes)
    assert k % BLOCK == 0
    return native_product(x, out_features, lambda x_ptr, out_ptr, threads: lib.specula_q8_0_linear(
        x_ptr, m, k, tiles.data_ptr(), out_features, out_ptr, threads))
