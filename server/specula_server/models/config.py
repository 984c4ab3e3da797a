"""Model configuration read from a Hugging Face `config.json`.

One frozen dataclass covers the whole Llama family; architecture differences (biases, tied embeddings,
rope scaling, explicit head_dim) are fields, not separate classes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("specula.models")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 style frequency-dependent RoPE scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    attention_bias: bool
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        architectures = raw.get("architectures") or []
        if not architectures:
            raise ValueError("config.json has no `architectures` entry; cannot pick a model implementation")
        arch = architectures[0]
        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        max_positions = int(raw.get("max_position_embeddings", 2048))
        window = raw.get("sliding_window")
        if window and raw.get("use_sliding_window", True) and int(window) < max_positions:
            # Positions past the window would need sliding-window attention; capping keeps results exact.
            logger.warning("capping max_position_embeddings %d to sliding_window %d", max_positions, window)
            max_positions = int(window)
        # transformers >= 5 writes `rope_parameters` (theta included); older checkpoints `rope_scaling`.
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta", 10000.0)),
            rope_scaling=_parse_rope_scaling(rope),
            max_position_embeddings=max_positions,
            # Qwen2 always has q/k/v biases; Llama declares them with `attention_bias`.
            attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        return cls.from_dict(json.loads((model_dir / "config.json").read_text()))


def _parse_rope_scaling(raw: dict[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3)")
    return RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw["low_freq_factor"]),
        high_freq_factor=float(raw["high_freq_factor"]),
        original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
    )
