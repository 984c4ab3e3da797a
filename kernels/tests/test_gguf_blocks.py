"""GGUF's Q8_0, Q4_0 and Q4_1 blocks (`specula_kernels.gguf_blocks`): read back as the `gguf` package's reference
dequantizers read them, and multiplied on the native kernels with those very values, a row's result the same
bits whatever else shares its call."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from specula_kernels import native
from specula_kernels.gguf_blocks import NATIVE_TYPES, GGUFBlocks, gguf_linear_native

needs_native = pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")


def blocks(type_name: str, out_features: int, in_features: int, seed: int = 0) -> tuple[GGUFBlocks, np.ndarray]:
    """Random weights quantized by the `gguf` package (llama.cpp's reference), and their dequantized values."""
    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal((out_features, in_features)) * rng.uniform(0.01, 2.0, (out_features, 1)))
    raw = quantize(weights.astype(np.float32), GGMLQuantizationType[type_name])
    return GGUFBlocks(type_name, torch.from_numpy(raw), in_features), dequantize(raw, GGMLQuantizationType[type_name])


@pytest.mark.parametrize("type_name", NATIVE_TYPES)
def test_dequantized_values_are_the_reference_dequantizers_bits(type_name):
    ours, reference = blocks(type_name, 37, 128)
    assert ours.dequantize().dtype == torch.float32
    assert torch.equal(ours.dequantize(), torch.from_numpy(reference))


def test_rows_fuse_and_pad_with_zero_weights():
    a, _ = blocks("Q4_1", 5, 64, seed=1)
    b, _ = blocks("Q4_1", 3, 64, seed=2)
    fused = GGUFBlocks.cat([a, b])
    assert fused.shape == (8, 64)
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    padded = fused.pad_rows(2)
    assert torch.equal(padded.dequantize()[8:], torch.zeros(2, 64))
    with pytest.raises(ValueError, match="one type and one input width"):
        GGUFBlocks.cat([a, blocks("Q8_0", 3, 64)[0]])


def test_malformed_blocks_are_refused_by_what_is_wrong():
    good, _ = blocks("Q8_0", 4, 64)
    with pytest.raises(ValueError, match="Q8_0 rows of 64 inputs take 68 bytes, not 67"):
        GGUFBlocks("Q8_0", good.data[:, :67], 64)
    with pytest.raises(ValueError, match="Q4_K are not served natively"):
        GGUFBlocks("Q4_K", good.data, 64)


@needs_native
@pytest.mark.parametrize("type_name", NATIVE_TYPES)
@pytest.mark.parametrize("out_features,in_features", [(13, 64), (40, 64), (64, 576), (6, 1536)])
def test_products_use_the_files_values_and_a_row_is_the_same_bits_in_any_batch(type_name, out_features,
                                                                               in_features):
    lib = native.library()
    weight, reference = blocks(type_name, out_features, in_features)
    tiles = weight.pack_native(lib.specula_vector_lanes())
    x = torch.randn(200, in_features, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([gguf_linear_native(lib, x[i:i + 1], type_name, tiles, out_features)
                       for i in range(len(x))])
    expected = x.double() @ torch.from_numpy(reference).double().T
    # float32 sums of `in_features` products in the kernel's order, against a float64 sum
    bound = 4 * in_features * torch.finfo(torch.float32).eps * (x.abs().double() @ expected.new_tensor(
        np.abs(reference)).T)
    assert ((alone.double() - expected).abs() <= bound + 1e-30).all()
    for rows in (2, 3, 4, 5, 70, 200):  # register blocks of every size, and the buffered passes for many rows
        assert torch.equal(gguf_linear_native(lib, x[:rows], type_name, tiles, out_features),
                           alone[:rows])
    assert gguf_linear_native(lib, x[:0], type_name, tiles, out_features).shape == (0, out_features)
    assert gguf_linear_native(lib, x[:2].bfloat16(), type_name, tiles, out_features).dtype == torch.bfloat16
