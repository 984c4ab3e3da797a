#!/usr/bin/env python
"""Trains the demo model that `specula-launcher` serves when no --model-id is given.

A small Llama-architecture model trained from scratch on the Python standard library's own source code (so it
needs no download) and on code-editing tasks made from it (a block of code, "# after: rename X to Y", the
block again with the rename applied; see `specula_testing.code_corpus`). It learns to write
Python-looking code and, above all, to copy and edit code it was given, which is what prompt lookup and the
other drafters speed up. Files are split by a hash of their path; one in 16 is held out for benchmarks.

Steps: train a byte-level BPE tokenizer on the training files, build the token streams, train with AdamW and a
cosine schedule (bfloat16 autocast on CUDA), measure held-out loss and how often the model's greedy token is
right inside held-out edit answers, and write everything in the Hugging Face layout with transformers'
`save_pretrained` (weights in bfloat16). Then the second phase (`CopyRecipe`, `--copy-steps`): from those
weights, windows that each start at an edit task's first token, so every window holds a whole task; this is
what makes the model copy (see `CopyRecipe`). `training.json` next to the model records both phases.

    python scripts/build_demo_model.py                           # rewrites the demo model (CUDA when present)
    python scripts/build_demo_model.py --copy-only               # the second phase again, on the model there
    python scripts/build_demo_model.py --steps 50 --copy-steps 5 --out /tmp/m   # a quick CPU try
    python scripts/build_demo_model.py --recipe draft --max-minutes 12   # the demo family's draft model

`--recipe draft` trains a much smaller model (hidden 128, 2 layers) with the demo model's own tokenizer (copied
from it, `--tokenizer-from`), for draft-model speculation (`--speculator`): it is written to
`launcher/specula_launcher/demo_adapters/draft-model` unless `--out` says otherwise. `--hidden-size`,
`--layers` and the other shape options override either recipe.

The recipe is sized for a laptop: the bundled model was trained on two CPU cores in under an hour (the README
the script writes next to it says where and how long). `--max-minutes` fits the step count to a time budget.
Needs the dev dependencies (`pip install -e ".[dev]"`).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "server"), str(ROOT / "testing")]  # runnable from a checkout without installing

import torch  # noqa: E402

from specula_testing import code_corpus  # noqa: E402
from specula_testing.tokenizer import BOS_ID, EOS_ID, MULTILINGUAL_TEXT, build_tokenizer  # noqa: E402

DEFAULT_OUT = ROOT / "launcher" / "specula_launcher" / "demo_model"
DRAFT_OUT = ROOT / "launcher" / "specula_launcher" / "demo_adapters" / "draft-model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# The demo model's chat template (see its README): a code model, so the conversation is written as code.
DEMO_CHAT_TEMPLATE = (
    "{{- bos_token -}}{%- for message in messages -%}{%- set text = message['content'] or '' -%}"
    "{%- if message['role'] == 'system' -%}{%- for line in text.split('\\n') -%}{{ '# ' + line + '\\n' }}"
    "{%- endfor -%}{%- else -%}{{ text }}{%- if not loop.last and not text.endswith('\\n') -%}{{ '\\n' }}"
    "{%- endif -%}{%- endif -%}{%- endfor -%}{%- if add_generation_prompt and messages and not "
    "(messages[-1]['content'] or '').endswith('\\n') -%}{{ '\\n' }}{%- endif -%}"
)
TRAINING_RECORD = "training.json"  # each phase's recipe and measurements, which the README is written from
MAX_BYTES = 12_000_000  # the model part of the bundled family (all of it must stay under 20 MB)


@dataclass(frozen=True)
class Recipe:
    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 2048
    seq_len: int = 512
    batch_size: int = 8
    steps: int = 2400
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1
    edit_fraction: float = 0.75  # share of training windows drawn from the edit stream
    num_edits: int = 60_000
    seed: int = 0


# Named presets: `demo` is the bundled demo model, `draft` the draft model of its family (same tokenizer).
RECIPES = {
    "demo": Recipe(),
    "draft": Recipe(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2),
}


@dataclass(frozen=True)
class CopyRecipe:
    """The demo model's second phase: whole edit tasks only, from the first phase's weights. Random windows of
    the edit stream often cut a task in two (an answer without its block, a block without its answer); windows
    that start at a task's first token always hold a whole task, and the model learns to copy far faster (held
    out, greedy-token accuracy inside edit answers: 80% after the first phase; in a trial run of this phase, 91%
    after 200 steps and 94% after 600; the bundled model's run: 94.4%)."""

    steps: int = 600
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 1e-3
    warmup: int = 20
    weight_decay: float = 0.1
    num_edits: int = 60_000
    seed: int = 7  # other edit tasks than the first phase's


