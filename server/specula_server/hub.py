"""Where a model's files come from: a model id (local directory or Hugging Face Hub id) to a local directory.

The worker calls `resolve_model_dir` once at start-up, before any weights are read; `weight_files` then lists the
safetensors files that `weights.Weights` opens. Adapters will go through the same path later (with
`required_file="adapter_config.json"`).

Resolution order:
  1. `model_id` names an existing directory -> used as is (it must hold `config.json`).
  2. `model_id` names a GGUF file (`model.gguf`, or `org/repo:FILE.gguf` on the Hub) -> the directory of Hugging
     Face files made from its metadata (`gguf_metadata.model_directory`), whose `gguf.json` names the file that
     holds the weights.
  3. Otherwise it is a Hub id -> `huggingface_hub.snapshot_download` into the Hugging Face cache, or, offline,
     the snapshot already in that cache. huggingface_hub draws its own progress bars while downloading.

Only safetensors weights are fetched: `.bin`/`.pt` checkpoints are never downloaded, so a repository that has
both costs one copy of the weights, and a repository with only pickled weights fails in `weight_files` with a
clear message instead of silently unpickling.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from huggingface_hub import hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from specula_server.gguf_checkpoint import GGUFError, is_gguf
from specula_server.gguf_metadata import GGUF_POINTER, model_directory

logger = logging.getLogger("specula.hub")

DEFAULT_ALLOW_PATTERNS: tuple[str, ...] = ("*.json", "*.safetensors", "tokenizer.model")
# Pickled / foreign-framework weights: never downloaded even when a caller widens `allow_patterns`.
IGNORE_PATTERNS: tuple[str, ...] = (
    "*.bin",
    "*.bin.index.json",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.h5",
    "*.msgpack",
    "*.gguf",
    "*.onnx",
)
# The same truthy spellings huggingface_hub accepts for HF_HUB_OFFLINE.
_TRUE_VALUES = frozenset({"1", "ON", "YES", "TRUE"})


class ModelNotFoundError(ValueError):
    """A model id could not be resolved to a usable local directory.

    `reason` is a short human sentence (not found / offline and not cached / gated or unauthorised / ...).
    """

    def __init__(self, model_id: str, revision: str | None, reason: str) -> None:
        self.model_id = model_id
        self.revision = revision
        self.reason = reason
        shown_revision = revision if revision is not None else "main"
        super().__init__(f"Cannot resolve model '{model_id}' (revision '{shown_revision}'): {reason}")


def is_offline_from_env() -> bool:
    """Whether HF_HUB_OFFLINE (or the older TRANSFORMERS_OFFLINE) asks for offline mode, read now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in _TRUE_VALUES


def resolve_model_dir(
    model_id: str,
    revision: str | None = None,
    cache_dir: Path | None = None,
    token: str | None = None,
    allow_patterns: Sequence[str] = DEFAULT_ALLOW_PATTERNS,
    offline: bool | None = None,
    *,
    required_file: str = "config.json",
) -> Path:
    """Return a local directory holding `model_id`'s files.

    Args:
        model_id: a local directory, or a Hub id such as "org/name".
        revision: branch, tag or commit sha (Hub ids only; ignored for local directories). None means "main".
        cache_dir: Hugging Face cache root; None uses huggingface_hub's default (HF_HUB_CACHE).
        token: Hub token; None falls back to the HF_TOKEN environment variable. Never logged.
        allow_patterns: which repository files to fetch; pickled weights are excluded whatever this says.
        offline: True -> cache only (local_files_only); None -> follow HF_HUB_OFFLINE.
        required_file: the file whose presence makes a directory a model ("adapter_config.json" for adapters).

    Raises:
        ModelNotFoundError: with the id, the revision and why (missing directory or file, not on the Hub,
            offline and not cached, gated or unauthorised, unknown revision, Hub unreachable).
    """
    local = Path(model_id).expanduser()
    if is_gguf(model_id) and required_file == "config.json":
        return _gguf_model_dir(model_id, revision, cache_dir, token, offline)
    if local.is_dir():
        _require_file(local, required_file, model_id, revision, where="local directory")
        if revision is not None:
            logger.warning("Ignoring revision '%s': '%s' is a local directory", revision, model_id)
        logger.info("Using local directory %s for model '%s'", local.resolve(), model_id)
        return local.resolve()
    if _looks_like_path(model_id):
        raise ModelNotFoundError(model_id, revision, f"local directory '{local}' does not exist")

    is_offline = is_offline_from_env() if offline is None else offline
    resolved_token = token if token is not None else (os.environ.get("HF_TOKEN") or None)
    logger.info(
        "Resolving '%s' (revision '%s') from the Hugging Face Hub %s, %s",
        model_id,
        revision or "main",
        "cache only (offline)" if is_offline else "(downloading missing files)",
        "with a token" if resolved_token else "without a token",
    )
    path = snapshot(model_id, revision, cache_dir, resolved_token, allow_patterns, is_offline)
    _require_file(path, required_file, model_id, revision, where="Hub snapshot")
    logger.info("Resolved '%s' (revision '%s') to %s", model_id, revision or "main", path)
    return path


