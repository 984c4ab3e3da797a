"""The worker's plain decode step time, for comparing source trees (e.g. before and after an engine change).

Loads the model in-process from the source tree given (its `server`, `kernels`, `proto`, `testing`), starts
`--concurrency` greedy requests of 32 prompt tokens, and times `--steps` decode steps after 10 warm-up steps;
prints the median step time. It drives either engine API: requests by id (`TextGenerator.step`) or the older
cached batches (`prefill` / `decode`). Run it once per tree, alternating, on an otherwise idle machine:

    for tree in /tmp/specula-before .; do python benchmark/engine_step.py --tree $tree --model-dir MODEL; done
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantize", choices=("int8", "int4"), help="weight-only quantization (trees that have it)")
    args = parser.parse_args()
    tree = args.tree.resolve()
    sys.path[:0] = [str(tree / p) for p in ("server", "kernels", "proto", "testing")]
    import torch

    # The test helpers: their own package `specula_testing` (testing/), or, in trees from before they moved out
    # of the worker's package, `specula_server.testing`.
    helpers = "specula_testing" if (tree / "testing" / "specula_testing").is_dir() else "specula_server.testing"
    worker = importlib.import_module(f"{helpers}.worker")
    BlockPool, load_test_generator, make_spec = worker.BlockPool, worker.load_test_generator, worker.make_spec

    torch.set_num_threads(args.threads)
    num_blocks = args.concurrency * 8 + 16
    settings = {"quantize": args.quantize} if args.quantize else {}
    generator = load_test_generator(args.model_dir, num_blocks=num_blocks, dtype=args.dtype, **settings)
    pool = BlockPool(num_blocks, 16)
    specs = [make_spec(i, [1] + [(i * 7 + j) % 1000 + 3 for j in range(31)], pool, max_new_tokens=args.steps + 20)
             for i in range(args.concurrency)]
    if hasattr(generator, "step"):
        from specula_server.request import StepPlan

        generator.step(StepPlan(new=specs))
        step = lambda: generator.step(StepPlan())  # noqa: E731
    else:
        generator.prefill(0, specs)
        step = lambda: generator.decode([0])  # noqa: E731
    times = []
    for _ in range(args.steps + 10):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    median = statistics.median(times[10:])
    precision = args.dtype + (" " + args.quantize if args.quantize else "")
    print(f"{args.tree}: {precision}, {args.concurrency} sequences, median decode step {median * 1e3:.1f} ms, "
          f"{args.concurrency / median:.0f} tokens/s")


if __name__ == "__main__":
    main()
