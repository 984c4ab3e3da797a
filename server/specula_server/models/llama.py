"""The Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2), tensor parallel, over a paged KV cache.

One implementation for the family: Qwen2's q/k/v biases, tied embeddings, Llama 3.1 rope scaling, GQA and an
explicit `head_dim` are all `ModelConfig` fields. A step processes a flat list of tokens from many sequences
(`[num_tokens]`); which token belongs to which sequence, and where its keys and values live, is in the
step's `PagedAttentionInputs`. Per-request LoRA adapters come in as a `LoraBatch`: each projection adds its
tokens' adapter deltas to the base output (row-parallel ones before the all-reduce, which then sums the
shards' partial deltas with the base partial sums).
"""

from __future__ import annotations

import torch
from torch import nn

from specula_kernels import native
from specula_kernels.decode_layers import (
    GGUF_KINDS,
    INT4,
    INT8,
    PANELS,
    W8A8,
    LayerWeights,
    NativeStack,
    ProductWeights,
)
from specula_kernels.fused import add_rms_norm, rms_norm, rotary_and_cache, silu_and_mul
from specula_kernels.paged_attention import GroupedAttentionInputs, PagedAttentionInputs, paged_attention
from specula_server.adapters.registry import LoraBatch
from specula_server.distributed import ShardGroup
from specula_server.layers.quantization import DenseLinear, GGUFLinear, Int4Linear, Int8Linear, W8A8Linear
from specula_server.layers.rotary import RotaryEmbedding
from specula_server.layers.tensor_parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from specula_server.models.config import ModelConfig
from specula_server.weights import Weights

