"""A GGUF file's metadata as the files of a Hugging Face model directory.

`model_directory(checkpoint)` writes, once per file (cached by path, size and modification time):

    config.json              the `llama.*` keys as a LlamaForCausalLM config
    tokenizer.json           the `tokenizer.ggml.*` vocabulary, merges and pre-tokenizer as a `tokenizers` file
    tokenizer_config.json    the chat template(s), the named special tokens, add_bos_token
    generation_config.json   the end-of-generation ids (EOS, and llama.cpp's EOT and EOM where the file has them)
    gguf.json                which GGUF file holds the weights (`hub.weight_files` returns it)

so the router (tokenizer, chat template, EOS ids) and the workers (config, weights) read a GGUF model as they read
any model directory. The tokenizer is rebuilt with the `tokenizers` library from what llama.cpp stores: a
byte-level BPE (`tokenizer.ggml.model == "gpt2"`: Llama 3, SmolLM, ...) with the pre-tokenizer its `tokenizer.ggml.pre`
names, or a SentencePiece-style BPE (`"llama"`: Llama 2, Mistral, TinyLlama) whose merges are derived from the
token scores. Tests check both against transformers' own GGUF tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from specula_server.gguf_checkpoint import GGUFCheckpoint, GGUFError

logger = logging.getLogger("specula.gguf")

GGUF_POINTER = "gguf.json"  # in a model directory made from a GGUF file: {"file": path of the weights}
_FORMAT_VERSION = 1  # bump when what `model_directory` writes changes, so cached directories are rebuilt

# llama.cpp's token types (`tokenizer.ggml.token_type`).
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer splits by `tokenizer.ggml.pre`, as llama.cpp's `llama-vocab.cpp` defines them for the types a
# `llama` architecture file carries. The regex after the split is the byte-level one of each family.
_GPT2 = "gpt2"  # ByteLevel's own regex
_DIGITS_GPT2 = "digits+gpt2"  # each digit alone, then ByteLevel's regex
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# name -> (split, whether BPE first looks the whole word up in the vocabulary, as llama.cpp does for these)
_PRE_TOKENIZERS: dict[str, tuple[str, bool]] = {
    "default": (_GPT2, False), "gpt-2": (_GPT2, False), "gpt2": (_GPT2, False), "mpt": (_GPT2, False),
    "olmo": (_GPT2, False),
    "smollm": (_DIGITS_GPT2, False), "starcoder": (_DIGITS_GPT2, False), "refact": (_DIGITS_GPT2, False),
    "codeshell": (_DIGITS_GPT2, False), "command-r": (_DIGITS_GPT2, False),
    "llama-bpe": (_LLAMA3_SPLIT, True), "llama3": (_LLAMA3_SPLIT, True), "llama-v3": (_LLAMA3_SPLIT, True),
    "smaug-bpe": (_LLAMA3_SPLIT, False), "dbrx": (_LLAMA3_SPLIT, False), "falcon3": (_LLAMA3_SPLIT, False),
    "qwen2": (_QWEN2_SPLIT, False), "deepseek-r1-qwen": (_QWEN2_SPLIT, False),
    "tekken": (_TEKKEN_SPLIT, True),
}


def model_directory(gguf_file: Path, cache_root: Path | None = None) -> Path:
    """The Hugging Face style directory for `gguf_file`, written on first use and reused after.

    `cache_root`: where such directories live (`gguf_cache_root()` by default). A cached directory is found from
    the file's path, size and modification time without reading the file. Writing is atomic (a temporary
    directory renamed into place), so the router and several workers resolving the same file at once each see a
    whole directory. Raises `GGUFError` for a file Specula cannot serve.
    """
    gguf_file = Path(gguf_file).expanduser().resolve()
    root = cache_root or gguf_cache_root()
    stat = gguf_file.stat()
    key = f"{gguf_file}|{stat.st_size}|{stat.st_mtime_ns}|{_FORMAT_VERSION}"
    target = root / f"{gguf_file.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (target / GGUF_POINTER).is_file():
        return target
    checkpoint = GGUFCheckpoint.open(gguf_file)
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=root))
    except OSError as error:
        if cache_root is not None:
            raise
        logger.warning("cannot write GGUF metadata under %s (%s); using a temporary directory", root, error)
        return model_directory(gguf_file, Path(tempfile.gettempdir()) / f"specula-gguf-{os.getuid()}")
    write_model_files(checkpoint, staging)
    try:
        staging.rename(target)
    except OSError:  # another process renamed its copy first: theirs is as good as ours
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("GGUF metadata of %s written to %s", gguf_file, target)
    return target


def gguf_cache_root() -> Path:
    """`SPECULA_CACHE/gguf`, else `HF_HOME/specula/gguf` (HF_HOME defaulting to ~/.cache/huggingface): beside the
    Hub cache, so a Docker volume on /data keeps it too."""
    base = os.environ.get("SPECULA_CACHE")
    if base:
        return Path(base).expanduser() / "gguf"
    return Path(os.environ.get("HF_HOME") or "~/.cache/huggingface").expanduser() / "specula" / "gguf"


def write_model_files(checkpoint: GGUFCheckpoint, out_dir: Path) -> None:
    """Writes config.json, tokenizer.json, tokenizer_config.json, generation_config.json and gguf.json."""
    config = hf_config(checkpoint)
    tokens: list[str] = checkpoint.metadata.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise GGUFError(checkpoint.path, "no tokenizer (tokenizer.ggml.tokens) in the metadata")
    build_tokenizer(checkpoint).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(checkpoint))
    generation = {key: config[key] for key in ("bos_token_id", "pad_token_id") if config.get(key) is not None}
    generation["eos_token_id"] = end_of_generation_ids(checkpoint)
    _write_json(out_dir / "generation_config.json", generation)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / GGUF_POINTER, {"file": str(checkpoint.path), "types": checkpoint.type_counts()})


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def hf_config(checkpoint: GGUFCheckpoint) -> dict[str, Any]:
    """The `llama.*` metadata as a transformers LlamaForCausalLM `config.json`."""
    key, meta = checkpoint.key, checkpoint.metadata
    required = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count", "context_length")
    missing = [f"{checkpoint.architecture}.{name}" for name in required if key(name) is None]
    if missing:
        raise GGUFError(checkpoint.path, f"metadata lacks {', '.join(missing)}")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length") or hidden // heads)
    rotary_dims = key("rope.dimension_count")
    if rotary_dims is not None and int(rotary_dims) != head_dim:
        raise GGUFError(checkpoint.path, f"rotary embedding over {rotary_dims} of {head_dim} head dimensions is not "
                                         "supported")
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFError(checkpoint.path, f"rope scaling {scaling!r} is not supported")
    embed = checkpoint.tensors.get("model.embed_tokens.weight")
    if embed is None:
        raise GGUFError(checkpoint.path, "no token embedding (token_embd.weight)")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": _float32(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _float32(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length")),
        "vocab_size": embed.shape[0],
        "tie_word_embeddings": "lm_head.weight" not in checkpoint.tensors,
        "torch_dtype": "float32",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if "rope_freqs.weight" in checkpoint.extra:
        config["rope_scaling"] = _llama3_rope_scaling(checkpoint, head_dim, config["rope_theta"])
    return config


def _float32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that is the same float32 (1e-05, not 9.9999997e-06), as
    the config it was converted from wrote it."""
    import numpy as np

    return float(str(np.float32(value)))