def copy_tokenizer(source: Path, out_dir: Path) -> int:
    """Copies the tokenizer files of `source` (a model directory) to `out_dir`; returns its vocab size."""
    from tokenizers import Tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out_dir / name)
    if not (out_dir / "tokenizer.json").is_file():
        raise SystemExit(f"--tokenizer-from {source}: no tokenizer.json there")
    vocab_size = Tokenizer.from_file(str(out_dir / "tokenizer.json")).get_vocab_size()
    config = source / "config.json"
    if config.is_file():  # the model's embedding rows, which may exceed the tokenizer's entries
        vocab_size = max(vocab_size, json.loads(config.read_text()).get("vocab_size", 0))
    return vocab_size


def token_stream(tokenizer, docs: list[str]) -> torch.Tensor:
    """`<s> doc </s>` for every doc, concatenated (the tokenizer adds the `<s>`)."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(docs):
        ids.extend(encoding.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


def windows_at(stream: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    """The `length + 1` tokens of `stream` from each of `starts`: `[len(starts), length + 1]`."""
    if starts.numel() == 0:
        return stream.new_empty((0, length + 1))
    return torch.stack([stream[s : s + length + 1] for s in starts.tolist()])


def sample_windows(stream: torch.Tensor, count: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """`count` windows of `stream` at random offsets."""
    return windows_at(stream, torch.randint(0, stream.numel() - length - 1, (count,), generator=gen), length)


def task_windows(stream: torch.Tensor, starts: torch.Tensor, count: int, length: int,
                 gen: torch.Generator) -> torch.Tensor:
    """`count` windows of `stream`, each starting at one of `starts` (the first tokens of documents)."""
    return windows_at(stream, starts[torch.randint(0, starts.numel(), (count,), generator=gen)], length)


def learning_rate(step: int, recipe: Recipe | CopyRecipe) -> float:
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    progress = (step - recipe.warmup) / max(recipe.steps - recipe.warmup, 1)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def build_model(recipe: Recipe, vocab_size: int):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers, num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads, max_position_embeddings=recipe.max_position_embeddings,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=BOS_ID,
        eos_token_id=EOS_ID, initializer_range=0.02,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(recipe.seed)
    return transformers.LlamaForCausalLM(config)


@torch.no_grad()
def evaluate(model, tokenizer, plain: torch.Tensor, recipe: Recipe, device: torch.device,
             num_edits: int = 64) -> dict:
    """Held-out loss on plain code, and greedy-token accuracy inside held-out edit answers."""
    model.eval()
    gen = torch.Generator().manual_seed(1)
    windows = sample_windows(plain, 16, min(recipe.seq_len, plain.numel() - 2), gen).to(device)
    with autocast(device):
        loss = next_token_loss(model, windows)
    correct = total = 0
    for edit in code_corpus.held_out_edits(num_edits, seed=2):
        prompt = tokenizer.encode(edit.prompt).ids
        answer = tokenizer.encode(edit.answer, add_special_tokens=False).ids
        ids = torch.tensor([prompt + answer], device=device)
        with autocast(device):
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        correct += int((logits.argmax(-1).cpu() == torch.tensor(answer)).sum())
        total += len(answer)
    model.train()
    return {"held_out_loss": round(float(loss), 4), "edit_answer_token_accuracy": round(correct / max(total, 1), 4)}


def next_token_loss(model, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of every next token of `windows` [batch, length + 1]."""
    logits = model(input_ids=windows[:, :-1]).logits  # [batch, length, vocab]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten())


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def optimise(model, recipe, next_batch, device: torch.device, started: float,
             max_minutes: float | None = None):
    """AdamW over `recipe.steps` batches from `next_batch(generator)`, warmup then cosine, with a progress bar.
    With `max_minutes`, the step count is cut to fit the time the first steps suggest (decided before the warmup
    ends, so the schedule stays a whole cosine). Returns the recipe used and the last training loss."""
    from tqdm import tqdm

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95),
                                  fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(recipe.seed)
    model.train()
    progress = tqdm(total=recipe.steps, desc="training", unit="step", mininterval=5, file=sys.stdout)
    loop_started = time.perf_counter()
    step = 0
    while step < recipe.steps:
        if max_minutes and step == min(30, recipe.warmup - 1) and step > 0:
            seconds_per_step = (time.perf_counter() - loop_started) / step
            fitting = int((max_minutes * 60 - (time.perf_counter() - started)) / seconds_per_step)
            if fitting < recipe.steps:
                recipe = replace(recipe, steps=max(fitting, recipe.warmup + 1))
                progress.total = recipe.steps
                print(f"\n{seconds_per_step * 1e3:.0f} ms/step: {recipe.steps} steps fit in {max_minutes} min",
                      flush=True)
        batch = next_batch(gen).to(device)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, recipe)
        with autocast(device):
            loss = next_token_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0:
            progress.set_postfix(loss=f"{loss.item():.3f}")
            if not progress.disable and not sys.stdout.isatty():  # a log file: tqdm's bar is not line-based
                print(f"step {step}/{recipe.steps} loss {loss.item():.3f} "
                      f"{(time.perf_counter() - started) / 60:.1f} min", flush=True)
        step += 1
        progress.update()
    progress.close()
    return recipe, loss.item()


