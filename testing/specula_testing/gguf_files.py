"""GGUF files for tests, written from a Hugging Face model directory the way llama.cpp's converter writes them.

`write_gguf(model_dir, out_file, tensor_type)` takes a Llama directory (`models.build_tiny_model`) and writes
it with the `gguf` package's own writer and quantizers: `llama.*` metadata, the byte-level tokenizer's vocabulary
and merges under `tokenizer.ggml.*`, the chat template, q/k rows permuted for llama.cpp's rotary layout, 2-D
weights in `tensor_type` and norms in F32 (as the converter leaves them). The K-quant types have no quantizer in
the `gguf` package: their blocks are random bytes with small scales, a valid file whose values are what the
reference dequantizer makes of them. Tests compare Specula on the file against transformers on the same file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from specula_server.gguf_checkpoint import gguf_tensor_name

# Where each K-quant block keeps its float16 scales (super-block scale `d`, and `dmin` where it has one).
_K_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


BLOCK_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
K_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]  # 256-wide blocks: written from a 256-wide model

def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order: each head's rotary halves interleaved into pairs."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def llama3_rope_factors(head_dim: int, scaling: dict, rope_theta: float) -> np.ndarray:
    """The divisor of each rotary frequency, as llama.cpp's converter stores Llama 3.1 scaling (`rope_freqs`)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    frequencies = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    factors = []
    for frequency in frequencies:
        wavelength = 2 * np.pi / frequency
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(model_dir: Path, out_file: Path, tensor_type: str = "F32", *, architecture: str = "llama",
               embedding_type: str | None = None, drop: tuple[str, ...] = (), pre_tokenizer: str = "default",
               seed: int = 0, types: dict[str, str] | None = None) -> Path:
    """Writes `model_dir` as a GGUF file; `embedding_type` (default: `tensor_type`) for the token embedding,
    `types`: the type of other tensors (by llama.cpp's name) that are not `tensor_type`, `drop`: metadata keys or
    tensor names (llama.cpp's) to leave out."""
    import gguf

    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    writer = gguf.GGUFWriter(str(out_file), architecture)
    writer.add_name(model_dir.name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta") or config.get("rope_parameters", {})["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    _add_tokenizer(writer, tokenizer, tokenizer_config, config, drop, pre_tokenizer)

    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if scaling.get("rope_type") == "llama3" and "rope_freqs.weight" not in drop:
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, scaling, rope_theta=float(
            config.get("rope_theta") or scaling["rope_theta"])))
    rng = np.random.default_rng(seed)
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    for hf_name, value in tensors.items():
        name = gguf_tensor_name(hf_name)
        if name is None or name in drop:
            continue
        value = value.astype(np.float32)
        if name.endswith("attn_q.weight"):
            value = llama_cpp_permute(value, heads)
        elif name.endswith("attn_k.weight"):
            value = llama_cpp_permute(value, kv_heads)
        kind = (embedding_type or tensor_type) if name == "token_embd.weight" else (types or {}).get(name, tensor_type)
        if value.ndim == 1:
            kind = "F32"
        _add_tensor(writer, name, value, kind, rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_file


def _add_tokenizer(writer, tokenizer: dict, tokenizer_config: dict, config: dict, drop: tuple[str, ...],
                   pre_tokenizer: str) -> None:
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    added = {t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}
    size = max([*vocab.values(), *added.values()]) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [1] * size  # NORMAL
    for token, index in vocab.items():
        tokens[index] = token
    for token, index in added.items():
        tokens[index], types[index] = token, 3  # CONTROL
    if tokenizer["model"].get("byte_fallback"):
        # A SentencePiece-style vocabulary (Llama 2): llama.cpp stores scores, not merges; the converter gives each
        # piece its SentencePiece score, which falls with the piece's rank, and marks byte and unknown tokens.
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0 if types[i] == 3 or token.startswith("<0x") else -float(i)
                                 for i, token in enumerate(tokens)])
        writer.add_token_types([6 if token.startswith("<0x") and types[i] == 1 else 2 if token == "<unk>" else types[i]
                                for i, token in enumerate(tokens)])
        writer.add_add_space_prefix(True)
        writer.add_unk_token_id(vocab.get("<unk>", added.get("<unk>", 0)))
    else:
        merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"].get("merges", [])]
        writer.add_tokenizer_model("gpt2")
        if "tokenizer.ggml.pre" not in drop:
            writer.add_tokenizer_pre(pre_tokenizer)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
    for key, adder in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id)):
        if config.get(key) is not None:
            adder(int(config[key]))
    writer.add_add_bos_token(bool(tokenizer.get("post_processor")))
    template = tokenizer_config.get("chat_template")
    if template and "tokenizer.chat_template" not in drop:
        writer.add_chat_template(template)


def _add_tensor(writer, name: str, value: np.ndarray, kind: str, rng: np.random.Generator) -> None:
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        writer.add_tensor(name, value)
    elif kind == "F16":
        writer.add_tensor(name, value.astype(np.float16))
    elif kind in _K_SCALE_OFFSETS:
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        rows, columns = value.shape
        data = rng.integers(0, 256, size=(rows, columns // block, block_bytes), dtype=np.uint8)
        for offset in _K_SCALE_OFFSETS[kind]:
            scales = (rng.random((rows, columns // block)) * 2e-4 + 1e-4).astype(np.float16)
            data[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(rows, columns // block, 2)
        writer.add_tensor(name, data.reshape(rows, -1), raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
