"""Medusa heads: extra decoding heads that read the base model's last hidden state and guess further tokens.

Loaded from a directory `sources.resolve_adapter` returned; the Medusa drafter calls `MedusaHeads` on the
base model's final-normed hidden states. Head h guesses the token h + 2 positions past the hidden state's
(the base model's own head gives h + 1).

Each head is `num_layers` residual blocks, `x = x + SiLU(W x + b)` (W `[hidden, hidden]`), then a vocabulary
projection. Two layouts, told apart by the weights (as LoRAX does):
  - FasterDecoding (v1): `config.json` {medusa_num_heads, medusa_num_layers, base_model_name_or_path} +
    `medusa_lm_head.safetensors` (or `.pt`) with `{h}.{l}.linear.weight|bias` for l < L and the head's own
    vocabulary projection `{h}.{L}.weight [vocab, hidden]`.
  - LoRAX v2 (`version: 2`): the same `{h}.{l}.linear.*` blocks but no `{h}.{L}.weight`: every head reuses the
    base model's LM head, `logits_h = lm_head(x + SiLU(W_h x + b_h))` (LoRAX itself allows one layer; any
    number works here).
A LoRA + Medusa adapter (LoRAX) holds `adapter_config.json` and the LoRA weights next to these files; LoRAX
reads the head tensors from any safetensors file of the directory, so they may also sit in
`adapter_model.safetensors`, unprefixed.

Legacy quirk: some FasterDecoding checkpoints' `config.json` states fewer heads (2) than the weights hold (5),
because the training script saved the config before the head count was overridden. The weights are what the
heads were trained as, so the head (and layer) counts come from the tensor names; a disagreeing config only
gets a warning.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from specula_server.adapters.sources import (
    MEDUSA_CONFIG,
    MEDUSA_WEIGHT_FILES,
    AdapterError,
    TensorFile,
    adapter_error,
    check_finite,
    medusa_weight_files,
    read_json,
)

if TYPE_CHECKING:  # the models package imports the adapter registry: no import cycle at run time
    from specula_server.models.config import ModelConfig

logger = logging.getLogger("specula.adapters")

_BLOCK_TENSOR = re.compile(r"(\d+)\.(\d+)\.linear\.(weight|bias)")

LMHead = Callable[[torch.Tensor], torch.Tensor]  # [n, hidden] -> [n, vocab]


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int
    num_layers: int
    base_model_name: str | None
    version: int
    uses_base_lm_head: bool  # the v2 layout: no per-head vocabulary projection

    @classmethod
    def from_dict(cls, raw: dict, adapter_id: str) -> MedusaConfig:
        """The declared config; `load_medusa` corrects the counts and the layout from the weights."""
        try:
            num_heads = int(raw["medusa_num_heads"])
            num_layers = int(raw.get("medusa_num_layers", 1))
            version = int(float(raw.get("version", 1)))  # written as "2" by some tools
        except (KeyError, TypeError, ValueError) as error:
            raise adapter_error(adapter_id, f"{MEDUSA_CONFIG} has no valid medusa_num_heads / medusa_num_layers "
                                            f"/ version ({error!r})") from None
        return cls(num_heads, num_layers, raw.get("base_model_name_or_path") or None, version, version >= 2)


class MedusaHeads(nn.Module):
    """All heads at once: `forward(hidden [n, hidden]) -> logits [num_heads, n, vocab]` in float32.

    `linear_weight [H, L, hidden, hidden]` and `linear_bias [H, L, hidden]` are the residual blocks (weights
    as stored, `[out, in]`); `head_weight [H, vocab, hidden]` the heads' own vocabulary projections, or None
    for heads that use the base model's LM head (then `forward` needs `lm_head`).
    """

    def __init__(self, config: MedusaConfig, linear_weight: torch.Tensor, linear_bias: torch.Tensor,
                 head_weight: torch.Tensor | None) -> None:
        super().__init__()
        assert (head_weight is None) == config.uses_base_lm_head
        self.config = config
        self.register_buffer("linear_weight", linear_weight)
        self.register_buffer("linear_bias", linear_bias)
        self.register_buffer("head_weight", head_weight)

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def forward(self, hidden: torch.Tensor, lm_head: LMHead | None = None) -> torch.Tensor:
        num_heads, n = self.config.num_heads, hidden.shape[0]
        x = hidden.to(self.linear_weight.dtype).unsqueeze(0).expand(num_heads, n, -1)  # [H, n, hidden]
        for layer in range(self.config.num_layers):
            w = self.linear_weight[:, layer].transpose(1, 2)  # [H, in, out]
            x = x + nn.functional.silu(torch.baddbmm(self.linear_bias[:, layer].unsqueeze(1), x, w))
        if self.head_weight is not None:
            return torch.bmm(x, self.head_weight.transpose(1, 2)).float()  # [H, n, vocab]
        if lm_head is None:
            raise ValueError("these Medusa heads reuse the base model's LM head: pass `lm_head`")
        return lm_head(x.reshape(num_heads * n, -1)).float().reshape(num_heads, n, -1)


def load_medusa(
    path: Path,
    config: ModelConfig,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    adapter_id: str | None = None,
) -> MedusaHeads:
    """Reads the Medusa heads in `path` (either layout) and checks them against the base model.

    Raises:
        AdapterError 424: no or unreadable config or weights, head tensors missing or numbered with gaps,
            shapes that do not fit the base model's hidden size and vocabulary, or a tensor with a NaN or an
            infinity.
    """
    path = Path(path)
    name = adapter_id if adapter_id is not None else str(path)
    raw = read_json(path / MEDUSA_CONFIG, name)
    if not isinstance(raw, dict):
        raise adapter_error(name, f"{MEDUSA_CONFIG} is not a JSON object")
    declared = MedusaConfig.from_dict(raw, name)
    reader = _find_heads(path, name)
    medusa = _layout_from_names(reader.names(), declared, name)
    hidden, vocab = config.hidden_size, config.vocab_size
    names = set(reader.names())

    def read(tensor: str, shape: list[int]) -> torch.Tensor:
        if tensor not in names:
            raise adapter_error(name, f"Medusa tensor {tensor} is missing")
        found = reader.shape(tensor)
        if found != shape:
            raise adapter_error(name, f"Medusa tensor {tensor} has shape {found}, but this base model needs "
                                      f"{shape} (hidden size {hidden}, vocabulary {vocab})")
        try:
            weight = reader.read(tensor, None).to(device=device, dtype=dtype)
        except AdapterError:  # already names the adapter and the tensor (non-finite values)
            raise
        except Exception as error:
            raise adapter_error(name, f"cannot read Medusa tensor {tensor}: {error}") from error
        check_finite(weight, tensor, name, after=f" in {dtype}")  # finite in the file, may overflow when cast
        return weight

    heads, layers = range(medusa.num_heads), range(medusa.num_layers)
    linear_weight = torch.stack([torch.stack([read(f"{h}.{j}.linear.weight", [hidden, hidden]) for j in layers])
                                 for h in heads])  # [H, L, hidden, hidden]
    linear_bias = torch.stack([torch.stack([read(f"{h}.{j}.linear.bias", [hidden]) for j in layers])
                               for h in heads])  # [H, L, hidden]
    head_weight = None
    if not medusa.uses_base_lm_head:
        head_weight = torch.stack([read(f"{h}.{medusa.num_layers}.weight", [vocab, hidden])
                                   for h in heads])  # [H, vocab, hidden]
    logger.info("read Medusa adapter %s: %d heads of %d layers, %s", name, medusa.num_heads, medusa.num_layers,
                "on the base LM head" if medusa.uses_base_lm_head else "with their own LM heads")
    return MedusaHeads(medusa, linear_weight, linear_bias, head_weight)


def _find_heads(path: Path, adapter_id: str) -> TensorFile:
    """The first weights file (see `sources.medusa_weight_files`) holding a Medusa block tensor."""
    files = medusa_weight_files(path)
    for file in files:
        reader = TensorFile(file, adapter_id)
        if any(_BLOCK_TENSOR.fullmatch(t) for t in reader.names()):
            return reader
    looked = ", ".join(f.name for f in files) or f"no {' or '.join(MEDUSA_WEIGHT_FILES)}"
    raise adapter_error(adapter_id, f"no Medusa head tensors (`{{head}}.{{layer}}.linear.weight`) found ({looked})")


def _layout_from_names(names: list[str], declared: MedusaConfig, adapter_id: str) -> MedusaConfig:
    """Head and layer counts and the layout, from the tensor names (see the module docstring on legacy
    configs)."""
    blocks: dict[int, set[int]] = {}
    for tensor in names:
        match = _BLOCK_TENSOR.fullmatch(tensor)
        if match and match[3] == "weight":
            blocks.setdefault(int(match[1]), set()).add(int(match[2]))
    num_heads = len(blocks)
    if not num_heads:
        raise adapter_error(adapter_id, "no Medusa head tensors (`{head}.{layer}.linear.weight`) found")
    if sorted(blocks) != list(range(num_heads)):
        raise adapter_error(adapter_id, f"Medusa heads are numbered {sorted(blocks)}; expected 0..{num_heads - 1}")
    layer_sets = {frozenset(layers) for layers in blocks.values()}
    num_layers = len(next(iter(layer_sets)))
    if len(layer_sets) != 1 or next(iter(layer_sets)) != frozenset(range(num_layers)):
        raise adapter_error(adapter_id, f"Medusa heads have different or gapped layers: "
                                        f"{ {h: sorted(ls) for h, ls in sorted(blocks.items())} }")
    present = set(names)
    own = [h for h in range(num_heads) if f"{h}.{num_layers}.weight" in present]
    if own and len(own) != num_heads:
        raise adapter_error(adapter_id, f"only Medusa heads {own} of {num_heads} have their own LM head "
                                        f"(`{{head}}.{num_layers}.weight`)")
    if (num_heads, num_layers) != (declared.num_heads, declared.num_layers):
        logger.warning("adapter %s: %s declares %d Medusa heads of %d layers, the weights hold %d of %d; "
                       "using the weights", adapter_id, MEDUSA_CONFIG, declared.num_heads, declared.num_layers,
                       num_heads, num_layers)
    if declared.uses_base_lm_head == bool(own):
        logger.info("adapter %s: %s says Medusa version %d, the weights are the %s layout", adapter_id,
                    MEDUSA_CONFIG, declared.version, "own-LM-head (v1)" if own else "shared-LM-head (v2)")
    return MedusaConfig(num_heads, num_layers, declared.base_model_name, declared.version, uses_base_lm_head=not own)
