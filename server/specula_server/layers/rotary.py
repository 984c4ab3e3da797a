"""Rotary position embeddings (RoPE), including Llama 3.1 frequency scaling.

cos/sin tables for every position up to the model's limit are built once; a step indexes them by position.
The rotation is the "rotate half" form Hugging Face Llama checkpoints are trained with.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from specula_server.models.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    # float32 throughout, as the checkpoints' reference implementation computes it.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth blend in between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos().to(device=device, dtype=dtype), persistent=False)
        # The sine with its first half negated: `specula_kernels.fused.apply_rotary` then needs no negation of its
        # own (exact: a sign).
        sin = emb.sin()
        sin[:, : head_dim // 2].neg_()
        self.register_buffer("sin", sin.to(device=device, dtype=dtype), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and the half-negated sin (see `specula_kernels.fused.apply_rotary`) for the step's positions,
        `[num_tokens, 1, head_dim]`, shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
