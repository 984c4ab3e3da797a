"""Finding and loading EAGLE-3 checkpoints: the `speculators` layout (`eagle3.py`'s docstring), and the original
EAGLE-3 repository's layout, which SGLang's SpecForge also writes:

  - `config.json`: a flat Llama config of the draft layer with `"architectures": ["LlamaForCausalLMEagle3"]`,
    `draft_vocab_size`, and optionally `target_hidden_size`, `norm_before_residual` and the auxiliary layer ids
    (`eagle_aux_hidden_state_layer_ids`, at the top or under `eagle_config`); no verifier is named;
  - weights in safetensors: the draft layer under `midlayer.` (`midlayer.self_attn.q_proj.weight`, ...), the rest
    (`fc`, `norm`, `lm_head`, `d2t`, `t2d`) named as in the speculators layout.

It is read as the speculators layout it converts to (the translation `speculators convert` makes): the flat config
becomes `transformer_layer_config`, and `midlayer.*` is served as `layers.0.*`.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from specula_server.layers.quantization import Quantization
from specula_server.models.config import ModelConfig
from specula_server.speculation.eagle3 import (
    CONFIG_FILE,
    HUB_ALLOW_PATTERNS,
    MODEL_TYPE,
    Eagle3Config,
    Eagle3Model,
    check_verifier,
    refuse,
)

if TYPE_CHECKING:
    from specula_server.weights import Weights

logger = logging.getLogger("specula.speculation")

ORIGINAL_ARCHITECTURES = ("LlamaForCausalLMEagle3",)
ORIGINAL_LAYER_PREFIX = "midlayer."
# Keys of an original-layout config that are about the drafter, not its Llama layer.
_DRAFTER_KEYS = ("architectures", "draft_vocab_size", "target_hidden_size", "norm_before_residual",
                 "eagle_aux_hidden_state_layer_ids", "eagle_config")


def is_original_layout(raw: object) -> bool:
    """Whether a `config.json` is the original EAGLE-3 layout's."""
    return (isinstance(raw, dict) and "speculators_model_type" not in raw
            and any(a in ORIGINAL_ARCHITECTURES for a in raw.get("architectures") or ()))


def as_speculators_config(raw: object, target_positions: int) -> object:
    """An original-layout config as the speculators layout's (other configs as they are). Its positions are at
    least the target's (`target_positions`), as `speculators convert` makes them: the original configs carry the
    training length."""
    if not is_original_layout(raw):
        return raw
    eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    layer_ids = raw.get("eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids"))
    layer = {k: v for k, v in raw.items() if k not in _DRAFTER_KEYS}
    positions = layer.get("max_position_embeddings")
    if positions is None or (isinstance(positions, int) and positions < target_positions):
        layer["max_position_embeddings"] = target_positions
    return {
        "speculators_model_type": MODEL_TYPE,
        "transformer_layer_config": layer,
        "draft_vocab_size": raw.get("draft_vocab_size", raw.get("vocab_size")),
        "eagle_aux_hidden_state_layer_ids": layer_ids,
        "norm_before_residual": raw.get("norm_before_residual", False),
        "target_hidden_size": raw.get("target_hidden_size"),
    }


