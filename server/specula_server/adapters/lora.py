"""PEFT LoRA adapters: `adapter_config.json` + `adapter_model.safetensors` to per-layer `(A, B)` for one rank.

The registry (`adapters/registry.py`) calls `load_lora` on a directory `sources.resolve_adapter` returned and
writes the result into its slot stacks; the model adds `x @ A @ B` to each targeted projection's output.

PEFT stores, per targeted module, `lora_A.weight [r, in]` and `lora_B.weight [out, r]`, and computes
`y = W x + scaling * B (A x)` with `scaling = lora_alpha / r` (`lora_alpha / sqrt(r)` with rslora). Here both
are transposed to the `x @ a @ b` form the kernels read, `a [d_in, r]`, `b [r, d_out]`, with the scaling
folded into `b`.

Tensor parallelism follows the base projections (`layers/tensor_parallel.py`):
  - column-parallel q, k, v, gate, up (output features split): `a` whole, `b` keeps this rank's output
    columns, so `x @ a @ b_rank` is exactly this rank's columns of the full delta;
  - row-parallel o, down (input features split, partial sums all-reduced): `a` keeps this rank's input rows,
    `b` whole, so `x_rank @ a_rank @ b` is this rank's partial sum, and the all-reduce the layer already does
    for `x_rank @ W_rank` sums the partials into the full delta: sum_k x_k A_k B = (x A) B.
Example, world_size 2, q_proj with 4 heads of 16: rank 1's `b` is columns 32..63 of the full `[r, 64]`.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specula_server.adapters.sources import (
    LORA_CONFIG,
    LORA_WEIGHT_FILES,
    TensorFile,
    adapter_error,
    check_finite,
    read_json,
)

if TYPE_CHECKING:  # the models package imports the adapter registry: no import cycle at run time
    from specula_server.models.config import ModelConfig

logger = logging.getLogger("specula.adapters")

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
_MODULE_OF = {p: "self_attn" if p in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp" for p in PROJECTIONS}
# PEFT names: `base_model.model.` + the base model's module path (+ `.default` in some older saves).
_TENSOR_NAME = re.compile(
    r"base_model\.model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight"
)
# Config options that change what the adapter computes in ways this server does not implement: refusing is
# better than answering with different outputs than the adapter was trained for.
_REFUSED_OPTIONS = {
    "use_dora": "DoRA (`use_dora`)",
    "lora_bias": "LoRA biases (`lora_bias`)",
    "modules_to_save": "fully trained extra modules (`modules_to_save`)",
    "trainable_token_indices": "trained token embeddings (`trainable_token_indices`)",
    "layer_replication": "layer replication (`layer_replication`)",
    "target_parameters": "LoRA on parameters (`target_parameters`)",
    "alora_invocation_tokens": "activated LoRA (`alora_invocation_tokens`)",
    "use_qalora": "QALoRA (`use_qalora`)",
    "rank_pattern": "per-module ranks (`rank_pattern`)",
    "alpha_pattern": "per-module alphas (`alpha_pattern`)",
}


@dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: frozenset[str]  # subset of PROJECTIONS
    base_model_name: str | None

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], adapter_id: str, *, num_layers: int) -> LoraConfig:
        """Parses a PEFT `adapter_config.json`; AdapterError 424 for what this server cannot serve.

        `num_layers` is the base model's, for `target_modules` given as a regular expression (which PEFT
        matches against full module names such as `model.layers.3.self_attn.q_proj`).
        """
        peft_type = raw.get("peft_type", "LORA")
        if str(peft_type).upper() != "LORA":
            raise adapter_error(adapter_id, f"unsupported PEFT adapter type {peft_type!r} (only LORA is served)")
        refused = [what for key, what in _REFUSED_OPTIONS.items() if raw.get(key)]
        if raw.get("bias", "none") != "none":
            refused.append(f"trained biases (`bias: {raw['bias']}`)")
        if refused:
            raise adapter_error(adapter_id, f"unsupported LoRA options: {', '.join(refused)}")
        try:
            rank = int(raw["r"])
            alpha = float(raw.get("lora_alpha", 8))  # PEFT's default
        except (KeyError, TypeError, ValueError) as error:
            raise adapter_error(adapter_id, f"{LORA_CONFIG} has no valid rank `r` or `lora_alpha` ({error!r})") \
                from None
        if rank < 1:
            raise adapter_error(adapter_id, f"LoRA rank must be positive, got r={rank}")
        # `fan_in_fan_out` only says how the *base* weight is stored (GPT-2 Conv1D); lora_A/lora_B are always
        # nn.Linear weights, and Llama's projections are nn.Linear, for which PEFT ignores the flag.
        return cls(
            rank=rank,
            alpha=alpha,
            use_rslora=bool(raw.get("use_rslora", False)),
            target_modules=_parse_targets(raw.get("target_modules"), adapter_id, num_layers),
            base_model_name=raw.get("base_model_name_or_path") or None,
        )


@dataclass
class LoraWeights:
    """One adapter for one tensor-parallel rank: `layers[i][projection] = (a [d_in_local, r], b [r, d_out_local])`
    with the scaling folded into `b`; a projection the adapter leaves alone is absent."""

    config: LoraConfig
    layers: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]

    @property
    def projections(self) -> frozenset[str]:
        return frozenset(p for layer in self.layers.values() for p in layer)


# (layer, projection) -> (lora_A [r, d_in], lora_B [d_out, r]) in float32, PEFT's own layout and names.
Factors = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def load_lora(
    path: Path,
    config: ModelConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    adapter_id: str | None = None,
) -> LoraWeights:
    """Reads, checks against the base model's shapes, and shards the PEFT LoRA adapter in `path`.

    Raises:
        AdapterError 424: unsupported options, missing or unreadable weights, a tensor whose shape does not
            fit the base model (the message names the tensor, the expected and the found shape), a tensor with
            a NaN or an infinity (in the file, or once scaled and cast to `dtype`), a layer index past the base
            model's layers, or an A without its B.
    """
    name = adapter_id if adapter_id is not None else str(path)
    lora, factors, names = read_lora(path, config, rank=rank, world_size=world_size, adapter_id=name)
    weights = lora_weights(lora, factors, lora.scaling, name, names=names, dtype=dtype, device=device)
    logger.info("read LoRA adapter %s: rank %d, scaling %.4g, %d layers, %s", name, lora.rank, lora.scaling,
                len(weights.layers), ",".join(p for p in PROJECTIONS if p in weights.projections))
    return weights


def read_lora(
    path: Path, config: ModelConfig, *, rank: int = 0, world_size: int = 1, adapter_id: str | None = None
) -> tuple[LoraConfig, Factors, dict[tuple[int, str], tuple[str, str]]]:
    """The adapter's config and its factors as PEFT stores them (this rank's slices of them), with their
    tensor names; `world_size` 1 reads them whole (what a merge needs: its trimming looks at whole tensors).
    Raises AdapterError as `load_lora` does."""
    path = Path(path)
    name = adapter_id if adapter_id is not None else str(path)
    raw = read_json(path / LORA_CONFIG, name)
    if not isinstance(raw, dict):
        raise adapter_error(name, f"{LORA_CONFIG} is not a JSON object")
    lora = LoraConfig.from_dict(raw, name, num_layers=config.num_layers)
    reader = _open_weights(path, name, rank, world_size)
    pairs = _lora_tensor_names(reader.names(), lora, config, name)
    expected = _full_shapes(config)
    factors: Factors = {}
    for (layer, projection), (a_name, b_name) in sorted(pairs.items()):
        d_in, d_out = expected[projection]
        _check_shape(reader, a_name, [lora.rank, d_in], name)
        _check_shape(reader, b_name, [d_out, lora.rank], name)
        try:
            if projection in COLUMN_PARALLEL:
                a, b = reader.read(a_name, None), reader.read(b_name, 0)  # [r, in], [out_local, r]
            else:
                a, b = reader.read(a_name, 1), reader.read(b_name, None)  # [r, in_local], [out, r]
        except (RuntimeError, ValueError, OSError) as error:
            raise adapter_error(name, f"cannot read {a_name} / {b_name}: {error}") from error
        factors[(layer, projection)] = (a, b)
    if not factors:
        raise adapter_error(name, "the adapter's weights hold no LoRA tensors for this model's projections")
    return lora, factors, pairs


def shard_factors(factors: Factors, rank: int, world_size: int) -> Factors:
    """This rank's slices of whole factors, as `read_lora` reads them from a file (see the module docstring)."""
    if world_size == 1:
        return factors
    sharded = {}
    for (layer, projection), (a, b) in factors.items():
        if projection in COLUMN_PARALLEL:
            b = b.chunk(world_size, dim=0)[rank]
        else:
            a = a.chunk(world_size, dim=1)[rank]
        sharded[(layer, projection)] = (a, b)
    return sharded


