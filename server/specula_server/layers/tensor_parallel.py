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

from specula_kernels.linear import default_num_parts, linear, pack_weight
from specula_server.distributed import ShardGroup
from specula_server.weights import Weights


class ColumnParallelLinear(nn.Module):
    """`y = x W^T + b` with W's rows (output features) split across ranks; one or several fused weights."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        parts = default_num_parts(weight.shape[0], weight.device)
        self.weight = nn.Parameter(pack_weight(weight, parts), requires_grad=False)  # [parts, in, out_local/parts]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def load(cls, weights: Weights, prefixes: Sequence[str], bias: bool) -> ColumnParallelLinear:
        """Loads `{prefix}.weight` for each prefix, sharded on dim 0 and concatenated (fused q/k/v, gate/up)."""
        weight = weights.get_packed_sharded([f"{p}.weight" for p in prefixes], dim=0)
        b = weights.get_packed_sharded([f"{p}.bias" for p in prefixes], dim=0) if bias else None
        return cls(weight, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """`y = x W^T + b` with W's columns (input features) split across ranks; partial sums all-reduced."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: ShardGroup) -> None:
        super().__init__()
        parts = default_num_parts(weight.shape[0], weight.device)
        self.weight = nn.Parameter(pack_weight(weight, parts), requires_grad=False)  # [parts, in_local, out/parts]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    @classmethod
    def load(cls, weights: Weights, prefix: str, bias: bool, group: ShardGroup) -> RowParallelLinear:
        weight = weights.get_sharded(f"{prefix}.weight", dim=1)
        b = weights.get_tensor(f"{prefix}.bias") if bias else None
        return cls(weight, b, group)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """`delta`: this shard's partial extra output (a LoRA delta), summed by the same all-reduce."""
        out = linear(x, self.weight)
        if delta is not None:
            out = out + delta
        out = self.group.all_reduce(out)
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
        parts = default_num_parts(weight.shape[0], weight.device)
        self.weight = nn.Parameter(pack_weight(weight, parts), requires_grad=False)  # [parts, hidden, vocab_local/parts]
        self.vocab_size = weights.shape(name)[0]
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        logits = linear(hidden, self.weight)
        if self.group.world_size == 1:
            return logits
        return self.group.all_gather(logits, dim=-1)[:, : self.vocab_size]
