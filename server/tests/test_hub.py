"""Tests for `specula_server.hub`: local directories, a hand-built Hugging Face cache, errors, weight files.

No test touches the network: an autouse fixture turns on offline mode both for our code (HF_HUB_OFFLINE, read at
call time) and for huggingface_hub itself (its constant is read at its import, so it is patched directly).
The cache is written byte-for-byte in huggingface_hub's layout and checked with huggingface_hub's own readers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import httpx2
import huggingface_hub
import pytest
import torch
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from safetensors.torch import save

from specula_server import hub
from specula_server.hub import ModelNotFoundError, resolve_model_dir, weight_files

REPO_ID = "specula-test/tiny-model"
OLD_SHA = "1" * 40
MAIN_SHA = "a1b2c3d4e5f60718293a4b5c6d7e8f9012345678"


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.delenv("HF_TOKEN", raising=False)


def _blob_name(filename: str, content: bytes) -> str:
    """The blob name huggingface_hub uses: sha256 for LFS files (weights), the git blob sha1 otherwise."""
    if filename.endswith(".safetensors"):
        return hashlib.sha256(content).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def _add_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, bytes], refs: tuple[str, ...]) -> Path:
    """Write one commit of `repo_id` into `cache` exactly as `snapshot_download` would leave it."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for filename, content in files.items():
        blob = repo / "blobs" / _blob_name(filename, content)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(content)
        link = snapshot / filename
        link.parent.mkdir(parents=True, exist_ok=True)
        # huggingface_hub links snapshot files to blobs with relative symlinks.
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no trailing newline: the hub reads the file verbatim
    return snapshot


def _config(hidden_size: int) -> bytes:
    return json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": hidden_size}).encode()


