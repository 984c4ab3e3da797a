"""The worker's paged KV cache: per layer, keys and values addressed by slot.

`num_slots = num_blocks * block_size`. Blocks are handed out by the router; a request's block table maps its
positions to slots (`slots_for_blocks`). The cache itself knows nothing about requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: ([num_slots, kv_heads, head_dim], same)
    num_blocks: int
    block_size: int

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element

    @classmethod
    def allocate(
        cls,
        num_blocks: int,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
        return cls(layers=layers, num_blocks=num_blocks, block_size=block_size)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copies every layer's keys and values from slots `src` to slots `dst` (all read before any write)."""
        for keys, values in self.layers:
            keys.index_copy_(0, dst, keys.index_select(0, src))
            values.index_copy_(0, dst, values.index_select(0, src))


def slots_for_blocks(blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot of every position a block table covers: position p -> blocks[p // bs] * bs + p % bs.

    >>> slots_for_blocks(torch.tensor([3, 0]), 2).tolist()
    [6, 7, 0, 1]
    """
    offsets = torch.arange(block_size, device=blocks.device)
    return (blocks.long().unsqueeze(1) * block_size + offsets).flatten()
