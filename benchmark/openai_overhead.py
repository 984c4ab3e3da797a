"""What the OpenAI chat route costs per streamed token, against `/generate_stream`, at several concurrencies.

Starts `specula-launcher` on the bundled demo model (3.7M parameters: its forward is short, so the router's
share of a token is as large as it gets on this machine), or targets a running server with `--url`. Both routes
get identical work: under the demo model's chat template, the chat prompt `<s>` + PROMPT + `\\n` tokenises to the
same ids as `/generate_stream` with PROMPT + `\\n` and its BOS; both are greedy with `ignore_eos_token` and the
same number of new tokens. Rounds alternate the routes (generate, chat, generate, chat, ...) so that drift on a
shared machine reaches both. Per concurrency and route: aggregate tokens/s (median over rounds) and the median
decode time per token a client sees ((last token - first token) / (tokens - 1)); then chat / generate.

    python benchmark/openai_overhead.py --concurrency 1 32 --rounds 4 --json benchmark/results/openai_overhead.json
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
from http_load import REPO, free_port, start_launcher, wait_healthy

DEMO_MODEL = REPO / "launcher" / "specula_launcher" / "demo_model"
PROMPTS = ["def read_config(path):", "class Stack:\n    def __init__(self):", "def fibonacci(n):",
           "import os\n\ndef walk(root):"]


async def generate_request(client: httpx.AsyncClient, url: str, i: int, new_tokens: int) -> tuple[float, int]:
    body = {"inputs": PROMPTS[i % len(PROMPTS)] + "\n",
            "parameters": {"max_new_tokens": new_tokens, "ignore_eos_token": True}}
    times = []
    async with client.stream("POST", f"{url}/generate_stream", json=body, timeout=600) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                if "error" in json.loads(line[5:]):
                    raise RuntimeError(line)
                times.append(time.perf_counter())
    return (times[-1] - times[0]) / max(len(times) - 1, 1), len(times)


async def chat_request(client: httpx.AsyncClient, url: str, i: int, new_tokens: int) -> tuple[float, int]:
    body = {"model": "tgi", "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": new_tokens, "temperature": 0, "ignore_eos_token": True, "stream": True,
            "stream_options": {"include_usage": True}}
    times, tokens = [], 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(line)
            if chunk["choices"]:
                times.append(time.perf_counter())
            else:
                tokens = chunk["usage"]["completion_tokens"]
    # A chunk per token (a token that ends inside a UTF-8 character waits for the next): time over tokens.
    return (times[-1] - times[0]) / max(tokens - 1, 1), tokens


async def run_round(url: str, route: str, concurrency: int, requests_per_client: int, new_tokens: int) -> dict:
    request = chat_request if route == "chat" else generate_request
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        async def one_client(c: int) -> list[tuple[float, int]]:
            return [await request(client, url, c * requests_per_client + r, new_tokens)
                    for r in range(requests_per_client)]

        start = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(one_client(c) for c in range(concurrency))) for r in rs]
        elapsed = time.perf_counter() - start
    assert all(tokens == new_tokens for _, tokens in results), results
    return {"tokens_per_s": sum(t for _, t in results) / elapsed,
            "ms_per_token": statistics.median(s for s, _ in results) * 1000}


async def measure(url: str, concurrency: list[int], rounds: int, requests_per_client: int, new_tokens: int) -> list:
    await run_round(url, "chat", 2, 1, 8)  # warm both paths
    await run_round(url, "generate", 2, 1, 8)
    rows = []
    for c in concurrency:
        samples: dict[str, list[dict]] = {"generate": [], "chat": []}
        for _ in range(rounds):
            for route in ("generate", "chat"):
                samples[route].append(await run_round(url, route, c, requests_per_client, new_tokens))
        row = {"concurrency": c}
        for route, runs in samples.items():
            row[route] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        row["chat_vs_generate_tokens_per_s"] = row["chat"]["tokens_per_s"] / row["generate"]["tokens_per_s"]
        row["chat_vs_generate_ms_per_token"] = row["chat"]["ms_per_token"] / row["generate"]["ms_per_token"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="target a running server (serving the demo model) instead of starting one")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    proc = None
    with tempfile.TemporaryDirectory() as tmp:
        url = args.url
        if url is None:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = start_launcher(DEMO_MODEL, port, Path(tmp), [])
        try:
            wait_healthy(url, proc)
            rows = asyncio.run(measure(url, args.concurrency, args.rounds, args.requests_per_client, args.new_tokens))
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(60)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
