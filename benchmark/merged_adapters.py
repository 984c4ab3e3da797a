"""Merged adapters (LoRAX's `merged_adapters`): what the merge adds to its first request, and the steady state.

Builds a Llama-shaped model with random weights (default: the 134M-parameter benchmark shape) and random PEFT LoRA
adapters (rank 16 on all seven projections by default, plus one of half that rank for the merges across ranks), then

- merge latency: the worker's load of each strategy's merge of `--merge-size` adapters (reading every adapter
  whole, merging on the CPU in float32, sharding, installing in a slot), beside the load of one plain adapter; the
  merges across ranks (`--cross-rank`) take PEFT's `cat` (linear) or SVD path (the others);
- steady state: a batch of B requests on `--adapters` distinct merges vs the same batch on as many plain
  adapters (request i on adapter or merge i mod N), alternated in one process, the order swapping each round;
  reported as in benchmark/lora.py: median generated tokens/s of the decode steps and the median paired ratio.

    python benchmark/merged_adapters.py --adapters 4 --batch 32 --rounds 5 --json benchmark/results/merged.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("server", "kernels", "proto", "testing")]

import torch  # noqa: E402
from lora import decode_rate  # noqa: E402 (benchmark/lora.py)

from specula_server.adapters.merge import STRATEGIES, MergeSpec  # noqa: E402
from specula_testing.adapters import ALL_PROJECTIONS, build_lora_adapter  # noqa: E402
from specula_testing.models import BENCHMARK_125M, build_tiny_model  # noqa: E402
from specula_testing.worker import load_test_generator  # noqa: E402


def timed_load(generator, name: str, merge: MergeSpec | None = None) -> float:
    started = time.perf_counter()
    generator.adapters.load(name, "local", merge=merge)
    elapsed = time.perf_counter() - started
    generator.adapters.offload(name)
    return elapsed


def merge_latencies(generator, names: list[str], small: str, size: int, rounds: int, cross_rank: bool) -> dict:
    """Median seconds of each load: a plain adapter, then each strategy's merge (and across ranks)."""
    ids = tuple(names[:size])
    specs = {s: MergeSpec(ids, (1.0 / size,) * size, s, density=0.5, seed=1) for s in STRATEGIES}
    if cross_rank:
        mixed = (*ids[:-1], small)
        specs.update({f"{s}-ranks": MergeSpec(mixed, (1.0 / size,) * size, s, density=0.5, seed=1)
                      for s in STRATEGIES})
    times: dict[str, list[float]] = {"plain": [], **{k: [] for k in specs}}
    for _ in range(rounds):
        times["plain"].append(timed_load(generator, names[0]))
        for key, spec in specs.items():
            times[key].append(timed_load(generator, f"merge-{key}", spec))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="model to use (default: a random 134M Llama)")
    parser.add_argument("--adapters", type=int, default=4, help="distinct merges (and plain adapters) in a batch")
    parser.add_argument("--merge-size", type=int, default=2, help="adapters per merge")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", nargs="+", default=list(ALL_PROJECTIONS))
    parser.add_argument("--cross-rank", action="store_true", help="also time merges across ranks (SVD path)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA by default")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or build_tiny_model(Path(tmp) / "model", "llama", **BENCHMARK_125M)
        root = Path(tmp) / "adapters"
        num_plain = max(args.adapters, args.merge_size + 1)
        names = [f"adapter{i}" for i in range(num_plain)]
        for i, name in enumerate(names):
            build_lora_adapter(model_dir, root / name, rank=args.rank, alpha=2 * args.rank,
                               target_modules=args.targets, seed=i, std=0.01)
        small = "small"
        build_lora_adapter(model_dir, root / small, rank=max(args.rank // 2, 1), alpha=args.rank,
                           target_modules=args.targets, seed=99, std=0.01)
        blocks = args.batch * -(-(args.prompt_tokens + args.new_tokens) // 16) + 8
        generator = load_test_generator(model_dir, num_blocks=blocks, dtype=dtype, device=args.device,
                                        adapter_dirs=(root,), max_active_adapters=2 * args.adapters + 2)
        latency = merge_latencies(generator, names, small, args.merge_size, args.rounds, args.cross_rank)
        print(json.dumps({"load_seconds": {k: round(v, 4) for k, v in latency.items()}}), flush=True)

        merges = [f"merge{i}" for i in range(args.adapters)]
        for i, name in enumerate(merges):  # each merge of merge_size consecutive adapters, ties at density 0.5
            ids = tuple(names[(i + j) % num_plain] for j in range(args.merge_size))
            generator.adapters.load(name, "local", merge=MergeSpec(ids, (0.5,) * args.merge_size, "ties", 0.5))
        for name in names[: args.adapters]:
            generator.adapters.load(name, "local")
        batches = {"single": [names[i % args.adapters] for i in range(args.batch)],
                   "merged": [merges[i % args.adapters] for i in range(args.batch)]}
        for batch in batches.values():  # warm up both
            decode_rate(generator, batch, args.prompt_tokens, 4, seed=0)
        samples: dict[str, list[float]] = {k: [] for k in batches}
        for r in range(args.rounds):
            order = list(batches) if r % 2 == 0 else list(batches)[::-1]
            for name in order:
                samples[name].append(decode_rate(generator, batches[name], args.prompt_tokens, args.new_tokens, r))
            print(json.dumps({"round": r, **{k: round(v[-1], 1) for k, v in samples.items()}}), flush=True)

    ratios = [m / s for m, s in zip(samples["merged"], samples["single"])]
    summary = {"adapters": args.adapters, "merge_size": args.merge_size, "rank": args.rank, "targets": args.targets,
               "batch": args.batch, "device": args.device, "dtype": dtype, "threads": args.threads,
               "rounds": args.rounds, "load_seconds": latency,
               "single_tok_s": statistics.median(samples["single"]),
               "merged_tok_s": statistics.median(samples["merged"]), "ratio": statistics.median(ratios),
               "round_ratios": ratios, "samples": samples}
    print(f"merge of {args.merge_size} rank-{args.rank} adapters: " + ", ".join(
        f"{k} {v * 1000:.0f} ms" for k, v in latency.items()))
    print(f"batch {args.batch} over {args.adapters} merges vs {args.adapters} adapters: merged "
          f"{summary['merged_tok_s']:.1f} tok/s, single {summary['single_tok_s']:.1f} tok/s, ratio "
          f"{summary['ratio']:.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
