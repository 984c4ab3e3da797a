"""EAGLE-3 drafters (arXiv 2503.01840) in the `speculators` layout: the checkpoint's config, its checks and the draft
layer (finding and loading a checkpoint, and the original EAGLE-3 layout: `eagle3_checkpoint.py`).

Checkpoint layout (what the `speculators` package saves and vLLM and SGLang load):
  - `config.json`: `{"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
    "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path", "architectures"}, ...},
    "transformer_layer_config": {a Llama config, written as its difference from LlamaConfig's defaults},
    "draft_vocab_size", "eagle_aux_hidden_state_layer_ids" (null: 2, L // 2 and L - 3 of an L-layer verifier),
    "norm_before_residual", "target_hidden_size" (null: the draft's hidden size), and EAGLE 3.1's
    "norm_before_fc" / "fc_norm" / "norm_output"}`.
  - weights in `model.safetensors` (or shards): `fc.weight [hidden, A * target_hidden]` for A auxiliary
    layers, `layers.{i}.*` (Llama decoder layers; layer 0's q/k/v read `[embedding, hidden]`, 2 x hidden wide,
    and it has a `hidden_norm`), `norm.weight`, `lm_head.weight [draft_vocab, hidden]`, `d2t [draft_vocab]`
    (a draft token d is target token `d + d2t[d]`), `t2d [target_vocab]` (bool), and where set
    `input_norm.weight [A * target_hidden]` (norm_before_fc) or `fc_norm.{a}.weight [target_hidden]` (fc_norm).
    `embed_tokens.weight` may be missing: the verifier's embedding is used then.

The target's auxiliary hidden state for layer id l is its residual stream after l decoder layers (0: the
embeddings; L: the last layer's output, before the final norm), as vLLM and `speculators` take them.

One draft position (`Eagle3Model.forward`), for a token x and an input state s:

    s    = fc(norms(concat(aux_l for l in layer ids)))   from the target (EAGLE 3.1's norms where set),
           or the draft's own output state at the position before (chained drafting)
    e    = input_layernorm(embed(x));  n = hidden_norm(s);  residual = n if norm_before_residual else s
    h    = residual + attn(concat(e, n));  h = h + mlp(post_attention_layernorm(h));  then layers 1.. as Llama
    logits = lm_head(norm(h)) over the draft vocabulary;  the output state is norm(h) with norm_output, else h
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from specula_kernels import native
from specula_kernels.decode_layers import NativeStack
from specula_kernels.fused import rms_norm
from specula_server.distributed import ShardGroup
from specula_server.layers.quantization import build_linear
from specula_server.models.config import ModelConfig
from specula_server.models.llama import (
    MLP,
    Attention,
    AttentionInputs,
    DecoderLayer,
    KVCache,
    LayerDoesNotFit,
    RMSNorm,
    native_layer_weights,
)

if TYPE_CHECKING:
    from specula_server.weights import Weights

logger = logging.getLogger("specula.speculation")

MODEL_TYPE = "eagle3"
CONFIG_FILE = "config.json"
HUB_ALLOW_PATTERNS = (CONFIG_FILE, "*.safetensors", "*.safetensors.index.json")
# transformers' LlamaConfig defaults: `speculators` writes transformer_layer_config as its difference from them.
LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "attention_bias": False,
}
LAYER_TYPES = ("llama",)  # transformer_layer_config model types the draft layer implements


class Eagle3Error(ValueError):
    """An EAGLE-3 checkpoint that cannot be used with this model; the message names it and says why."""


def refuse(name: str, reason: str) -> Eagle3Error:
    """The error refusing checkpoint `name`, saying why."""
    return Eagle3Error(f"EAGLE-3 speculator `{name}`: {reason}")


@dataclass(frozen=True)
class Eagle3Config:
    """What `config.json` says, with defaults resolved (`layer`: the draft's decoder layers)."""

    layer: ModelConfig
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: the default ids for the verifier's depth
    target_hidden_size: int
    norm_before_residual: bool
    norm_before_fc: bool
    fc_norm: bool
    norm_output: bool
    verifier_name: str | None
    verifier_architectures: tuple[str, ...]
    speculative_tokens: int | None  # the default proposal's draft length, when the checkpoint names one

    @classmethod
    def from_dict(cls, raw: object, name: str) -> Eagle3Config:
        if not isinstance(raw, dict):
            raise refuse(name, f"{CONFIG_FILE} is not a JSON object")
        if raw.get("speculators_model_type") != MODEL_TYPE:
            raise refuse(name, f"{CONFIG_FILE} has speculators_model_type {raw.get('speculators_model_type')!r}, "
                               f"not {MODEL_TYPE!r}")
        layer_raw = raw.get("transformer_layer_config")
        if not isinstance(layer_raw, dict):
            raise refuse(name, f"{CONFIG_FILE} lacks transformer_layer_config (the draft layer's Llama config)")
        layer_type = layer_raw.get("model_type", "llama")
        if layer_type not in LAYER_TYPES:
            raise refuse(name, f"its draft layer is a {layer_type!r} layer; the server implements "
                               f"{', '.join(LAYER_TYPES)} draft layers")
        try:
            layer = ModelConfig.from_dict({**LLAMA_DEFAULTS, **layer_raw, "architectures": ["LlamaForCausalLM"]})
            draft_vocab = _int(raw.get("draft_vocab_size", layer.vocab_size))
            ids = raw.get("eagle_aux_hidden_state_layer_ids")
            aux_ids = None if ids is None else tuple(_int(i) for i in ids)
            target_hidden = raw.get("target_hidden_size")
            target_hidden = layer.hidden_size if target_hidden is None else _int(target_hidden)
        except (TypeError, ValueError, KeyError) as error:
            raise refuse(name, f"{CONFIG_FILE} has a malformed field ({error})") from None
        if draft_vocab < 1 or target_hidden < 1 or layer.num_layers < 1:
            raise refuse(name, f"needs a positive draft_vocab_size ({draft_vocab}), target_hidden_size "
                               f"({target_hidden}) and num_hidden_layers ({layer.num_layers})")
        if aux_ids is not None and (not aux_ids or len(set(aux_ids)) != len(aux_ids) or min(aux_ids) < 0):
            raise refuse(name, f"eagle_aux_hidden_state_layer_ids {list(aux_ids)} must be distinct layer ids >= 0")
        if raw.get("norm_before_fc") and raw.get("fc_norm"):
            raise refuse(name, "norm_before_fc and fc_norm are both set (they exclude each other)")
        spec = raw.get("speculators_config") if isinstance(raw.get("speculators_config"), dict) else {}
        verifier = spec.get("verifier") if isinstance(spec.get("verifier"), dict) else {}
        return cls(
            layer=layer, draft_vocab_size=draft_vocab, aux_layer_ids=aux_ids, target_hidden_size=target_hidden,
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            norm_before_fc=bool(raw.get("norm_before_fc", False)), fc_norm=bool(raw.get("fc_norm", False)),
            norm_output=bool(raw.get("norm_output", False)),
            verifier_name=verifier.get("name_or_path"),
            verifier_architectures=tuple(verifier.get("architectures") or ()),
            speculative_tokens=_default_draft_length(spec),
        )

    def layer_ids_for(self, num_target_layers: int) -> tuple[int, ...]:
        """The auxiliary layer ids for a verifier of `num_target_layers` layers (the defaults where unset)."""
        if self.aux_layer_ids is not None:
            return self.aux_layer_ids
        return (2, num_target_layers // 2, num_target_layers - 3)


def _default_draft_length(spec: dict) -> int | None:
    methods = spec.get("proposal_methods") or []
    default = spec.get("default_proposal_method")
    for method in methods:
        if isinstance(method, dict) and method.get("proposal_type") == default:
            tokens = method.get("speculative_tokens")
            return tokens if isinstance(tokens, int) else None
    return None


def _int(value: object) -> int:
    if isinstance(value, bool) or not float(value).is_integer():  # type: ignore[arg-type]
        raise ValueError(f"{value!r} is not an integer")
    return int(value)  # type: ignore[arg-type]


def check_verifier(spec: Eagle3Config, name: str, model_id: str, config: ModelConfig) -> tuple[int, ...]:
    """Refuses a checkpoint whose verifier is not the served model, naming both; returns the layer ids.

    The checkpoint names its verifier (`name_or_path`, `architectures`) and implies its shape (hidden size,
    vocabulary, depth): another architecture or shape is refused. A different name alone (a local copy, a GGUF
    file of the same model) is only logged: the shapes are what the draft layer depends on.
    """
    verifier = spec.verifier_name or "an unnamed verifier"
    problems = []
    if spec.verifier_architectures and config.architecture not in spec.verifier_architectures:
        problems.append(f"architecture {config.architecture} (it was trained for "
                        f"{', '.join(spec.verifier_architectures)})")
    if spec.target_hidden_size != config.hidden_size:
        problems.append(f"hidden size {config.hidden_size} (its verifier's: {spec.target_hidden_size})")
    if spec.layer.vocab_size != config.vocab_size:
        problems.append(f"vocabulary of {config.vocab_size} tokens (its verifier's: {spec.layer.vocab_size})")
    layer_ids = spec.layer_ids_for(config.num_layers)
    if min(layer_ids) < 0 or max(layer_ids) > config.num_layers:
        problems.append(f"{config.num_layers} layers (its auxiliary hidden states are read after layers "
                        f"{list(layer_ids)})")
    if problems:
        raise refuse(name, f"its verifier is {verifier}, which is not the served model {model_id}: the served "
                           f"model has " + "; ".join(problems))
    if spec.verifier_name and _base_name(spec.verifier_name) != _base_name(model_id):
        logger.warning("EAGLE-3 speculator %s was trained for %s; serving it for %s, whose shapes match",
                       name, spec.verifier_name, model_id)
    return layer_ids


def _base_name(model_id: str) -> str:
    return Path(model_id.rstrip("/")).name.lower()


# --- the draft layer ------------------------------------------------------------------------------------------


class Eagle3FirstLayer(nn.Module):
    """Layer 0: attention over `concat(input_layernorm(embedding), hidden_norm(state))`, 2 x hidden wide."""

    def __init__(self, config: ModelConfig, weights: Weights, norm_before_residual: bool) -> None:
        super().__init__()
        eps, group = config.rms_norm_eps, ShardGroup()
        self.input_layernorm = RMSNorm(weights.get_tensor("layers.0.input_layernorm.weight"), eps)
        self.hidden_norm = RMSNorm(weights.get_tensor("layers.0.hidden_norm.weight"), eps)
        self.self_attn = Attention(config, weights, "layers.0.self_attn", group, 0)
        self.post_attention_layernorm = RMSNorm(weights.get_tensor("layers.0.post_attention_layernorm.weight"), eps)
        self.mlp = MLP(weights, "layers.0.mlp", group, 0)
        self.norm_before_residual = norm_before_residual

    def forward(self, embeds: torch.Tensor, state: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, attn: AttentionInputs) -> torch.Tensor:
        normed = self.hidden_norm(state)
        residual = normed if self.norm_before_residual else state
        attended = self.self_attn(torch.cat([self.input_layernorm(embeds), normed], dim=-1), cos, sin, kv_cache, attn)
        hidden, normed = self.post_attention_layernorm.add_and_norm(residual.clone(), attended)
        return hidden + self.mlp(normed)


class Eagle3Model(nn.Module):
    """The draft layers, fc, norms, draft LM head and vocabulary map of one EAGLE-3 checkpoint.

    `combine(aux [n, A * target_hidden]) -> [n, hidden]` turns the target's auxiliary states into the input
    state; `forward(tokens [n], state [n, hidden], positions, kv_caches, attn) -> (logits [n, draft_vocab]
    float32, next_state [n, hidden])`; `to_target(draft_ids)` maps draft tokens into the target vocabulary.
    `embed` is the checkpoint's embedding, or the target's when it has none.
    """

    def __init__(self, spec: Eagle3Config, weights: Weights, embed: nn.Module, layer_ids: Sequence[int],
                 device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        self.layer_ids = tuple(layer_ids)
        cfg = spec.layer
        self.embed = embed
        fc = weights.get_tensor("fc.weight")  # [hidden, A * target_hidden]
        self.aux_size, self.dtype = fc.shape[1], fc.dtype
        # The products as the target's are built (`--quantize` of the drafter's own: `Weights.quantization`).
        self.fc = build_linear(fc, weights.quantization, "fc")
        self.input_norm = weights.get_tensor("input_norm.weight") if spec.norm_before_fc else None
        self.fc_norms = [weights.get_tensor(f"fc_norm.{a}.weight") for a in range(len(self.layer_ids))] \
            if spec.fc_norm else []
        self.first = Eagle3FirstLayer(cfg, weights, spec.norm_before_residual)
        self.rest = nn.ModuleList(DecoderLayer(cfg, weights, f"layers.{i}", ShardGroup(), i)
                                  for i in range(1, cfg.num_layers))
        self.norm = RMSNorm(weights.get_tensor("norm.weight"), cfg.rms_norm_eps)
        self.lm_head = build_linear(weights.get_tensor("lm_head.weight"), weights.quantization, "lm_head")
        d2t = weights.get_tensor("d2t") if weights.has("d2t") else torch.zeros(spec.draft_vocab_size, dtype=torch.long)
        self.draft_to_target = (torch.arange(spec.draft_vocab_size) + d2t.long().cpu()).to(device)
        from specula_server.layers.rotary import RotaryEmbedding  # here: rotary imports the models package

        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                      device=device, dtype=self.dtype)
        self._stack: NativeStack | None | bool = False  # False: not tried yet (`_native_stack`)

    @property
    def num_layers(self) -> int:
        return self.spec.layer.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.first.self_attn.num_kv_heads

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The input state from the target's auxiliary hidden states `[n, A * target_hidden]`."""
        eps = self.spec.layer.rms_norm_eps
        aux = aux.to(self.dtype)
        if self.input_norm is not None:
            aux = rms_norm(aux, self.input_norm, eps)
        elif self.fc_norms:
            aux = torch.cat([rms_norm(chunk.contiguous(), w, eps)
                             for chunk, w in zip(aux.chunk(len(self.fc_norms), dim=-1), self.fc_norms)], dim=-1)
        return self.fc(aux)

    def forward(self, tokens: torch.Tensor, state: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn: AttentionInputs, rows: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits and output state of every row, or of `rows` only (a catch-up over many rows drafts from
        each request's last: the draft vocabulary's head over the others would be wasted)."""
        cos, sin = self.rotary.tables(positions)
        embeds = self.embed(tokens).to(state.dtype)
        stack = self._native_stack()
        if stack is not None and state.dtype == torch.float32 and NativeStack.serves(attn, kv_caches):
            hidden = stack.run_eagle3(embeds, state, self.first.hidden_norm.weight, self.spec.norm_before_residual,
                                      cos, sin, kv_caches, attn)
        else:
            hidden = self.first(embeds, state, cos, sin, kv_caches[0], attn)
            for layer, kv_cache in zip(self.rest, kv_caches[1:]):
                hidden = layer(hidden, cos, sin, kv_cache, attn)
        if rows is not None:
            hidden = hidden[rows]
        normed = self.norm(hidden)
        logits = self.lm_head(normed).float()
        return logits, normed if self.spec.norm_output else hidden

    def _native_stack(self) -> NativeStack | None:
        """The draft layers as one native call (`NativeStack.run_eagle3`) where they fit it, as the target's layers
        do (`LlamaForCausalLM._native_stack`): the same kernels in the same order, so the same bits; chains of one
        row a request then pay one call a draft instead of a dozen operators'. None otherwise."""
        if self._stack is False:
            self._stack = None
            hidden_norm = self.first.hidden_norm.weight
            try:
                if native.library() is not None and native.stack_enabled() and hidden_norm.dtype == torch.float32 \
                        and hidden_norm.device.type == "cpu":
                    attention = self.first.self_attn
                    self._stack = NativeStack([native_layer_weights(self.first)]
                                              + [native_layer_weights(layer) for layer in self.rest],
                                              attention.num_heads, attention.num_kv_heads, attention.head_dim,
                                              self.first.input_layernorm.eps, attention.scale)
            except LayerDoesNotFit:
                pass
        return self._stack

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.draft_to_target[draft_ids]

