"""Merged LoRA adapters (LoRAX's `merged_adapters`): several PEFT LoRA adapters combined into one adapter.

The registry (`adapters/registry.py`) reads each adapter whole (`lora.read_lora`), calls `merge_lora`, shards the
result for its rank and installs it in a slot like any adapter; the router names it by its whole specification, so
a repeated merge finds it loaded. The arithmetic is PEFT's `add_weighted_adapter`, step for step, on float32 CPU
tensors in PEFT's layout (`lora_A [r, in]`, `lora_B [out, r]`), so that every rank and every device computes the same
weights:

  - adapters of one rank: each factor is merged on its own (PEFT's `linear`, `ties`, `dare_linear`, `dare_ties`),
    with weight `sqrt(|w s|)` on both factors and w's sign on A (`s` the adapter's scaling). This is PEFT's cheap
    approximation: (sum_i a_i A_i)(sum_i b_i B_i) has cross terms, so it is not sum_i w_i s_i B_i A_i;
  - adapters of different ranks, `linear`: the factors are concatenated (PEFT's `cat`), the exact weighted sum of
    the adapters' products, of rank sum(r_i);
  - adapters of different ranks, the others: the products B_i A_i s_i are merged and truncated back to rank
    max(r_i) by an SVD (PEFT's `ties_svd`, `dare_linear_svd`, `dare_ties_svd`): one SVD per module, slow for large
    projections (seconds each on a CPU for 4096 x 4096).
The merged adapter has scaling 1 (PEFT sets `lora_alpha = r`); PEFT also copies the first adapter's `use_rslora`,
which would scale the merge by sqrt(r): that is not done here, so a merge of one adapter with weight 1 is that
adapter, rslora or not. A single adapter is always merged linearly, as PEFT does.

TIES keeps the `density` fraction of each tensor's entries of largest magnitude (per adapter), elects each entry's
sign (`total`: the sign of the entries' sum; `frequency`: the sign most entries have) and averages the entries of
that sign. DARE drops each entry with probability 1 - density and divides the kept ones by density; its draws come
from a generator seeded with the merge's seed, in PEFT's order (layer by layer, q k v o gate up down, A then B,
adapter by adapter), so the same merge always gives the same weights. Example: linear, ids [a, b], weights
[0.5, 0.5], both rank 8 with scaling 2: A = A_a + A_b, B = B_a + B_b (sqrt(0.5 * 2) = 1), rank 8, scaling 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specula_server.adapters.lora import PROJECTIONS, Factors, LoraConfig

STRATEGIES = ("linear", "ties", "dare_linear", "dare_ties")
SIGN_METHODS = ("total", "frequency")


@dataclass(frozen=True)
class MergeSpec:
    """What to merge, as the router checked it (`router/specula_router/merges.py`)."""

    adapter_ids: tuple[str, ...]
    weights: tuple[float, ...]
    strategy: str = "linear"
    density: float = 1.0  # fraction kept by ties and dare merges, in (0, 1]
    majority_sign_method: str = "total"
    seed: int = 0  # DARE's draws

    def __post_init__(self) -> None:
        if not self.adapter_ids or len(self.weights) != len(self.adapter_ids):
            raise ValueError(f"a merge needs at least one adapter and one weight per adapter; got "
                             f"{len(self.adapter_ids)} ids and {len(self.weights)} weights")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"merge strategy must be one of {', '.join(STRATEGIES)}; got {self.strategy!r}")
        if self.majority_sign_method not in SIGN_METHODS:
            raise ValueError(f"majority sign method must be one of {', '.join(SIGN_METHODS)}; got "
                             f"{self.majority_sign_method!r}")
        if self.strategy != "linear" and not 0.0 < self.density <= 1.0:
            raise ValueError(f"density must be in (0, 1] for {self.strategy}; got {self.density}")


def merge_lora(spec: MergeSpec, adapters: list[tuple[LoraConfig, Factors]]) -> tuple[LoraConfig, Factors]:
    """The merged adapter's config (scaling 1) and whole factors, from each adapter's config and whole factors
    (`read_lora` with world_size 1), in `spec.adapter_ids` order."""
    assert len(adapters) == len(spec.adapter_ids)
    strategy = spec.strategy if len(adapters) > 1 else "linear"
    ranks = [config.rank for config, _ in adapters]
    generator = torch.Generator().manual_seed(spec.seed)
    keys = sorted({key for _, factors in adapters for key in factors}, key=lambda k: (k[0], PROJECTIONS.index(k[1])))
    merged: Factors = {}
    for key in keys:
        present = [(w, config.scaling, factors[key]) for w, (config, factors) in zip(spec.weights, adapters)
                   if key in factors]
        if len(set(ranks)) == 1:
            merged[key] = _merge_factors(present, strategy, spec, generator)
        elif strategy == "linear":
            merged[key] = _concatenate(present, sum(ranks))
        else:
            merged[key] = _merge_products(present, strategy, spec, generator, max(ranks))
    rank = ranks[0] if len(set(ranks)) == 1 else sum(ranks) if strategy == "linear" else max(ranks)
    config = LoraConfig(rank=rank, alpha=float(rank), use_rslora=False,
                        target_modules=frozenset(p for config, _ in adapters for p in config.target_modules),
                        base_model_name=adapters[0][0].base_model_name)
    return config, merged


Present = list[tuple[float, float, tuple[torch.Tensor, torch.Tensor]]]  # (weight, scaling, (A, B)) per adapter


def _merge_factors(present: Present, strategy: str, spec: MergeSpec,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's `_generalized_task_arithmetic_weighted_adapter`: A and B merged separately, A first."""
    scaled = [w * s for w, s, _ in present]
    weights_a = [math.sqrt(abs(x)) * (1 if x >= 0 else -1) for x in scaled]  # the sign on one side only
    weights_b = [math.sqrt(abs(x)) for x in scaled]
    a = combine([ab[0] for _, _, ab in present], weights_a, strategy, spec, generator)
    b = combine([ab[1] for _, _, ab in present], weights_b, strategy, spec, generator)
    return a, b


