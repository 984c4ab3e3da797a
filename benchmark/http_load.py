"""HTTP load generator: time to first token, inter-token latency and throughput over concurrency.

Starts `specula-launcher` on a model (by default a ~125M-parameter Llama-shaped model with random weights,
built on the fly) or targets a running server with `--url`, then for each concurrency runs that many
streaming clients (`/generate_stream`) issuing requests back to back. Every request generates exactly
`--new-tokens` tokens (`ignore_eos_token`). Reports per concurrency: aggregate generated tokens/s,
median/p90 TTFT and inter-token latency, and the router + gRPC overhead per decode step (client-observed
inter-token latency minus the worker's own step time, from the server's Prometheus histograms).

    python benchmark/http_load.py --concurrency 1 8 32 64 --json benchmark/results/http_load.json \\
        --plot benchmark/results/http_load.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("server", "kernels", "proto", "router", "launcher", "testing")]

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


@dataclass
class RequestStats:
    ttft: float
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0


def prompt_for(i: int) -> str:
    words = ["def", "return", "value", "class", "import", "for", "while", "self", "data", "result"]
    rng = random.Random(i)
    return " ".join(rng.choice(words) for _ in range(24))


async def one_request(client: httpx.AsyncClient, url: str, i: int, new_tokens: int) -> RequestStats:
    body = {"inputs": prompt_for(i), "parameters": {"max_new_tokens": new_tokens, "ignore_eos_token": True,
                                                    "details": True}}
    start = time.perf_counter()
    stats, last = None, start
    async with client.stream("POST", f"{url}/generate_stream", json=body, timeout=600) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(event["error"])
            now = time.perf_counter()
            if stats is None:
                stats = RequestStats(ttft=now - start)
            else:
                stats.gaps.append(now - last)
            stats.tokens += 1
            last = now
    return stats


async def run_level(url: str, concurrency: int, requests_per_client: int, new_tokens: int) -> dict:
    results: list[RequestStats] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        before = await worker_step_stats(client, url)

        async def worker(c: int) -> None:
            for k in range(requests_per_client):
                results.append(await one_request(client, url, c * 1000 + k, new_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in range(concurrency)))
        wall = time.perf_counter() - start
        after = await worker_step_stats(client, url)
    gaps = [g for r in results for g in r.gaps]
    ttfts = [r.ttft for r in results]
    steps = after["count"] - before["count"]
    step_s = (after["sum"] - before["sum"]) / steps if steps else float("nan")
    itl_mean = statistics.fmean(gaps) if gaps else float("nan")
    return {
        "concurrency": concurrency, "requests": len(results), "tokens": sum(r.tokens for r in results),
        "wall_s": wall, "throughput_tok_s": sum(r.tokens for r in results) / wall,
        "ttft_median_ms": 1000 * statistics.median(ttfts), "ttft_p90_ms": 1000 * quantile(ttfts, 0.9),
        "itl_median_ms": 1000 * statistics.median(gaps), "itl_p90_ms": 1000 * quantile(gaps, 0.9),
        "itl_mean_ms": 1000 * itl_mean, "worker_decode_step_mean_ms": 1000 * step_s,
        "overhead_per_step_ms": 1000 * (itl_mean - step_s) if concurrency == 1 else None,
    }


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def worker_step_stats(client: httpx.AsyncClient, url: str) -> dict:
    """Sum and count of the worker's own decode step time (forward + sampling), from /metrics."""
    text = (await client.get(f"{url}/metrics")).text
    totals = {"sum": 0.0, "count": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name not in ("specula_batch_forward_duration", "specula_batch_decode_duration"):
            continue
        for sample in family.samples:
            if sample.labels.get("method") != "decode":
                continue
            if sample.name.endswith("_sum"):
                totals["sum"] += sample.value
            elif sample.name.endswith("_count") and family.name == "specula_batch_forward_duration":
                totals["count"] += sample.value
    return totals


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_launcher(model_dir: Path, port: int, tmp: Path, extra: list[str], tree: Path = REPO) -> subprocess.Popen:
    """`specula-launcher` from the source tree `tree` (this one, or a checkout of another commit to compare)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(tree / p) for p in
                                                      ("server", "kernels", "proto", "router", "launcher")))
    cmd = [sys.executable, "-m", "specula_launcher.cli", "--model-id", str(model_dir), "--port", str(port),
           "--hostname", "127.0.0.1", "--shard-uds-path", str(tmp / "shard"), *extra]
    log = open(tmp / "server.log", "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("server did not become healthy")


@contextlib.contextmanager
def served(model_dir: Path, tmp: Path, extra: list[str], tree: Path = REPO) -> Iterator[str]:
    """A launcher serving `model_dir` with the `extra` flags while the block runs; yields its URL once healthy."""
    port = free_port()
    proc = start_launcher(model_dir, port, tmp, extra, tree)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["concurrency"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot(xs, [r["throughput_tok_s"] for r in results], marker="o")
    axes[0].set(title="Throughput", xlabel="concurrent streams", ylabel="generated tokens/s", xscale="log", xticks=xs)
    axes[1].plot(xs, [r["ttft_median_ms"] for r in results], marker="o", label="median")
    axes[1].plot(xs, [r["ttft_p90_ms"] for r in results], marker="o", label="p90")
    axes[1].set(title="Time to first token", xlabel="concurrent streams", ylabel="ms", xscale="log", xticks=xs)
    axes[2].plot(xs, [r["itl_median_ms"] for r in results], marker="o", label="median")
    axes[2].plot(xs, [r["itl_p90_ms"] for r in results], marker="o", label="p90")
    axes[2].set(title="Inter-token latency", xlabel="concurrent streams", ylabel="ms", xscale="log", xticks=xs)
    for ax in axes:
        ax.set_xticklabels([str(x) for x in xs])
        ax.grid(alpha=0.3)
    axes[1].legend()
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="target a running server instead of starting one")
    parser.add_argument("--model-dir", type=Path, help="model to serve (default: a ~125M random Llama)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--launcher-args", default="", help="extra launcher flags, e.g. '--speculative-tokens 3'")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--server-log", type=Path, help="keep the started server's log here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        proc = None
        url = args.url
        if url is None:
            model_dir = args.model_dir
            if model_dir is None:
                from specula_testing.models import BENCHMARK_125M, build_tiny_model

                model_dir = build_tiny_model(tmp / "model", "llama", **BENCHMARK_125M)
            port = free_port()
            extra = ["--max-concurrent-requests", str(4 * max(args.concurrency)), *args.launcher_args.split()]
            proc = start_launcher(model_dir, port, tmp, extra)
            url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc)
            asyncio.run(run_level(url, 1, 1, 8))  # warm up
            results = []
            for c in args.concurrency:
                result = asyncio.run(run_level(url, c, args.requests_per_client, args.new_tokens))
                results.append(result)
                print(json.dumps(result), flush=True)
        finally:
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
            if proc is not None and args.server_log:
                args.server_log.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(tmp / "server.log", args.server_log)
    single = results[0]["throughput_tok_s"] if results[0]["concurrency"] == 1 else None
    print("| concurrency | tokens/s | vs 1 stream | TTFT median ms | ITL median ms | ITL p90 ms |")
    print("|---|---|---|---|---|---|")
    for r in results:
        ratio = f"{r['throughput_tok_s'] / single:.2f}x" if single else "-"
        print(f"| {r['concurrency']} | {r['throughput_tok_s']:.1f} | {ratio} | {r['ttft_median_ms']:.0f} | "
              f"{r['itl_median_ms']:.1f} | {r['itl_p90_ms']:.1f} |")
    if results[0]["overhead_per_step_ms"] is not None:
        r = results[0]
        print(f"router + gRPC overhead per decode step at concurrency 1: {r['overhead_per_step_ms']:.2f} ms "
              f"(client ITL mean {r['itl_mean_ms']:.2f} ms - worker step {r['worker_decode_step_mean_ms']:.2f} ms)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(results, args.plot)


if __name__ == "__main__":
    main()
