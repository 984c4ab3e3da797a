"""Shared fixtures: small random models in Hugging Face layout, built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from specula_server.testing.models import build_tiny_model


@pytest.fixture(scope="session", autouse=True)
def _threads():
    # Two threads, like the CI machine; OMP_NUM_THREADS=1 when the machine is shared (threads that spin on a
    # busy machine slow every test down many times over).
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))


@pytest.fixture(scope="session", autouse=True)
def _gguf_cache(tmp_path_factory):
    # GGUF models' metadata directories go to this session's own cache (spawned ranks inherit it).
    os.environ["SPECULA_CACHE"] = str(tmp_path_factory.mktemp("specula-cache"))


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {kind: build_tiny_model(root / kind, kind) for kind in ("llama", "qwen2", "llama31")}


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> Path:
    return model_dirs["llama"]
