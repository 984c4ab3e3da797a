"""The packed linear kernel against `F.linear`."""

from __future__ import annotations

import pytest
import torch

from specula_kernels.linear import (
    default_num_parts,
    linear,
    linear_reference,
    onednn_linear,
    onednn_pack,
    onednn_supports,
    pack_panels,
    pack_weight,
    panel_linear,
    panels_supported,
    unpack_panels,
    unpack_weight,
)


@pytest.mark.parametrize("num_parts", [1, 2, 4])
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_reference(num_parts, rows, with_bias):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 48, generator=gen)
    bias = torch.randn(64, generator=gen) if with_bias else None
    x = torch.randn(rows, 48, generator=gen)
    packed = pack_weight(weight, num_parts)
    assert packed.shape == (num_parts, 48, 64 // num_parts) and packed.is_contiguous()
    torch.testing.assert_close(linear(x, packed, bias), linear_reference(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert torch.equal(unpack_weight(packed), weight)


def test_pack_rejects_uneven_split():
    with pytest.raises(ValueError, match="cannot split 10 output features into 4"):
        pack_weight(torch.zeros(10, 4), 4)


def test_default_parts_follow_threads_on_cpu_only():
    threads = torch.get_num_threads()
    assert default_num_parts(threads * 8, torch.device("cpu")) == threads
    assert default_num_parts(threads * 8 + 1, torch.device("cpu")) in (1, threads)
    assert default_num_parts(64, torch.device("cuda")) == 1


def test_shape_and_dtype_checks():
    packed = pack_weight(torch.zeros(8, 4), 2)
    with pytest.raises(AssertionError):
        linear(torch.zeros(2, 5), packed)
    with pytest.raises(AssertionError):
        linear(torch.zeros(2, 4, dtype=torch.float64), packed)


@pytest.mark.skipif(not onednn_supports(torch.float32, torch.device("cpu")), reason="PyTorch built without oneDNN")
@pytest.mark.parametrize("rows", [1, 3, 17, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_linear_matches_reference(rows, with_bias):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 64, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 64, generator=gen)
    packed = onednn_pack(weight)  # packed once, for any row count
    torch.testing.assert_close(onednn_linear(x, packed, bias), linear_reference(x, weight, bias), rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError):
        onednn_linear(torch.zeros(2, 65), packed)


@pytest.mark.skipif(not onednn_supports(torch.bfloat16, torch.device("cpu")),
                    reason="oneDNN has no native bfloat16 kernels on this CPU")
def test_onednn_bfloat16_linear_is_the_product_rounded_once():
    """bfloat16 in and out: the float32 product of the same bfloat16 values, rounded to bfloat16 at the end."""
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(256, 128, generator=gen) * 0.05).bfloat16()
    x = torch.randn(9, 128, generator=gen).bfloat16()
    out = onednn_linear(x, onednn_pack(weight))
    assert out.dtype == torch.bfloat16
    reference = linear_reference(x.float(), weight.float())
    torch.testing.assert_close(out.float(), reference, rtol=2**-7, atol=1e-3)


def test_onednn_is_only_for_cpu_float32_and_native_bfloat16():
    assert not onednn_supports(torch.float32, torch.device("cuda"))
    assert not onednn_supports(torch.float16, torch.device("cpu"))


needs_panels = pytest.mark.skipif(not panels_supported(torch.float32, torch.device("cpu")),
                                  reason="native kernels unavailable here")


@needs_panels
@pytest.mark.parametrize("out_features", [16, 37, 100])  # a whole panel, and partial last panels
# register blocks, their tails, past one pass of 96 rows, a prompt's several passes and a partial one
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 13, 97, 191, 200, 450])
@pytest.mark.parametrize("in_features", [72, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_linear_matches_reference(out_features, rows, in_features, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    x = torch.randn(rows, in_features, generator=gen)
    panels = pack_panels(weight)
    assert torch.equal(unpack_panels(panels, out_features), weight)
    got = panel_linear(x, panels, out_features, bias)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got, linear_reference(x, weight, bias), rtol=1e-5, atol=1e-5)


@needs_panels
def test_a_rows_panel_result_is_the_same_bits_in_any_batch():
    """One sum over the inputs in order per output: a verified draft row equals the decode row it stands for."""
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(70, 300, generator=gen), torch.randn(450, 300, generator=gen)
    bias = torch.randn(70, generator=gen)
    panels = pack_panels(weight)
    for b in (None, bias):
        whole = panel_linear(x, panels, 70, b)  # a prompt's rows, in passes of 96
        for start, stop in [(0, 1), (5, 6), (3, 10), (60, 75), (0, 96), (90, 150), (0, 191), (200, 392), (7, 450)]:
            assert torch.equal(panel_linear(x[start:stop], panels, 70, b), whole[start:stop]), (start, stop)
    # a strided view of the rows (a slice of a wider tensor) gives the same bits as the rows alone
    wide = torch.cat([x, torch.randn(450, 8, generator=gen)], dim=1)[:, :300]
    assert torch.equal(panel_linear(wide, panels, 70), panel_linear(x, panels, 70))


@needs_panels
def test_dense_float32_layers_use_the_panels():
    from specula_server.layers.quantization import DenseLinear

    weight = torch.randn(40, 32)
    layer = DenseLinear(weight)
    assert layer.kind == "panels"
    x = torch.randn(3, 32)
    torch.testing.assert_close(layer(x), linear_reference(x, weight), rtol=1e-5, atol=1e-5)