def lora_weights(
    lora: LoraConfig,
    factors: Factors,
    scaling: float,
    adapter_id: str,
    *,
    names: dict[tuple[int, str], tuple[str, str]] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LoraWeights:
    """PEFT-layout factors to the kernels' `a [d_in, r]`, `b [r, d_out]` with `scaling` folded into `b`, cast to
    `dtype`; AdapterError 424 naming the tensor when a value overflows once scaled and cast."""
    layers: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, projection), (a, b) in sorted(factors.items()):
        a_name, b_name = (names or {}).get((layer, projection),
                                           (f"layer {layer} {projection} lora_A", f"layer {layer} {projection} lora_B"))
        a = a.t().to(device=device, dtype=dtype).contiguous()  # [d_in_local, r]
        b = (b.t() * scaling).to(device=device, dtype=dtype).contiguous()  # [r, d_out_local]
        # The file's values are finite (TensorFile.read checks); scaled and cast, they may still overflow.
        check_finite(a, a_name, adapter_id, after=f" in {dtype}")
        check_finite(b, b_name, adapter_id, after=f" once scaled by {scaling:.4g} in {dtype}")
        layers.setdefault(layer, {})[projection] = (a, b)
    return LoraWeights(lora, layers)


def _parse_targets(raw: Any, adapter_id: str, num_layers: int) -> frozenset[str]:
    """PEFT `target_modules` (a list of module names or name suffixes, "all-linear", or a regular expression
    matched against full module names) to the projections it selects."""
    if raw == "all-linear":  # every linear layer but the output head
        return frozenset(PROJECTIONS)
    if isinstance(raw, str):
        try:
            pattern = re.compile(raw)
        except re.error as error:
            raise adapter_error(adapter_id, f"`target_modules` is not a valid regular expression ({error})") \
                from None
        others = [m for m in ("model.embed_tokens", "lm_head") if pattern.fullmatch(m)]
        found = frozenset(p for p in PROJECTIONS for i in range(num_layers)
                          if pattern.fullmatch(f"model.layers.{i}.{_MODULE_OF[p]}.{p}"))
        names = others
    elif isinstance(raw, (list, tuple, set)) and raw:
        last = [str(m).rsplit(".", 1)[-1] for m in raw]
        found = frozenset(m for m in last if m in PROJECTIONS)
        names = sorted(m for m in last if m not in PROJECTIONS)
    else:
        raise adapter_error(adapter_id, f"`target_modules` must be a non-empty list or a string, got {raw!r}")
    if names:
        raise adapter_error(adapter_id, f"LoRA on {names} is not supported (supported: {', '.join(PROJECTIONS)})")
    if not found:
        raise adapter_error(adapter_id, f"`target_modules` {raw!r} selects none of {', '.join(PROJECTIONS)}")
    return found


