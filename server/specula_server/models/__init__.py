"""Model implementations and the registry that maps `architectures[0]` of config.json to one of them."""

from __future__ import annotations

from torch import nn

from specula_server.distributed import ShardGroup
from specula_server.models.config import ModelConfig
from specula_server.models.llama import LlamaForCausalLM
from specula_server.weights import Weights

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


class UnsupportedModelError(ValueError):
    pass


def build_model(config: ModelConfig, weights: Weights, group: ShardGroup) -> LlamaForCausalLM:
    model_cls = MODEL_REGISTRY.get(config.architecture)
    if model_cls is None:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise UnsupportedModelError(f"architecture {config.architecture!r} is not supported (supported: {supported})")
    return model_cls(config, weights, group).eval()
