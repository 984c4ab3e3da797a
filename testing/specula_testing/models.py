"""Small random models in the exact Hugging Face layout, for tests and benchmarks.

Models are written by transformers itself (`save_pretrained` with safetensors), so the worker is always
checked against checkpoints it did not write. Weights are random but seeded, with a larger init scale than
the default so that logits are peaked and greedy decoding is not decided by rounding noise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specula_testing.tokenizer import build_tokenizer

# Small shapes that still exercise GQA, an explicit head_dim, biases, tied embeddings and rope scaling.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False,
    ),
    "llama31": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64),
    ),
    "mistral": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096, tie_word_embeddings=False,
    ),
}


# A ~125M-parameter Llama shape (134M with the 32000-token vocabulary) for benchmarks.
BENCHMARK_125M: dict[str, Any] = dict(
    hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
    max_position_embeddings=2048, vocab_size=32000, init_std=0.02,
)


def build_tiny_model(
    out_dir: Path,
    kind: str = "llama",
    seed: int = 0,
    init_std: float = 0.1,
    max_shard_size: str | None = None,
    tokenizer_kind: str = "bytelevel",
    **overrides: Any,
) -> Path:
    """Writes a random `kind` model (see TINY_CONFIGS) with its tokenizer to `out_dir` and returns it."""
    import transformers  # test-only dependency

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(out_dir, kind=tokenizer_kind)
    tok = json.loads((out_dir / "tokenizer.json").read_text())
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    raw = dict(TINY_CONFIGS[kind], vocab_size=vocab_size, initializer_range=init_std,
               bos_token_id=special.get("<s>"), eos_token_id=special.get("</s>"), torch_dtype="float32")
    raw.update(overrides)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "architectures"})
    config.architectures = raw["architectures"]
    torch.manual_seed(seed)
    model = getattr(transformers, raw["architectures"][0])(config)
    with torch.no_grad():  # default init leaves biases at 0 and norms at 1, which would hide bugs in both
        for name, param in model.named_parameters():
            if "bias" in name or "norm" in name:
                param.add_(torch.randn_like(param) * init_std)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    return out_dir
