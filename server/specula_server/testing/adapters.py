"""Random LoRA adapters in PEFT's own layout, written by peft itself (test-only dependency)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

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
