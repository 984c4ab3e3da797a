"""LoRAX's `merged_adapters`: a request's merge of LoRA adapters, checked and named as an adapter of its own.

`Validator` turns a request's `MergedAdapters` into a `MergeSpec`; the request then names the adapter
`spec.adapter_id`, a name derived from the whole specification, so that the adapter manager (`adapters.py`) loads,
caches (LRU, one adapter slot), labels and offloads a merge like any adapter, and a repeated merge finds it loaded.
The workers compute the merge when they load it (`server/specula_server/adapters/merge.py`).

Settings that do not change a strategy's result are normalised before naming, so that requests differing only in
them share one merge: linear ignores density, sign method and seed; ties ignores the seed; dare_linear ignores the
sign method. DARE's seed is `merged_adapters.seed` (a Specula extension) or, when absent, derived from the rest of the
specification, so the same request always gets the same merged weights.

Example: {"ids": ["a", "b"], "weights": [0.5, 0.5]} -> MergeSpec(("a", "b"), (0.5, 0.5), "linear", 1.0, "total", 0,
"local"), named "merge:" + 24 hex digits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import unicodedata
from dataclasses import dataclass

from specula_router.schemas import MAX_ADAPTER_ID_LENGTH
from specula_router.wire import UINT64_MAX

MERGED_ID_PREFIX = "merge:"  # the names of merged adapters; refused as a request's `adapter_id`
MAX_MERGED_ADAPTERS = 16
STRATEGIES = ("linear", "ties", "dare_linear", "dare_ties")
SIGN_METHODS = ("total", "frequency")
# LoRAX's words (router/src/validation.rs), which call the field `adapters`.
ADAPTER_ID_CONFLICT = "at most one of `adapter_id` or `adapters` may be provided"
NO_ADAPTER_IDS = "at least one adapter ID must be provided when setting `adapters`"
WEIGHT_MISMATCH = "number of adapter IDs must match number of adapter weights"


class MergeError(Exception):
    """A merge the router refuses; `field` names the offending parameter (a 422 with `message`)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


@dataclass(frozen=True)
class MergeSpec:
    adapter_ids: tuple[str, ...]
    weights: tuple[float, ...]
    strategy: str
    density: float  # fraction kept by ties and dare merges, in (0, 1]; 1.0 for linear
    majority_sign_method: str
    seed: int  # DARE's draws; 0 where unused
    source: str  # where every adapter of the merge is read from

    @property
    def adapter_id(self) -> str:
        """The merge's name as an adapter: the same for the same specification, different otherwise."""
        text = json.dumps([self.adapter_ids, [repr(w) for w in self.weights], self.strategy, repr(self.density),
                           self.majority_sign_method, self.seed, self.source])
        return MERGED_ID_PREFIX + hashlib.sha256(text.encode()).hexdigest()[:24]


def is_merged_id(adapter_id: str | None) -> bool:
    return bool(adapter_id) and adapter_id.startswith(MERGED_ID_PREFIX)


def merge_spec(ids: list[str], weights: list[float], strategy: str | None, density: float,
               majority_sign_method: str | None, seed: int | None, source: str) -> MergeSpec:
    """The checked, normalised merge; MergeError naming the field for anything out of range.

    Example: strategy "ties", density 0 -> "`merged_adapters.density` must be > 0.0 and <= 1.0 for ties. Given: 0.0"
    """
    if not ids:
        raise MergeError(NO_ADAPTER_IDS, "merged_adapters.ids")
    if len(ids) > MAX_MERGED_ADAPTERS:
        raise MergeError(f"`merged_adapters.ids` must name at most {MAX_MERGED_ADAPTERS} adapters. "
                         f"Given: {len(ids)}", "merged_adapters.ids")
    for adapter_id in ids:
        _check_id(adapter_id)
    if len(weights) != len(ids):
        raise MergeError(WEIGHT_MISMATCH, "merged_adapters.weights")
    if not all(math.isfinite(w) for w in weights):
        raise MergeError("`merged_adapters.weights` must be finite numbers", "merged_adapters.weights")
    strategy = strategy or "linear"
    if strategy not in STRATEGIES:
        raise MergeError(f"`merged_adapters.merge_strategy` must be one of {', '.join(STRATEGIES)}. "
                         f"Given: {strategy!r}", "merged_adapters.merge_strategy")
    sign_method = majority_sign_method or "total"
    if sign_method not in SIGN_METHODS:
        raise MergeError(f"`merged_adapters.majority_sign_method` must be one of {', '.join(SIGN_METHODS)}. "
                         f"Given: {sign_method!r}", "merged_adapters.majority_sign_method")
    if strategy == "linear":
        if not 0.0 <= density <= 1.0:  # LoRAX's clients send 0.0 when it does not matter
            raise MergeError(f"`merged_adapters.density` must be >= 0.0 and <= 1.0. Given: {density}",
                             "merged_adapters.density")
    elif not 0.0 < density <= 1.0:
        raise MergeError(f"`merged_adapters.density` must be > 0.0 and <= 1.0 for {strategy}. Given: {density}",
                         "merged_adapters.density")
    if seed is not None and not 0 <= seed <= UINT64_MAX:
        raise MergeError(f"`merged_adapters.seed` must be >= 0 and <= {UINT64_MAX}. Given: {seed}",
                         "merged_adapters.seed")
    spec = MergeSpec(tuple(ids), tuple(float(w) for w in weights), strategy,
                     1.0 if strategy == "linear" else float(density),
                     sign_method if strategy in ("ties", "dare_ties") else "total", 0, source)
    if strategy.startswith("dare"):
        # Derived from the rest of the specification (its name, as yet unseeded) when the request names none.
        derived = int(hashlib.sha256(spec.adapter_id.encode()).hexdigest()[:16], 16)
        spec = dataclasses.replace(spec, seed=derived if seed is None else seed)
    return spec


def _check_id(adapter_id: str) -> None:
    """Each id as `adapter_id` is checked (`Validator._adapter`)."""
    field = "merged_adapters.ids"
    if not adapter_id:
        raise MergeError("`merged_adapters.ids` must not contain an empty id", field)
    if len(adapter_id) > MAX_ADAPTER_ID_LENGTH:
        raise MergeError(f"`merged_adapters.ids` must hold ids of at most {MAX_ADAPTER_ID_LENGTH} characters. "
                         f"Given: {len(adapter_id)}", field)
    if any(unicodedata.category(char) == "Cc" for char in adapter_id) or adapter_id != adapter_id.strip():
        raise MergeError("`merged_adapters.ids` must hold ids without control characters or surrounding "
                         f"whitespace. Given: {adapter_id!r}", field)
    if is_merged_id(adapter_id):
        raise MergeError(f"`merged_adapters.ids` must not name a merge (`{MERGED_ID_PREFIX}...`)", field)
