"""The native kernels' two builds: the machine's own (`-march=native`) and, on AVX-512 machines, the AVX2 variant
(`SPECULA_NATIVE_ARCH=x86-64-v3`) that CPUs without AVX-512 run, tested here against the same references."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specula_kernels import native

REPO = Path(__file__).resolve().parents[2]
needs_native = pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")


def _cpu_has(flag: str) -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and flag in line.split() for line in text.splitlines())


@needs_native
def test_the_build_uses_the_widest_vectors_the_cpu_has():
    expected = 16 if _cpu_has("avx512f") and not os.environ.get("SPECULA_NATIVE_ARCH") else 8
    assert native.vector_lanes() == expected
    assert native.library().specula_float_panel_rows() == 2 * expected


@pytest.mark.slow
@pytest.mark.skipif(not _cpu_has("avx512f"), reason="this CPU's own build is the AVX2 variant, tested directly")
@pytest.mark.skipif(not (_cpu_has("avx2") and _cpu_has("fma")), reason="needs AVX2 and FMA")
def test_the_avx2_variant_passes_the_kernel_tests(tmp_path):
    env = {**os.environ, "SPECULA_NATIVE_ARCH": "x86-64-v3", "SPECULA_KERNEL_CACHE": str(tmp_path)}
    tests = [str(REPO / "kernels" / "tests" / name)
             for name in ("test_native_build.py", "test_linear.py", "test_fused.py", "test_paged_attention.py",
                          "test_quantized_linear.py", "test_gguf_blocks.py", "test_w8a8_linear.py")]
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "not slow", *tests]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "native kernels unavailable" not in result.stdout
