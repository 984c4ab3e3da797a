"""SGMV and the LoRA delta built from it, against per-row loops and explicit per-segment math.

The Triton kernel runs three ways: under Triton's interpreter on CPU tensors, in a subprocess because the
interpreter is chosen when a kernel is built (`test_triton_interpreter` runs this file's `test_triton_case*`
tests with `TRITON_INTERPRET=1`); on CUDA when a GPU is present; and compiled for a GPU target without one,
which catches what the interpreter does not type-check.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from specula_kernels import sgmv as sgmv_module
from specula_kernels.sgmv import add_lora, segments_from_slots, sgmv, sgmv_reference, sgmv_triton, triton_available
from specula_testing.triton import run_interpreted

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TOLERANCES = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
              torch.float16: dict(rtol=2e-3, atol=2e-3)}


def naive_sgmv(x, weight, seg_starts, seg_slots) -> torch.Tensor:
    """One row at a time, straight from the definition."""
    out = torch.zeros(x.shape[0], weight.shape[2], dtype=x.dtype)
    for s, slot in enumerate(seg_slots.tolist()):
        for row in range(int(seg_starts[s]), int(seg_starts[s + 1])):
            if slot >= 0:
                out[row] = (x[row].float() @ weight[slot].float()).to(x.dtype)
    return out


def random_segments(gen, n, num_segments, num_slots, index_dtype=torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """Random cut points (repeats make empty segments) and slots in [-1, num_slots)."""
    cuts = torch.randint(0, n + 1, (num_segments - 1,), generator=gen).sort().values
    seg_starts = torch.cat([torch.tensor([0]), cuts, torch.tensor([n])]).to(index_dtype)
    seg_slots = torch.randint(-1, num_slots, (num_segments,), generator=gen).to(index_dtype)
    return seg_starts, seg_slots


def random_inputs(gen, n, d_in, d_out, num_slots, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, d_in, generator=gen).to(dtype)
    weight = (torch.randn(num_slots, d_in, d_out, generator=gen) / d_in**0.5).to(dtype)
    return x, weight


# --- reference -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n,num_segments,num_slots,d_in,d_out", [
    (1, 1, 1, 8, 4),  # one decode token
    (37, 6, 3, 24, 8),  # shrink-like
    (64, 20, 8, 16, 40),  # many slots, many empty segments
    (5, 9, 2, 12, 12),  # more segments than rows
    (200, 3, 4, 64, 96),  # long prefill segments
])
def test_reference_matches_per_row_loop(dtype, index_dtype, n, num_segments, num_slots, d_in, d_out):
    gen = torch.Generator().manual_seed(n * 1000 + num_segments)
    x, weight = random_inputs(gen, n, d_in, d_out, num_slots, dtype)
    seg_starts, seg_slots = random_segments(gen, n, num_segments, num_slots, index_dtype)
    out = sgmv_reference(x, weight, seg_starts, seg_slots)
    assert out.shape == (n, d_out) and out.dtype == dtype
    torch.testing.assert_close(out, naive_sgmv(x, weight, seg_starts, seg_slots), **TOLERANCES[dtype])
    torch.testing.assert_close(sgmv(x, weight, seg_starts, seg_slots), out, rtol=0, atol=0)  # CPU: the reference


def test_one_segment_for_the_whole_batch_and_no_adapter_at_all():
    gen = torch.Generator().manual_seed(3)
    x, weight = random_inputs(gen, 9, 16, 8, 2, torch.float32)
    whole = sgmv(x, weight, torch.tensor([0, 9]), torch.tensor([1]))
    torch.testing.assert_close(whole, x @ weight[1])
    none = sgmv(x, weight, torch.tensor([0, 4, 9]), torch.tensor([-1, -1]))
    assert torch.equal(none, torch.zeros(9, 8))
    empty = sgmv(torch.zeros(0, 16), weight, torch.tensor([0]), torch.tensor([], dtype=torch.long))
    assert empty.shape == (0, 8)


def test_one_slot_in_separated_segments_is_gathered():
    """Slot 0 appears in segments 0 and 2, around a segment of slot 1."""
    gen = torch.Generator().manual_seed(4)
    x, weight = random_inputs(gen, 7, 8, 5, 2, torch.float32)
    out = sgmv(x, weight, torch.tensor([0, 2, 5, 7]), torch.tensor([0, 1, 0]))
    expected = torch.cat([x[:2] @ weight[0], x[2:5] @ weight[1], x[5:] @ weight[0]])
    torch.testing.assert_close(out, expected)


# --- add_lora ------------------------------------------------------------------------------------------------


def lora_inputs(gen, n, d_in, d_out, ranks, dtype):
    """Stacks with rank `ranks[slot]` zero-padded to the largest."""
    r_max = max(ranks)
    lora_a = torch.zeros(len(ranks), d_in, r_max)
    lora_b = torch.zeros(len(ranks), r_max, d_out)
    for slot, r in enumerate(ranks):
        lora_a[slot, :, :r] = torch.randn(d_in, r, generator=gen) / d_in**0.5
        lora_b[slot, :r] = torch.randn(r, d_out, generator=gen) / r**0.5
    x = torch.randn(n, d_in, generator=gen)
    y = torch.randn(n, d_out, generator=gen)
    return x.to(dtype), y.to(dtype), lora_a.to(dtype), lora_b.to(dtype)


def per_segment_lora(y, x, lora_a, lora_b, seg_starts, seg_slots) -> torch.Tensor:
    out = y.clone()
    for s, slot in enumerate(seg_slots.tolist()):
        rows = slice(int(seg_starts[s]), int(seg_starts[s + 1]))
        if slot >= 0:
            shrunk = (x[rows].float() @ lora_a[slot].float()).to(x.dtype)  # the intermediate is in x's dtype
            out[rows] += (shrunk.float() @ lora_b[slot].float()).to(x.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_lora_matches_per_segment_math(dtype):
    gen = torch.Generator().manual_seed(5)
    x, y, lora_a, lora_b = lora_inputs(gen, 30, 48, 64, ranks=[8, 16, 4], dtype=dtype)
    seg_starts = torch.tensor([0, 4, 4, 11, 12, 30], dtype=torch.int32)
    seg_slots = torch.tensor([1, 0, -1, 2, 1], dtype=torch.int32)
    expected = per_segment_lora(y, x, lora_a, lora_b, seg_starts, seg_slots)
    before = y.clone()
    result = add_lora(y, x, lora_a, lora_b, seg_starts, seg_slots)
    assert result is y  # in place
    torch.testing.assert_close(y, expected, **TOLERANCES[dtype])
    assert torch.equal(y[4:11], before[4:11])  # the slot -1 rows are untouched


def test_add_lora_writes_through_a_column_view():
    """The model adds each projection's delta into its columns of a fused output."""
    gen = torch.Generator().manual_seed(6)
    x, _, lora_a, lora_b = lora_inputs(gen, 6, 16, 8, ranks=[4], dtype=torch.float32)
    fused = torch.zeros(6, 24)
    add_lora(fused[:, 8:16], x, lora_a, lora_b, torch.tensor([0, 6]), torch.tensor([0]))
    torch.testing.assert_close(fused[:, 8:16], x @ lora_a[0] @ lora_b[0])
    assert not fused[:, :8].any() and not fused[:, 16:].any()