def run_facts(recipe: Recipe | CopyRecipe, started: float, device: torch.device) -> dict:
    """What a training phase records about its run: tokens seen, minutes, device, torch version."""
    return {"train_tokens": recipe.steps * recipe.batch_size * recipe.seq_len,
            "minutes": round((time.perf_counter() - started) / 60, 1),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__}


def make_readable(out_dir: Path) -> None:
    for path in out_dir.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; installed copies must be readable by every user


def train(recipe: Recipe, out_dir: Path, device: torch.device, max_minutes: float | None = None,
          max_files: int | None = None, tokenizer_from: Path | None = None,
          draft_for: str | None = None) -> tuple[Recipe, dict]:
    """Trains and writes the model; with `max_minutes`, the step count is cut to fit the time the first steps
    suggest (decided before the warmup ends, so the schedule stays a whole cosine). `max_files` trains on only
    the first files of the corpus (quick checks of the pipeline). `tokenizer_from` (a model directory) reuses
    that model's tokenizer instead of training one, so the result can draft for it; `draft_for` names the
    target in the README (a draft model's README). Returns the recipe used and the metrics."""
    from tokenizers import Tokenizer

    started = time.perf_counter()
    train_texts = code_corpus.read_sources(code_corpus.source_files(held_out=False)[:max_files])
    held_texts = code_corpus.read_sources(code_corpus.source_files(held_out=True)[:max_files])
    print(f"corpus: {len(train_texts)} training files ({sum(map(len, train_texts)) / 1e6:.1f} MB), "
          f"{len(held_texts)} held out", flush=True)
    if tokenizer_from is not None and tokenizer_from.resolve() == out_dir.resolve():
        raise SystemExit("--tokenizer-from must differ from --out (the output directory is rewritten)")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    if tokenizer_from is not None:
        vocab_size = copy_tokenizer(tokenizer_from, out_dir)
        print(f"tokenizer: copied from {tokenizer_from} (vocab {vocab_size})", flush=True)
    else:
        vocab_size = build_tokenizer(out_dir, recipe.vocab_size, "bytelevel", train_texts + [MULTILINGUAL_TEXT])
    tokenizer_config = json.loads((out_dir / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = DEMO_CHAT_TEMPLATE
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))

    edits = [e.document for e in code_corpus.code_edits(train_texts, recipe.num_edits, seed=recipe.seed)]
    plain = token_stream(tokenizer, train_texts)
    edit_stream = token_stream(tokenizer, edits)
    held_plain = token_stream(tokenizer, held_texts)
    print(f"tokens: {plain.numel() / 1e6:.1f}M plain, {edit_stream.numel() / 1e6:.1f}M in {len(edits)} edits, "
          f"{held_plain.numel() / 1e6:.2f}M held out; vocab {vocab_size}", flush=True)

    model = build_model(recipe, vocab_size).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    num_edit = round(recipe.batch_size * recipe.edit_fraction)

    def next_batch(gen: torch.Generator) -> torch.Tensor:
        return torch.cat([sample_windows(edit_stream, num_edit, recipe.seq_len, gen),
                          sample_windows(plain, recipe.batch_size - num_edit, recipe.seq_len, gen)])

    recipe, loss = optimise(model, recipe, next_batch, device, started, max_minutes)
    metrics = evaluate(model, tokenizer, held_plain, recipe, device)
    metrics.update(final_train_loss=round(loss, 4), num_parameters=num_params,
                   **run_facts(recipe, started, device))
    print(json.dumps(metrics), flush=True)

    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    model.generation_config.save_pretrained(out_dir)
    (out_dir / "README.md").write_text(draft_readme(recipe, vocab_size, metrics, draft_for) if draft_for
                                       else readme(recipe, vocab_size, metrics))
    (out_dir / TRAINING_RECORD).write_text(json.dumps({"recipe": asdict(recipe), "vocab_size": vocab_size,
                                                       "metrics": metrics}, indent=2) + "\n")
    make_readable(out_dir)
    return recipe, metrics


