"""A decoder layer's small operations, one call each: RMS norm (with the residual add before it), SiLU times
up, and the rotary embedding (`apply_rotary`) with the KV cache write; and after the LM head, what a greedy step
reads from each row of logits (`logit_rows`: finite or not, argmax, log-normaliser).

On a CPU where the native kernels build (`native.py`, `csrc/fused.cpp`) and for float32 rows, each is one pass
in C++; elsewhere (other dtypes, accelerators, `SPECULA_NATIVE_KERNELS=0`) the PyTorch operators they stand for,
which are also the reference the tests hold the native ones to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specula_kernels import native
from specula_kernels.paged_attention import write_kv_cache


def _library(*tensors: torch.Tensor):
    """The native kernels where they serve these tensors (CPU, float32, rows of contiguous elements), else None."""
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32 or t.stride(-1) != 1:
            return None
    return native.library()


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalised in float32, scaled in the model's dtype (as transformers' Llama)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`[rows, dim]` -> `[rows, dim]`."""
    lib = _library(x, weight) if x.dim() == 2 else None
    if lib is None:
        return rms_norm_reference(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.specula_rms_norm(x.data_ptr(), x.stride(0), None, 0, weight.contiguous().data_ptr(), x.shape[0], x.shape[1],
                         eps, out.data_ptr(), out.stride(0), torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after adding `delta`, and its norm: `(x + delta, rms_norm(x + delta))`. `x` may be
    updated in place (the native path does: one pass reads both rows, writes the sum and the norm)."""
    lib = _library(x, delta, weight) if x.dim() == 2 and x.shape == delta.shape else None
    if lib is None:
        total = x + delta
        return total, rms_norm_reference(total, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.specula_rms_norm(x.data_ptr(), x.stride(0), delta.data_ptr(), delta.stride(0), weight.contiguous().data_ptr(),
                         x.shape[0], x.shape[1], eps, out.data_ptr(), out.stride(0), torch.get_num_threads())
    return x, out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`[rows, 2 * width]` (gate columns, then up columns) -> `silu(gate) * up`, `[rows, width]`."""
    lib = _library(gate_up) if gate_up.dim() == 2 else None
    if lib is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype)
    lib.specula_silu_mul(gate_up.data_ptr(), gate_up.stride(0), rows, width, out.data_ptr(), out.stride(0),
                         torch.get_num_threads())
    return out


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim] (queries and keys may come as one tensor: the rotation is per head).

    The rotate-half form `x * cos + cat(-x2, x1) * sin`, with the sign folded into the table (`sin` is
    `cat(-sin1, sin2)`, `layers.rotary.RotaryEmbedding.tables`): `cat(x2, x1) * sin` equals
    `cat(-x2, x1) * cat(sin1, sin2)` bit for bit, one operation fewer."""
    half = x.shape[-1] // 2
    rotated = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rotary_and_cache(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor,
                     sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> torch.Tensor:
    """The fused q/k/v rows `[tokens, (heads + 2 * kv_heads) * head_dim]`: queries and keys rotated (`cos`, `sin`
    as `RotaryEmbedding.tables` gives them, `[tokens, 1, head_dim]`), keys and values stored at `slot_mapping` in
    the caches. Returns the rotated queries, `[tokens, heads, head_dim]`. The native rotation rounds exactly as
    `apply_rotary`, the other path's."""
    tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    cos2, sin2 = cos.reshape(tokens, head_dim), sin.reshape(tokens, head_dim)
    lib = _library(qkv, cos2, sin2, key_cache, value_cache)
    if (lib is None or qkv.dim() != 2 or head_dim > 1024 or head_dim % 2 or not key_cache.is_contiguous()
            or not value_cache.is_contiguous()):
        qk = qkv[:, : q_size + kv_size].view(tokens, num_heads + num_kv_heads, head_dim)
        qk = apply_rotary(qk, cos, sin)
        v = qkv[:, q_size + kv_size :].view(tokens, num_kv_heads, head_dim)
        write_kv_cache(qk[:, num_heads:], v, key_cache, value_cache, slot_mapping)
        return qk[:, :num_heads]
    cos2, sin2, slots = cos2.contiguous(), sin2.contiguous(), slot_mapping.contiguous()
    lib.specula_rotary_cache(qkv.data_ptr(), qkv.stride(0), tokens, num_heads, num_kv_heads, head_dim,
                             cos2.data_ptr(), sin2.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                             slots.data_ptr(), torch.get_num_threads())
    return qkv[:, :q_size].view(tokens, num_heads, head_dim)


def logit_rows(logits: torch.Tensor, finite: bool = True, argmax: bool = True, normalizer: bool = True
               ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """`[rows, vocab]` logits -> `(finite, argmax, log_normalizer)`, each `[rows]` where asked for, else None:
    whether the row has no NaN nor infinity (bool), the first index of its largest value (long, as `argmax`;
    meaningful for finite rows) and `logsumexp` of the row (float32; -inf values, a grammar's masked tokens, weigh 0;
    NaN where the row has a NaN or a +inf or nothing above -inf).

    One native pass per row where the kernels serve the logits (CPU, float32), else the PyTorch reductions of what
    is asked for (on an accelerator, no more kernels than the caller needs)."""
    lib = _library(logits) if logits.dim() == 2 else None
    if lib is None:
        return (torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1)) if finite else None,
                logits.argmax(dim=-1) if argmax else None,
                torch.logsumexp(logits.float(), dim=-1) if normalizer else None)
    rows, vocab = logits.shape
    out = (torch.empty(rows, dtype=torch.bool) if finite else None,
           torch.empty(rows, dtype=torch.long) if argmax else None,
           torch.empty(rows, dtype=torch.float32) if normalizer else None)
    lib.specula_logit_rows(logits.data_ptr(), logits.stride(0), rows, vocab,
                           *(None if t is None else t.data_ptr() for t in out), torch.get_num_threads())
    return out
