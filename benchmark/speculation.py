"""Speculative decoding in the worker, side by side: off vs fixed vs adaptive over concurrency.

Runs the worker in-process (prefill a batch of `c` requests, decode until all finish) for each speculation
setting on the same model, prompts and thread count, in alternating order, and reports generated tokens/s,
mean accepted tokens per step and the ratio to speculation off. Two workloads:

- `repetitive`: greedy decoding, whose output repeats itself (prompt lookup finds what to copy);
- `novel`: sampling at temperature 1 from random prompts: nothing to copy, so drafts are mostly rejected and
  speculation must not slow anything down.

At concurrency 1 it also times transformers `generate(prompt_lookup_num_tokens=...)` on the same weights.

    python benchmark/speculation.py --workload repetitive novel --concurrency 1 4 16 32 64 \\
        --json benchmark/results/speculation.json --plot benchmark/results/speculation.png
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("server", "kernels", "proto")]

import torch  # noqa: E402

from specula_server.params import SamplingParams  # noqa: E402
from specula_server.testing.models import BENCHMARK_125M, build_tiny_model  # noqa: E402
from specula_server.testing.worker import BlockPool, load_test_generator, make_spec  # noqa: E402
from specula_server.warmup import calibrate_step_cost  # noqa: E402

SETTINGS = {"off": {}, "fixed": {"speculative_tokens": 4, "speculation_mode": "fixed"},
            "adaptive": {"speculative_tokens": 4, "speculation_mode": "adaptive"}}


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 500) for _ in range(length - 1)] for _ in range(n)]


def run_batch(generator, batch_prompts, new_tokens: int, workload: str, seed: int) -> tuple[float, int, int]:
    """Seconds, generated tokens and decode steps for one batch run to completion."""
    pool = BlockPool(generator.kv_cache.num_blocks, generator.block_size)
    specs = []
    for i, p in enumerate(batch_prompts):
        sampling = SamplingParams() if workload == "repetitive" else SamplingParams(do_sample=True, seed=seed + i)
        specs.append(make_spec(i, p, pool, max_new_tokens=new_tokens, sampling=sampling))
    start = time.perf_counter()
    result = generator.prefill(0, specs)
    tokens = sum(len(o.tokens) for o in result.outputs)
    steps = 0
    while result.batch is not None:
        result = generator.decode([0])
        tokens += sum(len(o.tokens) for o in result.outputs)
        steps += 1
    return time.perf_counter() - start, tokens, steps


def transformers_prompt_lookup(model_dir: Path, prompt: list[int], new_tokens: int, rounds: int) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    rates = {}
    for name, extra in (("plain", {}), ("prompt_lookup", {"prompt_lookup_num_tokens": 4})):
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **extra)
            times.append(time.perf_counter() - start)
        rates[name] = new_tokens / statistics.median(times)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="model to use (default: a ~125M random Llama)")
    parser.add_argument("--workload", nargs="+", default=["repetitive", "novel"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or build_tiny_model(Path(tmp) / "model", "llama", **BENCHMARK_125M)
        blocks = max(args.concurrency) * -(-(args.prompt_tokens + args.new_tokens + 8) // 16)
        generators = {name: load_test_generator(model_dir, num_blocks=blocks, **s) for name, s in SETTINGS.items()}
        for g in generators.values():
            calibrate_step_cost(g)  # what the server's warmup does
        results = []
        for workload in args.workload:
            for c in args.concurrency:
                batch = prompts(c, args.prompt_tokens, seed=c)
                samples = {name: [] for name in SETTINGS}
                for r in range(args.rounds):
                    for name, g in generators.items():
                        seconds, tokens, steps = run_batch(g, batch, args.new_tokens, workload, seed=1000 * r)
                        samples[name].append((tokens / seconds, tokens / max(c * steps, 1)))
                row = {"workload": workload, "concurrency": c}
                for name, values in samples.items():
                    row[f"{name}_tok_s"] = statistics.median(v[0] for v in values)
                    row[f"{name}_tokens_per_step"] = statistics.median(v[1] for v in values)
                for name in ("fixed", "adaptive"):
                    row[f"{name}_vs_off"] = row[f"{name}_tok_s"] / row["off_tok_s"]
                results.append(row)
                print(json.dumps(row), flush=True)
        baseline = None
        if 1 in args.concurrency and "repetitive" in args.workload:
            baseline = transformers_prompt_lookup(model_dir, prompts(1, args.prompt_tokens, seed=1)[0],
                                                  args.new_tokens, args.rounds)
            print(json.dumps({"transformers": baseline}), flush=True)

    print("| workload | concurrency | off tok/s | fixed | adaptive | tokens/step (adaptive) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['workload']} | {r['concurrency']} | {r['off_tok_s']:.1f} | {r['fixed_vs_off']:.2f}x | "
              f"{r['adaptive_vs_off']:.2f}x | {r['adaptive_tokens_per_step']:.2f} |")
    if baseline:
        print(f"transformers at concurrency 1: generate() {baseline['plain']:.1f} tok/s, "
              f"prompt_lookup_num_tokens=4 {baseline['prompt_lookup']:.1f} tok/s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"results": results, "transformers": baseline}, indent=2))
    if args.plot:
        plot(results, args.plot)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in results})
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        rows = [r for r in results if r["workload"] == workload]
        xs = [r["concurrency"] for r in rows]
        for name in SETTINGS:
            ax.plot(xs, [r[f"{name}_tok_s"] for r in rows], marker="o", label=name)
        ax.set(title=f"{workload} workload", xlabel="concurrent requests", ylabel="generated tokens/s",
               xscale="log", xticks=xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