AttentionInputs = PagedAttentionInputs | GroupedAttentionInputs
KVCache = tuple[torch.Tensor, torch.Tensor]  # ([num_slots, kv_heads, head_dim], same) for one layer


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, then scale in the model dtype (matches the reference implementation).
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(x + delta, norm(x + delta))`, in one pass where the fused kernels serve; `x` may be updated in place."""
        return add_rms_norm(x, delta, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, weights: Weights, prefix: str, group: ShardGroup, index: int) -> None:
        super().__init__()
        self.index = index
        if config.num_heads % group.world_size or config.num_kv_heads % group.world_size:
            raise ValueError(
                f"{config.num_heads} attention heads / {config.num_kv_heads} KV heads cannot be split over "
                f"{group.world_size} shards; choose a --num-shard that divides both"
            )
        self.num_heads = config.num_heads // group.world_size
        self.num_kv_heads = config.num_kv_heads // group.world_size
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = ColumnParallelLinear.load(
            weights, [f"{prefix}.{n}_proj" for n in ("q", "k", "v")], bias=config.attention_bias
        )
        self.o_proj = RowParallelLinear.load(weights, f"{prefix}.o_proj", bias=False, group=group)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        attn: AttentionInputs,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(hidden)
        if lora is not None:  # in place, into the fused output's columns
            for name, out in zip(("q_proj", "k_proj", "v_proj"), qkv.split([q_size, kv_size, kv_size], dim=-1)):
                lora.add(self.index, name, hidden, out)
        # Queries and keys rotated as one tensor of heads, keys and values stored in the cache: one call.
        q = rotary_and_cache(qkv, self.num_heads, self.num_kv_heads, self.head_dim, cos, sin, kv_cache[0],
                             kv_cache[1], attn.slot_mapping)
        out = paged_attention(q, kv_cache[0], kv_cache[1], attn, self.scale).reshape(num_tokens, q_size)
        return self.o_proj(out, None if lora is None else lora.delta(self.index, "o_proj", out))


class MLP(nn.Module):
    def __init__(self, weights: Weights, prefix: str, group: ShardGroup, index: int) -> None:
        super().__init__()
        self.index = index
        self.gate_up_proj = ColumnParallelLinear.load(
            weights, [f"{prefix}.gate_proj", f"{prefix}.up_proj"], bias=False
        )
        self.down_proj = RowParallelLinear.load(weights, f"{prefix}.down_proj", bias=False, group=group)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is not None:  # in place, into the fused output's columns
            gate, up = gate_up.chunk(2, dim=-1)
            lora.add(self.index, "gate_proj", x, gate)
            lora.add(self.index, "up_proj", x, up)
        h = silu_and_mul(gate_up)
        return self.down_proj(h, None if lora is None else lora.delta(self.index, "down_proj", h))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, weights: Weights, prefix: str, group: ShardGroup, index: int) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(weights.get_tensor(f"{prefix}.input_layernorm.weight"), eps)
        self.self_attn = Attention(config, weights, f"{prefix}.self_attn", group, index)
        self.post_attention_layernorm = RMSNorm(weights.get_tensor(f"{prefix}.post_attention_layernorm.weight"), eps)
        self.mlp = MLP(weights, f"{prefix}.mlp", group, index)

    def forward(self, hidden, cos, sin, kv_cache: KVCache, attn: AttentionInputs,
                lora: LoraBatch | None = None) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, attn, lora)
        hidden, normed = self.post_attention_layernorm.add_and_norm(hidden, attended)
        return hidden + self.mlp(normed, lora)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM. `forward` returns final-normed hidden states; `compute_logits` the logits."""

    def __init__(self, config: ModelConfig, weights: Weights, group: ShardGroup) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(weights, "model.embed_tokens.weight", group)
        self.layers = nn.ModuleList(
            DecoderLayer(config, weights, f"model.layers.{i}", group, i) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(weights.get_tensor("model.norm.weight"), config.rms_norm_eps)
        head_name = "lm_head.weight"
        if config.tie_word_embeddings or not weights.has(head_name):
            head_name = "model.embed_tokens.weight"
        self.lm_head = ParallelLMHead(weights, head_name, group)
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            device=self.norm.weight.device,
            dtype=self.norm.weight.dtype,
        )

        self._stack: NativeStack | None | bool = False  # False: not looked at yet; None: the model does not fit

    @property
    def num_kv_heads(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],
        attn: AttentionInputs,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        return self.forward_with_aux(input_ids, positions, kv_caches, attn, lora)[0]

    def forward_with_aux(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],
        attn: AttentionInputs,
        lora: LoraBatch | None = None,
        aux_layer_ids: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [num_tokens, hidden], [num_tokens, len(ids) * hidden]
        """`forward`, and the residual stream after each of `aux_layer_ids` layers (0: the embeddings; the
        number of layers: the last layer's output, before the final norm), side by side in the order given:
        what an EAGLE-3 draft layer reads. None without ids."""
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary.tables(positions)
        aux = hidden.new_empty(hidden.shape[0], len(aux_layer_ids) * hidden.shape[1]) if aux_layer_ids else None
        if lora is None:
            stack = self._native_stack()
            if stack is not None and hidden.dtype == torch.float32 and stack.serves(attn, kv_caches):
                hidden = hidden.contiguous()
                stack.run(hidden, cos, sin, kv_caches, attn,
                          lambda index, h: self._keep_aux(aux, aux_layer_ids, index, h), aux_layer_ids)
                return self.norm(hidden), aux
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            self._keep_aux(aux, aux_layer_ids, index, hidden)  # copied: the layer updates its input in place
            hidden = layer(hidden, cos, sin, kv_cache, attn, lora)
        self._keep_aux(aux, aux_layer_ids, len(self.layers), hidden)
        return self.norm(hidden), aux

    def _native_stack(self) -> NativeStack | None:
        """The layers as one native call (`specula_kernels.decode_layers`) where every layer fits it: a CPU with the
        native kernels, one shard, no q/k/v bias, products in the panel, native int8 or native int4 layouts or a GGUF
        file's blocks, float32 norms. None otherwise (the layers run one operator at a time, as they do for prompts,
        LoRA and `SPECULA_NATIVE_STACK=0`)."""
        if self._stack is False:
            self._stack = None
            try:
                if native.library() is not None and native.stack_enabled():
                    self._stack = self._build_stack()
            except LayerDoesNotFit:
                pass
        return self._stack

    def _build_stack(self) -> NativeStack:
        layers = [native_layer_weights(layer) for layer in self.layers]
        first = self.layers[0].self_attn
        return NativeStack(layers, first.num_heads, first.num_kv_heads, first.head_dim,
                           self.layers[0].input_layernorm.eps, first.scale)

    @staticmethod
    def _keep_aux(aux: torch.Tensor | None, layer_ids: tuple[int, ...], index: int, hidden: torch.Tensor) -> None:
        if aux is not None and index in layer_ids:
            width = hidden.shape[1]
            at = layer_ids.index(index) * width
            aux[:, at : at + width].copy_(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] float32
        return self.lm_head(hidden).float()


def native_layer_weights(layer: torch.nn.Module) -> LayerWeights:
    """A decoder layer's weights as the native stack reads them (`self_attn`, `mlp` and the two norms of a
    `DecoderLayer`); raises `LayerDoesNotFit` for one the stack cannot run (sharded, biased, another product kind,
    norms that are not float32 on the CPU)."""
    attention, mlp = layer.self_attn, layer.mlp
    products = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if attention.o_proj.group.world_size != 1 or any(p.bias is not None for p in products):
        raise LayerDoesNotFit
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if any(n.dtype != torch.float32 or n.device.type != "cpu" or not n.is_contiguous() for n in norms):
        raise LayerDoesNotFit
    return LayerWeights(*norms, *(_product_weights(p.linear) for p in products))


class LayerDoesNotFit(Exception):
    """A layer the native stack cannot run."""


def _product_weights(linear: torch.nn.Module) -> ProductWeights:
    if isinstance(linear, DenseLinear) and linear.kind == "panels":
        panels = linear.packed
        return ProductWeights(PANELS, linear.out_features, panels.shape[1], panels)
    if isinstance(linear, Int8Linear) and linear.native:
        return ProductWeights(INT8, linear.out_features, linear.in_features, linear.tiles)
    if isinstance(linear, W8A8Linear) and linear.native:
        return ProductWeights(W8A8, linear.out_features, linear.in_features, linear.tiles)
    if isinstance(linear, Int4Linear) and linear.native:
        return ProductWeights(INT4, linear.out_features, linear.tiles.shape[1] * linear.group_size, linear.tiles,
                              group_size=linear.group_size)
    if isinstance(linear, GGUFLinear):
        return ProductWeights(GGUF_KINDS[linear.type_name], linear.out_features, linear.in_features, linear.weight,
                              group_size=32)
    raise LayerDoesNotFit
