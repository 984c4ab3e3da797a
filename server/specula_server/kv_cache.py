"""The worker's paged KV cache: per layer, keys and values addressed by slot.

`num_slots = num_blocks * block_size`. Blocks are handed out by the router; a request's block table maps its
positions to slots (`slots_for_blocks`). The cache itself knows nothing about requests.

Storage dtype (`--kv-cache-dtype`, vLLM's names): `auto` keeps keys and values in the model's compute dtype;
`bfloat16`/`float16` or fp8 (`fp8`/`fp8_e4m3`: float8_e4m3fn, `fp8_e5m2`: float8_e5m2) store them narrower, so
the same `--kv-cache-memory` holds more blocks (fp8: 4x float32's). Storage only: `write_kv_cache` converts on
write (clamped to the storage range, scale 1.0, as vLLM without calibrated scales) and attention converts back
to the compute dtype when it gathers the context (specula_kernels.paged_attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specula_proto.choices import KVCacheDtype, parse_choice

# Each --kv-cache-dtype value (specula_proto.choices.KVCacheDtype) -> storage dtype; None: the compute dtype.
KV_CACHE_DTYPES: dict[KVCacheDtype, torch.dtype | None] = {
    KVCacheDtype.AUTO: None,
    KVCacheDtype.BFLOAT16: torch.bfloat16,
    KVCacheDtype.FLOAT16: torch.float16,
    KVCacheDtype.FP8: torch.float8_e4m3fn,
    KVCacheDtype.FP8_E4M3: torch.float8_e4m3fn,
    KVCacheDtype.FP8_E4M3FN: torch.float8_e4m3fn,
    KVCacheDtype.FP8_E5M2: torch.float8_e5m2,
}


def parse_kv_cache_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype `--kv-cache-dtype name` asks for on a model computing in `compute_dtype`.

    >>> parse_kv_cache_dtype("fp8", torch.float32)
    torch.float8_e4m3fn
    >>> parse_kv_cache_dtype("auto", torch.bfloat16)
    torch.bfloat16
    """
    return KV_CACHE_DTYPES[parse_choice(KVCacheDtype, name, "--kv-cache-dtype")] or compute_dtype


def _indexable(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, viewed as uint8 where it is float8: CPU has no float8 `index_copy_` (torch 2.13)."""
    return tensor.view(torch.uint8) if tensor.element_size() == 1 and tensor.is_floating_point() else tensor


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
        extra_slots: int = 0,
    ) -> KVCache:
        """`extra_slots` past the blocks' slots belong to no block: CUDA graphs' padding rows write there."""
        shape = (num_blocks * block_size + extra_slots, num_kv_heads, head_dim)
        layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
        return cls(layers=layers, num_blocks=num_blocks, block_size=block_size)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copies every layer's keys and values from slots `src` to slots `dst` (all read before any write).

        Bytes are copied as they are stored, whatever the storage dtype (fp8 through a uint8 view)."""
        for layer in self.layers:
            for cache in map(_indexable, layer):
                cache.index_copy_(0, dst, cache.index_select(0, src))

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0][0].dtype if self.layers else torch.float32


def slots_for_blocks(blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot of every position a block table covers: position p -> blocks[p // bs] * bs + p % bs.

    >>> slots_for_blocks(torch.tensor([3, 0]), 2).tolist()
    [6, 7, 0, 1]
    """
    offsets = torch.arange(block_size, device=blocks.device)
    return (blocks.long().unsqueeze(1) * block_size + offsets).flatten()
