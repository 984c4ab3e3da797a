"""The Triton paged attention kernel against the gathered-context SDPA reference (`paged_attention._attend`).

As for SGMV (`test_sgmv.py`), the kernel runs three ways: under Triton's interpreter on CPU tensors, in a
subprocess because the interpreter is chosen when a kernel is built (`test_triton_interpreter` runs this file's
`test_triton_case*` tests with `TRITON_INTERPRET=1`); on CUDA when a GPU is present (`-m cuda`); and compiled for a
GPU target without one, which catches what the interpreter does not type-check. Shapes stay small: the
interpreter runs every program in Python, on CI's two cores.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import pytest
import torch

from specula_kernels import paged_attention as paged_attention_module
from specula_kernels import triton_paged_attention as kernel_module
from specula_kernels.paged_attention import GroupedAttentionInputs, PagedAttentionInputs, paged_attention
from specula_kernels.sgmv import triton_available
from specula_kernels.triton_paged_attention import context_lengths, paged_attention_triton
from specula_testing.triton import run_interpreted

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_DEVICE = "cpu" if INTERPRETED else "cuda"
# Against the reference in float32 (SDPA's math on the same stored values): the kernel's sums run in another order,
# and its bfloat16/float16 dots round the softmax weights to the compute dtype before multiplying the values.
TOLERANCES = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
              torch.float16: dict(rtol=4e-3, atol=4e-3)}


@dataclass
class Case:
    """Sequences with `spans[i] = (start, count)`: `start` cached positions, `count` new query rows."""

    spans: list[tuple[int, int]]
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    trees: dict[int, list[int]] | None = None  # sequence -> parent of each draft node (-1: the root)


# Small: the interpreter runs each (sequence, KV head, row tile) program in Python.
TRITON_CASES = {
    "decode": Case([(0, 1), (16, 1), (69, 1)], heads=4, kv_heads=2, head_dim=32, block_size=16),  # crosses blocks
    "verify": Case([(20, 4), (5, 3), (40, 1)], heads=8, kv_heads=2, head_dim=16, block_size=4),  # drafts, causal
    "tree": Case([(11, 5), (3, 1)], heads=4, kv_heads=4, head_dim=16, block_size=8,
                 trees={0: [-1, -1, 0, 1]}),  # root, two children of it, one grandchild under each
    "mqa_long": Case([(130, 2)], heads=8, kv_heads=1, head_dim=64, block_size=32),  # several key tiles
    "odd_head_dim": Case([(7, 2), (33, 3)], heads=6, kv_heads=3, head_dim=48, block_size=2),  # head_dim < tile
    "many_rows": Case([(9, 16)], heads=8, kv_heads=1, head_dim=16, block_size=16),  # 128 rows: two row tiles
}


def build_case(case: Case, dtype: torch.dtype, device: str, seed: int = 0):
    """Random cache (slots no sequence owns hold NaN), queries, block tables and the step's inputs.

    Returns `(query, key_cache, value_cache, block_table, inputs)` where `inputs` is what the worker builds:
    context slots padded with each sequence's own first slot, a causal mask (a tree's ancestors for trees).
    """
    gen = torch.Generator().manual_seed(seed)
    bs, num_seqs = case.block_size, len(case.spans)
    blocks_per_seq = [-(-(s + c) // bs) for s, c in case.spans]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_seq)
    block_table = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    key_cache = torch.full((num_blocks * bs, case.kv_heads, case.head_dim), float("nan"))
    value_cache = key_cache.clone()
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_table[i, :n] = order[used : used + n]
        used += n
    max_query = max(c for _, c in case.spans)
    max_context = max(s + c for s, c in case.spans)
    context_slots = torch.zeros(num_seqs, max_context, dtype=torch.long)
    query_index = torch.zeros(num_seqs, max_query, dtype=torch.long)
    query_valid = torch.zeros(num_seqs, max_query, dtype=torch.bool)
    mask = torch.zeros(num_seqs, 1, max_query, max_context, dtype=torch.bool)
    row = 0
    for i, (s, c) in enumerate(case.spans):
        positions = torch.arange(s + c)
        slots = block_table[i, positions // bs].long() * bs + positions % bs
        key_cache[slots] = torch.randn(s + c, case.kv_heads, case.head_dim, generator=gen)
        value_cache[slots] = torch.randn(s + c, case.kv_heads, case.head_dim, generator=gen)
        context_slots[i] = slots[0]
        context_slots[i, : s + c] = slots
        query_index[i, :c] = torch.arange(row, row + c)
        query_valid[i, :c] = True
        for q in range(max_query):
            mask[i, 0, q, : s + q + 1 if q < c else 1] = True
        if case.trees and i in case.trees:
            parents = case.trees[i]
            ancestors = torch.eye(c, dtype=torch.bool)
            for node, parent in enumerate(parents, start=1):
                ancestors[node] |= ancestors[parent + 1]
            mask[i, 0, :c, s : s + c] = ancestors
        row += c
    query = torch.randn(row, case.heads, case.head_dim, generator=gen)
    tensors = [t.to(device) for t in (query.to(dtype), key_cache.to(dtype), value_cache.to(dtype), block_table)]
    inputs = PagedAttentionInputs(*(t.to(device) for t in (torch.zeros(row, dtype=torch.long), context_slots,
                                                              query_index, query_valid, mask)))
    return (*tensors, inputs)


def reference(query, key_cache, value_cache, inputs) -> torch.Tensor:
    """The gathered-context SDPA path in float32 on CPU: `[num_tokens, num_heads, head_dim]`."""
    cpu = PagedAttentionInputs(*(t.cpu() for t in (inputs.slot_mapping, inputs.context_slots, inputs.query_index,
                                                      inputs.query_valid, inputs.mask)))
    return paged_attention_module._attend(query.cpu().float(), key_cache.cpu().float(), value_cache.cpu().float(),
                                          cpu, query.shape[-1] ** -0.5)


# --- on CPU, no kernel --------------------------------------------------------------------------------------------


def test_context_lengths_end_at_the_last_visible_position():
    mask = torch.zeros(3, 1, 2, 6, dtype=torch.bool)
    mask[0, 0, 0, :3] = True  # 3 positions, the rest padding
    mask[1, 0, 0, :5], mask[1, 0, 1, :6] = True, True  # a draft sees one more
    mask[2, 0, :, 0] = True
    slots = torch.zeros(3, 6, dtype=torch.long)
    assert context_lengths(slots, mask).tolist() == [3, 6, 1]
    assert context_lengths(slots, None).tolist() == [6, 6, 6]


Q, K = torch.zeros(3, 4, 16), torch.zeros(32, 2, 16)
ROWS, VALID = torch.tensor([[0, 1], [2, 0]]), torch.tensor([[True, True], [True, False]])
TABLE, LENS = torch.zeros(2, 4, dtype=torch.int32), torch.tensor([5, 7], dtype=torch.int32)


@pytest.mark.parametrize("changes,message", [
    (dict(query=torch.zeros(3, 4)), "query must be"),
    (dict(query=Q.long()), "query must be"),
    (dict(query=torch.zeros(3, 16, 4).transpose(1, 2)), "unit stride"),
    (dict(key_cache=torch.zeros(32, 2, 8)), "key_cache must be"),
    (dict(key_cache=K.long(), value_cache=K.long()), "key_cache must be float32/bfloat16/float16/float8"),
    (dict(value_cache=torch.zeros(16, 2, 16)), "share shape and strides"),
    (dict(key_cache=torch.zeros(32, 3, 16), value_cache=torch.zeros(32, 3, 16)), "multiple of num_kv_heads=3"),
    (dict(query_rows=ROWS.float()), "query_rows must be"),
    (dict(query_rows=torch.zeros(2, 17, dtype=torch.long), query_valid=torch.zeros(2, 17, dtype=torch.bool)),
     "max_query <= 16"),
    (dict(query_valid=VALID.long()), "query_valid must be bool"),
    (dict(block_table=torch.zeros(3, 4, dtype=torch.int32)), "block_table must be"),
    (dict(mask=torch.ones(2, 1, 3, 8, dtype=torch.bool)), "mask must be"),
    (dict(context_lens=LENS.float()), "context_lens must be"),
    (dict(out=torch.zeros(3, 4, 16, dtype=torch.bfloat16)), "out must be"),
])
def test_bad_inputs_are_named(changes, message):
    args = dict(query=Q, key_cache=K, value_cache=K.clone(), block_table=TABLE, query_rows=ROWS, query_valid=VALID,
                mask=None, context_lens=LENS, out=torch.zeros(3, 4, 16))
    args.update(changes)
    with pytest.raises(ValueError, match=re.escape(message)):
        kernel_module.check_inputs(**args)


def test_kernel_explains_what_it_needs(monkeypatch):
    args = (Q, K, K.clone(), TABLE, ROWS, VALID, None, LENS, 0.25)
    if triton_available() and not INTERPRETED:
        with pytest.raises(ValueError, match="CUDA tensors"):
            paged_attention_triton(*args)
    monkeypatch.setattr(kernel_module, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs the triton package"):
        paged_attention_triton(*args)


def test_cpu_attention_never_takes_the_kernel(monkeypatch):
    """The CPU path is unchanged: the Triton path is chosen for CUDA tensors only."""
    def fail(*args, **kwargs):
        raise AssertionError("the Triton path ran on CPU")

    monkeypatch.setattr(paged_attention_module, "_paged_attention_triton", fail)
    query, key_cache, value_cache, _, inputs = build_case(TRITON_CASES["verify"], torch.float32, "cpu")
    assert not paged_attention_module.use_triton(query, key_cache, value_cache)
    out = paged_attention(query, key_cache, value_cache, inputs, scale=query.shape[-1] ** -0.5)
    torch.testing.assert_close(out, reference(query, key_cache, value_cache, inputs))


@pytest.mark.parametrize("spans", [[(0, 20)], [(5, 18)], [(0, 17), (0, 20)]])
def test_prompts_take_sdpa_and_a_whole_prompt_the_causal_form(spans, monkeypatch):
    """More rows than the kernel serves: SDPA; one sequence from position 0 (no cached prefix) as causal SDPA
    without a mask tensor (CUDA's flash kernel takes that), the others with their mask."""
    causal = []
    real = paged_attention_module._attend_whole_prompt
    monkeypatch.setattr(paged_attention_module, "_attend_whole_prompt", lambda *a: causal.append(1) or real(*a))
    query, key_cache, value_cache, _, inputs = build_case(Case(spans, 8, 2, 16, 4), torch.float32, "cpu")
    out = paged_attention_module._paged_attention_triton(query, key_cache, value_cache, inputs, 16**-0.5)
    torch.testing.assert_close(out, reference(query, key_cache, value_cache, inputs))
    assert len(causal) == (spans == [(0, 20)])


# --- Triton -------------------------------------------------------------------------------------------------------

needs_triton_device = pytest.mark.skipif(
    not triton_available() or not (INTERPRETED or torch.cuda.is_available()),
    reason="needs triton and CUDA, or TRITON_INTERPRET=1 (test_triton_interpreter runs these in a subprocess)")


@pytest.mark.cuda
@needs_triton_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_case_matches_reference(case, dtype):
    """With the block table at its block size, and with the worker's context slots as one-slot blocks."""
    query, key_cache, value_cache, block_table, inputs = build_case(TRITON_CASES[case], dtype, TRITON_DEVICE)
    expected = reference(query, key_cache, value_cache, inputs)
    lengths = context_lengths(inputs.context_slots, inputs.mask)
    scale = query.shape[-1] ** -0.5
    valid = inputs.query_valid.cpu()
    for table, block_size in ((block_table, TRITON_CASES[case].block_size), (inputs.context_slots, 1)):
        out = paged_attention_triton(query, key_cache, value_cache, table, inputs.query_index, inputs.query_valid,
                                     inputs.mask, lengths, scale, block_size=block_size)
        got = out.cpu().float()[inputs.query_index.cpu()[valid]]  # valid rows in the flat token order
        assert torch.isfinite(got).all()  # no NaN slot of another sequence or of padding was read
        torch.testing.assert_close(got, expected, **TOLERANCES[dtype])


@pytest.mark.cuda
@needs_triton_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["decode", "verify", "many_rows"])
def test_triton_case_causal_by_positions_equals_the_mask(case, dtype):
    """Without a mask, given each row's position, a chain of drafts sees what the causal mask shows it: the form
    a CUDA graph replays (no tensor of the context's width). Sequences padded past their rows read nothing."""
    query, key_cache, value_cache, block_table, inputs = build_case(TRITON_CASES[case], dtype, TRITON_DEVICE)
    expected = reference(query, key_cache, value_cache, inputs)
    spans = TRITON_CASES[case].spans
    positions = torch.cat([torch.arange(s, s + c) for s, c in spans]).to(TRITON_DEVICE)
    lengths = torch.tensor([s + c for s, c in spans] + [0], dtype=torch.int32, device=TRITON_DEVICE)
    pad = lambda t, value: torch.cat([t, torch.full_like(t[:1], value)])  # noqa: E731 - a padding sequence
    out = paged_attention_triton(query, key_cache, value_cache, pad(block_table, 0), pad(inputs.query_index, 0),
                                 pad(inputs.query_valid, False), None, lengths, query.shape[-1] ** -0.5,
                                 block_size=TRITON_CASES[case].block_size, positions=positions)
    valid = inputs.query_valid.cpu()
    got = out.cpu().float()[inputs.query_index.cpu()[valid]]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])


