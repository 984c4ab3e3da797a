"""Random EAGLE-3 checkpoints in the `speculators` layout, for tests and benchmarks, written without the package.

`build_eagle3` writes what `speculators`' `Eagle3DraftModel.from_training_args(...).save_pretrained(...)`
writes (`speculators_eagle3.py save`, run where the package is installed; the tests compare the two): the
same `config.json` fields and the same tensors, the embedding and the LM head's rows (through t2d) taken from
the verifier, random draft layers and norms. `SPECULATORS_PYTHON` names a Python with the package, for the
tests that check against it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from specula_server.training.eagle3 import eagle3_config

SPECULATORS_SCRIPT = Path(__file__).with_name("speculators_eagle3.py")


def build_eagle3(
    out_dir: Path,
    verifier_dir: Path,
    *,
    draft_vocab_size: int | None = None,
    layer_ids: Sequence[int] | None = None,
    num_layers: int = 1,
    norm_before_residual: bool = False,
    norm_before_fc: bool = False,
    fc_norm: bool = False,
    norm_output: bool = False,
    init_std: float = 0.1,
    seed: int = 0,
    config_changes: dict[str, Any] | None = None,
) -> Path:
    """Writes a random EAGLE-3 drafter for the model in `verifier_dir` to `out_dir` and returns it."""
    out_dir, verifier_dir = Path(out_dir), Path(verifier_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    verifier = json.loads((verifier_dir / "config.json").read_text())
    weights = {}
    for path in sorted(verifier_dir.glob("*.safetensors")):
        weights.update(load_file(path))
    generator = torch.Generator().manual_seed(seed)
    hidden, vocab = verifier["hidden_size"], verifier["vocab_size"]
    heads = verifier["num_attention_heads"]
    kv_heads = verifier.get("num_key_value_heads") or heads
    head_dim, inter = verifier.get("head_dim") or hidden // heads, verifier["intermediate_size"]
    draft_vocab = draft_vocab_size or vocab
    selected = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[selected] = True
    num_aux = len(layer_ids) if layer_ids else 3

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * init_std

    def norm(size: int) -> torch.Tensor:
        return 1 + 0.2 * torch.randn(size, generator=generator)

    embed = weights["model.embed_tokens.weight"]
    head = weights.get("lm_head.weight", embed)
    tensors = {
        "d2t": selected - torch.arange(draft_vocab), "t2d": t2d, "embed_tokens.weight": embed.clone(),
        "fc.weight": rand(hidden, num_aux * hidden), "lm_head.weight": head[t2d].clone(), "norm.weight": norm(hidden),
        "layers.0.hidden_norm.weight": norm(hidden),
    }
    for i in range(num_layers):
        width, p = (2 if i == 0 else 1) * hidden, f"layers.{i}"
        tensors.update({
            f"{p}.input_layernorm.weight": norm(hidden), f"{p}.post_attention_layernorm.weight": norm(hidden),
            f"{p}.self_attn.q_proj.weight": rand(heads * head_dim, width),
            f"{p}.self_attn.k_proj.weight": rand(kv_heads * head_dim, width),
            f"{p}.self_attn.v_proj.weight": rand(kv_heads * head_dim, width),
            f"{p}.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            f"{p}.mlp.gate_proj.weight": rand(inter, hidden), f"{p}.mlp.up_proj.weight": rand(inter, hidden),
            f"{p}.mlp.down_proj.weight": rand(hidden, inter),
        })
    if norm_before_fc:
        tensors["input_norm.weight"] = norm(num_aux * hidden)
    for a in range(num_aux if fc_norm else 0):
        tensors[f"fc_norm.{a}.weight"] = norm(hidden)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_dir / "model.safetensors", metadata={"format": "pt"})
    layer = {k: v for k, v in verifier.items() if k not in ("transformers_version",)}
    config = eagle3_config(layer, verifier["architectures"][0], str(verifier_dir), draft_vocab, layer_ids,
                           num_layers=num_layers, norm_before_residual=norm_before_residual,
                           norm_before_fc=norm_before_fc, fc_norm=fc_norm, norm_output=norm_output)
    config.update(config_changes or {})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def build_echo_eagle3(out_dir: Path, verifier_dir: Path, noise: float = 0.01, seed: int = 0) -> Path:
    """A drafter that mostly drafts the request's last token again: fc passes the target's last layer output
    through, the draft layer adds little (`noise` scales its attention and MLP outputs), and the norm and LM
    head are the target's, so slot p's logits are nearly the target's at p (which chose token p + 1). Random
    models repeat tokens often, so its drafts are sometimes accepted and sometimes not."""
    verifier = json.loads((verifier_dir / "config.json").read_text())
    layers, hidden = verifier["num_hidden_layers"], verifier["hidden_size"]
    build_eagle3(out_dir, verifier_dir, layer_ids=[0, 1, layers], seed=seed)
    path = Path(out_dir) / "model.safetensors"
    tensors = load_file(path)
    target = {}
    for file in sorted(Path(verifier_dir).glob("*.safetensors")):
        target.update(load_file(file))
    tensors["fc.weight"] = torch.cat([torch.zeros(hidden, 2 * hidden), torch.eye(hidden)], dim=1)
    tensors["norm.weight"] = target["model.norm.weight"].clone()
    for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
        tensors[name] = tensors[name] * noise
    save_file(tensors, path, metadata={"format": "pt"})
    return Path(out_dir)
