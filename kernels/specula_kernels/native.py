"""Native CPU kernels (`csrc/`), compiled for this machine on first use and loaded with ctypes.

Why by hand: the products of a decode step must stream weights at the memory's pace, where PyTorch's float kernels
(oneDNN, MKL) take one row at 7-15 GB/s of a memory that gives 21 and its packed int8/int4 kernels are compute-bound
(`csrc/float_linear.cpp`, `csrc/tiled_linear.cpp` for int8, int4 and a GGUF file's own blocks;
docs/benchmarks.md#weight-only-quantization), and int8 weights by int8 activations take integer dot products
(`csrc/w8a8_linear.cpp`); decode attention must read the paged KV cache where it lies, where
PyTorch's path gathers a dense copy first (`csrc/paged_attention.cpp`); a prompt's causal attention runs at a sixth
of the products' rate in PyTorch's CPU kernel (`csrc/prompt_attention.cpp`); and a layer's small operators (norms,
rotary, SiLU) and a greedy step's reductions over its logits cost their dispatch more than their arithmetic at a
few rows (`csrc/fused.cpp`). The sources are
plain C++ with vector extensions and OpenMP, built with `-O3 -march=native` by the system's C++ compiler into one
library in a cache (`$SPECULA_KERNEL_CACHE`, else `~/.cache/specula/kernels`, else a temporary directory), keyed by
the sources, the compiler and the CPU's feature flags, so a worker compiles it once per machine (a few seconds).

Instruction sets: the kernels are written over one vector type (`csrc/simd.h`) that is 16 floats wide with AVX-512
and 8 with AVX2 (the int8/int4 blocks have a variant of each). `SPECULA_NATIVE_ARCH` replaces `native` in
`-march=` (e.g. `x86-64-v3`: AVX2 and FMA), so an AVX-512 machine can build and test the AVX2 variant; a CPU with
neither builds nothing, and PyTorch's kernels run.

Linking: the library asks for `libgomp.so.1`, the soname of the OpenMP runtime PyTorch's x86-64 wheels load, so
the kernels share PyTorch's threads instead of starting a second pool.

Without a compiler, or with `SPECULA_NATIVE_KERNELS=0`, `library()` returns None and the callers fall back to
PyTorch's kernels; `unavailable_reason()` says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCES = tuple(Path(__file__).with_name("csrc") / name
                 for name in ("tiled_linear.cpp", "paged_attention.cpp", "fused.cpp", "float_linear.cpp",
                              "decode_layers.cpp", "w8a8_linear.cpp", "prompt_attention.cpp"))
_HEADERS = tuple(Path(__file__).with_name("csrc") / name for name in ("simd.h", "team.h"))
_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
# Entry points a baseline checkout's kernels (`load_from`) may lack: added after the stack's clock, the oldest
# baseline the benchmarks take.
_LATER = frozenset({"specula_prompt_attention"})
_BUILD_TIMEOUT_S = 300  # a second or two is usual
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_reason: str | None = None
_tried = False


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cache_dir() -> Path:
    """`$SPECULA_KERNEL_CACHE`, else `~/.cache/specula/kernels`; where that cannot be written (a container run as a
    user without a home), a directory of this user's in the system's temporary directory."""
    configured = os.environ.get("SPECULA_KERNEL_CACHE")
    chosen = Path(configured) if configured else Path.home() / ".cache" / "specula" / "kernels"
    try:
        chosen.mkdir(parents=True, exist_ok=True)
        if os.access(chosen, os.W_OK):
            return chosen
    except OSError:
        pass
    if configured:  # a directory the user named: say so rather than build elsewhere
        raise RuntimeError(f"SPECULA_KERNEL_CACHE={configured} cannot be written")
    fallback = Path(tempfile.gettempdir()) / f"specula-kernels-{os.getuid()}"
    fallback.mkdir(mode=0o700, exist_ok=True)
    return fallback


def _flags() -> tuple[str, ...]:
    return (*_FLAGS, f"-march={os.environ.get('SPECULA_NATIVE_ARCH', '').strip() or 'native'}")


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True,
                             timeout=60).stdout
    key = hashlib.sha256("\0".join([*(s.read_text() for s in _SOURCES + _HEADERS), " ".join(_flags()), version,
                                     _cpu_flags()]).encode())
    cache = _cache_dir()
    target = cache / f"specula_kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    # Built under a temporary name and renamed, so processes building at once never load a half-written file.
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        out = Path(tmp) / target.name
        result = subprocess.run([compiler, *_flags(), *map(str, _SOURCES), "-o", str(out)], capture_output=True,
                                text=True, check=False, timeout=_BUILD_TIMEOUT_S)
        if result.returncode:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(out, target)
    return target


def _load(baseline: bool = False) -> ctypes.CDLL:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    path = _build(compiler)
    lib = ctypes.CDLL(str(path))
    logger.info("native kernels: %s", path)
    i64, ptr, c_int, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    signatures = {
        "specula_int8_linear": [ptr, i64, i64, ptr, i64, ptr, c_int],
        "specula_q4_linear": [ptr, i64, i64, ptr, ctypes.c_int32, i64, i64, ptr, c_int],
        "specula_q8_0_linear": [ptr, i64, i64, ptr, i64, ptr, c_int],
        "specula_w8a8_linear": [ptr, i64, i64, ptr, i64, ptr, c_int],
        "specula_paged_attention": [ptr, i64, ptr, ptr, i64, ptr, i64, i64, ptr, ptr, i64, ptr, i64, i64, f32, ptr,
                                    i64, c_int],
        "specula_rms_norm": [ptr, i64, ptr, i64, ptr, i64, i64, f32, ptr, i64, c_int],
        "specula_silu_mul": [ptr, i64, i64, i64, ptr, i64, c_int],
        "specula_rotary_cache": [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, c_int],
        "specula_float_linear": [ptr, i64, i64, ptr, ptr, i64, ptr, c_int],
        "specula_decode_layers": [ptr, i64, ptr, ptr, c_int],
        "specula_eagle3_layer": [ptr, ptr, ctypes.c_int32, ptr, ptr, ptr, ptr, ptr, c_int],
        "specula_logit_rows": [ptr, i64, i64, i64, ptr, ptr, ptr, c_int],
        "specula_stack_stamps": [ptr],
        "specula_prompt_attention": [ptr, i64, ptr, ptr, i64, ptr, i64, i64, i64, i64, f32, ptr, i64, c_int],
    }
    for name, argtypes in signatures.items():
        if baseline and name in _LATER and not hasattr(lib, name):
            continue  # another checkout's kernels (`load_from`), from before this entry point
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, None
    lib.specula_float_panel_rows.restype = c_int
    lib.specula_vector_lanes.restype = c_int
    lib.specula_w8a8_vnni.restype = c_int
    return lib


def load_from(csrc: Path) -> ctypes.CDLL:
    """The kernels built from another checkout's sources (`csrc`: its `kernels/specula_kernels/csrc`), for benchmarks
    that time a change to the kernels against the code before it in one process (benchmark/kernel_turns.py,
    benchmark/linear_kernels.py). Raises AttributeError if those sources lack an entry point this tree binds."""
    global _SOURCES, _HEADERS
    saved = _SOURCES, _HEADERS
    _SOURCES = tuple(csrc / source.name for source in saved[0] if (csrc / source.name).exists())
    _HEADERS = tuple(csrc / header.name for header in saved[1])
    try:
        return _load(baseline=True)
    finally:
        _SOURCES, _HEADERS = saved


def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built here (logged once, with the reason)."""
    global _library, _reason, _tried
    if _tried:
        return _library
    with _lock:
        if not _tried:
            if os.environ.get("SPECULA_NATIVE_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
                _reason = "disabled by SPECULA_NATIVE_KERNELS"
            else:
                try:
                    _library = _load()
                except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                    _reason = str(error)
                    logger.warning("native kernels unavailable, using PyTorch's: %s", _reason)
            _tried = True
    return _library


def stack_enabled() -> bool:
    """Whether a decoder stack may run its decode steps as one native call (`decode_layers.py`); on unless
    `SPECULA_NATIVE_STACK=0`, which keeps the layer-by-layer path (for comparison)."""
    return os.environ.get("SPECULA_NATIVE_STACK", "1").strip().lower() not in ("0", "false", "no", "off")


def vector_lanes() -> int | None:
    """Floats per vector of the build: 16 with AVX-512, 8 with AVX2; None without the kernels."""
    lib = library()
    return None if lib is None else lib.specula_vector_lanes()


def unavailable_reason() -> str | None:
    library()
    return _reason
