"""What a second OpenMP team costs a decode step: the worker's reason for computing on one thread (threads.py).

Loads the model on one thread and times single-sequence decode steps there; then runs one parallel PyTorch
operator on the main thread, which gives the process a second OpenMP team, and times the same steps again.
Prints both medians. Run on an otherwise idle machine:

    python benchmark/compute_thread.py --model-dir MODEL [--quantize int8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("server", "kernels", "proto", "testing")]

import torch  # noqa: E402

from specula_server.request import StepPlan  # noqa: E402
from specula_testing.worker import BlockPool, load_test_generator, make_spec  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--quantize", choices=("int8", "int4"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    compute = ThreadPoolExecutor(max_workers=1)

    def setup():
        torch.set_num_threads(args.threads)
        generator = load_test_generator(args.model_dir, num_blocks=64, quantize=args.quantize)
        pool = BlockPool(64, 16)
        prompt = [1] + [(7 * j) % 1000 + 3 for j in range(31)]
        generator.step(StepPlan(new=[make_spec(0, prompt, pool, max_new_tokens=2 * args.steps + 20)]))
        return generator

    generator = compute.submit(setup).result()

    def steps() -> float:
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            generator.step(StepPlan())
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    one_team = compute.submit(steps).result()
    x = torch.randn(1024, 1024)
    x @ x  # the main thread's first parallel operator: a second team
    two_teams = compute.submit(steps).result()
    print(f"{args.quantize or 'float32'}: median decode step {one_team:.2f} ms with one OpenMP team, "
          f"{two_teams:.2f} ms once a second thread has run a parallel operator ({two_teams / one_team:.2f}x)")


if __name__ == "__main__":
    main()
