"""Shared fixtures: small random models in Hugging Face layout, built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from specula_testing.gguf_files import BLOCK_TYPES, K_TYPES, write_gguf
from specula_testing.models import build_tiny_model


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


@pytest.fixture(scope="session")
def wide_llama_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("wide") / "llama", "llama", hidden_size=256,
                            intermediate_size=512, head_dim=64)


@pytest.fixture(scope="session")
def gguf_files(tmp_path_factory, llama_dir, wide_llama_dir) -> dict[str, Path]:
    """The tiny Llama written in each tensor type (K-quants from the wide one), one file per type."""
    root = tmp_path_factory.mktemp("gguf")
    return {kind: write_gguf(wide_llama_dir if kind in K_TYPES else llama_dir, root / f"model-{kind}.gguf", kind)
            for kind in BLOCK_TYPES + K_TYPES}
