"""Weight-only quantized linear products on PyTorch's packed int8 and int4 kernels.

A decode step streams every weight from memory once, so its speed follows the bytes per weight: int8 weights
are a quarter of float32's, int4 an eighth. Two formats, both quantized from float weights at load time:

- int8, symmetric per output channel: `w[o, i] ~ q[o, i] * scale[o]`, `q` in [-127, 127]. Kernel:
  `aten._weight_int8pack_mm(x, q [out, in], scale [out])` (CPU and CUDA), which reads `q` as it is.
- int4, asymmetric per group of `group_size` consecutive inputs: `w[o, i] ~ (q[o, i] - 8) * scale[o, g] +
  zero[o, g]` with `g = i // group_size` and `q` in [0, 15] (the convention of PyTorch's tinygemm kernels: the
  zero is a float, so a group's minimum maps to 0 and its maximum to 15). Kernels:
  `aten._weight_int4pack_mm_for_cpu` and `aten._weight_int4pack_mm` (CUDA), each on its own packed layout
  made by its convert op (`pack_int4`).

The products run on bfloat16 activations: on CPU both kernels are vectorised for bfloat16 inputs only (with
float32 inputs they are slower than the float32 product they replace, as measured when this path was chosen:
docs/benchmarks.md's history), and the CUDA int4 kernel accepts nothing else. So a product rounds its input to
bfloat16 and returns its bfloat16 output in the caller's dtype; everything around it (residual stream, norms, attention,
LoRA deltas, logits) stays in the model's dtype. Scales and zeros are rounded to bfloat16 *before* the values
are quantized, so the kernels dequantize with exactly the scales the values were rounded against.

On CPUs with AVX2 or AVX-512 the worker uses Specula's own kernels instead (`native.py`, the end of this module: float32
activations, both formats in tiles of output rows); the functions above are the fallback elsewhere.

`int8_linear_reference` and `int4_linear_reference` dequantize and multiply in float32: the definition the
kernels are tested against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

KERNEL_DTYPE = torch.bfloat16
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the int4 kernels accept
INT8_IN_MULTIPLE = 16  # the CPU int8 kernel reads inputs 16 at a time (and crashes on other widths)
INT4_OUT_MULTIPLE = 16  # the CPU int4 packing works on blocks of 16 output rows; `pack_int4` pads to it


def _bf16_exact(t: torch.Tensor) -> torch.Tensor:
    """`t` rounded to bfloat16, kept in float32: the value the kernel will see."""
    return t.to(KERNEL_DTYPE).float()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[out, in]` float -> (`q` int8 `[out, in]`, `scale` float32 `[out]`) with `w ~ q * scale`; rows of zeros
    get scale 1."""
    w = weight.float()
    scale = _bf16_exact(w.abs().amax(dim=1) / 127)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`[out, in]` float -> (`q` uint8 `[out, in]` in [0, 15], `scale`, `zero` float32 `[out, in / group_size]`).

    Example, one group of 4 (group_size 4 for brevity) `[-0.3, 0.0, 0.1, 1.2]`: scale = 1.5 / 15 = 0.1, zero =
    -0.3 + 8 * 0.1 = 0.5, q = round((w - zero) / scale + 8) = [0, 3, 4, 15] (before bfloat16 rounding).
    """
    out_features, in_features = weight.shape
    if group_size not in INT4_GROUP_SIZES or in_features % group_size:
        raise ValueError(f"int4 groups of {group_size} do not fit {in_features} inputs "
                         f"(group sizes: {', '.join(map(str, INT4_GROUP_SIZES))}, dividing the inputs)")
    w = weight.float().reshape(out_features, in_features // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scale = _bf16_exact((high - low) / 15)
    # A constant group: a negligible step makes `zero` the group's value (to bfloat16's precision).
    scale = torch.where(scale > 0, scale, torch.full_like(scale, 2.0**-100))
    zero = _bf16_exact(low + 8 * scale)
    q = torch.round((w - zero[..., None]) / scale[..., None] + 8).clamp(0, 15)
    return q.reshape(out_features, in_features).to(torch.uint8), scale, zero


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    group_size = q.shape[1] // scale.shape[1]
    scale, zero = (t.float().repeat_interleave(group_size, dim=1) for t in (scale, zero))  # [out, in]
    return (q.float() - 8) * scale + zero


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x [m, in] @ (q * scale)^T` -> `[m, out]` in `x`'s dtype; `scale` in `KERNEL_DTYPE`."""
    assert x.dim() == 2 and q.dim() == 2 and x.shape[1] == q.shape[1], (x.shape, q.shape)
    assert q.dtype == torch.int8 and scale.dtype == KERNEL_DTYPE and scale.shape == (q.shape[0],)
    assert q.shape[1] % INT8_IN_MULTIPLE == 0, q.shape
    if x.shape[0] == 0:
        return x.new_empty(0, q.shape[0])
    return torch.ops.aten._weight_int8pack_mm(x.to(KERNEL_DTYPE).contiguous(), q, scale).to(x.dtype)


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The output of `quantize_int4` in the kernel's layout on `q`'s device: (packed weight, scales and zeros
    `[groups, out_padded, 2]` in `KERNEL_DTYPE`). Output rows are padded to a multiple of `INT4_OUT_MULTIPLE`
    (padding rows are zero); `int4_linear` drops their outputs."""
    out_features = q.shape[0]
    pad = -out_features % INT4_OUT_MULTIPLE
    if pad:
        q = torch.cat([q, q.new_full((pad, q.shape[1]), 8)])
        scale = torch.cat([scale, scale.new_ones(pad, scale.shape[1])])
        zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(KERNEL_DTYPE)
    if q.device.type == "cuda":
        pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # two inputs per byte, the first in the high half
        # tinygemm tiles the inputs by 16 * inner_k_tiles; the widest tiling that divides them reads fastest.
        inner_k_tiles = next(t for t in (8, 4, 2) if q.shape[1] % (16 * t) == 0)
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), inner_k_tiles)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)
    return packed, scales_and_zeros


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                out_features: int) -> torch.Tensor:
    """`x [m, in] @ dequantized^T` -> `[m, out_features]` in `x`'s dtype, for a weight from `pack_int4`."""
    assert x.dim() == 2 and scales_and_zeros.shape[0] * group_size == x.shape[1], (x.shape, scales_and_zeros.shape)
    assert scales_and_zeros.dtype == KERNEL_DTYPE and out_features <= scales_and_zeros.shape[1]
    if x.shape[0] == 0:
        return x.new_empty(0, out_features)
    x16 = x.to(KERNEL_DTYPE).contiguous()
    if x.device.type == "cuda":
        out = torch.ops.aten._weight_int4pack_mm(x16, packed, group_size, scales_and_zeros)
    else:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x16, packed, group_size, scales_and_zeros)
    return out[:, :out_features].to(x.dtype)


