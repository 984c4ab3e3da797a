"""Which threads of a worker may run PyTorch's CPU operators on several cores: one.

PyTorch's CPU operators (and the native kernels) run on GNU OpenMP, which keeps one team of threads per thread that
starts a parallel region, and lets its idle threads spin for the next region only while the process's OpenMP
threads are no more than its CPUs. One more team, even an idle one, and every thread sleeps at the end of every
region and must be woken for the next: a decode step of the 134M benchmark model went from 7.3 to 12.2 ms (int8)
and from 22.6 to 26.2 ms (float32) once a second thread had run a single parallel operator.

So a worker runs its model (loading, warm-up, steps) on one thread, `compute_executor()`, and every other thread
that may touch a tensor (the event loop, adapter loads, grammar helpers) calls `single_threaded()` first, which
limits the OpenMP regions that thread starts to itself.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


@functools.cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    """libgomp's `omp_set_num_threads`, from the copy PyTorch loaded; None where PyTorch runs on another runtime."""
    try:
        return ctypes.CDLL("libgomp.so.1").omp_set_num_threads
    except (OSError, AttributeError):
        return None


def single_threaded() -> None:
    """Makes the calling thread's PyTorch operators and OpenMP regions run on this thread alone, for good."""
    # PyTorch sets a thread's OpenMP thread count at its first parallel loop. `arange` runs one, too short to start
    # a team, so that setting is made now and not later over the one below.
    torch.arange(4)
    set_threads = _omp_set_num_threads()
    if set_threads is not None:
        set_threads(1)


def run_single_threaded(fn: Callable[..., T], *args) -> T:
    """`fn(*args)` on the calling (helper) thread, kept off the compute thread's cores: for `asyncio.to_thread`."""
    single_threaded()
    return fn(*args)


def compute_executor() -> ThreadPoolExecutor:
    """The worker's one compute thread: the model is loaded, warmed up and stepped on it."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="specula-step")


def helper_executor(name: str) -> ThreadPoolExecutor:
    """A one-thread pool for work beside the steps (grammars), whose tensors stay on its own thread."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=single_threaded)
