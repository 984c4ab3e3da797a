"""Tensor-parallel building blocks (Megatron style).

Column-parallel linears split output features across ranks and need no communication; row-parallel linears
split input features and sum partial results with an all-reduce. The embedding and LM head split the
vocabulary. Each layer reads only its rank's slice of the checkpoint through `Weights`, and holds it in the
format `Weights.quantization` asks for (`quantization.build_linear`: float, int8, int4 or a GGUF file's blocks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specula_server.distributed import ShardGroup
from specula_server.layers.quantization import Quantization, build_linear
from specula_server.weights import Weights


class ColumnParallelLinear(nn.Module):
    """`y = x W^T + b` with W's rows (output features) split across ranks; one or several fused weights."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quantization: Quantization | None = None,
                 name: str = "linear") -> None:
        super().__init__()
        self.linear = build_linear(weight, quantization, name)  # [m, in] -> [m, out_local]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def load(cls, weights: Weights, prefixes: Sequence[str], bias: bool) -> ColumnParallelLinear:
        """Loads `{prefix}.weight` for each prefix, sharded on dim 0 and concatenated (fused q/k/v, gate/up)."""
        weight = weights.get_linear([f"{p}.weight" for p in prefixes], dim=0)
        b = weights.get_packed_sharded([f"{p}.bias" for p in prefixes], dim=0) if bias else None
        return cls(weight, b, weights.quantization, " + ".join(prefixes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        return out if self.bias is None else out + self.bias


class RowParallelLinear(nn.Module):
    """`y = x W^T + b` for an input split across ranks (the output of a column-parallel layer).

    Float weights: W's columns (input features) are split and the partial sums all-reduced. Quantized weights
    with several ranks: W's rows (output features) are split instead; the ranks all-gather the input, each
    computes its share of the outputs over the whole input, and the outputs are all-gathered. The quantized
    kernels round their output to bfloat16, so partial sums would each be rounded before they are added and
    two ranks would not compute what one does (greedy output parted from one rank's within a few tokens on the
    test model); whole dot products are the same, bit for bit, at any rank count.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: ShardGroup,
                 quantization: Quantization | None = None, name: str = "linear") -> None:
        super().__init__()
        self.splits_outputs = quantization is not None and group.world_size > 1
        # [m, in_local] -> [m, out]; when splitting outputs, [m, in] -> [m, out_local]
        self.linear = build_linear(weight, quantization, name)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    @classmethod
    def load(cls, weights: Weights, prefix: str, bias: bool, group: ShardGroup) -> RowParallelLinear:
        splits_outputs = weights.quantization is not None and group.world_size > 1
        weight = weights.get_linear([f"{prefix}.weight"], dim=0 if splits_outputs else 1)
        b = weights.get_tensor(f"{prefix}.bias") if bias else None
        return cls(weight, b, group, weights.quantization, prefix)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """`x`: this shard's inputs `[m, in_local]`; `delta`: its partial extra output (a LoRA delta), summed
        over the shards."""
        if self.splits_outputs:
            out = self.group.all_gather(self.linear(self.group.all_gather(x, dim=-1)), dim=-1)
            if delta is not None:
                out = out + self.group.all_reduce(delta)
        else:
            out = self.linear(x)
            if delta is not None:
                out = out + delta  # summed by the same all-reduce
            out = self.group.all_reduce(out)
        # The bias is added once, after the reduction, so it is not counted world_size times.
        return out if self.bias is None else out + self.bias


def _vocab_shard(weights: Weights, name: str, group: ShardGroup, linear: bool = False) -> tuple[torch.Tensor, int]:
    """This rank's rows of a `[vocab, hidden]` matrix, padded so every rank holds the same count; `linear`: for a
    product (`Weights.get_linear`: a GGUF file's blocks under `--quantize gguf`)."""
    full_rows = weights.shape(name)[0]
    rows = -(-full_rows // group.world_size)  # ceil: the last rank may hold padding rows
    start = group.rank * rows
    if full_rows % group.world_size == 0:
        return weights.get_linear([name], dim=0) if linear else weights.get_sharded(name, dim=0), start
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
        weight, _ = _vocab_shard(weights, name, group, linear=True)
        self.linear = build_linear(weight, weights.quantization, f"the LM head ({name})")  # -> [m, vocab_local]
        self.vocab_size = weights.shape(name)[0]
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        logits = self.linear(hidden)
        if self.group.world_size == 1:
            return logits
        return self.group.all_gather(logits, dim=-1)[:, : self.vocab_size]
