#!/usr/bin/env python
"""Trains the demo model's speculators with `specula-train`: a Medusa adapter and an MLP speculator.

Prompts are code-editing tasks and code beginnings from the training files of the demo model's corpus
(`specula_testing.code_corpus`; the held-out files stay unseen, so the benchmarks measure held-out
acceptance). The demo model continues them greedily and the speculators learn those continuations.

    python scripts/build_demo_speculators.py                       # both, into launcher/.../demo_adapters
    python scripts/build_demo_speculators.py --only medusa --prompts 200 --out /tmp/spec   # a quick try

Writes `<out>/medusa` (FasterDecoding layout) and `<out>/mlp-speculator` (IBM layout, tied weights), each with
the `training.json` that `specula-train` writes (settings, held-out top-1 accuracy before and after).
Needs the dev dependencies (`pip install -e ".[dev]"`).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "server"), str(ROOT / "testing")]  # runnable from a checkout without installing

from specula_testing import code_corpus  # noqa: E402

DEMO_MODEL = ROOT / "launcher" / "specula_launcher" / "demo_model"
DEFAULT_OUT = ROOT / "launcher" / "specula_launcher" / "demo_adapters"
BASE_MODEL_NAME = "specula-demo"  # what the bundled files name as their base model, not this machine's path


def neutral_paths(out: Path, model: Path, tmp: str) -> None:
    """Rewrites the paths of this machine that `specula-train` recorded (the model's directory, temporary files)
    in `out`'s config.json and training.json, so the bundled files say the same wherever they are built."""
    for name in ("config.json", "training.json"):
        path = out / name
        text = path.read_text()
        text = text.replace(json.dumps(str(model))[1:-1], BASE_MODEL_NAME).replace(json.dumps(tmp)[1:-1], "<tmp>")
        text = text.replace(json.dumps(str(out))[1:-1], f"<out>/{out.name}")
        path.write_text(text)


def write_prompts(path: Path, count: int, seed: int) -> None:
    """Three in four are edit tasks (copy-heavy), the rest beginnings of code blocks."""
    texts = code_corpus.read_sources(code_corpus.source_files(held_out=False))
    edits = [e.prompt for e in code_corpus.code_edits(texts, count - count // 4, seed=seed + 1000)]
    rng = random.Random(seed)
    chunks = [c for t in texts for c in code_corpus.code_chunks(t)]
    plain = [c[: rng.randint(120, 400)] for c in rng.sample(chunks, count // 4)]
    prompts = edits + plain
    rng.shuffle(prompts)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--only", choices=["medusa", "mlp"], help="Train one speculator only.")
    parser.add_argument("--prompts", type=int, default=1200)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    common = ["--model-id", str(args.model), "--max-new-tokens", str(args.max_new_tokens), "--epochs",
              str(args.epochs), "--lr", str(args.lr), "--seed", str(args.seed), "--save-dtype", "bfloat16",
              "--max-input-tokens", "384", "--batch-size", "16"]
    jobs = {
        "medusa": ["medusa", "--num-heads", "4", "--num-layers", "1", "--layout", "fasterdecoding"],
        "mlp": ["mlp", "--n-predict", "4", "--tie-weights", "--scale-input", "--top-k-tokens-per-head", "4,3,2,2",
                "--n-candidates", "8"],
    }
    names = {"medusa": "medusa", "mlp": "mlp-speculator"}
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        write_prompts(prompts, args.prompts, args.seed)
        for kind, command in jobs.items():
            if args.only and kind != args.only:
                continue
            started = time.monotonic()
            out = args.out / names[kind]
            subprocess.run([sys.executable, "-m", "specula_server.training", *command, *common, "--prompts",
                            str(prompts), "--output", str(out), "--samples-cache", str(Path(tmp) / "samples.pt")],
                           check=True)
            neutral_paths(out, args.model.resolve(), tmp)
            print(f"{kind}: {time.monotonic() - started:.0f}s, {sum(f.stat().st_size for f in out.iterdir())} bytes")


if __name__ == "__main__":
    main()
