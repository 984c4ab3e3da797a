"""A step that decodes running streams while a prompt arrives: one forward for both, or one forward each.

The worker computes a step's decodes and its prompt chunks in one forward (`TextGenerator.one_forward`); before,
it ran the decodes, then the prompts. In one generator `--streams` greedy requests decode; then, `--samples`
times, a new request joins with a `--prompt-tokens` prompt (a different one each time, so no prefix is reused)
and that step is timed, with the shared forward and without it in turn (the order reversing every pair, so
both see the same machine); the newcomer is ended after its step. A plain decode step of the streams is timed
between them, for scale. Reports medians, and the median over pairs of (one forward / two forwards).

    python benchmark/mixed_step.py --model ~/.cache/specula/real-model/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --streams 1 8 --prompt-tokens 16 64 350 --json mixed.json

Without `--model` it builds the ~125M-parameter Llama-shaped benchmark model with random weights.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("server", "kernels", "proto", "testing")]

import torch  # noqa: E402

from specula_server.request import StepPlan  # noqa: E402
from specula_testing.models import BENCHMARK_125M, build_tiny_model  # noqa: E402
from specula_testing.worker import BlockPool, load_test_generator, make_spec  # noqa: E402


def timed(generator, plan: StepPlan) -> float:
    start = time.perf_counter()
    generator.step(plan)
    return time.perf_counter() - start


def measure(generator, streams: int, prompt_tokens: int, samples: int, vocab: int) -> dict:
    pool = BlockPool(generator.kv_cache.num_blocks, generator.block_size)
    new_tokens = 4 * samples + 16
    running = [make_spec(i, [1] + [100 + (7 * i + j) % (vocab - 200) for j in range(31)], pool,
                         max_new_tokens=new_tokens) for i in range(streams)]
    generator.step(StepPlan(new=running))
    for _ in range(3):
        generator.step(StepPlan())
    times: dict[str, list[float]] = {"one": [], "two": [], "decode": []}
    for k in range(samples):
        for mode in (("one", "two") if k % 2 == 0 else ("two", "one")):
            request_id = 1000 + 2 * k + (mode == "two")
            prompt = [1] + [100 + (13 * request_id + 5 * j) % (vocab - 200) for j in range(prompt_tokens - 1)]
            newcomer = make_spec(request_id, prompt, pool, max_new_tokens=4)
            generator.one_forward = mode == "one"
            times[mode].append(timed(generator, StepPlan(new=[newcomer])))
            generator.step(StepPlan(finished=[request_id]))
            pool.give(newcomer.blocks)
        times["decode"].append(timed(generator, StepPlan()))
    generator.one_forward = True
    generator.step(StepPlan(finished=[s.id for s in running]))
    ratios = [a / b for a, b in zip(times["one"], times["two"])]
    return {"streams": streams, "prompt_tokens": prompt_tokens,
            **{f"{mode}_ms": 1e3 * statistics.median(values) for mode, values in times.items()},
            "one_over_two": statistics.median(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory or GGUF file (default: the random 125M benchmark model)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[16, 64, 350])
    parser.add_argument("--samples", type=int, default=12, help="timed steps per mode and cell")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantize", choices=("int8", "int4"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_tiny_model(Path(tmp) / "model", "llama", **BENCHMARK_125M)
        generator = load_test_generator(Path(model), num_blocks=1024, dtype=args.dtype, quantize=args.quantize)
        vocab = generator.model.config.vocab_size
        results = [measure(generator, s, p, args.samples, vocab) for s in args.streams for p in args.prompt_tokens]
    print(f"{'streams':>7} {'prompt':>6} {'decode ms':>9} {'two fwd ms':>10} {'one fwd ms':>10} {'one/two':>7}")
    for r in results:
        print(f"{r['streams']:>7} {r['prompt_tokens']:>6} {r['decode_ms']:>9.1f} {r['two_ms']:>10.1f} "
              f"{r['one_ms']:>10.1f} {r['one_over_two']:>7.3f}")
    if args.json:
        args.json.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "threads": args.threads,
                                         "model": str(args.model or "random 125M"), "results": results}, indent=1))


if __name__ == "__main__":
    main()
