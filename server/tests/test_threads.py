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


def test_helper_executors_and_run_single_threaded_keep_their_threads_single():
    out = _run(PROLOGUE + """
    import asyncio
    parallel_op()
    before = thread_count()
    threads.helper_executor("h").submit(lambda: (parallel_op(), print("executor", thread_count() - before))).result()
    def report():
        parallel_op()
        print("to_thread", thread_count() - before)
    async def main():
        await asyncio.to_thread(threads.run_single_threaded, report)
    asyncio.run(main())
    """)
    counts = dict(line.split() for line in out.splitlines())
    assert counts == {"executor": "1", "to_thread": "1"}, out