@pytest.fixture
def hf_cache(tmp_path: Path) -> Path:
    cache = tmp_path / "hub"
    weights = save({"embed.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)})
    _add_snapshot(cache, REPO_ID, OLD_SHA, {"config.json": _config(16), "model.safetensors": weights}, refs=())
    _add_snapshot(
        cache,
        REPO_ID,
        MAIN_SHA,
        {"config.json": _config(32), "model.safetensors": weights, "tokenizer.json": b"{}"},
        refs=("main",),
    )
    return cache


def test_hand_built_cache_is_read_by_huggingface_hub(hf_cache: Path) -> None:
    snapshot = huggingface_hub.snapshot_download(REPO_ID, cache_dir=hf_cache, local_files_only=True)
    assert Path(snapshot) == hf_cache / "models--specula-test--tiny-model" / "snapshots" / MAIN_SHA
    info = huggingface_hub.scan_cache_dir(hf_cache)
    assert not info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO_ID and repo.repo_type == "model"
    assert {r.commit_hash for r in repo.revisions} == {OLD_SHA, MAIN_SHA}
    assert {r.commit_hash: set(r.refs) for r in repo.revisions} == {OLD_SHA: set(), MAIN_SHA: {"main"}}
    cached = huggingface_hub.try_to_load_from_cache(REPO_ID, "config.json", cache_dir=hf_cache)
    assert isinstance(cached, str) and json.loads(Path(cached).read_text())["hidden_size"] == 32


def test_local_directory_resolves_to_itself(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_dir(str(tmp_path)) == tmp_path.resolve()


def test_local_directory_without_config_is_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"has no config\.json") as info:
        resolve_model_dir(str(tmp_path))
    assert str(tmp_path) in str(info.value)


def test_missing_local_path_is_not_sent_to_the_hub(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "nowhere"))


@pytest.mark.parametrize(
    ("revision", "commit", "hidden_size"), [(None, MAIN_SHA, 32), ("main", MAIN_SHA, 32), (OLD_SHA, OLD_SHA, 16)]
)
def test_hub_id_resolves_from_cache_offline(
    hf_cache: Path, revision: str | None, commit: str, hidden_size: int, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="specula.hub"):
        model_dir = resolve_model_dir(REPO_ID, revision=revision, cache_dir=hf_cache)
    assert model_dir.name == commit and model_dir.parent.name == "snapshots"
    assert json.loads((model_dir / "config.json").read_text())["hidden_size"] == hidden_size
    assert weight_files(model_dir) == [model_dir / "model.safetensors"]
    assert any(str(model_dir) in r.getMessage() for r in caplog.records)


def test_offline_argument_overrides_environment(hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    captured = _spy_snapshot_download(monkeypatch)
    resolve_model_dir(REPO_ID, cache_dir=hf_cache, offline=True)
    assert captured["local_files_only"] is True


def test_missing_id_offline_is_clear_error(hf_cache: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_dir("specula-test/absent", revision="v1", cache_dir=hf_cache)
    error = info.value
    assert isinstance(error, ValueError)
    assert (error.model_id, error.revision) == ("specula-test/absent", "v1")
    assert "'specula-test/absent'" in str(error) and "'v1'" in str(error)
    assert "offline" in error.reason and "not in cache" in error.reason


def test_online_mode_falls_back_to_cache_when_hub_unreachable(hf_cache: Path) -> None:
    # offline=False goes through huggingface_hub's online path; its own offline switch (patched on by the
    # autouse fixture) refuses the HTTP call, as a dead network would, and it falls back to the cache.
    model_dir = resolve_model_dir(REPO_ID, revision="main", cache_dir=hf_cache, offline=False)
    assert model_dir.name == MAIN_SHA
    with pytest.raises(ModelNotFoundError, match="could not be reached") as info:
        resolve_model_dir("specula-test/absent", cache_dir=hf_cache, offline=False)
    assert "specula-test/absent" in str(info.value)


def test_unknown_revision_offline_is_clear_error(hf_cache: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="offline"):
        resolve_model_dir(REPO_ID, revision="v2", cache_dir=hf_cache, offline=True)


def test_cached_snapshot_without_config_is_clear_error(tmp_path: Path) -> None:
    _add_snapshot(tmp_path, REPO_ID, MAIN_SHA, {"model.safetensors": save({"x": torch.zeros(1)})}, refs=("main",))
    with pytest.raises(ModelNotFoundError, match=r"Hub snapshot .* has no config\.json"):
        resolve_model_dir(REPO_ID, cache_dir=tmp_path)


def _spy_snapshot_download(monkeypatch: pytest.MonkeyPatch, raises: Exception | None = None) -> dict[str, Any]:
    """Replace the download with a recorder that returns a ready model directory (or raises `raises`)."""
    captured: dict[str, Any] = {}

    def fake(**kwargs: Any) -> str:
        captured.update(kwargs)
        if raises is not None:
            raise raises
        target = Path(kwargs["cache_dir"]) / "fake-snapshot"
        target.mkdir(parents=True, exist_ok=True)
        (target / "config.json").write_text("{}")
        return str(target)

    monkeypatch.setattr(hub, "snapshot_download", fake)
    return captured


def test_download_arguments_token_fallback_and_safetensors_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    captured = _spy_snapshot_download(monkeypatch)
    with caplog.at_level(logging.DEBUG, logger="specula.hub"):
        resolve_model_dir(REPO_ID, revision="v1", cache_dir=tmp_path)
    assert captured["repo_id"] == REPO_ID and captured["revision"] == "v1" and captured["cache_dir"] == tmp_path
    assert captured["token"] == "hf_secret_value"  # read from the environment at call time
    assert captured["local_files_only"] is False
    assert "*.safetensors" in captured["allow_patterns"] and "*.bin" not in captured["allow_patterns"]
    assert {"*.bin", "*.pt", "*.pth"} <= set(captured["ignore_patterns"])
    assert caplog.records and not any("hf_secret_value" in r.getMessage() for r in caplog.records)

    resolve_model_dir(REPO_ID, cache_dir=tmp_path, token="explicit")
    assert captured["token"] == "explicit"


def _http_error(cls: type[Exception], status: int) -> Exception:
    response = httpx2.Response(status, request=httpx2.Request("GET", f"https://huggingface.co/api/models/{REPO_ID}"))
    return cls("hub said no", response=response)


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (_http_error(GatedRepoError, 403), "gated"),
        (_http_error(RepositoryNotFoundError, 404), "no such repository"),
        (_http_error(RevisionNotFoundError, 404), "no such revision"),
        (_http_error(HfHubHTTPError, 401), r"refused access \(HTTP 401\)"),
    ],
)
def test_hub_errors_become_model_not_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception, reason: str
) -> None:
    _spy_snapshot_download(monkeypatch, raises=error)
    with pytest.raises(ModelNotFoundError, match=reason) as info:
        resolve_model_dir(REPO_ID, cache_dir=tmp_path, offline=False)
    assert info.value.__cause__ is error


def test_weight_files_single(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(save({"x": torch.zeros(1)}))
    (tmp_path / "extra.safetensors").write_bytes(save({"y": torch.zeros(1)}))
    assert weight_files(tmp_path) == [tmp_path / "model.safetensors"]


def test_weight_files_sharded_from_index(tmp_path: Path) -> None:
    shards = ["model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors"]
    for shard in shards:
        (tmp_path / shard).write_bytes(save({"x": torch.zeros(1)}))
    (tmp_path / "consolidated.safetensors").write_bytes(save({"x": torch.zeros(1)}))  # not in the index
    weight_map = {"a": shards[0], "b": shards[1], "c": shards[0]}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert weight_files(tmp_path) == [tmp_path / name for name in sorted(shards)]


def test_weight_files_index_with_missing_shard(tmp_path: Path) -> None:
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        weight_files(tmp_path)


def test_weight_files_fallback_glob(tmp_path: Path) -> None:
    for name in ("b.safetensors", "a.safetensors"):
        (tmp_path / name).write_bytes(save({"x": torch.zeros(1)}))
    assert weight_files(tmp_path) == [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]


def test_weight_files_none_is_clear_error(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(FileNotFoundError, match=r"No safetensors weights .*pytorch_model\.bin"):
        weight_files(tmp_path)