def train_copying(model_dir: Path, recipe: CopyRecipe, device: torch.device, max_files: int | None = None) -> dict:
    """The demo model's second phase, on the model in `model_dir` (its weights, tokenizer and training record),
    which it rewrites: `recipe.steps` steps on whole edit tasks. Returns the phase's metrics."""
    import transformers
    from tokenizers import Tokenizer

    started = time.perf_counter()
    record_path = model_dir / TRAINING_RECORD
    if not record_path.is_file():
        raise SystemExit(f"{model_dir} has no {TRAINING_RECORD}: train the first phase there first")
    record = json.loads(record_path.read_text())
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    train_texts = code_corpus.read_sources(code_corpus.source_files(held_out=False)[:max_files])
    held_plain = token_stream(tokenizer, code_corpus.read_sources(code_corpus.source_files(held_out=True)[:max_files]))
    edits = [e.document for e in code_corpus.code_edits(train_texts, recipe.num_edits, seed=recipe.seed)]
    edit_stream = token_stream(tokenizer, edits)
    starts = (edit_stream == BOS_ID).nonzero().flatten()
    starts = starts[starts < edit_stream.numel() - recipe.seq_len - 1]
    print(f"copy phase: {len(edits)} edit tasks ({edit_stream.numel() / 1e6:.1f}M tokens)", flush=True)
    if starts.numel() == 0:
        raise SystemExit("no edit task fits a window: too few training files")

    def next_batch(gen: torch.Generator) -> torch.Tensor:
        return task_windows(edit_stream, starts, recipe.batch_size, recipe.seq_len, gen)

    recipe, loss = optimise(model, recipe, next_batch, device, started)
    metrics = evaluate(model, tokenizer, held_plain, recipe, device)
    metrics.update(final_train_loss=round(loss, 4), **run_facts(recipe, started, device))
    print(json.dumps(metrics), flush=True)
    model.to(torch.bfloat16).save_pretrained(model_dir, safe_serialization=True)
    record["copy_phase"] = {"recipe": asdict(recipe), "metrics": metrics}
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    first = Recipe(**record["recipe"])
    (model_dir / "README.md").write_text(readme(first, record["vocab_size"], record["metrics"], record["copy_phase"]))
    make_readable(model_dir)
    return metrics