def read_config(path: Path) -> object | None:
    try:
        return json.loads((Path(path) / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def is_eagle3_dir(path: Path) -> bool:
    """Whether `path` is a directory whose `config.json` says `speculators_model_type: eagle3`, or is the original
    EAGLE-3 layout's."""
    raw = read_config(path) if Path(path).is_dir() else None
    return isinstance(raw, dict) and (raw.get("speculators_model_type") == MODEL_TYPE or is_original_layout(raw))


def find_eagle3(speculator_id: str, cache_dir: Path | None = None, revision: str | None = None) -> Path | None:
    """The local directory of `speculator_id` (a directory or a Hub id) when it is an EAGLE-3 checkpoint, else
    None. For a Hub id only `config.json` is fetched first, the weights only when it names one."""
    local = Path(speculator_id).expanduser()
    if local.is_dir():
        return local if is_eagle3_dir(local) else None
    from specula_server.hub import ModelNotFoundError, is_offline_from_env, snapshot

    token, offline = os.environ.get("HF_TOKEN") or None, is_offline_from_env()
    try:
        config_dir = snapshot(speculator_id, revision, cache_dir, token, (CONFIG_FILE,), offline)
    except ModelNotFoundError:
        return None
    if not is_eagle3_dir(config_dir):
        return None
    try:
        return snapshot(speculator_id, revision, cache_dir, token, HUB_ALLOW_PATTERNS, offline)
    except ModelNotFoundError as error:
        raise refuse(speculator_id, f"cannot fetch its weights from the Hub: {error.reason}") from None


def load_eagle3(path: Path, model_id: str, config: ModelConfig, target_embed: nn.Module | None, *,
                dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                speculator_id: str | None = None, quantization: Quantization | None = None) -> Eagle3Model:
    """Reads the EAGLE-3 checkpoint in `path` whole (every tensor-parallel rank holds it), checked against the
    served model `model_id` (`config`) before any weight is read, then every tensor's shape. `quantization`: the
    format of the draft layer's products, fc and head (None: float), as `--quantize` builds the target's.

    Raises:
        Eagle3Error: no or bad config, a verifier other than the served model, unreadable weights, a tensor
            missing or of the wrong shape.
    """
    from specula_server.hub import weight_files
    from specula_server.weights import Weights

    path, device = Path(path), torch.device(device)
    name = speculator_id if speculator_id is not None else str(path)
    raw = read_config(path)
    if raw is None:
        raise refuse(name, f"no readable {CONFIG_FILE} in {path}")
    spec = Eagle3Config.from_dict(as_speculators_config(raw, config.max_position_embeddings), name)
    layer_ids = check_verifier(spec, name, model_id, config)
    if not any(path.glob("*.safetensors")) and any(path.glob("*.bin")):
        raise refuse(name, "its weights are a PyTorch pickle (.bin), and Specula reads safetensors only: convert "
                           "it with `speculators convert`, or save its tensors as model.safetensors")
    try:
        weights = Weights(weight_files(path), device, dtype, quantization=quantization)
    except Exception as error:  # no files, a damaged file, a tensor in two shards
        raise refuse(name, f"cannot read its weights: {error}") from error
    if is_original_layout(raw):
        weights.rename_prefix(ORIGINAL_LAYER_PREFIX, "layers.0.")
    check_shapes(weights, spec, len(layer_ids), name)
    embed = target_embed
    if weights.has("embed_tokens.weight"):
        embed = nn.Embedding.from_pretrained(weights.get_tensor("embed_tokens.weight"), freeze=True)
    elif target_embed is None or spec.layer.hidden_size != config.hidden_size:
        raise refuse(name, f"it has no embed_tokens.weight, and its hidden size {spec.layer.hidden_size} is not "
                           f"the model's {config.hidden_size}, whose embedding it would use")
    model = Eagle3Model(spec, weights, embed, layer_ids, device)
    logger.info("EAGLE-3 speculator %s: %d draft layer(s), draft vocabulary %d, auxiliary layers %s", name,
                spec.layer.num_layers, spec.draft_vocab_size, list(layer_ids))
    return model


def check_shapes(weights: Weights, spec: Eagle3Config, num_aux: int, name: str) -> None:
    """Every tensor the draft layer reads, present and of its shape (before any is loaded)."""
    cfg = spec.layer
    h, th, heads, kv = cfg.hidden_size, spec.target_hidden_size, cfg.num_heads, cfg.num_kv_heads
    expected = {
        "fc.weight": [h, num_aux * th], "norm.weight": [h], "lm_head.weight": [spec.draft_vocab_size, h],
        "layers.0.hidden_norm.weight": [h],
    }
    for i in range(cfg.num_layers):
        width = 2 * h if i == 0 else h
        p = f"layers.{i}"
        expected.update({
            f"{p}.input_layernorm.weight": [h], f"{p}.post_attention_layernorm.weight": [h],
            f"{p}.self_attn.q_proj.weight": [heads * cfg.head_dim, width],
            f"{p}.self_attn.k_proj.weight": [kv * cfg.head_dim, width],
            f"{p}.self_attn.v_proj.weight": [kv * cfg.head_dim, width],
            f"{p}.self_attn.o_proj.weight": [h, heads * cfg.head_dim],
            f"{p}.mlp.gate_proj.weight": [cfg.intermediate_size, h],
            f"{p}.mlp.up_proj.weight": [cfg.intermediate_size, h],
            f"{p}.mlp.down_proj.weight": [h, cfg.intermediate_size],
        })
    if spec.norm_before_fc:
        expected["input_norm.weight"] = [num_aux * th]
    for a in range(num_aux if spec.fc_norm else 0):
        expected[f"fc_norm.{a}.weight"] = [th]
    if spec.draft_vocab_size != cfg.vocab_size or weights.has("d2t"):
        expected["d2t"] = [spec.draft_vocab_size]
    if weights.has("embed_tokens.weight"):
        expected["embed_tokens.weight"] = [cfg.vocab_size, h]
    for tensor, shape in expected.items():
        if not weights.has(tensor):
            raise refuse(name, f"tensor {tensor} is missing")
        found = weights.shape(tensor)
        if found != shape:
            raise refuse(name, f"tensor {tensor} has shape {found}, expected {shape} (hidden size {h}, "
                               f"{num_aux} auxiliary layers of {th}, draft vocabulary {spec.draft_vocab_size})")
    if "d2t" in expected:
        targets = torch.arange(spec.draft_vocab_size) + weights.get_tensor("d2t").long().cpu()
        if targets.min() < 0 or targets.max() >= cfg.vocab_size or math.prod(targets.unique().shape) != len(targets):
            raise refuse(name, f"d2t maps draft tokens outside the {cfg.vocab_size}-token vocabulary or two onto "
                               "one target token")