def _concatenate(present: Present, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's `cat`: A_i w_i s_i stacked over B_i, zero-padded to the merged rank (adapters without the module)."""
    a = torch.cat([ab[0] * w * s for w, s, ab in present], dim=0)  # [sum r_i, in]
    b = torch.cat([ab[1] for _, _, ab in present], dim=1)  # [out, sum r_i]
    a_full = torch.zeros(rank, a.shape[1], dtype=a.dtype)
    b_full = torch.zeros(b.shape[0], rank, dtype=b.dtype)
    a_full[: a.shape[0]] = a
    b_full[:, : b.shape[1]] = b
    return a_full, b_full


def _merge_products(present: Present, strategy: str, spec: MergeSpec, generator: torch.Generator,
                    rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's `_svd_generalized_task_arithmetic_weighted_adapter`: the products merged, then cut to `rank`."""
    deltas = [(ab[1] @ ab[0]) * s for _, s, ab in present]  # [out, in] each, as PEFT's get_delta_weight
    delta = combine(deltas, [w for w, _, _ in present], strategy, spec, generator)
    # The reduced SVD: its first `rank` vectors are PEFT's (full_matrices=True) to float32 rounding, at half the
    # time, since the full one also builds the [out, out] basis nothing reads.
    u, singular, vh = torch.linalg.svd(delta, full_matrices=False)
    return vh[:rank, :], u[:, :rank] @ torch.diag(singular[:rank])  # A [rank, in], B [out, rank]


def combine(tensors: list[torch.Tensor], weights: list[float], strategy: str, spec: MergeSpec,
            generator: torch.Generator) -> torch.Tensor:
    """One merged tensor from same-shape tensors: PEFT's `task_arithmetic`, `ties`, `dare_linear`, `dare_ties`.

    Example, ties, density 1, total: tensors [[1, -2]], [[3, 1]], weights [1, 1]: signs elected by the sums
    (4, -1) are (+, -), so entry 0 averages 1 and 3 (-> 2) and entry 1 keeps -2 alone (-> -2).
    """
    w = torch.tensor(weights)  # float32, as PEFT's
    if strategy in ("dare_linear", "dare_ties"):
        tensors = [_random_prune(t, spec.density, generator) for t in tensors]
    elif strategy == "ties":
        tensors = [_magnitude_prune(t, spec.density) for t in tensors]
    stacked = torch.stack(tensors, dim=0)
    w = w.view(-1, *([1] * (stacked.dim() - 1)))
    if strategy in ("linear", "dare_linear"):
        return (stacked * w).sum(dim=0)
    sign = stacked.sign()
    magnitude = stacked.sum(dim=0) if spec.majority_sign_method == "total" else sign.sum(dim=0)
    mask = sign == torch.where(magnitude >= 0, 1, -1)  # the sign is elected before the weights apply
    return (stacked * w * mask).sum(dim=0) / torch.clamp(mask.sum(dim=0), min=1.0)


def _magnitude_prune(tensor: torch.Tensor, density: float) -> torch.Tensor:
    """Keeps the int(density * numel) entries of largest magnitude (all of them at density 1)."""
    if density >= 1:
        return tensor
    mask = torch.zeros_like(tensor).reshape(-1)
    mask[torch.topk(tensor.abs().reshape(-1), k=int(density * tensor.numel()), largest=True)[1]] = 1
    return tensor * mask.reshape(tensor.shape)


def _random_prune(tensor: torch.Tensor, density: float, generator: torch.Generator) -> torch.Tensor:
    """Keeps each entry with probability `density`, rescaled by 1 / density (nothing dropped at density 1)."""
    if density >= 1:
        return tensor
    mask = torch.bernoulli(torch.full_like(tensor, density), generator=generator)
    return tensor * mask / density
