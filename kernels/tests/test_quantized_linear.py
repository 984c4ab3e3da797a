"""The int8 and int4 weight-only kernels against their dequantize-then-multiply references, and the formats'
own error bounds against the float weights."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specula_kernels.quantized_linear import (
    KERNEL_DTYPE,
    dequantize_int4,
    dequantize_int8,
    int4_linear,
    int4_linear_native,
    int4_linear_reference,
    int8_linear,
    int8_linear_native,
    int8_linear_reference,
    pack_int4,
    pack_int4_native,
    pack_int8_native,
    quantize_int4,
    quantize_int8,
)

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                 reason="needs CUDA")])]


def _weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen) / in_features**0.5


def _inputs(rows: int, in_features: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed))


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def test_int8_values_lie_within_half_a_step_of_the_weights():
    weight = _weight(48, 64)
    weight[3] = 0.0  # a row of zeros must not divide by zero
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and scale[3] == 1
    assert torch.equal(scale, scale.to(KERNEL_DTYPE).float())  # the kernel's scales are the quantizer's
    error = (dequantize_int8(q, scale) - weight).abs()
    assert torch.all(error <= scale[:, None] / 2 * (1 + 1e-3) + 1e-7)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_values_lie_within_half_a_step_of_the_weights(group_size):
    weight = _weight(48, 256)
    weight[5, :group_size] = 0.7  # a constant group: zero range
    q, scale, zero = quantize_int4(weight, group_size)
    assert q.dtype == torch.uint8 and q.max() <= 15 and scale.shape == (48, 256 // group_size)
    error = (dequantize_int4(q, scale, zero) - weight).abs()
    step = scale.repeat_interleave(group_size, dim=1)
    # Half a step, plus the bfloat16 rounding of the zero (at most 2^-9 of it) that rounding q cannot absorb.
    slack = zero.abs().repeat_interleave(group_size, dim=1) * 2**-8
    assert torch.all(error <= step / 2 + slack + 1e-6)
    assert error[5, :group_size].max() < 1e-2


def test_int4_rejects_groups_the_kernels_do_not_take():
    with pytest.raises(ValueError, match="int4 groups of 16"):
        quantize_int4(_weight(16, 64), 16)
    with pytest.raises(ValueError, match="int4 groups of 64 do not fit 96 inputs"):
        quantize_int4(_weight(16, 96), 64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [0, 1, 3, 17, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kernel_matches_reference(device, rows, dtype):
    weight = _weight(80, 128)
    q, scale = quantize_int8(weight)
    x = _inputs(rows, 128).to(dtype)
    got = int8_linear(x.to(device), q.to(device), scale.to(KERNEL_DTYPE).to(device)).cpu()
    assert got.dtype == dtype and got.shape == (rows, 80)
    # The kernel multiplies bfloat16-rounded inputs and rounds its output to bfloat16: within 2^-8 of the
    # reference on the same rounded inputs, elementwise, relative to the output's scale.
    want = int8_linear_reference(x.to(KERNEL_DTYPE).float(), q, scale)
    if rows:
        torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=2**-8 * float(want.abs().max()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [0, 1, 3, 17, 70])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("out_features", [64, 40])  # 40: padded to whole 16-row blocks and cut back
def test_int4_kernel_matches_reference(device, rows, group_size, out_features):
    weight = _weight(out_features, 256)
    q, scale, zero = quantize_int4(weight, group_size)
    packed, scales_and_zeros = pack_int4(q.to(device), scale.to(device), zero.to(device))
    x = _inputs(rows, 256)
    got = int4_linear(x.to(device), packed, scales_and_zeros, group_size, out_features).cpu()
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    want = int4_linear_reference(x.to(KERNEL_DTYPE).float(), q, scale, zero)
    if rows:
        torch.testing.assert_close(got, want, rtol=2**-8, atol=2**-8 * float(want.abs().max()))


# Output error of the whole path (rounding of weights and of the bfloat16 input and output) against the float
# product, for Gaussian weights (the worst case for a min/max grid: rare large values stretch every step).
# A rounding error is uniform within half a step, so its rms is step / sqrt(12): int8's step max|w| / 127 ~
# w_rms / 40 gives 0.7% (0.8% measured with the bfloat16 rounding); int4's (max - min) / 15 ~ w_rms / 3.7 over
# 32 inputs gives 7.7% (8.0% measured), over 128 inputs 10.1% measured.
TOLERANCE = {"int8": 0.01, "int4-32": 0.10, "int4-128": 0.12}


def test_quantized_products_stay_within_stated_tolerance_of_float():
    weight, x = _weight(256, 512), _inputs(8, 512)
    want = F.linear(x, weight)
    q, scale = quantize_int8(weight)
    errors = {"int8": _relative_error(int8_linear(x, q, scale.to(KERNEL_DTYPE)), want)}
    for group_size in (32, 128):
        q4, s4, z4 = quantize_int4(weight, group_size)
        packed, scales_and_zeros = pack_int4(q4, s4, z4)
        errors[f"int4-{group_size}"] = _relative_error(int4_linear(x, packed, scales_and_zeros, group_size, 256), want)
    assert all(errors[k] < TOLERANCE[k] for k in TOLERANCE), errors
    assert errors["int4-32"] < errors["int4-128"]  # smaller groups, finer steps


def test_a_rows_result_does_not_depend_on_the_other_rows():
    """Speculative verification multiplies several rows where plain decoding multiplies one: both must agree."""
    weight, x = _weight(64, 128), _inputs(9, 128)
    q, scale = quantize_int8(weight)
    q4, s4, z4 = quantize_int4(weight, 32)
    packed, scales_and_zeros = pack_int4(q4, s4, z4)
    products = [lambda rows: int8_linear(rows, q, scale.to(KERNEL_DTYPE)),
                lambda rows: int4_linear(rows, packed, scales_and_zeros, 32, 64)]
    for product in products:
        together = product(x)
        assert all(torch.equal(product(x[i : i + 1]), together[i : i + 1]) for i in range(9))


def test_int8_kernel_refuses_widths_it_cannot_read():
    q, scale = quantize_int8(_weight(16, 40))
    with pytest.raises(AssertionError):
        int8_linear(_inputs(1, 40), q, scale.to(KERNEL_DTYPE))


# The native kernels (`specula_kernels.native`): float32 activations, so they match the float32 reference to
# float32 rounding, where PyTorch's kernels round their input and output to bfloat16.

def _native_library():
    from specula_kernels import native

    lib = native.library()
    if lib is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    return lib


# rows: one, a few, past the register-decoded rows, past one pass (96 rows); outputs not a multiple of a tile
@pytest.mark.parametrize("rows", [0, 1, 3, 4, 9, 70, 200])
@pytest.mark.parametrize("out_features", [52, 61])
def test_native_int8_kernel_matches_reference(rows, out_features):
    lib = _native_library()
    q, scale = quantize_int8(_weight(out_features, 96))
    x = _inputs(rows, 96)
    got = int8_linear_native(lib, x, pack_int8_native(q, scale, lib.specula_vector_lanes()), out_features)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got, int8_linear_reference(x, q, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 67, 200])
@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
def test_native_int4_kernel_matches_reference(rows, group_size):
    lib = _native_library()
    q, scale, zero = quantize_int4(_weight(37, 512), group_size)
    x = _inputs(rows, 512)
    got = int4_linear_native(lib, x, pack_int4_native(q, scale, zero, lib.specula_vector_lanes()), group_size, 37)
    assert got.shape == (rows, 37)
    torch.testing.assert_close(got, int4_linear_reference(x, q, scale, zero), rtol=1e-5, atol=1e-5)


def test_native_kernels_keep_the_callers_dtype():
    lib = _native_library()
    q, scale = quantize_int8(_weight(16, 64))
    x = _inputs(3, 64).to(torch.bfloat16)
    got = int8_linear_native(lib, x, pack_int8_native(q, scale, lib.specula_vector_lanes()), 16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, int8_linear_reference(x.float(), q, scale).to(torch.bfloat16))


def test_a_rows_native_result_is_the_same_bits_in_any_batch():
    """Every output is one fixed-order sum, so a verified draft row equals the decode row it stands for."""
    lib = _native_library()
    tiles = pack_int8_native(*quantize_int8(_weight(70, 256)), lib.specula_vector_lanes())
    tiles4 = pack_int4_native(*quantize_int4(_weight(70, 256), 64), lib.specula_vector_lanes())
    x = _inputs(75, 256)
    for product in (lambda t: int8_linear_native(lib, t, tiles, 70),
                    lambda t: int4_linear_native(lib, t, tiles4, 64, 70)):
        whole = product(x)
        for start, stop in [(0, 1), (5, 6), (3, 10), (60, 75), (0, 64), (2, 5)]:
            assert torch.equal(product(x[start:stop]), whole[start:stop]), (start, stop)


def test_native_kernels_can_be_turned_off(monkeypatch):
    from specula_kernels import native

    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_reason", None)
    monkeypatch.setenv("SPECULA_NATIVE_KERNELS", "0")
    assert native.library() is None
    assert native.unavailable_reason() == "disabled by SPECULA_NATIVE_KERNELS"


def test_a_failing_build_leaves_the_pytorch_kernels_with_the_reason(monkeypatch, tmp_path):
    from specula_kernels import native

    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_reason", None)  # restored after, with the others: later tests see the real one
    monkeypatch.setenv("SPECULA_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "false-compiler"))
    (tmp_path / "false-compiler").write_text('#!/bin/sh\n[ "$1" = --version ] && { echo fake 1.0; exit 0; }\n'
                                             "echo 'error: no such thing' >&2\nexit 1\n")
    (tmp_path / "false-compiler").chmod(0o755)
    assert native.library() is None
    assert "false-compiler failed: error: no such thing" in native.unavailable_reason()
    assert not list(tmp_path.glob("*.so"))


def test_the_kernels_build_in_a_temporary_directory_without_a_writable_home(monkeypatch, tmp_path):
    from specula_kernels import native

    home = tmp_path / "home"
    cache = home / ".cache" / "specula" / "kernels"
    monkeypatch.delenv("SPECULA_KERNEL_CACHE", raising=False)
    monkeypatch.setattr(native.Path, "home", staticmethod(lambda: home))
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path))
    real_access = os.access
    # as a container user whose home cannot be written (the check itself: root may write anywhere)
    monkeypatch.setattr(native.os, "access", lambda path, mode: Path(path) != cache and real_access(path, mode))
    assert native._cache_dir() == tmp_path / f"specula-kernels-{os.getuid()}"
    monkeypatch.setattr(native.os, "access", real_access)
    assert native._cache_dir() == cache


def test_a_kernel_cache_the_user_named_must_be_writable(monkeypatch, tmp_path):
    from specula_kernels import native

    monkeypatch.setenv("SPECULA_KERNEL_CACHE", str(tmp_path / "file" / "below"))
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(RuntimeError, match="cannot be written"):
        native._cache_dir()