def readme(recipe: Recipe, vocab_size: int, metrics: dict, copying: dict | None = None) -> str:
    """The demo model's README from its first phase (`recipe`, `metrics`) and, once run, its copy phase
    (`copying`: the `CopyRecipe` as a dict under "recipe", its metrics under "metrics")."""
    shape = (f"hidden size {recipe.hidden_size}, {recipe.num_hidden_layers} layers, {recipe.num_attention_heads} "
             f"attention heads with {recipe.num_key_value_heads} key-value heads, MLP {recipe.intermediate_size}, "
             f"tied embeddings, {recipe.max_position_embeddings} positions")
    final = copying["metrics"] if copying else metrics
    minutes = metrics["minutes"] + (copying["metrics"]["minutes"] if copying else 0)
    if copying:
        c, cm = copying["recipe"], copying["metrics"]
        first_acc, copy_acc = metrics["edit_answer_token_accuracy"] * 100, cm["edit_answer_token_accuracy"] * 100
        phases = f"""It was trained from scratch by `scripts/build_demo_model.py` in two phases, {minutes:.0f} minutes
in all on {metrics['device']}:

1. On the Python standard library's own source code and on code-editing tasks made from it (three windows in
   four from the edit tasks, cut at random), {recipe.steps} steps of {recipe.batch_size} x {recipe.seq_len}
   tokens ({metrics['train_tokens'] / 1e6:.0f}M tokens, {metrics['minutes']} minutes). Held out: loss
   {metrics['held_out_loss']} on plain code, greedy token right {first_acc:.1f}% of the time inside edit answers.
2. From those weights, on whole edit tasks only (each window starts at a task's first token, so it holds the
   block and its answer), {c['steps']} steps of {c['batch_size']} x {c['seq_len']} tokens ({cm['minutes']}
   minutes). Held out: loss {cm['held_out_loss']} on plain code, greedy token right {copy_acc:.1f}% of the
   time inside edit answers."""
    else:
        phases = f"""It was trained from scratch by `scripts/build_demo_model.py` on the Python standard library's own
source code and on code-editing tasks made from it, for {recipe.steps} steps of {recipe.batch_size} x {recipe.seq_len}
tokens ({metrics['train_tokens'] / 1e6:.0f}M tokens, {metrics['minutes']} minutes on {metrics['device']})."""
    copy_line = f"\nCopy phase: {json.dumps(copying['recipe'])}\n" if copying else ""
    return f"""# Specula demo model

The model `specula-launcher` serves when it is started without `--model-id`: a Llama-architecture model
({shape}; {metrics['num_parameters'] / 1e6:.1f}M parameters, stored in bfloat16) with a byte-level BPE tokenizer
of {vocab_size} tokens, in the Hugging Face layout.

{phases}

Prompt it with Python code, or with an edit task:

```
# before
<a block of Python code>
# after: rename OLD_NAME to NEW_NAME
```

and it writes the block again, trying to apply the rename. It is a {metrics['num_parameters'] / 1e6:.0f}M-parameter
model trained for {minutes:.0f} minutes: its code looks like Python but rarely runs, and its copies slip (a line
repeated or skipped, a rename missed). What matters for the server is that its continuations reuse much of the
prompt, which is what prompt lookup and the other drafters speed up.

**Chat.** It is a code model, not an assistant: it was never trained on conversations. So that
`/v1/chat/completions` works out of the box, its `tokenizer_config.json` carries a plain chat template that
writes the conversation as code: `<s>`, system messages as `# ` comment lines, the other messages' contents one
after the other on their own lines, and a final newline; the answer is the model's continuation of that text.
Send code (or an edit task as above) as the user message.

Held out (files the model never saw): loss {final['held_out_loss']} on plain code; inside edit answers its
greedy token is the right one {final['edit_answer_token_accuracy'] * 100:.1f}% of the time.

Recipe: {json.dumps(asdict(recipe))}
{copy_line}
Rebuild it (needs the dev dependencies, e.g. `pip install -e ".[dev]"`) from the repository root with
`python scripts/build_demo_model.py` (both phases; `--copy-only` runs the second phase again on the model
there).
"""


