#!/usr/bin/env python
"""Trains the demo model's two LoRA adapters, each with an effect that is easy to see and to measure.

- `camel-case`: the model writes identifiers in camelCase. Trained on the demo corpus's training files with
  every snake_case identifier rewritten to camelCase (`read_sources` becomes `readSources`; dunder names
  stay). Measured as the share of camelCase among the multi-word identifiers (snake_case or camelCase)
  the model writes after held-out code prompts.
- `two-space`: the model indents by two spaces instead of four. Trained on the same files with every line's
  leading four-space steps halved (files indented with tabs are left out). Measured as the share of the
  indented lines the model writes after held-out code prompts (themselves indented by four spaces) that sit on
  two-space steps (2, 6, 10 spaces: four-space code never has them).

Both are trained with `peft` on the demo model loaded by transformers in float32 (LoRA rank 8 on every
projection, q k v o gate up down) and written with `save_pretrained`, in PEFT's own layout
(`adapter_config.json` + `adapter_model.safetensors`). Training data come from the training files of
`specula_testing.code_corpus` only; the measured prompts from the held-out files. Decoding is greedy.

    python scripts/build_demo_loras.py                          # both, into launcher/.../demo_adapters
    python scripts/build_demo_loras.py --only camel-case --steps 20 --out /tmp/loras   # a quick try
    python scripts/build_demo_loras.py --measure-only           # only measure the bundled adapters

Writes `<out>/<name>/` with the adapter files and a `training.json` (settings, loss, time and the measured
effect, base vs adapter). Needs the dev dependencies (`pip install -e ".[dev]"`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / p) for p in ("server", "testing", "scripts")]  # runnable from a checkout without installing

import torch  # noqa: E402
from build_demo_model import sample_windows, token_stream  # noqa: E402  (the demo model's own training data)

from specula_testing import code_corpus  # noqa: E402

DEMO_MODEL = ROOT / "launcher" / "specula_launcher" / "demo_model"
DEFAULT_OUT = ROOT / "launcher" / "specula_launcher" / "demo_adapters"
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BASE_MODEL_NAME = "specula-demo"  # adapter_config.json's base_model_name_or_path: the bundled demo model

# snake_case: lower-case words joined by underscores (leading underscores allowed, dunders excluded).
SNAKE = re.compile(r"\b(_*)([a-z][a-z0-9]*(?:_[a-z0-9]+)+)\b")
# camelCase: a lower-case word followed by capitalised ones (`getValue`, `_readAll`, `toHTML`).
CAMEL = re.compile(r"\b_*[a-z][a-z0-9]*(?:[A-Z][a-z0-9]*)+\b")
DUNDER = re.compile(r"\b__\w+__\b")


# ----------------------------------------------------------------------------------------------- transforms

def to_camel_case(text: str) -> str:
    """Rewrites every snake_case identifier of `text` to camelCase; dunder names stay as they are."""
    def camel(match: re.Match) -> str:
        if DUNDER.fullmatch(match.group(0)) or match.group(0).endswith("_"):
            return match.group(0)
        first, *rest = match.group(2).split("_")
        return match.group(1) + first + "".join(word[:1].upper() + word[1:] for word in rest)

    return SNAKE.sub(camel, text)


def to_two_space(text: str) -> str | None:
    """`text` with its indentation halved: each four-space step of a line's leading spaces becomes two spaces
    (the remainder of lines aligned to a bracket stays); None when a line is indented with tabs."""
    out = []
    for line in text.splitlines(keepends=True):
        stripped = line.lstrip(" ")
        if stripped.startswith("\t"):
            return None
        width = len(line) - len(stripped)
        out.append(" " * (width // 4 * 2 + width % 4) + stripped)
    return "".join(out)


# ------------------------------------------------------------------------------------------------ measures

def identifier_counts(text: str, exclude: set[str] = frozenset()) -> tuple[int, int]:
    """(camelCase, snake_case) multi-word identifiers in `text`, those in `exclude` left out."""
    camel = sum(1 for m in CAMEL.finditer(text) if m.group(0) not in exclude)
    snake = sum(1 for m in SNAKE.finditer(text) if m.group(0) not in exclude and not DUNDER.fullmatch(m.group(0)))
    return camel, snake


def indent_widths(continuation: str) -> list[int]:
    """Leading-space widths of the indented lines `continuation` starts (its first line continues the prompt's
    last line, so it is left out)."""
    return [len(line) - len(line.lstrip(" ")) for line in continuation.split("\n")[1:]
            if line.strip() and line.startswith(" ")]


def code_prompts(count: int, seed: int = 0) -> list[str]:
    """Beginnings of held-out code blocks: a def/class line and a little more (at most 160 characters)."""
    return code_corpus.held_out_code(count, 160, seed=seed)


def camel_share(outputs: Sequence[tuple[str, str]]) -> dict:
    camel = snake = new_camel = new_snake = 0
    for prompt, text in outputs:
        c, s = identifier_counts(text)
        camel, snake = camel + c, snake + s
        seen = set(re.findall(r"\w+", prompt))
        c, s = identifier_counts(text, seen)
        new_camel, new_snake = new_camel + c, new_snake + s
    return {"camel_case_share": round(camel / max(camel + snake, 1), 3), "camel": camel, "snake": snake,
            "camel_case_share_new_names": round(new_camel / max(new_camel + new_snake, 1), 3)}


def indent_share(outputs: Sequence[tuple[str, str]]) -> dict:
    """Of the indented lines the model writes, the share on two-space steps (width 2, 6, 10...: a four-space
    habit never writes them; two-space code writes them at every odd depth)."""
    widths = [w for _, text in outputs for w in indent_widths(text)]
    two = sum(w % 4 == 2 for w in widths)
    return {"two_space_share": round(two / max(len(widths), 1), 3), "two_space_lines": two,
            "indented_lines": len(widths)}


ADAPTERS: dict[str, dict] = {
    "camel-case": {"transform": to_camel_case, "prompts": code_prompts, "measure": camel_share,
                   "max_new_tokens": 64,
                   "what": "identifiers in camelCase (snake_case rewritten in the training code)"},
    "two-space": {"transform": to_two_space, "prompts": code_prompts, "measure": indent_share,
                  "max_new_tokens": 64,
                  "what": "two-space indentation (four-space steps halved in the training code)"},
}


# ------------------------------------------------------------------------------------------------ training

def training_documents(transform: Callable[[str], str | None], num_edits: int, seed: int
                       ) -> tuple[list[str], list[str]]:
    """(whole files, edit tasks) of the training side of the corpus, transformed."""
    texts = [t for t in map(transform, code_corpus.read_sources(code_corpus.source_files(held_out=False))) if t]
    edits = [e.document for e in code_corpus.code_edits(texts, num_edits, seed=seed)]
    return texts, edits


def train_adapter(name: str, args: argparse.Namespace) -> dict:
    import peft
    import transformers

    spec = ADAPTERS[name]
    started = time.perf_counter()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    texts, edits = training_documents(spec["transform"], args.num_edits, args.seed)
    plain, edit_stream = (token_stream(tokenizer.backend_tokenizer, docs) for docs in (texts, edits))
    print(f"{name}: {len(texts)} training files ({plain.numel() / 1e6:.1f}M tokens), {len(edits)} edits "
          f"({edit_stream.numel() / 1e6:.1f}M tokens)", flush=True)

    torch.manual_seed(args.seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGET_MODULES,
                             lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    num_edit = round(args.batch_size * args.edit_fraction)
    steps, warmup = args.steps, max(1, min(20, args.steps // 10))
    loop_started = time.perf_counter()
    model.train()
    losses: list[float] = []
    step = 0
    while step < steps:
        if args.max_minutes and step == 10:  # fit the step count to the time budget
            per_step = (time.perf_counter() - loop_started) / step
            fitting = int((args.max_minutes * 60 - (time.perf_counter() - started)) / per_step)
            if fitting < steps:
                steps = max(fitting, warmup + 1)
                print(f"{name}: {per_step * 1e3:.0f} ms/step, {steps} steps fit in {args.max_minutes} min",
                      flush=True)
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = torch.cat([sample_windows(edit_stream, num_edit, args.seq_len, gen),
                           sample_windows(plain, args.batch_size - num_edit, args.seq_len, gen)])
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == steps - 1:
            print(f"{name}: step {step}/{steps} loss {sum(losses[-25:]) / len(losses[-25:]):.3f} "
                  f"{(time.perf_counter() - started) / 60:.1f} min", flush=True)
        step += 1
    minutes = (time.perf_counter() - started) / 60

    out = args.out / name
    model.peft_config["default"].base_model_name_or_path = BASE_MODEL_NAME  # not this machine's path
    model.save_pretrained(out)
    for path in out.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; installed copies must be readable by every user
    (out / "README.md").unlink(missing_ok=True)  # peft's model-card template; the family README covers it
    return {"adapter": name, "effect": spec["what"], "base_model": BASE_MODEL_NAME, "steps": steps,
            "final_loss": round(sum(losses[-25:]) / len(losses[-25:]), 4), "minutes": round(minutes, 1),
            "settings": {"rank": args.rank, "lora_alpha": 2 * args.rank, "target_modules": TARGET_MODULES,
                         "lr": args.lr, "batch_size": args.batch_size, "seq_len": args.seq_len,
                         "edit_fraction": args.edit_fraction, "num_edits": args.num_edits, "seed": args.seed,
                         "torch_threads": torch.get_num_threads()}}


# ---------------------------------------------------------------------------------------------- measuring

@torch.no_grad()
def measure(name: str, adapter_dir: Path, model_dir: Path, num_prompts: int) -> dict:
    """The adapter's effect on held-out prompts, greedy: base model vs base model + adapter."""
    import peft
    import transformers

    spec = ADAPTERS[name]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    prompts = spec["prompts"](num_prompts)

    def run(adapter: bool) -> list[tuple[str, str]]:
        outputs = []
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            kwargs = dict(input_ids=ids, max_new_tokens=spec["max_new_tokens"], do_sample=False,
                          pad_token_id=tokenizer.eos_token_id)
            if adapter:
                out = model.generate(**kwargs)
            else:
                with model.disable_adapter():
                    out = model.generate(**kwargs)
            outputs.append((prompt, tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)))
        return outputs

    base_out, adapter_out = run(False), run(True)
    result = {"prompts": len(prompts), "max_new_tokens": spec["max_new_tokens"], "decoding": "greedy",
              "base": spec["measure"](base_out), "adapter": spec["measure"](adapter_out),
              "example": {"prompt": prompts[0], "base": base_out[0][1], "adapter": adapter_out[0][1]}}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--only", choices=sorted(ADAPTERS), help="Build one adapter only.")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--max-minutes", type=float, default=4.0, help="cut the step count to fit this much time")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--edit-fraction", type=float, default=0.25)
    parser.add_argument("--num-edits", type=int, default=4000)
    parser.add_argument("--eval-prompts", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--measure-only", action="store_true", help="measure the adapters already in --out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in ADAPTERS:
        if args.only and name != args.only:
            continue
        record = {} if args.measure_only else train_adapter(name, args)
        if args.measure_only:
            record = json.loads((args.out / name / "training.json").read_text())
        started = time.perf_counter()
        record["held_out"] = measure(name, args.out / name, args.model, args.eval_prompts)
        print(f"{name}: measured in {time.perf_counter() - started:.0f}s", flush=True)
        (args.out / name / "training.json").write_text(json.dumps(record, indent=2) + "\n")
        (args.out / name / "training.json").chmod(0o644)
        size = sum(f.stat().st_size for f in (args.out / name).iterdir())
        held = record["held_out"]
        print(f"{name}: {size / 1e6:.2f} MB; base {json.dumps(held['base'])} -> adapter {json.dumps(held['adapter'])}",
              flush=True)


if __name__ == "__main__":
    main()
