"""Helpers that build small, real artefacts (tokenizers, models) for tests and benchmarks, offline."""

from __future__ import annotations

from .tokenizer import build_tokenizer

__all__ = ["build_tokenizer"]
