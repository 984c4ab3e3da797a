"""Where an adapter's files come from: an adapter id and a source to a checked local directory.

The registry calls `resolve_adapter` first when a request (or the launcher) names an adapter, then
`detect_adapter_kind` to pick the loader (`lora.load_lora`, `medusa.load_medusa`, or both).

Sources:
  - "hub": a Hugging Face Hub repository id ("org/name"), fetched through `hub.snapshot` (the same download,
    cache and error handling as the base model; only the adapter's own files are fetched). The token is the
    request's `api_token`, else HF_TOKEN; offline mode follows HF_HUB_OFFLINE.
  - "local": a directory under one of the configured adapter roots. The id is a path relative to a root (or an
    absolute path inside one); `..` components and symlinks that lead out of the root are refused, so a request
    can never make the worker read files outside the roots.

`TensorFile` reads one of an adapter's weight files, safetensors or (local adapters only: the Hub download
never fetches pickles) a PyTorch state dict.

Errors are `AdapterError`s carrying an HTTP-style status: 400 when the id itself is refused (it could never
work), 424 when it is well formed but cannot be fetched or is not a usable adapter.

Layouts recognised (see `detect_adapter_kind`):
  - LoRA (PEFT): `adapter_config.json` + `adapter_model.safetensors` (or `adapter_model.bin`).
  - Medusa: `config.json` with `medusa_num_heads` + `medusa_lm_head.safetensors` (or `.pt`, or, as LoRAX
    writes them, the head tensors in another `*.safetensors` file of the directory).
  - LoRA + Medusa: both of the above in one directory.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from specula_proto.choices import AdapterKind, AdapterSource, values
from specula_server.hub import ModelNotFoundError, is_offline_from_env, snapshot
from specula_server.weights import Weights

logger = logging.getLogger("specula.adapters")

SOURCES = values(AdapterSource)

LORA_CONFIG = "adapter_config.json"
LORA_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
MEDUSA_CONFIG = "config.json"
MEDUSA_WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
# What a Hub adapter download fetches: the adapter's own files only, never a merged model that some adapter
# repositories also carry. Pickled files stay excluded by the hub module whatever this says.
HUB_ALLOW_PATTERNS = (LORA_CONFIG, MEDUSA_CONFIG, "adapter_model.safetensors", "medusa_lm_head.safetensors")
# "org/name" or "name": the characters the Hub accepts in repository ids.
_HUB_ID = re.compile(r"[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)?")


class AdapterError(Exception):
    """An adapter could not be used. `status`: 400 the id is refused, 424 fetching or loading it failed.

    The message always names the adapter and the reason, and never carries a token.
    """

    def __init__(self, message: str, status: int = 424) -> None:
        super().__init__(message)
        self.status = status


def adapter_error(adapter_id: str, reason: str, status: int = 424) -> AdapterError:
    return AdapterError(f"adapter `{adapter_id}`: {reason}", status=status)


def resolve_adapter(
    adapter_id: str,
    source: str,
    *,
    local_roots: Sequence[Path],
    api_token: str | None = None,
    revision: str | None = None,
    cache_dir: Path | None = None,
) -> Path:
    """A local directory holding the adapter `adapter_id` from `source`, checked to be an adapter.

    Args:
        adapter_id: Hub repository id ("org/name") or a path under one of `local_roots`.
        source: "hub" or "local".
        local_roots: the only directories "local" adapters may come from (none: local adapters are refused).
        api_token: per-request Hub token; None or "" falls back to HF_TOKEN. Never logged or echoed.
        revision: Hub branch, tag or commit (None: "main"); ignored for local adapters.
        cache_dir: Hugging Face cache root for Hub adapters (None: huggingface_hub's default).

    Raises:
        AdapterError: 400 for an unknown source or a refused id (traversal, outside the roots, not a Hub id);
            424 when it is missing, cannot be fetched (offline, unreachable, unauthorised) or is not an adapter.
    """
    if source == AdapterSource.HUB:
        path = _resolve_hub(adapter_id, api_token or None, revision, cache_dir)
    elif source == AdapterSource.LOCAL:
        path = _resolve_local(adapter_id, [Path(r) for r in local_roots])
    else:
        raise adapter_error(adapter_id, f"unknown adapter source {source!r} (expected one of {SOURCES})", 400)
    detect_adapter_kind(path, adapter_id)
    return path


def detect_adapter_kind(path: Path, adapter_id: str | None = None) -> AdapterKind:
    """"lora", "medusa" or "lora+medusa", from the files in `path`; AdapterError 424 when it is none of them.

    A directory is a LoRA adapter when it holds `adapter_config.json`, and a Medusa adapter when its
    `config.json` has `medusa_num_heads` (a LoRA directory may carry its base model's `config.json`, which
    does not make it a Medusa adapter) and a file with the heads' weights.
    """
    name = adapter_id if adapter_id is not None else str(path)
    path = Path(path)
    if not path.is_dir():
        raise adapter_error(name, "not an adapter: not a directory")
    is_lora = (path / LORA_CONFIG).is_file()
    is_medusa = is_medusa_dir(path, name)
    if is_lora and is_medusa:
        return AdapterKind.LORA_MEDUSA
    if is_lora:
        return AdapterKind.LORA
    if is_medusa:
        return AdapterKind.MEDUSA
    raise adapter_error(name, f"not an adapter: the directory has neither {LORA_CONFIG} (LoRA) nor a "
                              f"{MEDUSA_CONFIG} with `medusa_num_heads` and {MEDUSA_WEIGHT_FILES[0]} (Medusa)")


def is_medusa_dir(path: Path, adapter_id: str) -> bool:
    config = path / MEDUSA_CONFIG
    if not config.is_file():
        return False
    raw = read_json(config, adapter_id)
    if not isinstance(raw, dict) or "medusa_num_heads" not in raw:
        return False
    if not medusa_weight_files(path):
        raise adapter_error(adapter_id, f"Medusa config without weights: no {' or '.join(MEDUSA_WEIGHT_FILES)} "
                                        "and no other *.safetensors file")
    return True


def medusa_weight_files(path: Path) -> list[Path]:
    """Where Medusa heads may be stored, most specific first: the FasterDecoding files, then (LoRAX) any other
    safetensors file of the directory."""
    named = [path / f for f in MEDUSA_WEIGHT_FILES if (path / f).is_file()]
    others = sorted(p for p in path.glob("*.safetensors") if p.name not in MEDUSA_WEIGHT_FILES)
    return named + others


def read_json(path: Path, adapter_id: str) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise adapter_error(adapter_id, f"cannot read {path.name}: {error}") from error


def _resolve_hub(adapter_id: str, token: str | None, revision: str | None, cache_dir: Path | None) -> Path:
    # Only Hub ids: the hub module would take an existing directory as a local model, which must not happen
    # for an id a request sends with source "hub".
    parts = adapter_id.split("/")
    if not _HUB_ID.fullmatch(adapter_id) or any(p in (".", "..") or p.startswith(".") for p in parts):
        raise adapter_error(adapter_id, "not a Hugging Face Hub repository id (expected `org/name`); "
                                        "use adapter source `local` for a directory", 400)
    if token is None:
        token = os.environ.get("HF_TOKEN") or None
    is_offline = is_offline_from_env()
    logger.info("fetching adapter %s (revision %s) from the Hugging Face Hub%s", adapter_id, revision or "main",
                " cache only (offline)" if is_offline else "")
    try:
        return snapshot(adapter_id, revision, cache_dir, token, HUB_ALLOW_PATTERNS, is_offline)
    except ModelNotFoundError as error:
        reason = error.reason if not token else error.reason.replace(token, "***")
        raise adapter_error(adapter_id, f"cannot fetch it from the Hub: {reason}") from None


def _resolve_local(adapter_id: str, roots: list[Path]) -> Path:
    if not roots:
        raise adapter_error(adapter_id, "local adapters are disabled on this server (no adapter directory is "
                                        "configured)", 400)
    if not adapter_id or "\x00" in adapter_id:
        raise adapter_error(adapter_id, "empty or malformed local adapter path", 400)
    relative = Path(adapter_id)
    if ".." in relative.parts:
        raise adapter_error(adapter_id, "local adapter paths may not contain `..`", 400)
    if relative.is_absolute():
        inside = [(root, _relative_to_root(relative, root)) for root in roots]
        inside = [(root, rel) for root, rel in inside if rel is not None]
        if not inside:
            raise adapter_error(adapter_id, "absolute path outside the configured adapter directories", 400)
    else:
        inside = [(root, relative) for root in roots]
    for root, rel in inside:
        candidate = root / rel
        if not candidate.exists():
            continue
        _check_inside(adapter_id, candidate, root)
        if candidate.is_dir():
            for entry in candidate.iterdir():  # files in the directory may be symlinks too
                _check_inside(adapter_id, entry, root)
        logger.info("using local adapter %s from %s", adapter_id, candidate.resolve())
        return candidate.resolve()
    raise adapter_error(adapter_id, "no such adapter directory under the configured adapter directories")


def _relative_to_root(path: Path, root: Path) -> Path | None:
    """`path` relative to `root` (as configured or resolved), or None when it is not lexically inside."""
    for base in (root, root.resolve()):
        try:
            return path.relative_to(base)
        except ValueError:
            continue
    return None


def _check_inside(adapter_id: str, path: Path, root: Path) -> None:
    resolved, resolved_root = path.resolve(), root.resolve()
    if resolved != resolved_root and not resolved.is_relative_to(resolved_root):
        raise adapter_error(adapter_id, "a symlink in the adapter path leads outside the adapter directory", 400)


class TensorFile:
    """One weights file, safetensors (read through `Weights`: only this rank's slice is read) or a PyTorch
    pickle (`torch.load(weights_only=True)`, which refuses anything but tensors and containers)."""

    def __init__(self, path: Path, adapter_id: str, rank: int = 0, world_size: int = 1) -> None:
        self.adapter_id = adapter_id
        self.rank, self.world_size = rank, world_size
        self._weights: Weights | None = None
        self._tensors: dict[str, torch.Tensor] = {}
        try:
            if path.suffix == ".safetensors":
                self._weights = Weights([path], torch.device("cpu"), torch.float32, rank, world_size)
            else:
                loaded = torch.load(path, map_location="cpu", weights_only=True)
                if not isinstance(loaded, dict):
                    raise ValueError(f"holds a {type(loaded).__name__}, not a dict of tensors")
                self._tensors = {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
        except Exception as error:  # safetensors and unpickling raise many types for a damaged file
            raise adapter_error(adapter_id, f"cannot read {path.name} (missing, damaged or not a weights "
                                            f"file): {type(error).__name__}: {error}") from error

    def names(self) -> list[str]:
        return self._weights.names() if self._weights is not None else sorted(self._tensors)

    def shape(self, name: str) -> list[int]:
        return self._weights.shape(name) if self._weights is not None else list(self._tensors[name].shape)

    def read(self, name: str, shard_dim: int | None) -> torch.Tensor:
        """The tensor in float32, whole (`shard_dim` None) or this rank's contiguous block along `shard_dim`.

        Raises AdapterError 424 naming the tensor when it holds a NaN or an infinity: such an adapter loads
        without complaint otherwise and turns its requests' logits into NaN (`nonfinite`).
        """
        if self._weights is not None:
            tensor = self._weights.get_tensor(name) if shard_dim is None else self._weights.get_sharded(name, shard_dim)
        else:
            tensor = self._tensors[name].float()
            if shard_dim is not None:
                size = tensor.shape[shard_dim]
                if size % self.world_size:
                    raise ValueError(f"{name}: size {size} along dim {shard_dim} does not divide by {self.world_size}")
                tensor = tensor.narrow(shard_dim, self.rank * (size // self.world_size), size // self.world_size)
        check_finite(tensor, name, self.adapter_id)
        return tensor


def check_finite(tensor: torch.Tensor, name: str, adapter_id: str, after: str = "") -> None:
    """AdapterError 424 naming `name` when `tensor` holds a NaN or an infinity (`after`: what produced it)."""
    if not bool(torch.isfinite(tensor).all()):
        raise adapter_error(adapter_id, f"tensor {name} has non-finite values{after}")
