"""A KV cache stored narrower than the model computes (bfloat16, float16, fp8): converted on write, back on read.

Round-trip error bound per storage dtype, for a value x in the normal range: half a unit in the last place,
|x' - x| <= eps/2 * |x| (fp8 e4m3: 2^-4, fp8 e5m2: 2^-3, bfloat16: 2^-8, float16: 2^-11); below the smallest
normal, half the subnormal spacing (tiny * eps / 2).
"""

from __future__ import annotations

import math

import pytest
import torch

from specula_kernels.paged_attention import (
    PagedAttentionInputs,
    _gather,
    paged_attention,
    to_storage,
    write_kv_cache,
)

STORAGE = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


def decode_inputs(context_slots: torch.Tensor) -> PagedAttentionInputs:
    """One query per sequence, attending over its whole (unpadded) context; the query's own K/V is last."""
    num_seqs = context_slots.shape[0]
    return PagedAttentionInputs(
        slot_mapping=context_slots[:, -1], context_slots=context_slots,
        query_index=torch.arange(num_seqs).unsqueeze(1), query_valid=torch.ones(num_seqs, 1, dtype=torch.bool),
        mask=None,
    )


def gathered(key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor, dtype=torch.float32):
    """What attention reads back: the context's keys and values through `_gather`, in `dtype`."""
    inputs = decode_inputs(slots.unsqueeze(0))
    keys = _gather(key_cache, inputs, "keys", dtype)[0].clone()
    values = _gather(value_cache, inputs, "values", dtype)[0].clone()
    return keys, values


@pytest.mark.parametrize("storage", STORAGE, ids=str)
def test_write_then_gather_round_trips_within_half_an_ulp(storage):
    gen = torch.Generator().manual_seed(0)
    kv_heads, head_dim, num_slots = 2, 64, 96
    # Magnitudes from 1e-4 to ~100: subnormal to large for fp8, all inside e4m3's +-448.
    key = torch.randn(40, kv_heads, head_dim, generator=gen) * 10 ** torch.empty(40, kv_heads, head_dim).uniform_(
        -4, 2, generator=gen)
    value = torch.randn(40, kv_heads, head_dim, generator=gen)
    key_cache = torch.zeros(num_slots, kv_heads, head_dim, dtype=storage)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(num_slots, generator=gen)[:40]
    write_kv_cache(key, value, key_cache, value_cache, slots)
    assert key_cache.dtype == storage  # stored narrow ...
    keys, values = gathered(key_cache, value_cache, slots)
    assert keys.dtype == torch.float32  # ... read back in the compute dtype
    info = torch.finfo(storage)
    for got, want in ((keys, key), (values, value)):
        bound = info.eps / 2 * want.abs() + info.tiny * info.eps / 2
        assert ((got - want).abs() <= bound).all(), (storage, ((got - want).abs() / bound).max())
        assert torch.equal(got, want.to(storage).float())  # exactly the storage dtype's rounding, no other loss
    rel = ((keys - key).abs() / key.abs()).masked_select(key.abs() >= info.tiny).max().item()
    assert rel <= info.eps / 2  # e4m3: 2^-4 = 0.0625, e5m2: 2^-3, bf16: 2^-8, fp16: 2^-11


@pytest.mark.parametrize("storage", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float16], ids=str)
def test_out_of_range_values_saturate_never_inf_or_nan(storage):
    limit = torch.finfo(storage).max  # e4m3fn 448, e5m2 57344, float16 65504
    big = torch.tensor([limit * 1.5, -limit * 1.5, 1e30, -1e30, math.inf, -math.inf, 3.0, -0.5])
    key = big.view(8, 1, 1).expand(8, 1, 4).contiguous()
    key_cache = torch.zeros(8, 1, 4, dtype=storage)
    value_cache = torch.zeros_like(key_cache)
    write_kv_cache(key, key, key_cache, value_cache, torch.arange(8))
    keys, values = gathered(key_cache, value_cache, torch.arange(8))
    assert torch.isfinite(keys).all() and torch.isfinite(values).all()
    assert keys[:, 0, 0].tolist() == [limit, -limit, limit, -limit, limit, -limit, 3.0, -0.5]
    if storage != torch.float8_e4m3fn:  # the hazard the clamp removes (e4m3fn has no inf: NaN or saturation,
        assert torch.isinf(big.to(storage).float()[:6]).all()  # depending on the device and torch version)


