"""Default-budget requests under a small KV budget: blocks that grow with the sequence vs whole-budget reservation.

A request without `max_new_tokens` gets `max_total_tokens - input` (as in TGI and LoRAX). A router that reserves
KV blocks for a request's whole budget at admission fits only a few such requests in a small cache, whatever
they will really generate; one that gives blocks as sequences grow (and preempts when they run out) runs all
of them. This script measures both on the same machine, in one run, alternating for `--rounds` rounds:

    this tree      the server of this checkout (blocks grow, preemption)
    baseline tree  `--baseline-tree`, a checkout of the commit before (whole-budget reservation), e.g.
                   `git worktree add /tmp/specula-before <commit>`

`--concurrency` requests without `max_new_tokens` arrive at once, each with a stop sequence that ends it after
about `--answer-tokens` tokens (taken from its greedy answer, so both servers stop at the same token), on a
KV cache of `--kv-cache-memory`. Reports generated tokens/s over the whole burst (median over rounds) and the
ratio. Both servers must answer the same text.

    python benchmark/kv_pressure.py --baseline-tree /tmp/specula-before --rounds 3 \
        --json benchmark/results/kv_pressure.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from http_load import REPO, served  # noqa: E402
from prefix_cache import WORDS  # noqa: E402


def prompts(count: int) -> list[str]:
    return [f"Task {i}: " + " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(12)) for i in range(count)]


def stop_sequences(url: str, texts: list[str], answer_tokens: int) -> list[str]:
    """For each prompt, the last characters of its greedy answer's first `answer_tokens` tokens: a stop sequence
    that ends it there (or earlier, where the same text occurs first)."""
    stops = []
    for text in texts:
        r = httpx.post(f"{url}/generate", timeout=600, json={"inputs": text, "parameters": {
            "max_new_tokens": answer_tokens, "ignore_eos_token": True, "details": True}})
        r.raise_for_status()
        text = "".join(t["text"] for t in r.json()["details"]["tokens"])
        if not text.strip():
            raise SystemExit(f"the answer to {text!r} has no text to stop at")
        stops.append(text[-8:])  # its first occurrence ends the answer here, or earlier
    return stops


async def burst(url: str, texts: list[str], stops: list[str]) -> dict:
    async def one(client: httpx.AsyncClient, text: str, stop: str) -> tuple[str, int]:
        r = await client.post(f"{url}/generate", timeout=3600, json={"inputs": text, "parameters": {
            "stop": [stop], "ignore_eos_token": True, "details": True}})
        r.raise_for_status()
        body = r.json()
        return body["generated_text"], body["details"]["generated_tokens"]

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(texts))) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, t, s) for t, s in zip(texts, stops)))
        seconds = time.perf_counter() - start
    generated = sum(n for _, n in results)
    return {"seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds,
            "texts": [t for t, _ in results]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-tree", type=Path, required=True, help="checkout that reserves whole budgets")
    parser.add_argument("--tree", type=Path, default=REPO, help="checkout whose blocks grow (default: this one)")
    # A trained model: a random one's tokens (the ~125M benchmark Llama's) often decode to no text to stop at.
    parser.add_argument("--model-dir", type=Path, default=REPO / "launcher" / "specula_launcher" / "demo_model")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--answer-tokens", type=int, default=20)
    parser.add_argument("--max-total-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default="12MiB", help="1.5 whole budgets of the demo model (2048 tokens)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    flags = ["--max-total-tokens", str(args.max_total_tokens), "--kv-cache-memory", args.kv_cache_memory,
             "--max-concurrent-requests", str(max(128, args.concurrency))]
    trees = {"grow": args.tree.resolve(), "whole_budget": args.baseline_tree.resolve()}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = args.model_dir
        texts = prompts(args.concurrency)
        with served(model_dir, tmp, flags, trees["grow"]) as url:
            stops = stop_sequences(url, texts, args.answer_tokens)
        for _ in range(args.rounds):  # alternating, so both see the same machine
            for name, tree in trees.items():
                with served(model_dir, tmp, flags, tree) as url:
                    runs[name].append(asyncio.run(burst(url, texts, stops)))
                print(name, json.dumps({k: v for k, v in runs[name][-1].items() if k != "texts"}), flush=True)
    same = all(a["texts"] == b["texts"] for a, b in zip(runs["grow"], runs["whole_budget"]))
    grow = statistics.median(r["tokens_per_s"] for r in runs["grow"])
    whole = statistics.median(r["tokens_per_s"] for r in runs["whole_budget"])
    print(f"\nsame text: {same}\n")
    print("| router | generated tokens/s (median) | burst seconds (median) |")
    print("|---|---|---|")
    for name in trees:
        print(f"| {name} | {statistics.median(r['tokens_per_s'] for r in runs[name]):.1f} | "
              f"{statistics.median(r['seconds'] for r in runs[name]):.1f} |")
    print(f"\ngrow / whole budget: {grow / whole:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "same_text": same,
                                         "ratio": grow / whole, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