def draft_readme(recipe: Recipe, vocab_size: int, metrics: dict, target: str) -> str:
    shape = (f"hidden size {recipe.hidden_size}, {recipe.num_hidden_layers} layers, {recipe.num_attention_heads} "
             f"attention heads with {recipe.num_key_value_heads} key-value heads, MLP {recipe.intermediate_size}, "
             f"tied embeddings, {recipe.max_position_embeddings} positions")
    return f"""# Specula demo draft model

A draft model for {target}: draft-model speculation runs it to propose the next tokens, which the demo
model verifies. Served with the demo model, `--speculator` names it by its name:

```
specula-launcher --speculator draft-model --speculative-tokens 4
``` It is a Llama-architecture model ({shape};
{metrics['num_parameters'] / 1e6:.2f}M parameters, stored in bfloat16) with the demo model's own byte-level BPE
tokenizer of {vocab_size} tokens, copied from it: a draft model must share its target's vocabulary and
end-of-sequence ids, which the server checks when it loads it.

It was trained from scratch by `scripts/build_demo_model.py --recipe draft` on the same corpus as the demo model
(the Python standard library's source code and code-editing tasks made from it) for {recipe.steps} steps of
{recipe.batch_size} x {recipe.seq_len} tokens ({metrics['train_tokens'] / 1e6:.1f}M tokens, {metrics['minutes']} minutes
on {metrics['device']}). It learnt the corpus on its own, not from the demo model's outputs.

Held out (files neither model saw): loss {metrics['held_out_loss']} on plain code; inside edit answers its
greedy token is the right one {metrics['edit_answer_token_accuracy'] * 100:.1f}% of the time.

Recipe: {json.dumps(asdict(recipe))}

Rebuild it (needs the dev dependencies, e.g. `pip install -e ".[dev]"`) from the repository root with
`python scripts/build_demo_model.py --recipe draft --max-minutes 12`.
"""


def measure_draft(target_dir: Path, draft_dir: Path, num_prompts: int = 16, max_new_tokens: int = 96,
                  speculative_tokens: int = 4) -> dict:
    """How well the model at `draft_dir` drafts for `target_dir` in the server: greedy requests on held-out
    edit prompts, `speculative_tokens` drafts a step (fixed), and the same requests without speculation (the
    tokens must be the same)."""
    from tokenizers import Tokenizer

    from specula_testing.worker import BlockPool, generate_alone, load_test_generator, make_spec, token_ids

    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    prompts = [tokenizer.encode(e.prompt).ids for e in code_corpus.held_out_edits(num_prompts, seed=5)]
    plain = load_test_generator(target_dir, num_blocks=64)
    drafted = load_test_generator(target_dir, num_blocks=64, speculative_tokens=speculative_tokens,
                                  speculation_mode="fixed", speculator=str(draft_dir))
    num_drafted = num_accepted = steps = tokens = 0
    methods: set[str] = set()
    same = True
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        expected = token_ids(generate_alone(plain, make_spec(i, prompt, BlockPool(64, 16), max_new_tokens)))
        outputs = generate_alone(drafted, make_spec(i, prompt, BlockPool(64, 16), max_new_tokens,
                                                    lookahead=speculative_tokens))
        same &= token_ids(outputs) == expected
        methods.update(o.draft_method for o in outputs if o.num_drafted)
        num_drafted += sum(o.num_drafted for o in outputs)
        num_accepted += sum(o.num_accepted for o in outputs)
        steps += len(outputs)
        tokens += len(token_ids(outputs))
    return {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "speculative_tokens": speculative_tokens,
            "decoding": "greedy", "acceptance_rate": round(num_accepted / max(num_drafted, 1), 3),
            "accepted_per_step": round(num_accepted / max(steps, 1), 2),
            "tokens_per_target_step": round(tokens / max(steps, 1), 2), "same_tokens_as_no_speculation": same,
            "draft_methods": sorted(methods), "seconds": round(time.perf_counter() - started, 1)}


