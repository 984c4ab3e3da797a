"""Tensor-parallel building blocks (Megatron style).

Column-parallel linears split output features across ranks and need no communication; row-parallel linears
split input features and sum partial results with an all-reduce. The embedding and LM head split the
vocabulary. Each layer reads only its rank's slice of the checkpoint through `Weights`.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specula_server.distributed import ShardGroup
from specula_server.weights import Weights


def _linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ weight_t + bias` with the weight stored input-major (`[in, out]`).

    Checkpoints store `[out, in]`; we keep the transpose because single-token decode on CPU is a
    matrix-vector product bound by memory bandwidth, and MKL streams an `[in, out]` matrix about 1.4x
    faster than an `[out, in]` one (19.5 vs 14 GB/s measured on the 2-core benchmark machine, up to 2x on
    the LM head). Large-batch GEMMs run at the same speed either way.
    """
    if bias is None:
        return torch.matmul(x, weight_t)
    return torch.addmm(bias, x, weight_t) if x.dim() == 2 else torch.matmul(x, weight_t) + bias


class ColumnParallelLinear(nn.Module):
    """`y = x W^T + b` with W's rows (output features) split across ranks; one or several fused weights."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        # Input-major copy of the checkpoint's [out_local, in] weight; see `_linear`.
        self.weight_t = nn.Parameter(weight.t().contiguous(), requires_grad=False)  # [in, out_local]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def load(cls, weights: Weights, prefixes: Sequence[str], bias: bool) -> ColumnParallelLinear:
        """Loads `{prefix}.weight` for each prefix, sharded on dim 0 and concatenated (fused q/k/v, gate/up)."""
        weight = weights.get_packed_sharded([f"{p}.weight" for p in prefixes], dim=0)
        b = weights.get_packed_sharded([f"{p}.bias" for p in prefixes], dim=0) if bias else None
        return cls(weight, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.weight_t, self.bias)


class RowParallelLinear(nn.Module):
    """`y = x W^T + b` with W's columns (input features) split across ranks; partial sums all-reduced."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: ShardGroup) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(weight.t().contiguous(), requires_grad=False)  # [in_local, out]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    @classmethod
    def load(cls, weights: Weights, prefix: str, bias: bool, group: ShardGroup) -> RowParallelLinear:
        weight = weights.get_sharded(f"{prefix}.weight", dim=1)
        b = weights.get_tensor(f"{prefix}.bias") if bias else None
        return cls(weight, b, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce(_linear(x, self.weight_t, None))
        # The bias is added once, after the reduction, so it is not counted world_size times.
        return out if self.bias is None else out + self.bias


def _vocab_shard(weights: Weights, name: str, group: ShardGroup) -> tuple[torch.Tensor, int]:
    """This rank's rows of a `[vocab, hidden]` matrix, padded so every rank holds the same count."""
    full_rows = weights.shape(name)[0]
    rows = -(-full_rows // group.world_size)  # ceil: the last rank may hold padding rows
    start = group.rank * rows
    if full_rows % group.world_size == 0:
        return weights.get_sharded(name, dim=0), start
    part = weights.get_tensor(name)[start : start + rows]
    if part.shape[0] < rows:
        part = torch.cat([part, part.new_zeros(rows - part.shape[0], part.shape[1])])
    return part, start


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across ranks; each rank embeds the ids it owns."""

    def __init__(self, weights: Weights, name: str, group: ShardGroup) -> None:
        super().__init__()
        weight, self.vocab_start = _vocab_shard(weights, name, group)
        self.weight = nn.Parameter(weight, requires_grad=False)  # [vocab_local, hidden]
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(out)


class ParallelLMHead(nn.Module):
    """LM head with the vocabulary split across ranks; logits are gathered so every rank sees all of them."""

    def __init__(self, weights: Weights, name: str, group: ShardGroup) -> None:
        super().__init__()
        weight, _ = _vocab_shard(weights, name, group)
        self.weight_t = nn.Parameter(weight.t().contiguous(), requires_grad=False)  # [hidden, vocab_local]
        self.vocab_size = weights.shape(name)[0]
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        logits = _linear(hidden, self.weight_t, None)
        if self.group.world_size == 1:
            return logits
        return self.group.all_gather(logits, dim=-1)[:, : self.vocab_size]