def _gguf_model_dir(model_id: str, revision: str | None, cache_dir: Path | None, token: str | None,
                    offline: bool | None) -> Path:
    """A GGUF file (local, or `org/repo:FILE.gguf` downloaded from the Hub) as a model directory."""
    local = Path(model_id).expanduser()
    if not local.is_file():
        repo_id, _, filename = model_id.partition(":")
        if not filename or model_id.startswith(("/", "./", "../", "~")):
            raise ModelNotFoundError(model_id, revision, f"no such GGUF file '{local}' (a Hub file is written "
                                                         f"org/repo:FILE.gguf)")
        is_offline = is_offline_from_env() if offline is None else offline
        resolved_token = token if token is not None else (os.environ.get("HF_TOKEN") or None)
        local = _download_file(repo_id, filename, revision, cache_dir, resolved_token, is_offline)
    try:
        return model_directory(local)
    except GGUFError as error:
        raise ModelNotFoundError(model_id, revision, error.reason) from error


def _download_file(repo_id: str, filename: str, revision: str | None, cache_dir: Path | None, token: str | None,
                   is_offline: bool) -> Path:
    """One file of a Hub repository, through `hf_hub_download` (its own progress bar), errors as `snapshot`'s."""
    def download(**kwargs: object) -> str:
        return hf_hub_download(repo_id=repo_id, filename=filename, **kwargs)  # type: ignore[arg-type]

    return Path(_hub_call(download, f"{repo_id}:{filename}", revision, cache_dir, token, is_offline))


def snapshot(
    model_id: str,
    revision: str | None,
    cache_dir: Path | None,
    token: str | None,
    allow_patterns: Sequence[str],
    is_offline: bool,
) -> Path:
    """`snapshot_download` with its exceptions turned into `ModelNotFoundError` reasons."""
    def download(**kwargs: object) -> str:
        return snapshot_download(repo_id=model_id, allow_patterns=list(allow_patterns),  # type: ignore[arg-type]
                                 ignore_patterns=list(IGNORE_PATTERNS), **kwargs)

    return Path(_hub_call(download, model_id, revision, cache_dir, token, is_offline))


def _hub_call(download: Callable[..., str], model_id: str, revision: str | None, cache_dir: Path | None,
              token: str | None, is_offline: bool) -> str:
    """`download(revision=, cache_dir=, token=, local_files_only=)` with huggingface_hub's exceptions turned
    into `ModelNotFoundError` reasons."""
    try:
        return download(revision=revision, cache_dir=cache_dir, token=token, local_files_only=is_offline)
    # Order matters: GatedRepoError < RepositoryNotFoundError < HfHubHTTPError, and
    # LocalEntryNotFoundError is not an HTTP error at all.
    except GatedRepoError as error:
        reason = "the repository is gated: accept its license on the Hub and pass a token (HF_TOKEN) with access"
        raise ModelNotFoundError(model_id, revision, reason) from error
    except RepositoryNotFoundError as error:
        reason = "no such repository on the Hub (or it is private and the token is missing or lacks access)"
        raise ModelNotFoundError(model_id, revision, reason) from error
    except RevisionNotFoundError as error:
        raise ModelNotFoundError(model_id, revision, "the repository has no such revision") from error
    except LocalEntryNotFoundError as error:
        where = f"cache {cache_dir}" if cache_dir is not None else "the Hugging Face cache"
        if is_offline:
            reason = f"offline mode is on (HF_HUB_OFFLINE or offline=True) and it is not in {where}"
        else:
            reason = f"the Hub could not be reached and it is not in {where} ({error})"
        raise ModelNotFoundError(model_id, revision, reason) from error
    except HfHubHTTPError as error:
        status = error.response.status_code if error.response is not None else None
        if status in (401, 403):
            reason = f"the Hub refused access (HTTP {status}): check the token (HF_TOKEN)"
        else:
            reason = f"Hub error (HTTP {status}): {error}"
        raise ModelNotFoundError(model_id, revision, reason) from error
    except HFValidationError as error:
        reason = f"not an existing directory and not a valid Hub id ({error})"
        raise ModelNotFoundError(model_id, revision, reason) from error


def _looks_like_path(model_id: str) -> bool:
    """Ids that can only mean a filesystem path: reporting "not on the Hub" for them would mislead."""
    return model_id.startswith(("/", "./", "../", "~")) or model_id.count("/") > 1


def _require_file(directory: Path, filename: str, model_id: str, revision: str | None, where: str) -> None:
    if not (directory / filename).is_file():
        raise ModelNotFoundError(model_id, revision, f"{where} {directory} has no {filename}")


def weight_files(model_dir: Path) -> list[Path]:
    """The files holding `model_dir`'s weights, in a stable order.

    The GGUF file a `gguf.json` names (a directory made from a GGUF file); else `model.safetensors` if present;
    else the shards named by `model.safetensors.index.json` (its `weight_map` values, deduplicated and sorted);
    else every `*.safetensors` in the directory.

    Raises:
        FileNotFoundError: no safetensors weights, or a shard named by the index is missing.
    """
    pointer = model_dir / GGUF_POINTER
    if pointer.is_file():
        gguf_file = Path(json.loads(pointer.read_text())["file"])
        if not gguf_file.is_file():
            raise FileNotFoundError(f"{pointer} names {gguf_file}, which no longer exists")
        return [gguf_file]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return _shards_from_index(index)
    found = sorted(model_dir.glob("*.safetensors"))
    if found:
        return found
    pickled = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    hint = f" (found pickled weights {pickled}: convert them to safetensors)" if pickled else ""
    raise FileNotFoundError(f"No safetensors weights in {model_dir}{hint}")


def _shards_from_index(index: Path) -> list[Path]:
    try:
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise FileNotFoundError(f"{index} is not a safetensors index with a 'weight_map': {error}") from error
    shards = [index.parent / name for name in sorted(set(weight_map.values()))]
    missing = [shard.name for shard in shards if not shard.is_file()]
    if missing:
        raise FileNotFoundError(f"{index} names shards that are missing from {index.parent}: {missing}")
    return shards
