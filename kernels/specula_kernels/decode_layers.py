"""A decoder stack's step of a few rows in one native call (`csrc/decode_layers.cpp`).

`NativeStack` holds, per layer, the addresses of its norms, its four products' weights (panels, int8, int4 or w8a8, as
the layers hold them) and its KV cache, built once; `run` fills the step's shared inputs and runs every layer in
one parallel region, updating the residual stream in place. The kernels are the ones the layer-by-layer path
calls, in the same order, so the two give the same bits (tested); the model decides when a step qualifies
(`LlamaForCausalLM._native_stack`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specula_kernels import native, paged_attention
from specula_kernels.paged_attention import NATIVE_MAX_QUERY, GroupedAttentionInputs, PagedAttentionInputs

PANELS, INT8, INT4, W8A8 = 0, 1, 2, 6
# What `NativeStack.time_operators` splits a layer into, in the order the stack runs them.
OPERATORS = ("rms_norm", "qkv_proj", "rotary_and_cache", "paged_attention", "o_proj", "add_rms_norm",
             "gate_up_proj", "silu_and_mul", "down_proj", "residual_add")
GGUF_KINDS = {"Q4_0": 3, "Q4_1": 4, "Q8_0": 5}  # GGUF blocks (`gguf_blocks.GGUFBlocks.pack_native`), by type
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class Product(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("out_features", _i64), ("in_features", _i64), ("group_size", _i64),
                ("weight", _ptr)]


class Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("qkv", Product), ("o", Product), ("gate_up", Product),
                ("down", Product), ("key_cache", _ptr), ("value_cache", _ptr)]


class Attention(ctypes.Structure):
    _fields_ = [("context_slots", _ptr), ("num_seqs", _i64), ("max_context", _i64), ("query_index", _ptr),
                ("query_valid", _ptr), ("max_query", _i64), ("mask", _ptr)]


class Step(ctypes.Structure):
    _fields_ = [(name, _i64) for name in ("rows", "hidden", "num_heads", "num_kv_heads", "head_dim",
                                          "intermediate")]
    _fields_ += [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("cos", _ptr), ("sin", _ptr),
                 ("slot_mapping", _ptr), ("attention", _ptr), ("num_attention", _i64)]
    _fields_ += [(name, _ptr) for name in ("normed", "qkv", "attended", "projected", "gate_up", "activated")]


@dataclass(frozen=True)
class ProductWeights:
    """A product as the native kernels read it; the tensors are kept alive by the layer that holds them."""

    kind: int
    out_features: int
    in_features: int
    weight: torch.Tensor  # panels, or tiles that hold their own scales
    group_size: int = 0

    def struct(self) -> Product:
        return Product(self.kind, self.out_features, self.in_features, self.group_size, self.weight.data_ptr())


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: ProductWeights
    o: ProductWeights
    gate_up: ProductWeights
    down: ProductWeights


class NativeStack:
    """The layers of one model, ready for `run`; the KV caches' addresses are bound on first use (and again if the
    caches are reallocated)."""

    def __init__(self, layers: list[LayerWeights], num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 scale: float) -> None:
        self.layers = layers
        self.hidden = layers[0].input_norm.shape[0]
        self.intermediate = layers[0].down.in_features
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.eps, self.scale = eps, scale
        self._array = None
        self._caches: tuple[int, ...] = ()
        self.operator_seconds: torch.Tensor | None = None  # see `time_operators`

    def time_operators(self, on: bool = True) -> None:
        """While on, every call of `run` also adds each operator's seconds, summed over the layers, into
        `operator_seconds` (indexed as `OPERATORS`; zeroed here), from the clock the native stack reads after each
        operator (benchmark/decode_profile.py; off while serving)."""
        self.operator_seconds = torch.zeros(len(OPERATORS), dtype=torch.float64) if on else None

    @staticmethod
    def serves(attn, kv_caches) -> bool:
        """Whether a step's attention inputs and caches are ones the native stack runs: `PagedAttentionInputs` (or
        groups of them) of at most `NATIVE_MAX_QUERY` rows a sequence, float32 contiguous caches, a head size the
        kernel holds."""
        groups = _groups(attn)
        if groups is None or any(group.query_index.shape[1] > NATIVE_MAX_QUERY for _, group in groups):
            return False
        key, value = kv_caches[0]
        # The keys stand in for the query: the same device, dtype and head size (the hidden rows are float32).
        return paged_attention.native_serves(key, key, value)

    def _bind(self, kv_caches) -> ctypes.Array:
        addresses = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        if self._array is None or addresses != self._caches:
            array = (Layer * len(self.layers))()
            for entry, weights, (key, value) in zip(array, self.layers, kv_caches):
                entry.input_norm, entry.post_norm = weights.input_norm.data_ptr(), weights.post_norm.data_ptr()
                entry.qkv, entry.o = weights.qkv.struct(), weights.o.struct()
                entry.gate_up, entry.down = weights.gate_up.struct(), weights.down.struct()
                entry.key_cache, entry.value_cache = key.data_ptr(), value.data_ptr()
            self._array, self._caches = array, addresses
        return self._array

    def _step(self, rows: int, cos: torch.Tensor, sin: torch.Tensor, attn: PagedAttentionInputs) -> tuple:
        """The step's shared inputs as the native call reads them, and the tensors they point into (to be kept
        alive until the call returns)."""
        cos2, sin2 = cos.reshape(rows, self.head_dim).contiguous(), sin.reshape(rows, self.head_dim).contiguous()
        slots = attn.slot_mapping.contiguous()
        groups = _groups(attn)
        keep = [cos2, sin2, slots]
        attention = (Attention * len(groups))()
        for entry, (rows_of, group) in zip(attention, groups):
            context, valid = group.context_slots.contiguous(), group.query_valid.contiguous()
            mask = None if group.mask is None else group.mask.contiguous()
            index = group.query_index.contiguous() if rows_of is None else paged_attention.step_rows(rows_of, group)
            keep += [context, valid, mask, index]
            entry.context_slots, entry.num_seqs, entry.max_context = context.data_ptr(), *context.shape
            entry.query_index, entry.query_valid, entry.max_query = index.data_ptr(), valid.data_ptr(), index.shape[1]
            entry.mask = None if mask is None else mask.data_ptr()
        q_width = self.num_heads * self.head_dim
        scratch = [torch.empty(rows, width) for width in (
            self.hidden, q_width + 2 * self.num_kv_heads * self.head_dim, q_width, self.hidden,
            2 * self.intermediate, self.intermediate)]
        step = Step(rows, self.hidden, self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate,
                    self.eps, self.scale, cos2.data_ptr(), sin2.data_ptr(), slots.data_ptr(),
                    ctypes.addressof(attention), len(groups), *(t.data_ptr() for t in scratch))
        return step, (keep, attention, scratch)

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches,
            attn: PagedAttentionInputs, visit: Callable[[int, torch.Tensor], None] | None = None,
            visit_after: Sequence[int] = ()) -> None:
        """Every layer over `hidden` `[rows, hidden]` (float32, contiguous), updated in place; `cos`, `sin` as
        `RotaryEmbedding.tables` gives them. `visit(i, hidden)` is called after the first i layers for each i in
        `visit_after` (0: before any; the number of layers: after the last): the layers between run as one native
        call each, on the same inputs, so the residual stream is the same as in one call."""
        rows = hidden.shape[0]
        assert hidden.is_contiguous() and hidden.dtype == torch.float32 and hidden.shape[1] == self.hidden
        layers = self._bind(kv_caches)
        step, _keep = self._step(rows, cos, sin, attn)
        stops = sorted({i for i in visit_after if 0 <= i <= len(self.layers)} | {len(self.layers)})
        first = 0
        for stop in stops:
            if stop > first:
                stamps = None
                if self.operator_seconds is not None:
                    stamps = torch.zeros(1 + len(OPERATORS) * (stop - first), dtype=torch.int64)
                    native.library().specula_stack_stamps(stamps.data_ptr())
                native.library().specula_decode_layers(ctypes.addressof(layers) + first * ctypes.sizeof(Layer),
                                                       stop - first, ctypes.addressof(step), hidden.data_ptr(),
                                                       torch.get_num_threads())
                if stamps is not None:
                    native.library().specula_stack_stamps(None)
                    self.operator_seconds += stamps.diff().view(-1, len(OPERATORS)).sum(0) / 1e9
                first = stop
            if visit is not None and stop in visit_after:
                visit(stop, hidden)

    def run_eagle3(self, embeds: torch.Tensor, state: torch.Tensor, hidden_norm: torch.Tensor,
                   norm_before_residual: bool, cos: torch.Tensor, sin: torch.Tensor, kv_caches,
                   attn: PagedAttentionInputs) -> torch.Tensor:
        """An EAGLE-3 draft stack: the first layer reads the embeddings `embeds` and the input state `state` (both
        `[rows, hidden]` float32), its q/k/v product `[input_layernorm(embeds), hidden_norm(state)]` (so its q/k/v
        weights are 2 x hidden wide), its residual stream starting from the state (or its normed form with
        `norm_before_residual`); the other layers are decoder layers. Returns the last layer's output."""
        rows = state.shape[0]
        embeds, state = embeds.contiguous(), state.contiguous()
        assert embeds.dtype == state.dtype == torch.float32 and state.shape == embeds.shape == (rows, self.hidden)
        layers = self._bind(kv_caches)
        step, _keep = self._step(rows, cos, sin, attn)
        hidden, wide = torch.empty(rows, self.hidden), torch.empty(rows, 2 * self.hidden)
        native.library().specula_eagle3_layer(ctypes.addressof(layers), hidden_norm.data_ptr(),
                                              int(norm_before_residual), ctypes.addressof(step), embeds.data_ptr(),
                                              state.data_ptr(), wide.data_ptr(), hidden.data_ptr(),
                                              torch.get_num_threads())
        if len(self.layers) > 1:
            native.library().specula_decode_layers(ctypes.addressof(layers) + ctypes.sizeof(Layer),
                                                   len(self.layers) - 1, ctypes.addressof(step), hidden.data_ptr(),
                                                   torch.get_num_threads())
        return hidden


def _groups(attn) -> list[tuple[torch.Tensor | None, PagedAttentionInputs]] | None:
    """(rows of the step, or None for all of them; inputs) per attention group; None for other inputs."""
    if type(attn) is PagedAttentionInputs:
        return [(None, attn)]
    if type(attn) is GroupedAttentionInputs:
        return list(attn.groups)
    return None
