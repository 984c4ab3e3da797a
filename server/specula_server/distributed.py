"""Tensor-parallel process group of a model worker.

Each worker process is one rank. `init_distributed` joins the group from the launcher's `RANK`,
`WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` (gloo on CPU, NCCL on CUDA); layers then call the collectives
through `ShardGroup`, which skips communication entirely when there is a single rank.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger("specula.distributed")


@dataclass(frozen=True)
class ShardGroup:
    """This rank's place in the tensor-parallel group."""

    rank: int = 0
    world_size: int = 1

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sums (or takes the maximum, `op="max"`) `tensor` over ranks in place (no-op on one rank)."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenates every rank's `tensor` along `dim` (rank order)."""
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=dim)

    def agreed_max(self, value: float, device: torch.device) -> float:
        """The largest of every rank's `value`, on every rank (`value` itself on one rank)."""
        if self.world_size == 1:
            return value
        agreed = torch.tensor([value], dtype=torch.float64, device=device)
        return float(self.all_reduce(agreed, op="max"))

    def all_gather_object(self, value: object) -> list:
        """Every rank's `value` (picklable), in rank order."""
        if self.world_size == 1:
            return [value]
        values: list = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def init_distributed(
    rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device
) -> ShardGroup:
    """Joins the tensor-parallel group; a single rank needs no process group."""
    if world_size == 1:
        return ShardGroup()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    logger.info("rank %d/%d joining %s group at %s:%d", rank, world_size, backend, master_addr, master_port)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=10),
    )
    return ShardGroup(rank=rank, world_size=world_size)