# Llama 3.1 / 3.3 and Llama 3.2's published rotary scaling: (factor, low_freq_factor, high_freq_factor,
# original_max_position_embeddings).
_LLAMA3_SCALINGS = ((8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192))


def _llama3_rope_scaling(checkpoint: GGUFCheckpoint, head_dim: int, theta: float) -> dict[str, Any]:
    """Llama 3.1's rotary scaling, which llama.cpp stores as one divisor per frequency (`rope_freqs.weight`)
    without its parameters: the published parameters that reproduce the stored divisors, else a refusal."""
    import torch

    from specula_server.gguf_checkpoint import GGUFTensors
    from specula_server.layers.rotary import inverse_frequencies
    from specula_server.models.config import RopeScaling

    tensor = checkpoint.extra["rope_freqs.weight"]
    stored = GGUFTensors.read_extra(tensor)
    plain = inverse_frequencies(head_dim, theta, None)
    for factor, low, high, original in _LLAMA3_SCALINGS:
        scaling = RopeScaling(factor, low, high, original)
        divisors = plain / inverse_frequencies(head_dim, theta, scaling)
        if divisors.shape == stored.shape and torch.allclose(divisors, stored, rtol=1e-3):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": original}
    raise GGUFError(checkpoint.path, "its rotary frequency factors (rope_freqs.weight) match no Llama 3 scaling "
                                     "Specula knows")


