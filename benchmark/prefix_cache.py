"""Prefix caching on vs off through the HTTP API: a shared long prefix, and a multi-turn chat replay.

Starts `specula-launcher` on a model (by default the ~125M-parameter Llama-shaped benchmark model with random
weights, built on the fly), alternately with prefix caching (the default) and with `--no-prefix-caching`, for
`--rounds` rounds each, and measures on the same requests:

    shared prefix   `--prefix-tokens` common tokens (a system prompt, few-shot examples) + a short distinct
                    question per request, sent one at a time: time to first token, and tokens/s
    chat replay     `--conversations` conversations of `--turns` turns at each `--concurrency`; every turn
                    resends the whole conversation so far (as chat clients do) plus a new question:
                    generated tokens/s and median TTFT

Every request generates `--new-tokens` tokens (`ignore_eos_token`), greedy, so both modes do the same work but
for what the cache saves; the script also checks that both modes answer the same text. Reports medians over
rounds and the ratio off/on (higher is better for caching).

    python benchmark/prefix_cache.py --rounds 2 --json benchmark/results/prefix_cache.json
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
from http_load import served  # noqa: E402

WORDS = ["def", "return", "value", "class", "import", "for", "while", "self", "data", "result", "index", "items",
         "config", "path", "name", "count", "total", "buffer", "stream", "token"]


def make_prefix(url: str, num_tokens: int) -> str:
    """Words, as many as make `num_tokens` tokens for the served tokenizer."""
    rng = random.Random(0)
    words: list[str] = []
    while True:
        words += [rng.choice(WORDS) for _ in range(64)]
        text = " ".join(words)
        r = httpx.post(f"{url}/tokenize", json={"inputs": text}, timeout=60)
        if r.status_code != 200 or len(r.json()) >= num_tokens:  # 422: past the server's input limit
            return text


async def stream(client: httpx.AsyncClient, url: str, prompt: str, new_tokens: int) -> tuple[float, str, int]:
    """(TTFT seconds, generated text, cached prompt tokens) of one streamed request."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": new_tokens, "ignore_eos_token": True,
                                             "details": True}}
    start, ttft, text, cached = time.perf_counter(), None, "", 0
    async with client.stream("POST", f"{url}/generate_stream", json=body, timeout=1200) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if ttft is None:
                ttft = time.perf_counter() - start
            if event.get("generated_text") is not None:
                text = event["generated_text"]
                cached = (event.get("details") or {}).get("cached_tokens", 0)
    return ttft or 0.0, text, cached


async def shared_prefix(url: str, prefix: str, num_questions: int, new_tokens: int) -> dict:
    async with httpx.AsyncClient() as client:
        ttfts, texts, cached = [], [], []
        start = time.perf_counter()
        for i in range(num_questions):
            question = f"\nQuestion {i}: what does {WORDS[i % len(WORDS)]} {WORDS[(3 * i) % len(WORDS)]} do?\n"
            ttft, text, hit = await stream(client, url, prefix + question, new_tokens)
            ttfts.append(ttft)
            texts.append(text)
            cached.append(hit)
        elapsed = time.perf_counter() - start
    return {"ttft_median_ms": 1000 * statistics.median(ttfts[1:]),  # the first request fills the cache
            "tokens_per_s": num_questions * new_tokens / elapsed, "cached_tokens_median": statistics.median(cached),
            "texts": texts}


async def chat_replay(url: str, prefix: str, conversations: int, turns: int, concurrency: int,
                      new_tokens: int) -> dict:
    semaphore = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []

    async def conversation(c: int, client: httpx.AsyncClient) -> list[str]:
        history, answers = prefix[: 400 + 40 * c], []
        for turn in range(turns):
            history += f"\nUser: tell me about {WORDS[(c + turn) % len(WORDS)]} number {turn}\nAssistant:"
            async with semaphore:
                ttft, text, _ = await stream(client, url, history, new_tokens)
            ttfts.append(ttft)
            history += text
            answers.append(text)
        return answers

    async with httpx.AsyncClient() as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(conversation(c, client) for c in range(conversations)))
        elapsed = time.perf_counter() - start
    return {"tokens_per_s": conversations * turns * new_tokens / elapsed,
            "ttft_median_ms": 1000 * statistics.median(ttfts), "texts": [t for r in results for t in r]}


def run_mode(model_dir: Path, tmp: Path, caching: bool, args: argparse.Namespace) -> dict:
    extra = ["--max-concurrent-requests", "256", *([] if caching else ["--no-prefix-caching"])]
    with served(model_dir, tmp, extra) as url:
        prefix = make_prefix(url, args.prefix_tokens)
        asyncio.run(stream(httpx.AsyncClient(), url, "warm up", 4))
        result = {"shared_prefix": asyncio.run(shared_prefix(url, prefix, args.questions, args.new_tokens))}
        for c in args.concurrency:
            result[f"chat_c{c}"] = asyncio.run(chat_replay(url, prefix, args.conversations, args.turns, c,
                                                           args.new_tokens))
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="model to serve (default: a ~125M random Llama)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prefix-tokens", type=int, default=1500)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    runs: dict[str, list[dict]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = args.model_dir
        if model_dir is None:
            from specula_testing.models import BENCHMARK_125M, build_tiny_model

            model_dir = build_tiny_model(tmp / "model", "llama", **BENCHMARK_125M)
        for _ in range(args.rounds):  # alternating, so both modes see the same machine
            for mode in ("on", "off"):
                runs[mode].append(run_mode(model_dir, tmp, mode == "on", args))
                print(mode, json.dumps({k: {m: v for m, v in r.items() if m != "texts"}
                                        for k, r in runs[mode][-1].items()}), flush=True)
    same = all(on[k]["texts"] == off[k]["texts"] for on, off in zip(runs["on"], runs["off"]) for k in on)
    print(f"\nsame text with and without the cache: {same}\n")
    print("| workload | metric | caching on | caching off | gain (TTFT off/on, tokens/s on/off) |")
    print("|---|---|---|---|---|")
    for workload in runs["on"][0]:
        for metric in ("ttft_median_ms", "tokens_per_s"):
            on = statistics.median(r[workload][metric] for r in runs["on"])
            off = statistics.median(r[workload][metric] for r in runs["off"])
            ratio = off / on if metric == "ttft_median_ms" else on / off
            print(f"| {workload} | {metric} | {on:.1f} | {off:.1f} | {ratio:.2f}x |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "same_text": same,
                                         "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