@pytest.mark.parametrize("storage", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_a_nan_stays_nan(storage):
    """A NaN key is not hidden by the clamp nor by the read: the worker fails a request whose logits are not
    finite."""
    key = torch.tensor([float("nan"), 1.0]).view(2, 1, 1)
    cache = torch.zeros(2, 1, 1, dtype=storage)
    write_kv_cache(key, key, cache, cache.clone(), torch.arange(2))
    keys, _ = gathered(cache, cache, torch.arange(2))
    assert math.isnan(keys[0, 0, 0]) and keys[1, 0, 0] == 1.0


@pytest.mark.parametrize("storage", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_every_float8_byte_reads_back_as_torch_casts_it(storage, compute):
    """The CPU read looks a byte's value up in a table: for all 256 bytes it equals torch's own cast."""
    cache = torch.arange(256, dtype=torch.uint8).view(storage).view(256, 1, 1)
    slots = torch.randperm(256, generator=torch.Generator().manual_seed(0))
    keys, _ = gathered(cache, cache, slots, compute)
    want = cache.to(compute)[slots]
    assert keys.dtype == compute
    assert torch.equal(keys.isnan(), want.isnan()) and torch.equal(keys.nan_to_num(), want.nan_to_num())


def test_same_dtype_is_not_converted():
    x = torch.randn(3, 2, 4)
    assert to_storage(x, torch.float32) is x


@pytest.mark.parametrize("storage,tolerance", [(torch.bfloat16, 0.02), (torch.float8_e4m3fn, 0.1),
                                               (torch.float8_e5m2, 0.2)], ids=str)
def test_attention_over_a_narrow_cache_is_close_to_the_float_cache(storage, tolerance):
    """Decode attention of 4 sequences over 50 positions: outputs in the query's dtype, close to float32's."""
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, head_dim, ctx = 4, 2, 32, 50
    slots = torch.randperm(4 * ctx, generator=gen).view(4, ctx)
    key = torch.randn(4 * ctx, kv_heads, head_dim, generator=gen)
    value = torch.randn(4 * ctx, kv_heads, head_dim, generator=gen)
    query = torch.randn(4, heads, head_dim, generator=gen)
    outs = {}
    for dtype in (torch.float32, storage):
        k_cache = torch.zeros(4 * ctx, kv_heads, head_dim, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        write_kv_cache(key, value, k_cache, v_cache, slots.flatten())
        outs[dtype] = paged_attention(query, k_cache, v_cache, decode_inputs(slots), head_dim**-0.5)
    assert outs[storage].dtype == torch.float32
    diff = (outs[storage] - outs[torch.float32]).abs().max().item()
    assert diff < tolerance, diff  # outputs up to 0.83; measured: bf16 0.0019, e4m3 0.040, e5m2 0.077


def test_the_workspace_is_reused_across_layers():
    """A narrow cache gathers into reused buffers (stored, byte indexes, converted), not new tensors per layer."""
    slots = torch.arange(12).view(2, 6)
    inputs = decode_inputs(slots)
    k_cache = torch.randn(12, 1, 8).to(torch.float8_e4m3fn)
    first = _gather(k_cache, inputs, "keys", torch.float32)
    again = _gather(k_cache, inputs, "keys", torch.float32)
    assert first.data_ptr() == again.data_ptr() and set(inputs.workspace) == {"keys", "keys.stored", "keys.index"}
    assert inputs.workspace["keys.stored"].dtype == torch.float8_e4m3fn
