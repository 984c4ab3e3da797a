"""Running a test file's Triton cases under Triton's interpreter, on CPU tensors.

The interpreter is chosen when a kernel is built, so the cases run in a subprocess with `TRITON_INTERPRET=1`:
each Triton test file has one test that calls `run_interpreted` on its own `test_triton_case*` tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def run_interpreted(test_file: str, expected_passed: int, timeout: float = 600) -> None:
    """Runs `test_file`'s `test_triton_case*` tests under the interpreter; asserts that all `expected_passed` ran
    and passed (none skipped)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", "test_triton_case"],
        cwd=Path(test_file).resolve().parents[2], env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert re.match(rf"{expected_passed} passed", summary), summary
