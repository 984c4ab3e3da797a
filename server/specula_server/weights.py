"""Checkpoint reader that gives one tensor-parallel rank exactly its slice of each tensor.

Reads safetensors files, and GGUF files through `gguf_checkpoint.GGUFTensors` (the same handle interface, with
tensors under Hugging Face names, dequantized as they are read).

Sits between `hub.weight_files` (which safetensors files make up a checkpoint) and the model's layers: a
column-parallel linear asks for `get_sharded(name, dim=0)`, a row-parallel one for `get_sharded(name, dim=1)`,
fused projections for `get_packed_sharded([q, k, v], dim=0)`, and replicated tensors (norms, row-parallel
biases) for `get_tensor`. Sharded reads go through safetensors' `get_slice`, so a rank reads only its own
block from the memory-mapped file and never materialises the full tensor.

Example, world_size 2, a [6, 4] weight sharded on dim 0: rank 0 gets rows 0..2, rank 1 rows 3..5.

`quantization` (`--quantize`) travels with the reader to the layers that build linears from its tensors: each
quantizes the slice it read (`layers/quantization.py`). Linears read through `get_linear`, which under
`--quantize gguf` hands out a GGUF file's own blocks (`GGUFBlocks`) instead of float values where it can.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import Tensor

from specula_kernels.gguf_blocks import GGUFBlocks
from specula_server.gguf_checkpoint import GGUF_SUFFIX, GGUFTensors

if TYPE_CHECKING:
    from specula_server.layers.quantization import Quantization


class WeightNotFoundError(KeyError):
    """A tensor name is absent from every checkpoint file."""

    def __init__(self, name: str, files: Sequence[Path]) -> None:
        self.name = name
        self.files = list(files)
        self.message = f"Tensor '{name}' not found in checkpoint files {[str(f) for f in files]}"
        super().__init__(self.message)

    def __str__(self) -> str:
        # KeyError's default str() is the repr of its argument; show the plain sentence instead.
        return self.message


class Weights:
    """Name-routed, rank-aware access to the tensors of a (possibly sharded) safetensors or GGUF checkpoint.

    Floating-point tensors come back as `dtype` on `device`; integer tensors (quantised weights, index
    buffers) keep their dtype and only move to `device`. Every name passed in is prefixed with `prefix`
    ("base_model.model." for an adapter, say); `names()` returns the names under `prefix` without it, so they
    round-trip through `has`/`get_*`. Every returned tensor is contiguous and owns its memory: callers may
    modify it in place without affecting other reads.
    """

    def __init__(
        self,
        files: Sequence[Path],
        device: torch.device,
        dtype: torch.dtype,
        rank: int = 0,
        world_size: int = 1,
        prefix: str = "",
        quantization: Quantization | None = None,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if not files:
            raise ValueError("Weights needs at least one safetensors file")
        self.files = [Path(f) for f in files]
        self.device = device
        self.dtype = dtype
        self.rank = rank
        self.world_size = world_size
        self.prefix = prefix
        self.quantization = quantization  # the format of linear layers built from these tensors; None: float
        # Handles stay open for the loader's lifetime: opening parses the header, reads are mmap-backed.
        self._handles: dict[Path, Any] = {}
        self._routing: dict[str, Path] = {}  # full tensor name -> file holding it
        self._stored: dict[str, str] = {}  # full tensor name -> the name the file has for it, where they differ
        for file in self.files:
            handle = GGUFTensors(file) if file.suffix == GGUF_SUFFIX else safe_open(str(file), framework="pt")
            self._handles[file] = handle
            for name in handle.keys():
                if name in self._routing:
                    raise ValueError(f"Tensor '{name}' is in both {self._routing[name]} and {file}")
                self._routing[name] = file

    def has(self, name: str) -> bool:
        return self.prefix + name in self._routing

    def names(self) -> list[str]:
        """Sorted names under `prefix`, with `prefix` removed."""
        cut = len(self.prefix)
        return sorted(full[cut:] for full in self._routing if full.startswith(self.prefix))

    def shape(self, name: str) -> list[int]:
        """The full (unsharded) shape of `name`, read from the file header only."""
        full_name, handle = self._handle(name)
        return list(handle.get_slice(full_name).get_shape())

    def get_tensor(self, name: str, to_dtype: bool = True) -> Tensor:
        """The whole tensor, for weights every rank holds in full. `to_dtype=False` keeps the file's dtype."""
        full_name, handle = self._handle(name)
        return self._place(handle.get_tensor(full_name), to_dtype)

    def get_sharded(self, name: str, dim: int) -> Tensor:
        """This rank's contiguous block of `name` along `dim`; the size along `dim` must divide by world_size.

        Only the block is read: e.g. a [8, 6] tensor, dim=1, world_size=2, rank=1 reads `[:, 3:6]` -> [8, 3].
        """
        full_name, handle = self._handle(name)
        tensor_slice = handle.get_slice(full_name)
        shape: list[int] = tensor_slice.get_shape()
        if not -len(shape) <= dim < len(shape):
            raise ValueError(f"Cannot shard tensor '{full_name}' of shape {shape} along dim {dim}")
        dim %= len(shape)
        size = shape[dim]
        if size % self.world_size != 0:
            raise ValueError(
                f"Cannot shard tensor '{full_name}' of shape {shape} along dim {dim}: "
                f"size {size} is not divisible by world_size {self.world_size}"
            )
        block = size // self.world_size
        start = self.rank * block
        index = (slice(None),) * dim + (slice(start, start + block),)
        return self._place(tensor_slice[index], to_dtype=True)

    def get_packed_sharded(self, names: Sequence[str], dim: int) -> Tensor:
        """Each tensor sharded along `dim`, then concatenated along `dim` in the order given.

        For a fused q/k/v projection each rank gets [q_shard; k_shard; v_shard], which is what a
        column-parallel fused layer needs: the split sizes after the matmul are the per-rank head counts.
        """
        if not names:
            raise ValueError("get_packed_sharded needs at least one tensor name")
        shards = [self.get_sharded(name, dim) for name in names]
        return torch.cat(shards, dim=dim)

    def get_linear(self, names: Sequence[str], dim: int) -> Tensor | GGUFBlocks:
        """A linear layer's weight for this rank: `names` sharded along `dim` and fused along dim 0, as
        `get_packed_sharded`. Under `--quantize gguf`, the file's own blocks when every tensor is of a type the
        native kernels serve (`gguf_blocks.NATIVE_TYPES`), all of one type, and the rank takes whole rows (of whole
        heads for q/k); otherwise float values."""
        from specula_server.layers.quantization import gguf_blocks_served

        if (self.quantization is not None and self.quantization.method == "gguf" and
                (dim == 0 or self.world_size == 1) and gguf_blocks_served(self.device)):
            parts = [self._blocks(name) for name in names]
            if all(p is not None for p in parts) and len({p.type_name for p in parts}) == 1:
                return GGUFBlocks.cat(parts)
        return self.get_packed_sharded(names, dim)

    def _blocks(self, name: str) -> GGUFBlocks | None:
        full_name, handle = self._handle(name)
        if not isinstance(handle, GGUFTensors):
            return None
        rows = handle.get_slice(full_name).get_shape()[0]
        if rows % self.world_size:
            return None
        block = rows // self.world_size
        blocks = handle.get_blocks(full_name, self.rank * block, (self.rank + 1) * block)
        if blocks is None:
            return None
        return GGUFBlocks(blocks.type_name, blocks.data.to(self.device), blocks.in_features)

    def rename_prefix(self, old: str, new: str) -> None:
        """Serves the tensors the files name `old...` as `new...` (a checkpoint layout that names them otherwise)."""
        for stored in [name for name in self._routing if name.startswith(old)]:
            served = new + stored[len(old):]
            self._routing[served] = self._routing.pop(stored)
            self._stored[served] = self._stored.pop(stored, stored)

    def _handle(self, name: str) -> tuple[str, Any]:
        full_name = self.prefix + name
        file = self._routing.get(full_name)
        if file is None:
            raise WeightNotFoundError(full_name, self.files)
        return self._stored.get(full_name, full_name), self._handles[file]

    def _place(self, tensor: Tensor, to_dtype: bool) -> Tensor:
        # safetensors (0.8 at least) hands out zero-copy views into one private mmap per handle: every read of a
        # tensor aliases the same memory, so an in-place edit of one weight (a fused norm, say) would leak
        # into later reads (tied embeddings read the same tensor twice), and a dim-1 shard would be a
        # strided view. copy=True gives an owned, contiguous tensor of exactly the slice's size, in the
        # same single copy that a device or dtype change makes anyway.
        dtype = self.dtype if to_dtype and tensor.is_floating_point() else tensor.dtype
        return tensor.to(device=self.device, dtype=dtype, copy=True)