@pytest.mark.cuda
@needs_triton_device
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.float8_e4m3fn),
                                               (torch.float32, torch.float8_e5m2)])
@pytest.mark.parametrize("case", ["decode", "verify", "tree"])
def test_triton_case_float8_cache_matches_reference(case, dtype, cache_dtype):
    """A float8 cache (`--kv-cache-dtype fp8`) read as stored: the reference attends over the same float8 values
    widened to float32 (the gathered path's conversion), so only the sums' order and the dots' precision differ."""
    if not INTERPRETED and not kernel_module.reads_cache(cache_dtype, torch.device(TRITON_DEVICE)):
        pytest.skip("this GPU has no float8 conversions (compute capability under 8.9)")
    query, key_cache, value_cache, block_table, inputs = build_case(TRITON_CASES[case], dtype, TRITON_DEVICE)
    key_cache, value_cache = key_cache.float().to(cache_dtype), value_cache.float().to(cache_dtype)
    expected = reference(query, key_cache, value_cache, inputs)
    lengths = context_lengths(inputs.context_slots, inputs.mask)
    out = paged_attention_triton(query, key_cache, value_cache, block_table, inputs.query_index, inputs.query_valid,
                                 inputs.mask, lengths, query.shape[-1] ** -0.5,
                                 block_size=TRITON_CASES[case].block_size)
    got = out.cpu().float()[inputs.query_index.cpu()[inputs.query_valid.cpu()]]
    assert torch.isfinite(got).all()  # NaN bytes in slots no sequence owns were not read
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])


