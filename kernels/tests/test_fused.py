"""The fused per-layer kernels (`specula_kernels.fused`) against the PyTorch operators they replace."""

from __future__ import annotations

import pytest
import torch

from specula_kernels import fused, native
from specula_kernels.paged_attention import write_kv_cache

needs_native = pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")


@needs_native
@pytest.mark.parametrize("rows,dim", [(1, 768), (7, 40), (300, 512)])  # a tail of 8; enough rows for threads
def test_rms_norm_matches_reference(rows, dim):
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(rows, dim, generator=gen) * 3, torch.randn(dim, generator=gen)
    torch.testing.assert_close(fused.rms_norm(x, weight, 1e-5), fused.rms_norm_reference(x, weight, 1e-5),
                               rtol=1e-5, atol=1e-5)


@needs_native
def test_add_rms_norm_returns_the_sum_and_its_norm():
    gen = torch.Generator().manual_seed(1)
    x, delta, weight = (torch.randn(5, 96, generator=gen), torch.randn(5, 96, generator=gen),
                        torch.randn(96, generator=gen))
    expected_sum = x + delta
    total, normed = fused.add_rms_norm(x.clone(), delta, weight, 1e-6)
    assert torch.equal(total, expected_sum)  # one rounding, as `x + delta`
    torch.testing.assert_close(normed, fused.rms_norm_reference(expected_sum, weight, 1e-6), rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("rows,width", [(1, 2048), (3, 24), (64, 2048)])
def test_silu_and_mul_matches_reference(rows, width):
    gen = torch.Generator().manual_seed(2)
    gate_up = torch.randn(rows, 2 * width, generator=gen) * 4
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamps at both ends
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(fused.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up,
                               rtol=1e-5, atol=1e-6)


@needs_native
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(12, 12, 64), (8, 2, 32), (4, 1, 128)])
def test_rotary_and_cache_is_the_pytorch_rotation_bit_for_bit(heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(3)
    tokens = 9
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=gen) * 6
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    sin = torch.cat([-angles.sin(), angles.sin()], dim=-1)
    slots = torch.randperm(40, generator=gen)[:tokens]
    caches = [torch.zeros(40, kv_heads, head_dim) for _ in range(4)]

    expected_qk = fused.apply_rotary(qkv[:, : (heads + kv_heads) * head_dim].view(tokens, -1, head_dim), cos, sin)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    write_kv_cache(expected_qk[:, heads:], v, caches[0], caches[1], slots)

    q = fused.rotary_and_cache(qkv.clone(), heads, kv_heads, head_dim, cos, sin, caches[2], caches[3], slots)
    assert torch.equal(q, expected_qk[:, :heads])
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


def test_other_dtypes_use_the_pytorch_operators(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: pytest.fail("native kernels asked for bfloat16"))
    x, weight = torch.randn(3, 32).bfloat16(), torch.randn(32).bfloat16()
    assert torch.equal(fused.rms_norm(x, weight, 1e-5), fused.rms_norm_reference(x, weight, 1e-5))
    gate_up = torch.randn(3, 64).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(fused.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up)


def test_without_native_kernels_the_results_are_the_reference(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: None)
    gen = torch.Generator().manual_seed(4)
    x, delta, weight = torch.randn(4, 64, generator=gen), torch.randn(4, 64, generator=gen), torch.randn(64)
    total, normed = fused.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(total, x + delta) and torch.equal(normed, fused.rms_norm_reference(x + delta, weight, 1e-5))


@needs_native
@pytest.mark.parametrize("rows,vocab", [(1, 49152), (3, 101), (64, 1000), (2, 5)])  # tails; rows for threads
def test_logit_rows_match_argmax_and_logsumexp(rows, vocab):
    gen = torch.Generator().manual_seed(4)
    wide = torch.randn(rows, vocab + 3, generator=gen) * 6
    logits = wide[:, :vocab]  # rows a stride apart that is not their width
    finite, argmax, lse = fused.logit_rows(logits)
    assert finite.all()
    assert torch.equal(argmax, logits.argmax(dim=-1))
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1), rtol=1e-6, atol=1e-5)
    only_finite = fused.logit_rows(logits, argmax=False, normalizer=False)  # the others not written
    assert only_finite[0].all() and only_finite[1] is None and only_finite[2] is None


@needs_native
def test_logit_rows_take_the_first_of_equal_largest_values_as_argmax():
    logits = torch.zeros(4, 70)
    logits[0, [37, 5, 60]] = 2.0  # in different vector lanes: the smallest index wins
    logits[1, [3, 19]] = 1.0  # in the same lane
    logits[2, [8, 69]] = 1.0  # one in the scalar tail
    logits[3] = -1.0  # every value equal
    assert fused.logit_rows(logits)[1].tolist() == [5, 3, 8, 0] == logits.argmax(dim=-1).tolist()


@needs_native
def test_logit_rows_say_which_rows_are_not_finite():
    logits = torch.randn(6, 300)
    logits[1, 17] = float("nan")
    logits[2, 299] = float("inf")  # in the scalar tail
    logits[3, 0] = -float("inf")  # -inf is not finite either
    logits[4] = -float("inf")
    logits[5, 150] = float("nan")
    logits[5, 151] = float("inf")
    finite, _, lse = fused.logit_rows(logits)
    assert finite.tolist() == [True, False, False, False, False, False]
    # -inf weighs 0 in the normaliser (a grammar's masked tokens); NaN, +inf or nothing above -inf give NaN
    assert torch.isnan(lse[[1, 2, 4, 5]]).all()
    torch.testing.assert_close(lse[[0, 3]], torch.logsumexp(logits[[0, 3]], dim=-1), rtol=1e-6, atol=1e-5)


@needs_native
def test_logit_rows_normalise_over_the_tokens_a_mask_leaves():
    logits = torch.randn(2, 1000) * 4
    logits[:, ::3] = -float("inf")
    logits[1, 997:] = -float("inf")  # in the scalar tail too
    finite, argmax, lse = fused.logit_rows(logits)
    assert not finite.any()
    assert torch.equal(argmax, logits.argmax(dim=-1))
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1), rtol=1e-6, atol=1e-5)


def test_without_native_kernels_logit_rows_reduce_only_what_is_asked(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: None)
    logits = torch.randn(3, 50)
    logits[1, 7] = float("nan")
    finite, argmax, lse = fused.logit_rows(logits, argmax=False)
    assert finite.tolist() == [True, False, True] and argmax is None
    assert torch.allclose(lse, torch.logsumexp(logits, dim=-1), rtol=0, atol=0, equal_nan=True)
    assert fused.logit_rows(logits, finite=False, normalizer=False)[::2] == (None, None)
