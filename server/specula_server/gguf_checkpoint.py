"""GGUF checkpoints (llama.cpp's single-file format): weights, config, tokenizer and chat template in one file.

`--model-id` may name a `.gguf` file (`hub.resolve_model_dir`; on the Hub, `org/repo:FILE.gguf`). Specula serves it
as it serves a Hugging Face directory, without a conversion step:

- `GGUFCheckpoint.open(path)` memory-maps the file and reads its header (no tensor data), then checks what the
  server needs before any shard starts: the `llama` architecture, tensor types it can read, every tensor lying
  inside the file. Each refusal is a `GGUFError` naming the file and the reason.
- `gguf_metadata.model_directory` writes the small files of a Hugging Face directory (config.json, tokenizer.json,
  ...) from the metadata, so the router and the workers read them as they read any model directory.
- `GGUFTensors` is the weights reader's handle for the file (`weights.Weights` opens it in place of safetensors'
  `safe_open`): it serves tensors under Hugging Face names as float32, dequantized with the `gguf` package's
  reference dequantizers, a tensor-parallel rank reading only its own rows (or whole blocks of its columns).

llama.cpp's converter permutes the rows of `q_proj` and `k_proj` so that each head's rotary pairs are adjacent
(its rotation acts on pairs `(2i, 2i + 1)`; Hugging Face checkpoints rotate halves, `(i, i + d/2)`). `GGUFTensors`
undoes it per head, as transformers' GGUF loader does:

    file rows of one head (d = 4):   r0 r2 r1 r3      (pairs interleaved)
    served rows:                     r0 r1 r2 r3      (halves)
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from specula_kernels.gguf_blocks import GGUFBlocks

logger = logging.getLogger("specula.gguf")

GGUF_SUFFIX = ".gguf"
SUPPORTED_ARCHITECTURES = ("llama",)
# Tensor types read here, all through the `gguf` package's dequantizers. Others (the IQ family, ternary types)
# are refused by name before any shard starts.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K")

# llama.cpp's tensor names (`blk.N.` per layer) -> Hugging Face's Llama names.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Tensors the converter writes that no layer loads: Llama 3.1's rotary factors are a function of config values
# (`gguf_metadata` finds the values that give them).
_IGNORED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


class GGUFError(ValueError):
    """A GGUF file Specula cannot serve; the message names the file and the reason."""

    def __init__(self, path: Path | str, reason: str) -> None:
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"GGUF file {path}: {reason}")


def is_gguf(model_id: str) -> bool:
    """Whether `model_id` names a GGUF file: a path ending in `.gguf`, or a Hub file (`org/repo:NAME.gguf`)."""
    return model_id.lower().endswith(GGUF_SUFFIX)


@dataclass(frozen=True)
class _Tensor:
    name: str  # the file's name
    type_name: str  # "Q4_1", "F32", ...
    shape: tuple[int, ...]  # Hugging Face order: [rows, columns] for a matrix
    data: np.ndarray  # the file's bytes (quantized types: [rows, bytes per row]) or values, memory-mapped


class GGUFCheckpoint:
    """An opened, checked GGUF file: its metadata as plain Python values and its tensors under Hugging Face names."""

    def __init__(self, path: Path, metadata: dict[str, Any], tensors: dict[str, _Tensor],
                 extra: dict[str, _Tensor] | None = None) -> None:
        self.path = path
        self.metadata = metadata
        self.tensors = tensors  # Hugging Face name -> tensor
        self.extra = extra or {}  # tensors a Llama layer does not load (`rope_freqs.weight`), by the file's name

    @classmethod
    def open(cls, path: Path | str) -> GGUFCheckpoint:
        """Reads and checks the header of `path`. Raises `GGUFError` naming the file and the reason."""
        path = Path(path).expanduser().resolve()
        if not path.is_file():
            raise GGUFError(path, "no such file")
        from gguf import GGUFReader  # imported here: the package is only needed for GGUF models

        try:
            reader = GGUFReader(path)
        except Exception as error:  # the reader raises ValueError, IndexError, ... on a short or corrupt file
            raise GGUFError(path, f"not a readable GGUF file ({type(error).__name__}: {error}); it may be truncated "
                                  f"or not a GGUF file at all ({path.stat().st_size} bytes)") from error
        metadata = {name: _field_value(field) for name, field in reader.fields.items()
                    if not name.startswith("GGUF.")}
        architecture = metadata.get("general.architecture")
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(path, f"architecture {architecture!r} is not supported (supported: "
                                  f"{', '.join(SUPPORTED_ARCHITECTURES)})")
        size = path.stat().st_size
        tensors: dict[str, _Tensor] = {}
        extra: dict[str, _Tensor] = {}
        for tensor in reader.tensors:
            type_name = tensor.tensor_type.name
            if tensor.data_offset + tensor.n_bytes > size:
                end = tensor.data_offset + tensor.n_bytes
                raise GGUFError(path, f"truncated: tensor {tensor.name} ends at byte {end} but the file has {size} "
                                      f"bytes")
            shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
            if tensor.name in _IGNORED:
                extra[tensor.name] = _Tensor(tensor.name, type_name, shape, tensor.data)
                continue
            if type_name not in SUPPORTED_TYPES:
                raise GGUFError(path, f"tensor {tensor.name} is of type {type_name}, which Specula does not read "
                                      f"(supported: {', '.join(SUPPORTED_TYPES)})")
            hf_name = hf_tensor_name(tensor.name)
            if hf_name is None:
                raise GGUFError(path, f"tensor {tensor.name} is not part of a llama model")
            tensors[hf_name] = _Tensor(tensor.name, type_name, shape, tensor.data)
        return cls(path, metadata, tensors, extra)

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def key(self, name: str, default: Any = None) -> Any:
        """The architecture's own metadata key (`llama.block_count` for `key("block_count")`)."""
        return self.metadata.get(f"{self.architecture}.{name}", default)

    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for tensor in self.tensors.values():
            counts[tensor.type_name] = counts.get(tensor.type_name, 0) + 1
        return counts