@pytest.mark.cuda
@needs_triton_device
def test_triton_case_groups_strided_query_and_prompt_fallback():
    """The worker's layout: a decode group beside a verification group, queries a view of the fused q/k/v
    output, and a prompt group (more rows than the kernel serves) left to the SDPA path."""
    decode = build_case(Case([(5, 1), (37, 1)], 4, 2, 16, 8), torch.float32, TRITON_DEVICE, seed=1)
    verify = build_case(Case([(12, 3), (3, 2)], 4, 2, 16, 8), torch.float32, TRITON_DEVICE, seed=2)
    prompt = build_case(Case([(0, 20)], 4, 2, 16, 8), torch.float32, TRITON_DEVICE, seed=3)
    parts = [decode, verify, prompt]
    key_cache = torch.cat([p[1] for p in parts])
    value_cache = torch.cat([p[2] for p in parts])
    offsets = [0, decode[1].shape[0], decode[1].shape[0] + verify[1].shape[0]]
    num_rows = [p[0].shape[0] for p in parts]
    starts = [0, num_rows[0], num_rows[0] + num_rows[1]]
    groups, expected = [], []
    for part, offset, start, n in zip(parts, offsets, starts, num_rows):
        inputs = part[4]
        shifted = PagedAttentionInputs(inputs.slot_mapping, inputs.context_slots + offset, inputs.query_index,
                                       inputs.query_valid, inputs.mask)
        groups.append((torch.arange(start, start + n, device=TRITON_DEVICE), shifted))
        expected.append(reference(part[0], part[1], part[2], inputs))
    fused = torch.randn(sum(num_rows), 3, 4, 16, device=TRITON_DEVICE)  # [tokens, q|k|v, heads, head_dim]
    fused[:, 0] = torch.cat([p[0] for p in parts])
    query = fused[:, 0]
    assert not query.is_contiguous()
    steps = GroupedAttentionInputs(torch.zeros(sum(num_rows), dtype=torch.long, device=TRITON_DEVICE), groups)
    out = paged_attention_module._paged_attention_triton(query, key_cache, value_cache, steps, 16**-0.5)
    torch.testing.assert_close(out.cpu(), torch.cat(expected), **TOLERANCES[torch.float32])
    assert "triton.lengths" in groups[0][1].workspace and "triton.lengths" not in groups[2][1].workspace
    again = paged_attention_module._paged_attention_triton(query, key_cache, value_cache, steps, 16**-0.5)
    assert torch.equal(again, out)  # the next layer reuses the step's rows and lengths


