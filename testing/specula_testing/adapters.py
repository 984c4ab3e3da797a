"""Random LoRA adapters in PEFT's own layout, written by peft itself (test-only dependency)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_lora_adapter(
    model_dir: Path,
    out_dir: Path,
    rank: int = 8,
    alpha: float = 16,
    target_modules: Sequence[str] = ALL_PROJECTIONS,
    use_rslora: bool = False,
    seed: int = 0,
    std: float = 0.05,
) -> Path:
    """Wraps the model at `model_dir` with a LoRA of this shape, randomises both A and B (PEFT starts B at
    zero, which would make the adapter a no-op), and saves the adapter with `save_pretrained`."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), use_rslora=use_rslora,
                             lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(out_dir)
    return Path(out_dir)


def load_peft_reference(model_dir: Path, adapter_dir: Path):
    """transformers + peft on the same weights: the reference the worker's LoRA path is tested against."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, adapter_dir).eval()


def build_medusa_adapter(model_dir: Path, out_dir: Path, num_heads: int = 3, num_layers: int = 1,
                         own_heads: bool = True, seed: int = 0) -> Path:
    """Random Medusa heads for the model at `model_dir` in the FasterDecoding layout (`config.json` +
    `medusa_lm_head.safetensors`), or the LoRAX v2 layout (heads on the base LM head) when not `own_heads`."""
    import json

    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    tensors = medusa_tensors(config["hidden_size"], config["vocab_size"], num_heads, num_layers, own_heads, seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    medusa_config = {"base_model_name_or_path": str(model_dir), "medusa_num_heads": num_heads,
                     "medusa_num_layers": num_layers}
    if not own_heads:
        medusa_config["version"] = 2
    (out_dir / "config.json").write_text(json.dumps(medusa_config))
    save_file(tensors, out_dir / "medusa_lm_head.safetensors")
    return out_dir


def medusa_tensors(hidden: int, vocab: int, num_heads: int, num_layers: int, own_heads: bool,
                   seed: int = 0) -> dict[str, torch.Tensor]:
    """Random Medusa head tensors under their checkpoint names (`{head}.{layer}.linear.weight|bias`, and
    `{head}.{num_layers}.weight` for heads with their own vocabulary projection)."""
    import math

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            tensors[f"{h}.{layer}.linear.weight"] = torch.randn(hidden, hidden, generator=generator) / math.sqrt(hidden)
            tensors[f"{h}.{layer}.linear.bias"] = torch.randn(hidden, generator=generator) * 0.1
        if own_heads:
            tensors[f"{h}.{num_layers}.weight"] = torch.randn(vocab, hidden, generator=generator) / math.sqrt(hidden)
    return tensors


def build_mlp_speculator(model_dir: Path, out_dir: Path, n_predict: int = 3, inner_dim: int = 48,
                         tie_weights: bool = False, scale_input: bool = False, prefix: str = "speculator.",
                         top_k_tokens_per_head: Sequence[int] | None = None, n_candidates: int = 5,
                         num_shards: int = 1, seed: int = 0) -> Path:
    """A random MLP speculator for the model at `model_dir` in IBM's Hugging Face layout (`config.json` with
    `model_type: mlp_speculator`, `model.safetensors`, or `num_shards` shards with `model.safetensors.index.json`);
    a `tie_weights` one stores only emb.0, ln.0, head.0, proj.0 and proj.1. `prefix` "" writes the names
    without `speculator.`, as some checkpoints do."""
    import json

    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    tensors = mlp_speculator_tensors(hidden, inner_dim, vocab, n_predict, tie_weights, seed)
    tensors = {prefix + name: t for name, t in tensors.items()}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps({
        "architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator", "emb_dim": hidden,
        "inner_dim": inner_dim, "n_predict": n_predict, "vocab_size": vocab,
        "top_k_tokens_per_head": list(top_k_tokens_per_head or [4] * n_predict), "n_candidates": n_candidates,
        "tie_weights": tie_weights, "scale_input": scale_input, "torch_dtype": "float32",
    }))
    if num_shards == 1:
        save_file(tensors, out_dir / "model.safetensors")
        return out_dir
    names = sorted(tensors)
    weight_map = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[shard::num_shards]}
        save_file(part, out_dir / file)
        weight_map.update(dict.fromkeys(part, file))
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out_dir


def mlp_speculator_tensors(emb_dim: int, inner_dim: int, vocab: int, n_predict: int, tie_weights: bool,
                           seed: int = 0) -> dict[str, torch.Tensor]:
    """Random MLP speculator tensors under their names without the `speculator.` prefix; norms with random
    scales and shifts, heads scaled so that each stage's distribution is peaked."""
    import math

    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    tensors = {}
    for i in range(1 if tie_weights else n_predict):
        tensors[f"emb.{i}.weight"] = normal(vocab, inner_dim, std=1 / math.sqrt(inner_dim))
        tensors[f"ln.{i}.weight"] = 1 + normal(inner_dim, std=0.1)
        tensors[f"ln.{i}.bias"] = normal(inner_dim, std=0.1)
        tensors[f"head.{i}.weight"] = normal(vocab, inner_dim, std=3 / math.sqrt(inner_dim))
    for i in range(min(2, n_predict) if tie_weights else n_predict):
        fan_in = emb_dim if i == 0 else inner_dim
        tensors[f"proj.{i}.weight"] = normal(inner_dim, fan_in, std=1 / math.sqrt(fan_in))
    return tensors