def write_draft_measure(out_dir: Path, figures: dict) -> None:
    """Adds (or replaces) the README's section with the measured acceptance."""
    path = out_dir / "README.md"
    text = path.read_text().split("\n## Measured acceptance")[0].rstrip() + "\n"
    text += f"""
## Measured acceptance

Served as the demo model's `--speculator` with `--speculative-tokens {figures['speculative_tokens']}` (fixed), on
{figures['prompts']} held-out edit prompts, greedy, {figures['max_new_tokens']} new tokens each: the demo model
accepts {figures['acceptance_rate'] * 100:.1f}% of the drafted tokens, {figures['accepted_per_step']} a step, so
each forward of the demo model emits {figures['tokens_per_target_step']} tokens instead of 1; the tokens are
{'the same as' if figures['same_tokens_as_no_speculation'] else 'NOT the same as'} without speculation.
(`python scripts/build_demo_model.py --recipe draft --measure-only` measures it again.)
"""
    path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="demo",
                        help="preset: demo (the demo model) or draft (its draft model, with the demo model's "
                             "tokenizer, written to demo_adapters/draft-model by default)")
    parser.add_argument("--out", type=Path, help=f"output directory (default: {DEFAULT_OUT}; with --recipe draft, "
                                                 f"{DRAFT_OUT})")
    parser.add_argument("--tokenizer-from", type=Path,
                        help="copy the tokenizer of this model directory instead of training one (default with "
                             "--recipe draft: the demo model's)")
    parser.add_argument("--steps", type=int, default=Recipe.steps)
    parser.add_argument("--batch-size", type=int, default=Recipe.batch_size)
    parser.add_argument("--seq-len", type=int, default=Recipe.seq_len)
    parser.add_argument("--num-edits", type=int, default=Recipe.num_edits)
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--intermediate-size", type=int)
    parser.add_argument("--layers", type=int, help="number of hidden layers")
    parser.add_argument("--heads", type=int, help="attention heads")
    parser.add_argument("--kv-heads", type=int, help="key-value heads")
    parser.add_argument("--max-minutes", type=float, help="cut the step count to fit about this much time")
    parser.add_argument("--copy-steps", type=int, default=CopyRecipe.steps,
                        help="steps of the demo model's second phase, on whole edit tasks (0: none; never with "
                             "--recipe draft)")
    parser.add_argument("--copy-only", action="store_true",
                        help="run only the second phase, on the demo model already in --out (rewritten)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--measure-only", action="store_true",
                        help="with --tokenizer-from or --recipe draft: only measure the draft model in --out as that "
                             "model's speculator (acceptance on held-out edits, greedy)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    draft = args.recipe == "draft"
    out = args.out or (DRAFT_OUT if draft else DEFAULT_OUT)
    tokenizer_from = args.tokenizer_from or (DEFAULT_OUT if draft else None)
    if args.measure_only:
        if tokenizer_from is None:
            raise SystemExit("--measure-only measures a draft model: give --recipe draft or --tokenizer-from")
        figures = measure_draft(tokenizer_from, out)
        print(json.dumps(figures), flush=True)
        write_draft_measure(out, figures)
        return
    if args.copy_only:
        if draft:
            raise SystemExit("--copy-only is the demo model's second phase; the draft recipe has none")
        train_copying(out, replace(CopyRecipe(), steps=args.copy_steps), torch.device(args.device))
        return
    shape = {key: value for key, value in {
        "hidden_size": args.hidden_size, "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.layers, "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
    }.items() if value is not None}
    recipe = replace(RECIPES[args.recipe], steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                     num_edits=args.num_edits, warmup=min(Recipe.warmup, max(args.steps // 10, 1)), **shape)
    random.seed(recipe.seed)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    draft_for = None
    if tokenizer_from is not None:
        draft_for = "the demo model" if tokenizer_from.resolve() == DEFAULT_OUT.resolve() else str(tokenizer_from)
    train(recipe, out, torch.device(args.device), args.max_minutes, tokenizer_from=tokenizer_from,
          draft_for=draft_for)
    if not draft and args.copy_steps > 0:
        train_copying(out, replace(CopyRecipe(), steps=args.copy_steps), torch.device(args.device))
    if tokenizer_from is not None:  # a draft model: how well it drafts, in the server
        figures = measure_draft(tokenizer_from, out)
        print(json.dumps(figures), flush=True)
        write_draft_measure(out, figures)
    args.out = out
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"wrote {args.out} ({size / 1e6:.2f} MB)")
    if size > MAX_BYTES:
        raise SystemExit(f"the demo model grew past {MAX_BYTES / 1e6:.1f} MB; it ships inside the package")


if __name__ == "__main__":
    main()
