"""Chunked prefill: how long running streams stall while long prompts arrive, chunked vs in one prefill.

Starts `specula-launcher` on a model (by default the ~125M-parameter Llama-shaped benchmark model with random
weights, built on the fly), once per configuration, alternating for `--rounds` rounds: `--max-batch-prefill-tokens`
large enough for the longest prompt (one prefill), then each of `--chunk-tokens`. In each run `--streams` requests
generate `--stream-tokens` tokens while `--long-prompts` prompts of `--long-tokens` tokens arrive one after another
(prefix caching off, so each is prefilled for real). Reports the streams' inter-token latency (median and p99)
and the long prompts' time to first token. `--baseline-tree` runs each configuration from another checkout too.

    python benchmark/chunked_prefill.py --rounds 2 --chunk-tokens 256 512 --json benchmark/results/chunked.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from http_load import quantile, served  # noqa: E402
from prefix_cache import WORDS, stream  # noqa: E402


def long_prompt(url: str, num_tokens: int, seed: int) -> str:
    """Random words, at most `num_tokens` tokens (a prompt past the server's input limit is a 422)."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(num_tokens)]
    while True:
        r = httpx.post(f"{url}/tokenize", json={"inputs": " ".join(words)}, timeout=60)
        if r.status_code == 200 and len(r.json()) <= num_tokens:
            return " ".join(words)
        words = words[: int(len(words) * 0.95)]


async def one_stream(client: httpx.AsyncClient, url: str, i: int, new_tokens: int) -> list[float]:
    """The gaps between this stream's tokens, once it is past its first token."""
    body = {"inputs": f"stream {i}: " + " ".join(WORDS[i:i + 6]),
            "parameters": {"max_new_tokens": new_tokens, "ignore_eos_token": True}}
    gaps, last = [], None
    async with client.stream("POST", f"{url}/generate_stream", json=body, timeout=1200) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    return gaps


async def workload(url: str, args: argparse.Namespace, prompts: list[str]) -> dict:
    async with httpx.AsyncClient() as client:
        streams = [asyncio.create_task(one_stream(client, url, i, args.stream_tokens)) for i in range(args.streams)]
        await asyncio.sleep(2.0)  # the streams are decoding
        ttfts = []
        for prompt in prompts:
            ttft, _, _ = await stream(client, url, prompt, 2)
            ttfts.append(ttft)
        gaps = [g for gs in await asyncio.gather(*streams) for g in gs]
    return {"itl_median_ms": 1000 * statistics.median(gaps), "itl_p99_ms": 1000 * quantile(gaps, 0.99),
            "itl_max_ms": 1000 * max(gaps), "long_ttft_median_ms": 1000 * statistics.median(ttfts)}


def run_config(model_dir: Path, tmp: Path, budget: int, args: argparse.Namespace, tree: Path | None) -> dict:
    # One decode step per call: the streams' gaps are then one per step, not bursts of several tokens at once.
    extra = ["--no-prefix-caching", "--max-batch-prefill-tokens", str(budget), "--max-concurrent-requests", "64",
             "--num-scheduler-steps", "1"]
    with served(model_dir, tmp, extra, *([tree] if tree is not None else [])) as url:
        prompts = [long_prompt(url, args.long_tokens, seed) for seed in range(args.long_prompts)]
        asyncio.run(stream(httpx.AsyncClient(), url, "warm up", 4))
        return asyncio.run(workload(url, args, prompts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="model to serve (default: a ~125M random Llama)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--chunk-tokens", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-tokens", type=int, default=200)
    parser.add_argument("--long-prompts", type=int, default=3)
    parser.add_argument("--long-tokens", type=int, default=1900)
    parser.add_argument("--baseline-tree", type=Path,
                        help="a checkout of another commit: each configuration also runs from it, in turn")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    budgets = {"one prefill": args.long_tokens + 50, **{f"chunks of {c}": c for c in args.chunk_tokens}}
    configs = {name: (budget, None) for name, budget in budgets.items()}
    if args.baseline_tree is not None:
        configs = {f"{name}{label}": (budget, tree) for name, budget in budgets.items()
                   for label, tree in (("", None), (", baseline", args.baseline_tree))}
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = args.model_dir
        if model_dir is None:
            from specula_testing.models import BENCHMARK_125M, build_tiny_model

            model_dir = build_tiny_model(tmp / "model", "llama", **BENCHMARK_125M)
        for _ in range(args.rounds):
            for name, (budget, tree) in configs.items():
                runs[name].append(run_config(model_dir, tmp, budget, args, tree))
                print(name, json.dumps(runs[name][-1]), flush=True)
    print(f"\n{args.streams} streams decoding while {args.long_prompts} prompts of {args.long_tokens} tokens "
          f"arrive; medians over {args.rounds} rounds\n")
    print("| prefill | stream ITL median ms | stream ITL p99 ms | p99 / median | long prompt TTFT ms |")
    print("|---|---|---|---|---|")
    for name, results in runs.items():
        median = statistics.median(r["itl_median_ms"] for r in results)
        p99 = statistics.median(r["itl_p99_ms"] for r in results)
        ttft = statistics.median(r["long_ttft_median_ms"] for r in results)
        print(f"| {name} | {median:.1f} | {p99:.1f} | {p99 / median:.1f}x | {ttft:.0f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json), "model_dir": str(args.model_dir),
                                                               "baseline_tree": str(args.baseline_tree)},
                                         "runs": runs},
                                        indent=2))


if __name__ == "__main__":
    main()
