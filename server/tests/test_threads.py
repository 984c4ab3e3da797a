"""One thread of a worker computes on every core; the others keep their tensors to themselves (threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from specula_server import threads

pytestmark = pytest.mark.skipif(threads._omp_set_num_threads() is None,
                                reason="PyTorch here does not run on GNU OpenMP")


def _run(code: str) -> str:
    """`code` in a fresh interpreter (OpenMP teams live as long as their process), two PyTorch threads."""
    env = dict(os.environ, OMP_NUM_THREADS="2")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True,
                          env=env, timeout=120).stdout


PROLOGUE = """
    import os, threading, torch
    from specula_server import threads
    torch.set_num_threads(2)
    big = torch.randn(1 << 20)

    def thread_count():
        return len(os.listdir("/proc/self/task"))

    def parallel_op():
        (big * 2).sum()
"""


def test_a_single_threaded_helper_starts_no_openmp_team():
    out = _run(PROLOGUE + """
    parallel_op()  # the main thread's team: one more thread
    before = thread_count()
    def helper():
        threads.single_threaded()
        parallel_op()
        print("inside", thread_count() - before)
    t = threading.Thread(target=helper); t.start(); t.join()
    def plain():
        parallel_op()
        print("plain", thread_count() - before)
    t = threading.Thread(target=plain); t.start(); t.join()
    """)
    counts = dict(line.split() for line in out.splitlines())
    assert counts["inside"] == "1"  # the helper thread itself, no OpenMP worker of its own
    assert counts["plain"] == "2"  # without it, the helper starts a team: one more thread (the check can fail)


def test_a_workers_helpers_keep_their_threads_single_and_the_compute_thread_is_not():
    """`worker_threads`, as a worker's `serve` calls it: grammar helpers and `asyncio.to_thread` (adapter loads)
    start no team; the compute thread does."""
    out = _run(PROLOGUE + """
    import asyncio
    async def main():
        compute = threads.worker_threads(asyncio.get_running_loop())
        parallel_op()  # the event loop's own thread
        before = thread_count()
        helper = threads.helper_executor("h")  # kept: a pool that is collected ends its thread
        helper.submit(lambda: (parallel_op(), print("executor", thread_count() - before))).result()
        def report():
            parallel_op()
            print("to_thread", thread_count() - before)
        await asyncio.to_thread(report)
        def compute_op():
            parallel_op()
            print("compute", thread_count() - before)
        compute.submit(compute_op).result()
    asyncio.run(main())
    """)
    counts = dict(line.split() for line in out.splitlines())
    # one new thread each (the helper itself) and none of their own; the compute thread adds its OpenMP worker
    assert counts == {"executor": "1", "to_thread": "2", "compute": "4"}, out
