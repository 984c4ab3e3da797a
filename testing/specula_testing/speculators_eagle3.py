"""EAGLE-3 checkpoints written, and their draft logits computed, by the `speculators` package itself.

A script, run by a Python that has `speculators` installed (its own environment: it pins its own torch and
transformers), never imported by the server:

    python speculators_eagle3.py save VERIFIER_DIR OUT_DIR '{"draft_vocab_size": 300, ...}'
    python speculators_eagle3.py forward CHECKPOINT_DIR INPUTS.safetensors OUTPUTS.safetensors TTT_STEPS
    python speculators_eagle3.py convert ORIGINAL_DIR OUT_DIR VERIFIER_DIR '{"norm_before_residual": true, ...}'

`save` builds `Eagle3DraftModel.from_training_args` for the verifier (its embedding and, through t2d, its LM
head rows), gives every norm a random weight (ones would hide a norm applied to the wrong tensor) and saves it
with `save_pretrained`. `forward` loads a checkpoint with `Eagle3DraftModel.from_pretrained` and runs its
training forward on `hidden_states [1, T, A * H]`, `input_ids [1, T]` and `position_ids [1, T]`, recording the
draft logits of every step (`logits [steps, T, draft_vocab]`). `specula_testing.eagle3` writes the same
layout without the package, and the tests check the two against each other. `convert` runs the package's
converter (`speculators convert`'s) on a checkpoint in the original EAGLE-3 layout.
"""

from __future__ import annotations

import json
import sys


def save(verifier_dir: str, out_dir: str, options: dict) -> None:
    import torch
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import AutoConfig

    torch.manual_seed(options.get("seed", 0))
    verifier = AutoConfig.from_pretrained(verifier_dir)
    target_vocab = verifier.vocab_size
    draft_vocab = options.get("draft_vocab_size", target_vocab)
    selected = torch.randperm(target_vocab)[:draft_vocab].sort().values
    d2t = selected - torch.arange(draft_vocab)
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[selected] = True
    layer_config = AutoConfig.from_pretrained(verifier_dir)
    layer_config.num_hidden_layers = options.get("num_layers", 1)
    model = Eagle3DraftModel.from_training_args(
        layer_config, t2d=t2d, d2t=d2t, verifier_name_or_path=verifier_dir, draft_vocab_size=draft_vocab,
        norm_before_residual=options.get("norm_before_residual", False),
        norm_before_fc=options.get("norm_before_fc", False), fc_norm=options.get("fc_norm", False),
        norm_output=options.get("norm_output", False), target_layer_ids=options.get("layer_ids"), ttt_steps=3,
        draft_attn_impl="eager",
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or ".fc_norm." in name or "layernorm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.startswith(("layers.", "fc.")):
                param.normal_(0, options.get("init_std", 0.1))
    if options.get("verifier_lm_head", True) is False:  # not used by the draft: random rows instead
        model.lm_head.weight.data.normal_(0, 0.1)
    model.save_pretrained(out_dir)
    del load_file


def forward(checkpoint: str, inputs_path: str, outputs_path: str, steps: int) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    inputs = load_file(inputs_path)
    config = Eagle3SpeculatorConfig.from_pretrained(checkpoint)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention's block masks need CUDA sizes
    model = Eagle3DraftModel.from_pretrained(checkpoint, config=config)
    model.eval()
    recorded: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda module, args, output: recorded.append(output.detach()[0]))
    with torch.no_grad():
        model.forward(inputs["hidden_states"], inputs["input_ids"], document_ids=torch.zeros_like(inputs["input_ids"]),
                      position_ids=inputs["position_ids"], ttt_steps=steps)
    save_file({"logits": torch.stack(recorded).float().contiguous()}, outputs_path)


def convert(original: str, out_dir: str, verifier_dir: str, options: dict) -> None:
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    Eagle3Converter().convert(original, out_dir, verifier_dir, validate=False, **options)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "save":
        save(args[0], args[1], json.loads(args[2]) if len(args) > 2 else {})
    elif command == "forward":
        forward(args[0], args[1], args[2], int(args[3]))
    elif command == "convert":
        convert(args[0], args[1], args[2], json.loads(args[3]) if len(args) > 3 else {})
    else:
        raise SystemExit(f"unknown command {command!r}: save, forward or convert")
