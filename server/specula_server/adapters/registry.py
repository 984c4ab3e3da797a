"""The worker's loaded adapters, and the per-step view of them the model reads.

Loaded LoRA adapters live in fixed slots (`max_active` of them). For every layer and projection the registry
keeps two stacks, `A [slots, d_in, r_max]` and `B [slots, r_max, d_out]` (ranks below `r_max` are
zero-padded; the LoRA scaling is folded into B), which is the layout the segmented gather-matmul reads.

A step's tokens are laid out request after request, so the tokens of one request form a segment; a
`LoraBatch` says which slot each segment uses (-1: the base model), separately per projection, since an
adapter that targets only q and v costs nothing in the other projections.

Loading runs beside the steps (another thread): the weights are read and checked first, then written into a
free slot, which no running request reads. When a bigger rank needs wider stacks, new stacks are built and
swapped in as one new `LoraStacks` object; a step holds the one it started with.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specula_kernels.sgmv import SlotGroups, lora_delta_grouped, sgmv, slot_groups, triton_available
from specula_proto.choices import AdapterKind
from specula_server.adapters.lora import LoraWeights, load_lora, lora_weights, read_lora, shard_factors
from specula_server.adapters.medusa import MedusaHeads, load_medusa
from specula_server.adapters.merge import MergeSpec, merge_lora
from specula_server.adapters.sources import AdapterError, detect_adapter_kind, resolve_adapter

if TYPE_CHECKING:  # the model imports this module
    from specula_server.models.config import ModelConfig

logger = logging.getLogger("specula.adapters")

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraStacks:
    """Per `(layer, projection)` stacked A and B over the slots; only projections some adapter targets."""

    rank: int
    a: dict[tuple[int, str], torch.Tensor]
    b: dict[tuple[int, str], torch.Tensor]


@dataclass(frozen=True)
class LoadedAdapter:
    adapter_id: str
    kind: AdapterKind
    slot: int
    rank: int
    projections: frozenset[str]
    load_seconds: float
    medusa: MedusaHeads | None = None  # the adapter's Medusa heads ("medusa" and "lora+medusa" adapters)


@dataclass
class LoraBatch:
    """Which adapter slot each segment of a step's tokens uses, per projection."""

    stacks: LoraStacks
    seg_starts: torch.Tensor  # [num_segments + 1]
    seg_slots: dict[str, torch.Tensor] = field(default_factory=dict)  # projection -> [num_segments]
    # Per distinct seg_slots tensor (projections with the same slots share one), built once per step.
    _grouped: dict[int, SlotGroups | None] = field(default_factory=dict)

    def _groups(self, slots: torch.Tensor) -> SlotGroups | None:
        key = id(slots)
        if key not in self._grouped:
            self._grouped[key] = slot_groups(self.seg_starts, slots)
        return self._grouped[key]

    def delta(self, layer: int, projection: str, x: torch.Tensor) -> torch.Tensor | None:
        """`x @ A @ B` of each token's adapter for one projection (None when no token's adapter has it)."""
        slots = self.seg_slots.get(projection)
        a = self.stacks.a.get((layer, projection))
        if slots is None or a is None:
            return None
        if not (x.is_cuda and triton_available()):  # CPU: one batched product per side, whatever the adapters
            groups = self._groups(slots)
            if groups is None:
                return None
            return lora_delta_grouped(x, a, self.stacks.b[(layer, projection)], groups)
        shrunk = sgmv(x, a, self.seg_starts, slots)
        return sgmv(shrunk, self.stacks.b[(layer, projection)], self.seg_starts, slots)

    def add(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Adds the projection's delta into `out` (a view of the fused layer's output columns) in place."""
        d = self.delta(layer, projection, x)
        if d is not None:
            out += d


class AdapterRegistry:
    def __init__(
        self,
        config: ModelConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device = torch.device("cpu"),
        max_active: int = 8,
        local_roots: Sequence[Path] = (),
        hub_cache: Path | None = None,
    ) -> None:
        if max_active < 1:
            raise ValueError("max_active adapters must be at least 1")
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.dtype, self.device = dtype, device
        self.max_active = max_active
        self.local_roots = tuple(Path(r) for r in local_roots)
        self.hub_cache = hub_cache
        self.adapters: dict[str, LoadedAdapter] = {}
        self.stacks = LoraStacks(0, {}, {})
        self._lock = threading.Lock()  # one load or offload at a time; steps never take it

    # --- lifecycle (called beside the steps) ------------------------------------------------------------------

    def load(self, adapter_id: str, source: str = "hub", api_token: str | None = None,
             merge: MergeSpec | None = None) -> LoadedAdapter:
        """Fetches, checks and installs an adapter; raises `AdapterError` (400/424) when it cannot.

        With `merge`, `adapter_id` names the merge (the router's key for it) and the adapters it lists are read
        from `source` and merged (`adapters/merge.py`); the merged adapter takes one slot like any other.
        """
        with self._lock:
            if adapter_id in self.adapters:
                return self.adapters[adapter_id]
            started = time.perf_counter()
            used = {a.slot for a in self.adapters.values()}
            free = [s for s in range(self.max_active) if s not in used]
            if not free:
                raise AdapterError(f"adapter `{adapter_id}`: all {self.max_active} adapter slots are in use; "
                                   "offload one first", status=424)
            if merge is None:
                kind, weights, medusa = self._read(adapter_id, source, api_token)
            else:
                kind, weights, medusa = AdapterKind.LORA, self._merged(adapter_id, merge, source, api_token), None
            rank, projections = 0, frozenset()
            if weights is not None:
                self._install(weights, free[0])
                rank, projections = weights.config.rank, weights.projections
            loaded = LoadedAdapter(adapter_id, kind, free[0], rank, projections, time.perf_counter() - started,
                                   medusa)
            self.adapters[adapter_id] = loaded
            logger.info("loaded %s adapter %s (rank %d, %s%s) into slot %d in %.2fs", kind, adapter_id,
                        loaded.rank, ",".join(sorted(projections)) or "no LoRA",
                        f", {medusa.num_heads} Medusa heads" if medusa is not None else "", loaded.slot,
                        loaded.load_seconds)
            return loaded

    def _read(self, adapter_id: str, source: str,
              api_token: str | None) -> tuple[AdapterKind, LoraWeights | None, MedusaHeads | None]:
        """(kind, LoRA weights for this rank, Medusa heads) of one adapter."""
        path = resolve_adapter(adapter_id, source, local_roots=self.local_roots, api_token=api_token,
                               cache_dir=self.hub_cache)
        kind = detect_adapter_kind(path, adapter_id)
        medusa = weights = None
        if kind.has_medusa:  # heads are small and replicated on every shard, so every shard drafts alike
            medusa = load_medusa(path, self.config, dtype=self.dtype, device=self.device, adapter_id=adapter_id)
        if kind.has_lora:
            weights = load_lora(path, self.config, rank=self.rank, world_size=self.world_size,
                                dtype=self.dtype, device=self.device, adapter_id=adapter_id)
        return kind, weights, medusa

    def _merged(self, name: str, merge: MergeSpec, source: str, api_token: str | None) -> LoraWeights:
        """The merge's weights for this rank: every adapter read whole, merged on the CPU in float32 (the same
        weights on every rank and device), then sharded and cast."""
        adapters = []
        for adapter_id in merge.adapter_ids:
            path = resolve_adapter(adapter_id, source, local_roots=self.local_roots, api_token=api_token,
                                   cache_dir=self.hub_cache)
            if not detect_adapter_kind(path, adapter_id).has_lora:
                raise AdapterError(f"adapter `{adapter_id}`: only LoRA adapters can be merged "
                                   "(`merged_adapters`); this one has Medusa heads only", status=424)
            lora, factors, _ = read_lora(path, self.config, adapter_id=adapter_id)
            adapters.append((lora, factors))
        config, factors = merge_lora(merge, adapters)
        factors = shard_factors(factors, self.rank, self.world_size)
        return lora_weights(config, factors, config.scaling, name, dtype=self.dtype, device=self.device)

    def offload(self, adapter_id: str) -> bool:
        with self._lock:
            loaded = self.adapters.pop(adapter_id, None)
            if loaded is None:
                return False
            for key in self.stacks.a:  # a stale slot must read as zeros if it were ever used by mistake
                self.stacks.a[key][loaded.slot].zero_()
                self.stacks.b[key][loaded.slot].zero_()
            logger.info("offloaded adapter %s from slot %d", adapter_id, loaded.slot)
            return True

    def _install(self, weights: LoraWeights, slot: int) -> None:
        """Writes `weights` into `slot`, first widening or extending the stacks when they cannot hold them."""
        rank = max(self.stacks.rank, weights.config.rank)
        keys = {(layer, p) for layer, projs in weights.layers.items() for p in projs}
        stacks = self.stacks
        if rank > stacks.rank or not keys <= stacks.a.keys():
            stacks = self._grown(stacks, rank, keys, weights)
        for (layer, p) in keys:
            a, b = weights.layers[layer][p]
            r = a.shape[1]
            stacks.a[(layer, p)][slot].zero_()
            stacks.a[(layer, p)][slot, :, :r].copy_(a)
            stacks.b[(layer, p)][slot].zero_()
            stacks.b[(layer, p)][slot, :r, :].copy_(b)
        for key in stacks.a.keys() - keys:  # projections this adapter leaves alone
            stacks.a[key][slot].zero_()
            stacks.b[key][slot].zero_()
        self.stacks = stacks  # one reference swap: a step in flight keeps the stacks it started with

    def _grown(self, old: LoraStacks, rank: int, keys: set, weights: LoraWeights) -> LoraStacks:
        a, b = {}, {}
        for key in old.a.keys() | keys:
            if key in old.a:
                d_in, d_out = old.a[key].shape[1], old.b[key].shape[2]
            else:
                layer, p = key
                d_in, d_out = weights.layers[layer][p][0].shape[0], weights.layers[layer][p][1].shape[1]
            a[key] = torch.zeros(self.max_active, d_in, rank, dtype=self.dtype, device=self.device)
            b[key] = torch.zeros(self.max_active, rank, d_out, dtype=self.dtype, device=self.device)
            if key in old.a:
                a[key][:, :, : old.rank].copy_(old.a[key])
                b[key][:, : old.rank, :].copy_(old.b[key])
        return LoraStacks(rank, a, b)

    # --- per step -----------------------------------------------------------------------------------------------

    def medusa_heads(self, adapter_id: str) -> MedusaHeads | None:
        loaded = self.adapters.get(adapter_id) if adapter_id else None
        return loaded.medusa if loaded is not None else None

    def check(self, adapter_id: str) -> None:
        if adapter_id and adapter_id not in self.adapters:
            raise AdapterError(f"adapter `{adapter_id}` is not loaded on this worker", status=424)

    def batch(self, adapter_ids: Sequence[str], counts: Sequence[int]) -> LoraBatch | None:
        """The step view for requests with these adapters ('' for none) feeding `counts` tokens each."""
        if not any(adapter_ids):
            return None
        # Consecutive requests with the same adapter form one segment.
        seg_ids: list[str] = []
        seg_starts = [0]
        for adapter_id, count in zip(adapter_ids, counts):
            if seg_ids and seg_ids[-1] == adapter_id:
                seg_starts[-1] += count
            else:
                seg_ids.append(adapter_id)
                seg_starts.append(seg_starts[-1] + count)
        loaded = [self.adapters.get(a) if a else None for a in seg_ids]
        seg_slots = {}
        shared: dict[tuple[int, ...], torch.Tensor] = {}  # projections with the same slots share one tensor
        for p in PROJECTIONS:
            slots = tuple(x.slot if x is not None and p in x.projections else -1 for x in loaded)
            if any(s >= 0 for s in slots):
                if slots not in shared:
                    shared[slots] = torch.tensor(slots, dtype=torch.int32, device=self.device)
                seg_slots[p] = shared[slots]
        return LoraBatch(self.stacks, torch.tensor(seg_starts, dtype=torch.int32, device=self.device), seg_slots)
