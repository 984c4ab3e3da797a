"""Python source code from the standard library, as training data for the demo model and as benchmark prompts.

Every Python installation carries a few megabytes of well-written source code, so the demo model can be trained
and benchmarked anywhere without a download. Files are split into a training part and a held-out part by a hash
of their path relative to the standard library, so the split is the same on every installation and version:
benchmarks draw their prompts from held-out files only.

Two kinds of documents:

- plain code: a file's text as it is;
- code edits, the copy-heavy task prompt lookup exists for. A chunk of code, an instruction, and the chunk
  again with the instruction applied::

      # before
      def area(width, height):
          return width * height
      # after: rename width to w
      def area(w, height):
          return w * height

  Answers reuse almost all of the prompt, as they do when a user asks a model to edit code it was given.
"""

from __future__ import annotations

import keyword
import random
import re
import sysconfig
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# Directories left out: third-party packages, the test suites (huge and repetitive) and generated tables.
_SKIPPED_PARTS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings",
                  "lib2to3", "pydoc_data", "unicodedata"}
HELD_OUT_MODULUS = 16  # one file in 16 is held out
_IDENTIFIER = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")
_BLOCK_START = re.compile(r"^\s*(?:async\s+def|def|class)\s")
_RESERVED = set(keyword.kwlist) | set(keyword.softkwlist) | set(dir(__builtins__) if isinstance(__builtins__, dict)
                                                                   else dir(__builtins__)) | {"self", "cls"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str) -> bool:
    """Whether a file (path relative to the standard library, '/'-separated) is kept out of training."""
    return zlib.crc32(relative_path.encode()) % HELD_OUT_MODULUS == 0


def source_files(held_out: bool, root: Path | None = None) -> list[Path]:
    """The standard library's `.py` files of one side of the split, in a fixed order."""
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if _SKIPPED_PARTS.intersection(relative.parts[:-1]):
            continue
        if is_held_out(relative.as_posix()) == held_out:
            files.append(path)
    return files


def read_sources(paths: Sequence[Path], max_chars: int = 200_000) -> list[str]:
    """File texts (cut at `max_chars`), skipping files that are not UTF-8."""
    texts = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            texts.append(text[:max_chars])
    return texts


def code_chunks(text: str, max_chars: int = 600, min_chars: int = 120) -> list[str]:
    """Blocks of a file that start at a `def` or `class` line and run for at most `max_chars` whole lines."""
    lines = text.splitlines()
    chunks = []
    for i, line in enumerate(lines):
        if not _BLOCK_START.match(line):
            continue
        indent = len(line) - len(line.lstrip())
        block, size = [], 0
        for following in lines[i:]:
            if size + len(following) + 1 > max_chars:
                break
            block.append(following[indent:] if following[:indent].strip() == "" else following)
            size += len(following) + 1
        chunk = "\n".join(block).rstrip()
        if len(chunk) >= min_chars:
            chunks.append(chunk)
    return chunks


@dataclass(frozen=True)
class CodeEdit:
    """One edit task: `prompt` is what the model is given, `answer` what a perfect model continues with."""

    prompt: str
    answer: str

    @property
    def document(self) -> str:
        return self.prompt + self.answer


def rename_edit(chunk: str, rng: random.Random, names: Sequence[str]) -> CodeEdit | None:
    """Renames one identifier used at least twice in `chunk` to a name from `names`; None if none fits."""
    counts: dict[str, int] = {}
    for name in _IDENTIFIER.findall(chunk):
        if len(name) >= 3 and name not in _RESERVED:
            counts[name] = counts.get(name, 0) + 1
    candidates = sorted(name for name, n in counts.items() if n >= 2)
    if not candidates:
        return None
    old = rng.choice(candidates)
    new = rng.choice(names)
    if new in counts or new == old:
        return None
    edited = re.sub(rf"\b{re.escape(old)}\b", new, chunk)
    return CodeEdit(f"# before\n{chunk}\n# after: rename {old} to {new}\n", edited + "\n")


def identifier_pool(texts: Sequence[str], size: int = 4000, seed: int = 0) -> list[str]:
    """Identifiers that occur in `texts`, for replacement names that look like real code."""
    seen = sorted({n for t in texts for n in _IDENTIFIER.findall(t) if len(n) >= 3 and n not in _RESERVED})
    rng = random.Random(seed)
    rng.shuffle(seen)
    return seen[:size]


def code_edits(texts: Sequence[str], count: int, seed: int, names: Sequence[str] | None = None) -> Iterator[CodeEdit]:
    """`count` rename edits over chunks of `texts`, drawn reproducibly from `seed`."""
    rng = random.Random(seed)
    chunks = [c for t in texts for c in code_chunks(t)]
    if not chunks:
        return
    names = names or identifier_pool(texts, seed=seed)
    made = 0
    for _ in range(count * 20):
        edit = rename_edit(rng.choice(chunks), rng, names)
        if edit is not None:
            yield edit
            made += 1
            if made == count:
                return


def held_out_edits(count: int, seed: int = 0) -> list[CodeEdit]:
    """Edit tasks on held-out files: the copy-heavy benchmark's prompts."""
    texts = read_sources(source_files(held_out=True))
    return list(code_edits(texts, count, seed))


def held_out_code(count: int, num_chars: int, seed: int = 0) -> list[str]:
    """Beginnings of held-out code blocks (`num_chars` at most): prompts whose continuation is new text."""
    rng = random.Random(seed)
    chunks = [c for t in read_sources(source_files(held_out=True)) for c in code_chunks(t)]
    return [c[:num_chars] for c in rng.sample(chunks, min(count, len(chunks)))]