def test_add_lora_checks_stack_shapes():
    x, y = torch.zeros(3, 8), torch.zeros(3, 5)
    starts, slots = torch.tensor([0, 3]), torch.tensor([0])
    with pytest.raises(ValueError, match="lora_a"):
        add_lora(y, x, torch.zeros(2, 8, 4), torch.zeros(2, 6, 5), starts, slots)  # r_max differs
    with pytest.raises(ValueError, match="y is"):
        add_lora(torch.zeros(3, 6), x, torch.zeros(2, 8, 4), torch.zeros(2, 4, 5), starts, slots)


# --- segments_from_slots -------------------------------------------------------------------------------------


@pytest.mark.parametrize("slots,starts,seg_slots", [
    ([1, 1, -1, 0, 0, 1], [0, 2, 3, 5, 6], [1, -1, 0, 1]),
    ([3], [0, 1], [3]),
    ([-1, -1, -1], [0, 3], [-1]),
    ([0, 1, 0, 1], [0, 1, 2, 3, 4], [0, 1, 0, 1]),
    ([], [0], []),
])
def test_segments_from_slots(slots, starts, seg_slots):
    for dtype in (torch.int32, torch.int64):
        got_starts, got_slots = segments_from_slots(torch.tensor(slots, dtype=dtype))
        assert got_starts.tolist() == starts and got_slots.tolist() == seg_slots
        assert got_starts.dtype == got_slots.dtype == torch.int32


def test_segments_from_slots_give_the_per_token_product():
    gen = torch.Generator().manual_seed(7)
    slots = torch.randint(-1, 3, (40,), generator=gen)
    x, weight = random_inputs(gen, 40, 8, 6, 3, torch.float32)
    per_token = torch.stack([x[i] @ weight[s] if s >= 0 else torch.zeros(6) for i, s in enumerate(slots.tolist())])
    torch.testing.assert_close(sgmv(x, weight, *segments_from_slots(slots)), per_token)


def test_segments_from_slots_rejects_non_integer_slots():
    with pytest.raises(ValueError, match="slots_per_token"):
        segments_from_slots(torch.zeros(3))


# --- validation ----------------------------------------------------------------------------------------------

