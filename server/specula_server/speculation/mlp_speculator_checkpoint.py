"""Finding and loading MLP speculators (the model and its drafter: `mlp_speculator.py`), and their config.

Checkpoint layout (IBM's Hugging Face layout, e.g. `ibm-ai-platform/llama3-8b-accelerator`):
  - `config.json`: `{"model_type": "mlp_speculator", "architectures": ["MLPSpeculatorPreTrainedModel"],
    emb_dim, inner_dim, n_predict, vocab_size, top_k_tokens_per_head, n_candidates, tie_weights, scale_input}`;
    `inner_dim` 0 means `emb_dim` (as fms-extras and vLLM read it).
  - weights in `model.safetensors` (or shards named by `model.safetensors.index.json`, or any `*.safetensors`):
    `speculator.emb.{i}.weight [vocab, inner]`, `speculator.proj.{i}.weight [inner, emb_dim if i == 0 else
    inner]`, `speculator.ln.{i}.weight|bias [inner]`, `speculator.head.{i}.weight [vocab, inner]` for stages
    i < n_predict; the `speculator.` prefix may be missing. A `tie_weights` checkpoint stores only `emb.0`,
    `ln.0`, `head.0` (shared by every stage), `proj.0` and `proj.1` (stage 1 and on).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specula_server.speculation.mlp_speculator import MLPSpeculator

if TYPE_CHECKING:
    from specula_server.models.config import ModelConfig

logger = logging.getLogger("specula.speculation")

MODEL_TYPE = "mlp_speculator"
CONFIG_FILE = "config.json"
# What a Hub download of an MLP speculator fetches (pickles stay excluded by the hub module).
HUB_ALLOW_PATTERNS = (CONFIG_FILE, "*.safetensors", "*.safetensors.index.json")
_REQUIRED = ("emb_dim", "n_predict", "vocab_size")


class MLPSpeculatorError(ValueError):
    """An MLP speculator that cannot be used with this model; the message names it and says why."""


def _error(name: str, reason: str) -> MLPSpeculatorError:
    return MLPSpeculatorError(f"MLP speculator `{name}`: {reason}")


@dataclass(frozen=True)
class MLPSpeculatorConfig:
    emb_dim: int
    inner_dim: int
    n_predict: int
    vocab_size: int
    tie_weights: bool = False
    scale_input: bool = False
    top_k_tokens_per_head: tuple[int, ...] | None = None
    n_candidates: int | None = None

    @classmethod
    def from_dict(cls, raw: object, name: str) -> MLPSpeculatorConfig:
        if not isinstance(raw, dict):
            raise _error(name, f"{CONFIG_FILE} is not a JSON object")
        if raw.get("model_type") != MODEL_TYPE:
            raise _error(name, f"{CONFIG_FILE} has model_type {raw.get('model_type')!r}, not {MODEL_TYPE!r}")
        missing = [key for key in _REQUIRED if key not in raw]
        if missing:
            raise _error(name, f"{CONFIG_FILE} lacks {', '.join(missing)}")
        try:
            emb_dim, n_predict, vocab = (_int(raw[k]) for k in _REQUIRED)
            inner_dim = _int(raw.get("inner_dim") or 0) or emb_dim  # 0 or absent: emb_dim
            top_k = raw.get("top_k_tokens_per_head")
            top_k = None if top_k is None else tuple(_int(k) for k in top_k)
            n_candidates = raw.get("n_candidates")
            n_candidates = None if n_candidates is None else _int(n_candidates)
        except (TypeError, ValueError) as error:
            raise _error(name, f"{CONFIG_FILE} has a non-integer emb_dim / inner_dim / n_predict / vocab_size / "
                               f"top_k_tokens_per_head / n_candidates ({error})") from None
        if min(emb_dim, inner_dim, n_predict, vocab) < 1:
            raise _error(name, f"{CONFIG_FILE} needs positive emb_dim ({emb_dim}), inner_dim ({inner_dim}), "
                               f"n_predict ({n_predict}) and vocab_size ({vocab})")
        if top_k is not None and (len(top_k) != n_predict or min(top_k) < 1):
            raise _error(name, f"top_k_tokens_per_head {list(top_k)} must give a positive count for each of the "
                               f"{n_predict} stages")
        return cls(emb_dim, inner_dim, n_predict, vocab, bool(raw.get("tie_weights", False)),
                   bool(raw.get("scale_input", False)), top_k, n_candidates)

    @property
    def state_weight(self) -> float:
        return 0.5 ** (0.5 / self.n_predict)

    @property
    def emb_weight(self) -> float:
        return math.sqrt((1 - self.state_weight**2) * self.inner_dim / 2)

    def head_widths(self, tree_width: int) -> list[int]:
        """Tokens each stage offers per expanded node: 1 (a chain) for width 1, else min(width, the
        checkpoint's `top_k_tokens_per_head[i]`), or the width for every stage when it has no list."""
        if tree_width <= 1:
            return [1] * self.n_predict
        top_k = self.top_k_tokens_per_head or (tree_width,) * self.n_predict
        return [max(1, min(tree_width, k, self.vocab_size)) for k in top_k]


def _int(value: object) -> int:
    if isinstance(value, bool) or not float(value).is_integer():  # type: ignore[arg-type]
        raise ValueError(f"{value!r} is not an integer")
    return int(value)  # type: ignore[arg-type]


def read_config(path: Path) -> object | None:
    """`path/config.json` parsed, or None when there is none or it is not JSON."""
    try:
        return json.loads((Path(path) / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def is_mlp_speculator_dir(path: Path) -> bool:
    """Whether `path` is a directory whose `config.json` says `model_type: mlp_speculator`."""
    raw = read_config(path) if Path(path).is_dir() else None
    return isinstance(raw, dict) and raw.get("model_type") == MODEL_TYPE


def find_mlp_speculator(speculator_id: str, cache_dir: Path | None = None, revision: str | None = None) -> Path | None:
    """The local directory of `speculator_id` (a directory or a Hub id) when it is an MLP speculator, else None.

    For a Hub id only `config.json` is fetched first; the weights are fetched only when it names an MLP
    speculator. A Hub id that cannot be fetched gives None, so the caller's other loaders report the error.
    """
    local = Path(speculator_id).expanduser()
    if local.is_dir():
        return local if is_mlp_speculator_dir(local) else None
    from specula_server.hub import ModelNotFoundError, is_offline_from_env, snapshot

    token, offline = os.environ.get("HF_TOKEN") or None, is_offline_from_env()
    try:
        config_dir = snapshot(speculator_id, revision, cache_dir, token, (CONFIG_FILE,), offline)
    except ModelNotFoundError as error:
        logger.debug("--speculator %s: no config.json from the Hub (%s)", speculator_id, error.reason)
        return None
    if not is_mlp_speculator_dir(config_dir):
        return None
    logger.info("fetching MLP speculator %s from the Hugging Face Hub%s", speculator_id,
                " cache only (offline)" if offline else "")
    try:
        return snapshot(speculator_id, revision, cache_dir, token, HUB_ALLOW_PATTERNS, offline)
    except ModelNotFoundError as error:
        raise _error(speculator_id, f"cannot fetch its weights from the Hub: {error.reason}") from None


def load_mlp_speculator(
    path: Path,
    config: ModelConfig,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    speculator_id: str | None = None,
) -> MLPSpeculator:
    """Reads the MLP speculator in `path` (tied or not, with or without the `speculator.` prefix) whole, in
    `dtype` on `device`, and checks it against the base model.

    Raises:
        MLPSpeculatorError: no or bad config, emb_dim or vocab_size not the model's hidden size and vocabulary,
            no safetensors weights, a tensor missing or of the wrong shape.
    """
    from specula_server.hub import weight_files
    from specula_server.weights import Weights

    path = Path(path)
    name = speculator_id if speculator_id is not None else str(path)
    spec = _checked_config(path, config, name)
    try:
        reader = Weights(weight_files(path), torch.device("cpu"), dtype)
    except Exception as error:  # no files, a damaged file, a tensor in two shards
        raise _error(name, f"cannot read its weights: {error}") from error
    names = set(reader.names())
    prefix = "speculator." if any(n.startswith("speculator.") for n in names) else ""
    inner, vocab, stages = spec.inner_dim, spec.vocab_size, spec.n_predict

    def read(tensor: str, shape: list[int]) -> torch.Tensor:
        if prefix + tensor not in names:
            raise _error(name, f"tensor {prefix}{tensor} is missing"
                               + (" (a tie_weights checkpoint stores emb.0, ln.0, head.0, proj.0 and proj.1)"
                                  if spec.tie_weights else ""))
        found = reader.shape(prefix + tensor)
        if found != shape:
            raise _error(name, f"tensor {prefix}{tensor} has shape {found}, expected {shape} (emb_dim "
                               f"{spec.emb_dim}, inner_dim {inner}, vocab_size {vocab})")
        return reader.get_tensor(prefix + tensor).to(device=device, dtype=dtype)

    shared = range(1 if spec.tie_weights else stages)
    emb = torch.stack([read(f"emb.{i}.weight", [vocab, inner]) for i in shared])
    ln_weight = torch.stack([read(f"ln.{i}.weight", [inner]) for i in shared])
    ln_bias = torch.stack([read(f"ln.{i}.bias", [inner]) for i in shared])
    head = torch.stack([read(f"head.{i}.weight", [vocab, inner]) for i in shared])
    proj0 = read("proj.0.weight", [inner, spec.emb_dim])
    later = range(1, min(2, stages) if spec.tie_weights else stages)
    proj = (torch.stack([read(f"proj.{i}.weight", [inner, inner]) for i in later]) if len(later)
            else torch.empty(0, inner, inner, device=device, dtype=dtype))
    logger.info("read MLP speculator %s: %d stages, inner dim %d%s%s", name, stages, inner,
                ", tied weights" if spec.tie_weights else "", ", scaled input" if spec.scale_input else "")
    return MLPSpeculator(spec, emb, proj0, proj, ln_weight, ln_bias, head).eval()


def _checked_config(path: Path, config: ModelConfig, name: str) -> MLPSpeculatorConfig:
    """The speculator's config in `path`, refused (`MLPSpeculatorError`) when it is missing or was trained for a
    model of another hidden size or vocabulary."""
    raw = read_config(path)
    if raw is None:
        raise _error(name, f"no readable {CONFIG_FILE} in {path}")
    spec = MLPSpeculatorConfig.from_dict(raw, name)
    if spec.emb_dim != config.hidden_size:
        raise _error(name, f"emb_dim {spec.emb_dim} is not the model's hidden size {config.hidden_size} "
                           "(it was trained for another model)")
    if spec.vocab_size != config.vocab_size:
        raise _error(name, f"vocab_size {spec.vocab_size} is not the model's vocabulary size {config.vocab_size} "
                           "(it was trained for another model)")
    return spec