def int8_linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), dequantize_int8(q, scale)).to(x.dtype)


def int4_linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), dequantize_int4(q, scale, zero)).to(x.dtype)


# Native kernels (`native.py`, `csrc/tiled_linear.cpp`): float32 activations, weights decoded in registers, stored in
# tiles of two panels of P = 2 * lanes output rows (lanes: the build's floats per vector), each tile one stream.


def to_tiles(t: torch.Tensor, panel: int) -> torch.Tensor:
    """`[out, n, ...]` -> `[tiles, n, 2 panels, ..., P]`, rows past `out` zero."""
    pad = -t.shape[0] % (2 * panel)
    t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])]).unflatten(0, (-1, 2, panel))
    return t.movedim(2, -1).movedim(1, 2)


def tile_bytes(t: torch.Tensor) -> torch.Tensor:
    """`[tiles, n, ...]` -> uint8 `[tiles, n, bytes]`."""
    return t.contiguous().view(torch.uint8).flatten(2)


def pack_q4_tiles(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int,
                  lanes: int) -> torch.Tensor:
    """4-bit codes (uint8 `[out, in]` in [0, 15]) with a float32 scale and offset per row and group (`[out, in /
    group_size]`) as the native kernel reads them: uint8 `[tiles, groups, bytes]`, each group of a tile its panels'
    scales and offsets (float32 `[2][2][P]`) and then, input by input, their codes (`lanes` bytes per panel: row
    r's code in the low half, row lanes + r's in the high half)."""
    out_features, in_features = codes.shape
    panel = 2 * lanes
    pairs = to_tiles(torch.stack([scale.float(), offset.float()], dim=-1), panel)  # [tiles, groups, 2, 2, P]
    grouped = to_tiles(codes.reshape(out_features, in_features // group_size, group_size), panel).movedim(2, 3)
    packed = grouped[..., :lanes] | (grouped[..., lanes:] << 4)  # [tiles, groups, group_size, 2, lanes]
    return torch.cat([tile_bytes(pairs), tile_bytes(packed)], dim=-1).contiguous()


def pack_int8_native(q: torch.Tensor, scale: torch.Tensor, lanes: int) -> torch.Tensor:
    """The output of `quantize_int8` as the native kernel reads it (`csrc/tiled_linear.cpp`) in a build of
    `lanes`-float vectors: uint8 `[tiles, bytes]`, a tile being two panels of P = 2 * lanes output rows, its bytes
    the panels' scales (float32 `[2][P]`) and then, input by input, their codes (int8 `[in][2][P]`)."""
    scales = tile_bytes(to_tiles(scale.float()[:, None], 2 * lanes)).flatten(1)  # [tiles, 2 * P * 4]
    codes = tile_bytes(to_tiles(q, 2 * lanes)).flatten(1)  # [tiles, in * 2 * P]
    return torch.cat([scales, codes], dim=1)


def pack_int4_native(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, lanes: int) -> torch.Tensor:
    """The output of `quantize_int4` as the native kernel reads it: `pack_q4_tiles` with the scales and zeros
    rounded to bfloat16, the values PyTorch's int4 kernels take (codes stand for (q - 8) * scale + zero)."""
    group_size = q.shape[1] // scale.shape[1]
    return pack_q4_tiles(q, scale.to(KERNEL_DTYPE).float(), zero.to(KERNEL_DTYPE).float(), group_size, lanes)


def native_product(x: torch.Tensor, out_features: int, call: Callable[[int, int, int], object]) -> torch.Tensor:
    """The native products' calling convention: `call(x_ptr, out_ptr, threads)` writes `x`'s `[m, out_features]`
    product, in float32, from `x` as contiguous float32; it is not called for no rows. Returned in `x`'s dtype."""
    x32 = x.float().contiguous()
    out = x32.new_empty(x32.shape[0], out_features)
    if x32.shape[0]:
        call(x32.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out.to(x.dtype)


def int8_linear_native(lib, x: torch.Tensor, tiles: torch.Tensor, out_features: int) -> torch.Tensor:
    """`x [m, in] @ (q * scale)^T` on the native kernel, for a weight from `pack_int8_native`."""
    assert x.dim() == 2 and tiles.dim() == 2 and tiles.dtype == torch.uint8 and tiles.is_contiguous()
    m, k = x.shape
    panel = tiles.shape[1] // (2 * (4 + k))  # the build's, which packed them (per call: no query of the library)
    assert k % INT8_IN_MULTIPLE == 0 and tiles.shape == (-(-out_features // (2 * panel)), 2 * panel * (4 + k))
    return native_product(x, out_features, lambda x_ptr, out_ptr, threads: lib.specula_int8_linear(
        x_ptr, m, k, tiles.data_ptr(), out_features, out_ptr, threads))


def int4_linear_native(lib, x: torch.Tensor, tiles: torch.Tensor, group_size: int, out_features: int,
                       bias: int = 8) -> torch.Tensor:
    """`x [m, in] @ dequantized^T` on the native kernel, for a weight from `pack_q4_tiles`: codes stand for
    (q - bias) * scale + offset (bias 8 for Specula's int4 and GGUF's Q4_0, 0 for Q4_1)."""
    assert x.dim() == 2 and tiles.dim() == 3 and tiles.dtype == torch.uint8 and tiles.is_contiguous()
    m, k = x.shape
    lanes = tiles.shape[2] // (32 + 2 * group_size)  # the build's, which packed them
    assert k % group_size == 0 and tiles.shape == (-(-out_features // (4 * lanes)), k // group_size,
                                                  32 * lanes + 2 * lanes * group_size), tiles.shape
    return native_product(x, out_features, lambda x_ptr, out_ptr, threads: lib.specula_q4_linear(
        x_ptr, m, k, tiles.data_ptr(), bias, group_size, out_features, out_ptr, threads))


# int8 weights by int8 activations (`--quantize w8a8`, `csrc/w8a8_linear.cpp`): the weights are `quantize_int8`'s
# codes and row scales; each product quantizes its input per row and block of 32 inputs (GGUF's Q8_0 for
# activations, as llama.cpp's q8_0 products do) and sums integer products.

W8A8_BLOCK = 32  # inputs per activation scale
W8A8_TILE_ROWS = 16  # output rows per tile of the native layout


def quantize_activations_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float `[m, in]` -> (codes float32 `[m, blocks, 32]` in [-127, 127], scales float32 `[m, blocks]`): per row
    and block of 32 inputs (the last padded with zeros), scale = max |x| / 127 and code = round(x / scale), ties
    to even, computed as the kernel computes them (x times the scale's float32 inverse)."""
    m, k = x.shape
    blocks = -(-k // W8A8_BLOCK)
    padded = F.pad(x.float(), (0, blocks * W8A8_BLOCK - k)).view(m, blocks, W8A8_BLOCK)
    scale = padded.abs().amax(dim=-1) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return torch.round(padded * inverse[..., None]).clamp(-127, 127), scale


def w8a8_linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x [m, in]` by int8 codes `q [out, in]` with row scales `scale [out]`, with `x` quantized per block of 32:
    the definition the native kernel meets bit for bit (and the product where it is not built). Each block's sum
    of code products is an integer below 2**24, so float32 holds it exactly; the blocks are folded in order, one
    rounded product and one rounded sum each, then the row scale."""
    codes, x_scale = quantize_activations_q8(x)
    blocks = codes.shape[1]
    weights = F.pad(q.float(), (0, blocks * W8A8_BLOCK - q.shape[1])).view(q.shape[0], blocks, W8A8_BLOCK)
    sums = torch.einsum("mbk,nbk->mnb", codes, weights)  # [m, out, blocks]
    out = torch.zeros(x.shape[0], q.shape[0], device=x.device)
    for b in range(blocks):
        out = out + sums[:, :, b] * x_scale[:, b, None]
    return (out * scale.float()).to(x.dtype)


def pack_w8a8_native(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`quantize_int8`'s codes and scales as `csrc/w8a8_linear.cpp` reads them, on any instruction set: uint8
    `[tiles, bytes]`, a tile being 16 output rows, its bytes their scales (float32 `[16]`) and then, per group of
    four inputs, the rows' four codes (int8 `[in / 4][16][4]`); inputs padded to a multiple of 32, rows to 16."""
    out_features, in_features = q.shape
    rows, inputs = -out_features % W8A8_TILE_ROWS, -in_features % W8A8_BLOCK
    codes = F.pad(q, (0, inputs, 0, rows)).view(-1, W8A8_TILE_ROWS, (in_features + inputs) // 4, 4)
    codes = codes.transpose(1, 2).contiguous().view(torch.uint8).flatten(1)  # [tiles, in / 4 * 16 * 4]
    scales = F.pad(scale.float(), (0, rows)).view(-1, W8A8_TILE_ROWS).contiguous().view(torch.uint8)
    return torch.cat([scales, codes], dim=1).contiguous()


def w8a8_linear_native(lib, x: torch.Tensor, tiles: torch.Tensor, out_features: int) -> torch.Tensor:
    """`w8a8_linear_reference` on the native kernel, for a weight from `pack_w8a8_native`."""
    assert x.dim() == 2 and tiles.dim() == 2 and tiles.dtype == torch.uint8 and tiles.is_contiguous()
    m, k = x.shape
    padded = -(-k // W8A8_BLOCK) * W8A8_BLOCK
    assert tiles.shape == (-(-out_features // W8A8_TILE_ROWS), 4 * W8A8_TILE_ROWS + padded * W8A8_TILE_ROWS)
    return native_product(x, out_features, lambda x_ptr, out_ptr, threads: lib.specula_w8a8_linear(
        x_ptr, m, k, tiles.data_ptr(), out_features, out_ptr, threads))