X, W = torch.zeros(4, 8), torch.zeros(2, 8, 3)
STARTS, SLOTS = torch.tensor([0, 1, 4]), torch.tensor([0, 1])


@pytest.mark.parametrize("args,message", [
    ((torch.zeros(4, 8, 1), W, STARTS, SLOTS), "x must be"),
    ((X, torch.zeros(8, 3), STARTS, SLOTS), "weight must be"),
    ((X, torch.zeros(2, 7, 3), STARTS, SLOTS), "d_in=8"),
    ((X, W.double(), STARTS, SLOTS), "share a float32/bfloat16/float16 dtype"),
    ((X.long(), W.long(), STARTS, SLOTS), "share a float32/bfloat16/float16 dtype"),
    ((X, W, STARTS.float(), SLOTS), "seg_starts must be"),
    ((X, W, torch.tensor([], dtype=torch.long), SLOTS[:0]), "seg_starts must be"),
    ((X, W, STARTS, SLOTS.to(torch.int16)), "seg_slots must be"),
    ((X, W, STARTS, torch.tensor([0])), "1 seg_slots for 2 segments"),
    ((X, W, torch.tensor([1, 2, 4]), SLOTS), "rise from 0 to n=4"),
    ((X, W, torch.tensor([0, 1, 3]), SLOTS), "rise from 0 to n=4"),
    ((X, W, torch.tensor([0, 3, 1, 4]), torch.tensor([0, 0, 0])), "without decreasing"),
    ((X, W, STARTS, torch.tensor([0, 2])), "below num_slots=2"),
    ((X, W, STARTS, torch.tensor([-2, 0])), "below num_slots=2"),
])
def test_bad_inputs_are_named(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        sgmv(*args)


def test_sgmv_triton_explains_what_it_needs(monkeypatch):
    if triton_available() and not INTERPRETED:
        with pytest.raises(ValueError, match="CUDA tensors"):
            sgmv_triton(X, W, STARTS, SLOTS)
    monkeypatch.setattr(sgmv_module, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs the triton package"):
        sgmv_triton(X, W, STARTS, SLOTS)
    torch.testing.assert_close(sgmv(X, W, STARTS, SLOTS), torch.zeros(4, 3))  # the reference still serves


# --- Triton --------------------------------------------------------------------------------------------------

TRITON_DEVICE = "cpu" if INTERPRETED else "cuda"
needs_triton_device = pytest.mark.skipif(
    not triton_available() or not (INTERPRETED or torch.cuda.is_available()),
    reason="needs triton and CUDA, or TRITON_INTERPRET=1 (test_triton_interpreter runs these in a subprocess)")

# (n, d_in, d_out, num_slots, seg_starts, seg_slots): small, because the interpreter runs every program in Python.
TRITON_CASES = {
    "shrink": (23, 40, 8, 3, [0, 5, 5, 6, 23], [2, 0, -1, 1]),  # empty, no-adapter and 2-tile segments
    "expand": (23, 8, 72, 3, [0, 5, 5, 6, 23], [2, 0, -1, 1]),  # d_out not a multiple of the column tile
    "decode": (20, 32, 16, 4, list(range(21)), [3, 0, -1, 3, 3, 1, 2, -1, 0, 1] * 2),  # one row per segment
    "prefill": (70, 24, 20, 2, [0, 70], [1]),  # one long segment in 64-row tiles
    "wide": (9, 16, 300, 2, [0, 4, 9], [1, 0]),  # several column tiles
    "deep": (6, 200, 16, 2, [0, 3, 6], [0, 1]),  # several d_in steps and a remainder
    "no_adapter": (5, 16, 16, 1, [0, 2, 5], [-1, -1]),
    "no_rows": (0, 16, 16, 1, [0, 0], [0]),
}


@pytest.mark.cuda
@needs_triton_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_case_matches_reference(case, dtype):
    n, d_in, d_out, num_slots, starts, slots = TRITON_CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    x, weight = random_inputs(gen, n, d_in, d_out, num_slots, dtype)
    index_dtype = torch.int32 if len(case) % 2 else torch.int64
    args = [t.to(TRITON_DEVICE) for t in (x, weight, torch.tensor(starts, dtype=index_dtype),
                                          torch.tensor(slots, dtype=index_dtype))]
    out = sgmv_triton(*args)
    torch.testing.assert_close(out.cpu(), sgmv_reference(*args).cpu(), **TOLERANCES[dtype])
    if TRITON_DEVICE == "cuda":
        torch.testing.assert_close(sgmv(*args), out, rtol=0, atol=0)  # dispatch picks the kernel


@pytest.mark.cuda
@needs_triton_device
def test_triton_case_strided_operands():
    """x a column slice of a wider activation, weight stored transposed (`[slots, d_out, d_in]`, as peft keeps it)."""
    gen = torch.Generator().manual_seed(8)
    wide = torch.randn(12, 40, generator=gen).to(TRITON_DEVICE)
    stored = torch.randn(3, 24, 32, generator=gen).to(TRITON_DEVICE)  # [slots, d_out, d_in]
    x, weight = wide[:, 8:], stored.transpose(1, 2)
    starts, slots = torch.tensor([0, 5, 12], device=TRITON_DEVICE), torch.tensor([2, 0], device=TRITON_DEVICE)
    torch.testing.assert_close(sgmv_triton(x, weight, starts, slots).cpu(),
                               sgmv_reference(x, weight, starts, slots).cpu(), **TOLERANCES[torch.float32])


@pytest.mark.cuda
@needs_triton_device
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_case_lora_shrink_then_expand(dtype):
    gen = torch.Generator().manual_seed(9)
    x, y, lora_a, lora_b = lora_inputs(gen, 14, 64, 96, ranks=[8, 16], dtype=dtype)
    seg_starts, seg_slots = torch.tensor([0, 3, 4, 14]), torch.tensor([1, -1, 0])
    expected = per_segment_lora(y, x, lora_a, lora_b, seg_starts, seg_slots)
    args = [t.to(TRITON_DEVICE) for t in (x, lora_a, lora_b, seg_starts, seg_slots)]
    x, lora_a, lora_b, seg_starts, seg_slots = args
    y = y.to(TRITON_DEVICE)
    if TRITON_DEVICE == "cuda":
        add_lora(y, x, lora_a, lora_b, seg_starts, seg_slots)
    else:  # on CPU `add_lora` runs the reference; the kernel is called directly
        y += sgmv_triton(sgmv_triton(x, lora_a, seg_starts, seg_slots), lora_b, seg_starts, seg_slots)
    torch.testing.assert_close(y.cpu(), expected, **TOLERANCES[dtype])


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.skipif(INTERPRETED, reason="this test starts the interpreter itself")
def test_triton_interpreter():
    """Runs the `test_triton_case*` tests above on CPU tensors under the interpreter."""
    run_interpreted(__file__, 2 * len(TRITON_CASES) + 3, timeout=300)  # every case ran, none skipped


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kernel_compiles_for_a_gpu(dtype):
    """Compiles the kernel for sm_80 without a GPU: the type checks and lowering the interpreter skips."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = sgmv_module._kernel()
    signature = {name: f"*{dtype}" for name in ("x_ptr", "w_ptr", "out_ptr")}
    signature |= {"seg_starts_ptr": "*i32", "seg_slots_ptr": "*i64"}
    signature |= {name: "i32" for name in kernel.arg_names[5:15]}
    constexprs = {"SEG_BLOCK": 16, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64,
                  "INPUT_PRECISION": "ieee" if dtype == "fp32" else "tf32", "UPCAST_BF16": False}
    signature |= {name: "constexpr" for name in constexprs}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", 80, 32),
                              options={"enable_fp_fusion": True})  # as the launcher passes it
    assert "sgmv_kernel" in compiled.asm["ptx"]
    if dtype == "bf16":
        assert "mma" in compiled.asm["ptx"]  # bfloat16 tiles go through the tensor cores


def test_grouped_cpu_lora_delta_matches_the_reference():
    from specula_kernels.sgmv import lora_delta_grouped, sgmv_reference, slot_groups

    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, 24, generator=g)
    a = torch.randn(4, 24, 8, generator=g)
    b = torch.randn(4, 8, 40, generator=g)
    seg_starts = torch.tensor([0, 2, 2, 5, 6, 9, 11], dtype=torch.int32)
    seg_slots = torch.tensor([3, 0, -1, 1, 3, -1], dtype=torch.int32)
    expected = sgmv_reference(sgmv_reference(x, a, seg_starts, seg_slots), b, seg_starts, seg_slots)
    groups = slot_groups(seg_starts, seg_slots)
    assert groups is not None and sorted(groups.slots.tolist()) == [1, 3]
    got = lora_delta_grouped(x, a, b, groups)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert got[2:5].abs().sum() == 0 and got[9:].abs().sum() == 0  # rows without an adapter stay zero
    assert slot_groups(seg_starts, torch.full((6,), -1, dtype=torch.int32)) is None
    # Consecutive slots take the weights as a slice instead of a gather: the same result.
    consecutive = torch.tensor([1, 0, -1, 2, 1, -1], dtype=torch.int32)  # slot 0's segment is empty
    groups = slot_groups(seg_starts, consecutive)
    assert groups is not None and groups.first_slot == 1 and groups.slots.tolist() == [1, 2]
    expected = sgmv_reference(sgmv_reference(x, a, seg_starts, consecutive), b, seg_starts, consecutive)
    torch.testing.assert_close(lora_delta_grouped(x, a, b, groups), expected, rtol=1e-5, atol=1e-5)