def end_of_generation_ids(checkpoint: GGUFCheckpoint) -> list[int]:
    """EOS, and llama.cpp's end-of-turn and end-of-message ids where the file names them (Llama 3's `<|eot_id|>`)."""
    names = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [checkpoint.metadata.get(f"tokenizer.ggml.{name}") for name in names]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def tokenizer_config(checkpoint: GGUFCheckpoint) -> dict[str, Any]:
    """tokenizer_config.json: the chat template(s), the named special tokens and whether BOS is added."""
    meta = checkpoint.metadata
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {"add_bos_token": _adds_bos(checkpoint),
                              "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
                              "model_max_length": int(checkpoint.key("context_length", 0)) or None}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            config[name] = tokens[int(token_id)]
    named = {name.removeprefix("tokenizer.chat_template."): value for name, value in meta.items()
             if name.startswith("tokenizer.chat_template.") and isinstance(value, str)}
    default = meta.get("tokenizer.chat_template")
    if named:
        config["chat_template"] = ([{"name": "default", "template": default}] if default else []) + [
            {"name": name, "template": template} for name, template in named.items()]
    elif default:
        config["chat_template"] = default
    return config


def _adds_bos(checkpoint: GGUFCheckpoint) -> bool:
    flag = checkpoint.metadata.get("tokenizer.ggml.add_bos_token")
    if flag is not None:
        return bool(flag)
    # No flag: llama.cpp adds BOS for SentencePiece vocabularies, and transformers' byte-level one does not.
    return checkpoint.metadata.get("tokenizer.ggml.model") == "llama"


def build_tokenizer(checkpoint: GGUFCheckpoint) -> Tokenizer:
    """The file's tokenizer as a `tokenizers.Tokenizer`, special tokens and BOS handling included."""
    meta = checkpoint.metadata
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(checkpoint, tokens)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(checkpoint, tokens)
    else:
        raise GGUFError(checkpoint.path, f"tokenizer model {kind!r} is not supported (supported: gpt2, llama)")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token, kind_id in zip(tokens, types) if kind_id == _CONTROL and token])
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False)
                          for token, kind_id in zip(tokens, types) if kind_id == _USER_DEFINED and token])
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if _adds_bos(checkpoint) and bos_id is not None:
        bos = tokens[int(bos_id)]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, int(bos_id))])
    return tokenizer


def _byte_level_bpe(checkpoint: GGUFCheckpoint, tokens: list[str]) -> Tokenizer:
    pre = checkpoint.metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFError(checkpoint.path, f"pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported (supported: "
                                         f"{', '.join(sorted(_PRE_TOKENIZERS))})")
    split, ignore_merges = _PRE_TOKENIZERS[pre]
    merges = [tuple(merge.split(" ", 1)) for merge in checkpoint.metadata.get("tokenizer.ggml.merges") or []]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    if split == _GPT2:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == _DIGITS_GPT2:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(checkpoint: GGUFCheckpoint, tokens: list[str]) -> Tokenizer:
    """Llama 2's tokenizer: BPE over `▁`-prefixed text with byte fallback, merges ranked by the merged token's
    score (SentencePiece's BPE picks the best-scored pair first)."""
    scores: list[float] = checkpoint.metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {token: index for index, token in enumerate(tokens)}
    merges: list[tuple[float, int, str, str]] = []
    for token, index in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((-scores[index] if not math.isnan(scores[index]) else math.inf, index, left, right))
    merges.sort()
    unk_id = checkpoint.metadata.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(models.BPE(vocab, [(left, right) for _, _, left, right in merges], fuse_unk=True,
                                     byte_fallback=True,
                                     unk_token=tokens[int(unk_id)] if unk_id is not None else None))
    prefix = checkpoint.metadata.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("▁")] if prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                          + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tokenizer
