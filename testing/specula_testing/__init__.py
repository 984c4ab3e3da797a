"""Helpers for the tests, benchmarks and scripts, kept out of the server's packages: tiny models and their
tokenizers written in Hugging Face layouts (random or trained weights, adapters, Medusa heads, MLP speculators,
EAGLE-3 drafters), GGUF files written from those models, chat templates, a code corpus, the real model's fetch
(SmolLM2-135M-Instruct's GGUF), drivers for the worker in-process, and the published clients in their own
virtualenv. They build small, real artefacts offline.

The server never imports this package (nor do the router and the launcher); it is installed beside them from
testing/ and stays out of the Docker images.
"""

from __future__ import annotations

from .tokenizer import build_tokenizer

__all__ = ["build_tokenizer"]