@pytest.mark.cuda
@needs_triton_device
def test_triton_case_query_not_contiguous_within_a_head():
    """A query whose head vectors are strided (stored head-minor) is made contiguous before the kernel."""
    query, key_cache, value_cache, _, inputs = build_case(TRITON_CASES["verify"], torch.float32, TRITON_DEVICE)
    strided = query.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, stride 8 within a head
    assert strided.stride(2) != 1
    out = paged_attention_module._paged_attention_triton(strided, key_cache, value_cache, inputs, 16**-0.5)
    torch.testing.assert_close(out.cpu(), reference(query, key_cache, value_cache, inputs), **TOLERANCES[torch.float32])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and triton")
def test_cuda_attention_takes_the_kernel_for_decode_rows(monkeypatch):
    calls = []
    real = kernel_module.paged_attention_triton
    monkeypatch.setattr(kernel_module, "paged_attention_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    query, key_cache, value_cache, _, inputs = build_case(TRITON_CASES["verify"], torch.bfloat16, "cuda")
    out = paged_attention(query, key_cache, value_cache, inputs, scale=query.shape[-1] ** -0.5)
    assert calls == [1]
    torch.testing.assert_close(out.cpu().float(), reference(query, key_cache, value_cache, inputs),
                               **TOLERANCES[torch.bfloat16])


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.skipif(INTERPRETED, reason="this test starts the interpreter itself")
def test_triton_interpreter():
    """Runs the `test_triton_case*` tests above on CPU tensors under the interpreter."""
    run_interpreted(__file__, 3 * len(TRITON_CASES) + 2 + 6 + 6, timeout=600)  # every case ran, none skipped


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
@pytest.mark.parametrize("dtype,kv,group,block_d,has_mask,causal,block_size,arch", [
    ("bf16", "bf16", 4, 128, True, False, 1, 80), ("fp16", "fp16", 1, 64, True, False, 1, 80),
    ("fp32", "fp32", 8, 128, True, False, 1, 80), ("bf16", "bf16", 4, 64, False, False, 16, 80),
    ("bf16", "bf16", 4, 64, True, False, 1, 90), ("bf16", "bf16", 4, 64, False, True, 16, 90),
    ("bf16", "fp8e4nv", 4, 64, False, True, 16, 90), ("fp32", "fp8e5", 4, 64, True, False, 1, 90)])
def test_kernel_compiles_for_a_gpu(dtype, kv, group, block_d, has_mask, causal, block_size, arch):
    """Compiles the kernel for sm_80 and sm_90 (H100) without a GPU, float8 caches for sm_90: the type checks and
    lowering the interpreter skips."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = kernel_module._kernel()
    names = kernel.arg_names
    signature = {"q_ptr": f"*{dtype}", "k_ptr": f"*{kv}", "v_ptr": f"*{kv}", "out_ptr": f"*{dtype}"}
    signature |= {"table_ptr": "*i64", "rows_ptr": "*i64", "valid_ptr": "*u8", "mask_ptr": "*u8", "lens_ptr": "*i32",
                  "pos_ptr": "*i64", "scale": "fp32"}
    signature |= {name: "i32" for name in names[11:28]}
    constexprs = {"GROUP": group, "BLOCK_SIZE": block_size, "HAS_MASK": has_mask, "CAUSAL": causal, "BLOCK_M": 64,
                  "BLOCK_N": 32 if block_d > 64 else 64, "BLOCK_D": block_d, "UPCAST": False,
                  "INPUT_PRECISION": "ieee" if dtype == "fp32" else "tf32", "KV_FLOAT8": kv.startswith("fp8")}
    signature |= {name: "constexpr" for name in constexprs}
    assert list(signature) == names, names
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", arch, 32),
                              options={"enable_fp_fusion": True})
    assert "paged_attention_kernel" in compiled.asm["ptx"]
    if dtype != "fp32":
        assert "mma" in compiled.asm["ptx"]  # the score and value products go through the tensor cores
