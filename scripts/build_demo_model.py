#!/usr/bin/env python
"""Builds the demo model that `specula-launcher` serves when no --model-id is given.

A small Llama-architecture model with random (seeded) weights and a byte-level BPE tokenizer, written in the
Hugging Face layout by transformers itself, so the bundled model exercises the same loading path as a real
checkpoint. It is about 3 MB and loads in well under a second on a CPU; its output is meaningless text.

    python scripts/build_demo_model.py            # rewrites launcher/specula_launcher/demo_model/

Needs the dev dependencies (`pip install -e ".[dev]"`: transformers).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "server"))  # runnable from a checkout without installing

from specula_server.testing.models import build_tiny_model  # noqa: E402

DEFAULT_OUT = ROOT / "launcher" / "specula_launcher" / "demo_model"
# ~0.72M parameters in float32: hidden 128, 4 layers, 4 query / 2 key-value heads (GQA), 2048 positions.
SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048)
MAX_BYTES = 3_200_000

README = """# Specula demo model

The model `specula-launcher` serves when it is started without `--model-id`: a Llama-architecture model
(hidden size 128, 4 layers, 4 attention heads with 2 key-value heads, 2048 positions, float32) with a byte-level
BPE tokenizer of {vocab_size} tokens, in the Hugging Face layout (`config.json`, `model.safetensors`,
`tokenizer.json`, ...).

**Its weights are random** (seeded), so it generates meaningless text. It exists so that the launcher, the
router and the workers can be started and tried anywhere in seconds, without a download. A small trained demo
model family will replace it.

Rebuild it (needs the dev dependencies, e.g. `pip install -e ".[dev]"`) from the repository root with:

```
python scripts/build_demo_model.py
```
"""


def build(out_dir: Path) -> int:
    """Writes the model and its README to `out_dir` (replacing what is there); returns its size in bytes."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    build_tiny_model(out_dir, kind="llama", seed=0, **SHAPE)
    vocab_size = json.loads((out_dir / "config.json").read_text())["vocab_size"]
    (out_dir / "README.md").write_text(README.format(vocab_size=vocab_size))
    for path in out_dir.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; installed copies must be readable by every user
    return sum(p.stat().st_size for p in out_dir.iterdir())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    args = parser.parse_args()
    size = build(args.out)
    print(f"wrote {args.out} ({size / 1e6:.2f} MB)")
    if size > MAX_BYTES:
        raise SystemExit(f"the demo model grew past {MAX_BYTES / 1e6:.1f} MB; it ships inside the package")


if __name__ == "__main__":
    main()
