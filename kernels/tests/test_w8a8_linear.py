"""int8 weights by int8 activations (`--quantize w8a8`): the activation codes, the PyTorch definition against an
independent float64 computation, the native kernel against that definition bit for bit (on AVX-512 VNNI and, by
`test_native_build.py`, on AVX2), and the error against the float product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specula_kernels.quantized_linear import (
    dequantize_int8,
    pack_w8a8_native,
    quantize_activations_q8,
    quantize_int8,
    w8a8_linear_native,
    w8a8_linear_reference,
)


def _weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen) / in_features**0.5


def _inputs(rows: int, in_features: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed)) * 3


def _library():
    from specula_kernels import native

    lib = native.library()
    if lib is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    return lib


def test_activation_codes_lie_within_half_a_step_and_use_the_whole_range():
    x = _inputs(5, 100)  # three whole blocks of 32 and one of 4
    codes, scale = quantize_activations_q8(x)
    assert codes.shape == (5, 4, 32) and scale.shape == (5, 4)
    assert codes.abs().max() <= 127 and torch.equal(codes, codes.round())
    blocks = F.pad(x, (0, 28)).view(5, 4, 32)
    assert torch.allclose(blocks.abs().amax(-1), scale * 127, rtol=1e-6)
    assert (codes.abs().amax(-1) == 127).all()  # each block's largest value maps to +-127
    assert ((codes * scale[..., None] - blocks).abs() <= scale[..., None] / 2 * (1 + 1e-5)).all()
    assert (codes[:, -1, 4:] == 0).all()  # the padding


def test_a_block_of_zeros_has_scale_zero_and_codes_zero():
    x = torch.zeros(1, 64)
    x[0, 40] = 2.0
    codes, scale = quantize_activations_q8(x)
    assert scale[0, 0] == 0 and (codes[0, 0] == 0).all()
    assert codes[0, 1, 8] == 127 and scale[0, 1] == pytest.approx(2 / 127)


def test_the_reference_is_the_sum_of_integer_products_by_the_scales():
    """Against float64 arithmetic on the same codes: the reference's only roundings are float32 ones."""
    q, scale = quantize_int8(_weight(24, 96))
    x = _inputs(3, 96)
    codes, x_scale = quantize_activations_q8(x)
    exact = (codes * x_scale[..., None]).flatten(1).double() @ q.double().T * scale.double()
    torch.testing.assert_close(w8a8_linear_reference(x, q, scale).double(), exact, rtol=1e-6, atol=1e-6)


# W8A8's error against the float product is int8's weight rounding (0.7% rms for Gaussian weights,
# test_quantized_linear.py) plus the activations' (a step of max |x| / 127 over 32 Gaussian inputs: ~0.7% again).
def test_error_against_the_float_product_stays_within_stated_tolerance():
    weight, x = _weight(256, 512), _inputs(8, 512)
    want = F.linear(x, weight)
    q, scale = quantize_int8(weight)
    weights_only = F.linear(x, dequantize_int8(q, scale))
    got = w8a8_linear_reference(x, q, scale)
    error = float((got - want).norm() / want.norm())
    assert error < 0.015
    assert float((weights_only - want).norm() / want.norm()) < error  # the activations' rounding adds to it


# rows: none, one, a few, past one pass of four, many; inputs not a multiple of 32; outputs not a multiple of 16
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 9, 70, 200])
@pytest.mark.parametrize("out_features,in_features", [(52, 96), (61, 100), (33, 1536)])
def test_native_kernel_is_the_reference_bit_for_bit(rows, out_features, in_features):
    lib = _library()
    q, scale = quantize_int8(_weight(out_features, in_features))
    x = _inputs(rows, in_features)
    got = w8a8_linear_native(lib, x, pack_w8a8_native(q, scale), out_features)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    assert torch.equal(got, w8a8_linear_reference(x, q, scale))


def test_a_rows_result_is_the_same_bits_in_any_batch():
    lib = _library()
    tiles = pack_w8a8_native(*quantize_int8(_weight(70, 256)))
    x = _inputs(75, 256)
    whole = w8a8_linear_native(lib, x, tiles, 70)
    for start, stop in [(0, 1), (5, 6), (3, 10), (60, 75), (0, 64), (2, 5)]:
        assert torch.equal(w8a8_linear_native(lib, x[start:stop], tiles, 70), whole[start:stop]), (start, stop)


def test_a_row_that_is_not_finite_gives_outputs_that_are_not_and_leaves_the_others():
    lib = _library()
    q, scale = quantize_int8(_weight(20, 64))
    tiles = pack_w8a8_native(q, scale)
    x = _inputs(3, 64)
    x[1, 5], x[2, 40] = float("nan"), float("inf")
    got = w8a8_linear_native(lib, x, tiles, 20)
    assert torch.isnan(got[1]).all() and not torch.isfinite(got[2]).any()
    assert torch.equal(got[0], w8a8_linear_reference(x[:1], q, scale)[0])


def test_the_native_kernel_keeps_the_callers_dtype():
    lib = _library()
    q, scale = quantize_int8(_weight(16, 64))
    x = _inputs(3, 64).to(torch.bfloat16)
    got = w8a8_linear_native(lib, x, pack_w8a8_native(q, scale), 16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, w8a8_linear_reference(x.float(), q, scale).to(torch.bfloat16))