def hf_tensor_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for a name a Llama does not have."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def gguf_tensor_name(hf_name: str) -> str | None:
    """The inverse of `hf_tensor_name`: `model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight`."""
    for gguf_name, name in _GLOBAL_NAMES.items():
        if name == hf_name:
            return gguf_name
    layer, _, rest = hf_name.removeprefix("model.layers.").partition(".")
    if hf_name.startswith("model.layers.") and layer.isdigit():
        return next((f"blk.{layer}.{g}" for g, name in _LAYER_NAMES.items() if name == rest), None)
    return None


def _field_value(field: Any) -> Any:
    """A metadata field as a Python value (str, int, float, bool, or a list of them)."""
    from gguf import GGUFValueType

    if not field.types:
        return None
    if field.types[0] == GGUFValueType.ARRAY:
        item_type = field.types[-1]
        if item_type == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    value = field.parts[field.data[0]].tolist()[0]
    return bool(value) if field.types[0] == GGUFValueType.BOOL else value


class GGUFTensors:
    """The weights reader's handle for a GGUF file, with the interface of safetensors' `safe_open` handles
    (`keys`, `get_slice(name)[index]`, `get_tensor`): tensors under Hugging Face names, as float32 torch tensors."""

    def __init__(self, path: Path | str, checkpoint: GGUFCheckpoint | None = None) -> None:
        self.checkpoint = checkpoint or GGUFCheckpoint.open(path)
        self._heads = {"self_attn.q_proj.weight": int(self.checkpoint.key("attention.head_count")),
                       "self_attn.k_proj.weight": int(self.checkpoint.key("attention.head_count_kv")
                                                      or self.checkpoint.key("attention.head_count"))}

    def keys(self) -> Iterator[str]:
        return iter(self.checkpoint.tensors)

    def get_slice(self, name: str) -> _GGUFSlice:
        tensor = self.checkpoint.tensors[name]
        heads = next((n for suffix, n in self._heads.items() if name.endswith(suffix)), None)
        return _GGUFSlice(tensor, heads)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.get_slice(name)[:]

    def get_blocks(self, name: str, row_start: int, row_stop: int) -> GGUFBlocks | None:
        """Rows `[row_start, row_stop)` of `name` as the file's own blocks, for `--quantize gguf`; None when the
        tensor is not of a type served natively, or the rows split a q/k head."""
        from specula_kernels.gguf_blocks import NATIVE_TYPES, GGUFBlocks

        tensor = self.checkpoint.tensors[name]
        if tensor.type_name not in NATIVE_TYPES:
            return None
        data = tensor.data[row_start:row_stop]
        heads = next((n for suffix, n in self._heads.items() if name.endswith(suffix)), None)
        if heads is not None:
            head_rows = tensor.shape[0] // heads
            if row_start % head_rows or row_stop % head_rows:
                return None
            data = unpermute_rotary_rows(data, (row_stop - row_start) // head_rows)
        return GGUFBlocks(tensor.type_name, torch.from_numpy(np.array(data, dtype=np.uint8)), tensor.shape[1])

    @staticmethod
    def read_extra(tensor: _Tensor) -> torch.Tensor:
        """A tensor no layer loads (`GGUFCheckpoint.extra`), whole, as float32."""
        return _GGUFSlice(tensor, None)[:]


class _GGUFSlice:
    """One tensor, read lazily: `get_shape()`, and `[index]` dequantizing only the rows (or whole blocks of
    columns) the index selects. `heads`: the head count of a q/k projection whose rows llama.cpp permuted."""

    def __init__(self, tensor: _Tensor, heads: int | None) -> None:
        self.tensor = tensor
        self.heads = heads

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        spans = [_span(i, n) for i, n in zip(index, self.tensor.shape)]
        spans += [(0, n) for n in self.tensor.shape[len(spans):]]
        if len(self.tensor.shape) == 1:
            (start, stop), = spans
            return torch.from_numpy(_dequantize(self.tensor, slice(None))[start:stop].copy())
        (row_start, row_stop), (col_start, col_stop) = spans
        rows, head_rows = self.tensor.shape[0], None
        if self.heads is not None:
            head_rows = rows // self.heads
            if row_start % head_rows or row_stop % head_rows:  # unpermuting needs whole heads: read them all
                return self._read(0, rows, col_start, col_stop)[row_start:row_stop]
        return self._read(row_start, row_stop, col_start, col_stop)

    def _read(self, row_start: int, row_stop: int, col_start: int, col_stop: int) -> torch.Tensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block = GGML_QUANT_SIZES[GGMLQuantizationType[self.tensor.type_name]][0]
        columns = self.tensor.shape[1]
        if block > 1 and (col_start % block or col_stop % block):  # not whole blocks: dequantize whole rows
            values = _dequantize(self.tensor, slice(row_start, row_stop))[:, col_start:col_stop]
        elif block > 1 and (col_start, col_stop) != (0, columns):
            bytes_per_block = self.tensor.data.shape[1] // (columns // block)
            data = self.tensor.data[row_start:row_stop, col_start // block * bytes_per_block:
                                    col_stop // block * bytes_per_block]
            values = _dequantize(_Tensor(self.tensor.name, self.tensor.type_name, (0, 0), data), slice(None))
        else:
            values = _dequantize(self.tensor, slice(row_start, row_stop))[:, col_start:col_stop]
        if self.heads is not None:
            values = unpermute_rotary_rows(values, (row_stop - row_start) // (self.tensor.shape[0] // self.heads))
        values = np.ascontiguousarray(values, dtype=np.float32)
        return torch.from_numpy(values if values.flags.writeable else values.copy())


def _span(index: Any, size: int) -> tuple[int, int]:
    if not isinstance(index, slice) or index.step not in (None, 1):
        raise TypeError(f"GGUF tensors are read by contiguous slices, not {index!r}")
    start, stop, _ = index.indices(size)
    return start, max(start, stop)


def _dequantize(tensor: _Tensor, rows: slice) -> np.ndarray:
    """Float32 values of `tensor`'s rows (all of a 1-D tensor's values for `slice(None)`)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    data = tensor.data[rows]
    if tensor.type_name == "F32":
        return np.asarray(data, dtype=np.float32)
    return dequantize(np.ascontiguousarray(data), GGMLQuantizationType[tensor.type_name]).astype(np.float32,
                                                                                                 copy=False)


def unpermute_rotary_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's per-head row permutation of q/k projections (the module docstring shows one head).

    `rows`: `[heads * head_dim, in]`; within each head, file row `2i` is served row `i` and file row `2i + 1`
    served row `i + head_dim / 2`.
    """
    head_dim = rows.shape[0] // heads
    return rows.reshape(heads, head_dim // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