def _full_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Unsharded (d_in, d_out) of each projection of the base model."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def _lora_tensor_names(
    names: list[str], lora: LoraConfig, config: ModelConfig, adapter_id: str
) -> dict[tuple[int, str], tuple[str, str]]:
    """(layer, projection) -> (A name, B name). Names outside `base_model.` are other components stored in the
    same file (Medusa heads, as LoRAX writes them) and are left alone."""
    found: dict[tuple[int, str], dict[str, str]] = {}
    for tensor in names:
        if not tensor.startswith("base_model."):
            continue
        match = _TENSOR_NAME.fullmatch(tensor)
        if match is None or _MODULE_OF.get(match[3]) != match[2]:
            raise adapter_error(adapter_id, f"unsupported tensor {tensor} (LoRA is supported on "
                                            f"{', '.join(PROJECTIONS)} only)")
        layer, projection = int(match[1]), match[3]
        if layer >= config.num_layers:
            raise adapter_error(adapter_id, f"tensor {tensor} is for layer {layer}, but the base model has "
                                            f"{config.num_layers} layers")
        if projection not in lora.target_modules:
            # PEFT builds LoRA modules only for `target_modules` and drops other tensors when it loads.
            logger.warning("adapter %s: ignoring %s, not in target_modules", adapter_id, tensor)
            continue
        found.setdefault((layer, projection), {})[match[4]] = tensor
    for (layer, projection), pair in found.items():
        if set(pair) != {"A", "B"}:
            (has,) = pair
            raise adapter_error(adapter_id, f"layer {layer} {projection} has lora_{has} but no "
                                            f"lora_{'B' if has == 'A' else 'A'}")
    return {key: (pair["A"], pair["B"]) for key, pair in found.items()}


def _check_shape(reader: TensorFile, tensor: str, expected: list[int], adapter_id: str) -> None:
    found = reader.shape(tensor)
    if found != expected:
        raise adapter_error(adapter_id, f"tensor {tensor} has shape {found}, but this base model needs "
                                        f"{expected} (an adapter trained for a different base model?)")


def _open_weights(path: Path, adapter_id: str, rank: int, world_size: int) -> TensorFile:
    for filename in LORA_WEIGHT_FILES:
        if (path / filename).is_file():
            return TensorFile(path / filename, adapter_id, rank, world_size)
    raise adapter_error(adapter_id, f"no weights: neither {' nor '.join(LORA_WEIGHT_FILES)} is present")
