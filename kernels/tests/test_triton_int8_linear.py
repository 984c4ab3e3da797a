"""The Triton int8 product (`triton_int8_linear`) against the float32 reference (`int8_linear_reference`).

Runs as the Triton attention tests do: under Triton's interpreter on CPU tensors (in a subprocess,
`test_triton_interpreter`), on CUDA when a GPU is present (`-m cuda`), and compiled for GPU targets without one.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from specula_kernels import triton_int8_linear as kernel_module
from specula_kernels.quantized_linear import int8_linear_reference, quantize_int8
from specula_kernels.sgmv import triton_available
from specula_kernels.triton_int8_linear import int8_linear_triton
from specula_testing.triton import run_interpreted

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_DEVICE = "cpu" if INTERPRETED else "cuda"

needs_triton_device = pytest.mark.skipif(
    not triton_available() or not (INTERPRETED or torch.cuda.is_available()),
    reason="needs triton and CUDA, or TRITON_INTERPRET=1 (test_triton_interpreter runs these in a subprocess)")


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The product of the bfloat16-rounded activations (what every int8 kernel multiplies), in float32."""
    return int8_linear_reference(x.cpu().to(torch.bfloat16).float(), q.cpu(), scale.cpu().float())


@pytest.mark.cuda
@needs_triton_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 96, 256), (5, 40, 200), (33, 70, 144)])  # edges of every tile
def test_triton_case_matches_reference(m, n, k, dtype):
    gen = torch.Generator().manual_seed(m * n + k)
    q, scale = quantize_int8(torch.randn(n, k, generator=gen))
    x = torch.randn(m, k, generator=gen).to(dtype)
    out = int8_linear_triton(x.to(TRITON_DEVICE), q.to(TRITON_DEVICE), scale.to(torch.bfloat16).to(TRITON_DEVICE))
    assert out.shape == (m, n) and out.dtype == dtype
    expected = reference(x, q, scale)
    # float32 sums in another order; a bfloat16 output is rounded once more
    tolerance = dict(rtol=1e-4, atol=1e-3) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(out.cpu().float(), expected, **tolerance)


@pytest.mark.cuda
@needs_triton_device
@pytest.mark.parametrize("split", [2, 3])
def test_triton_case_split_inputs_match_reference(split):
    """The inputs shared among `split` programs (the last one's share shorter, not a whole number of blocks):
    the same product, and the same from one call to the next."""
    gen = torch.Generator().manual_seed(split)
    m, n, k = 20, 48, 3 * 128 + 40
    q, scale = quantize_int8(torch.randn(n, k, generator=gen))
    x = torch.randn(m, k, generator=gen)
    args = (x.to(TRITON_DEVICE), q.to(TRITON_DEVICE), scale.to(TRITON_DEVICE))
    out = int8_linear_triton(*args, split_k=split)
    torch.testing.assert_close(out.cpu(), reference(x, q, scale), rtol=1e-4, atol=1e-3)
    assert torch.equal(int8_linear_triton(*args, split_k=split), out)
    torch.testing.assert_close(out, int8_linear_triton(*args, split_k=1), rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@needs_triton_device
def test_triton_case_strided_rows_and_no_rows():
    gen = torch.Generator().manual_seed(1)
    q, scale = quantize_int8(torch.randn(48, 64, generator=gen))
    wide = torch.randn(3, 128, generator=gen)
    x = wide[:, ::2]  # not contiguous in the inputs
    out = int8_linear_triton(x.to(TRITON_DEVICE), q.to(TRITON_DEVICE), scale.to(TRITON_DEVICE))
    torch.testing.assert_close(out.cpu(), reference(x, q, scale), rtol=1e-4, atol=1e-3)
    empty = int8_linear_triton(x[:0].to(TRITON_DEVICE), q.to(TRITON_DEVICE), scale.to(TRITON_DEVICE))
    assert empty.shape == (0, 48)


@pytest.mark.parametrize("args,message", [
    (dict(x=torch.zeros(2, 3, 4)), "x must be [m, in]"),
    (dict(q=torch.zeros(8, 16)), "q must be int8"),
    (dict(q=torch.zeros(8, 12, dtype=torch.int8)), "q must be int8 [out, in=16]"),
    (dict(scale=torch.zeros(7)), "scale must be float [out=8]"),
])
def test_bad_inputs_are_named(args, message):
    if not triton_available():
        pytest.skip("triton is not installed")
    call = dict(x=torch.zeros(2, 16), q=torch.zeros(8, 16, dtype=torch.int8), scale=torch.ones(8)) | args
    with pytest.raises(ValueError, match=re.escape(message)):
        int8_linear_triton(**call)


def test_cpu_activations_are_not_served():
    assert not kernel_module.supports(torch.zeros(1, 16))


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.skipif(INTERPRETED, reason="this test starts the interpreter itself")
def test_triton_interpreter():
    """Runs the `test_triton_case*` tests above on CPU tensors under the interpreter."""
    run_interpreted(__file__, 9, timeout=600)  # every case ran, none skipped


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
@pytest.mark.parametrize("dtype,block_m,block_n,arch,split", [
    ("bf16", 16, 32, 80, False), ("fp32", 64, 64, 80, True), ("bf16", 16, 32, 90, True), ("fp16", 32, 32, 90, False)])
def test_kernel_compiles_for_a_gpu(dtype, block_m, block_n, arch, split):
    """Compiles for sm_80 and sm_90 without a GPU: the type checks and lowering the interpreter skips."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = kernel_module._kernel()
    out = "*fp32" if split else f"*{dtype}"  # a split writes its shares to a float32 workspace
    signature = {"x_ptr": f"*{dtype}", "q_ptr": "*i8", "scale_ptr": "*bf16", "out_ptr": out}
    signature |= {name: "i32" for name in ("m", "n", "k", "k_per_split", "stride_xm", "stride_qn", "stride_om",
                                           "stride_split")}
    constexprs = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": 128, "UPCAST": False, "SPLIT": split}
    signature |= {name: "constexpr" for name in constexprs}
    assert list(signature) == kernel.arg_names, kernel.arg_names
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", arch, 32))
    assert "int8_linear_kernel" in compiled.asm["ptx"] and "mma" in compiled.asm["ptx"]  # on the tensor cores
