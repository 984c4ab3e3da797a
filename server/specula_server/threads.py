"""Which threads of a worker may run PyTorch's CPU operators on several cores: one.

PyTorch's CPU operators (and the native kernels) run on GNU OpenMP, which keeps one team of threads per thread that
starts a parallel region, and lets its idle threads spin for the next region only while the process's OpenMP
threads are no more than its CPUs. One more team, even an idle one, and every thread sleeps at the end of every
region and must be woken for the next, which slows every CPU decode step once a second thread has run a single
parallel operator (measured in docs/benchmarks.md#decode-in-the-worker).

So a worker runs its model (loading, warm-up, steps) on one thread, `compute_executor()`, and every other thread
that may touch a tensor calls `single_threaded()` first, which limits the OpenMP regions that thread starts to
itself: the event loop's thread, the event loop's default executor (`asyncio.to_thread`: adapter loads) and the
grammar helpers, all made by `helper_executor`.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch


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


def worker_threads(loop: asyncio.AbstractEventLoop) -> ThreadPoolExecutor:
    """Sets up a worker's threads from its event loop's thread: that thread and the loop's default executor
    (`asyncio.to_thread`) keep their tensors to themselves. Returns the compute thread."""
    single_threaded()
    loop.set_default_executor(helper_executor("specula-helper", max_workers=4))
    return compute_executor()


def compute_executor() -> ThreadPoolExecutor:
    """The worker's one compute thread: the model is loaded, warmed up and stepped on it."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="specula-step")


def helper_executor(name: str, max_workers: int = 1) -> ThreadPoolExecutor:
    """A pool for work beside the steps, whose threads keep their tensors to themselves."""
    return ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name, initializer=single_threaded)
