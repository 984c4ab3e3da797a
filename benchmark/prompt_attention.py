"""A prompt's causal attention on CPU, float32: the native prompt kernel against PyTorch's SDPA path, taking turns.

Two measurements, each path in turn round by round (the order reversing every round), medians over rounds:

    kernel   one layer's attention of a `--prompt-tokens` prompt alone (SmolLM2-135M's heads: 9 over 3 KV heads of
             64; keys and values scattered over the cache as a block table leaves them), through `paged_attention`
    prefill  the step that prefills the prompt in the worker on the real model (`--model`: SmolLM2-135M-Instruct
             by default), float32, every layer's attention on one path or the other

    python benchmark/prompt_attention.py --prompt-tokens 350 --rounds 6
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from decode_profile import REAL_MODEL, prefill_seconds, synthetic_prompt  # noqa: E402

from specula_kernels import paged_attention as attention  # noqa: E402
from specula_testing.worker import load_test_generator  # noqa: E402

PATHS = ("native", "sdpa")
NATIVE_PROMPTS = attention._native_prompts


def on_path(path: str) -> None:
    """Routes prompts to the native prompt kernel (as served) or to SDPA (the kernel turned down)."""
    attention._native_prompts = NATIVE_PROMPTS if path == "native" else (lambda query, inputs: None)


def kernel_inputs(tokens: int, gen: torch.Generator):
    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    num_blocks = 2 * (tokens + block - 1) // block
    order = torch.randperm(num_blocks, generator=gen)[: (tokens + block - 1) // block]
    slots = (order.unsqueeze(1) * block + torch.arange(block)).flatten()[:tokens]
    cache = [torch.randn(num_blocks * block, kv_heads, head_dim, generator=gen) for _ in range(2)]
    mask = (torch.arange(tokens).unsqueeze(0) <= torch.arange(tokens).unsqueeze(1)).view(1, 1, tokens, tokens)
    inputs = attention.PagedAttentionInputs(slots, slots.unsqueeze(0), torch.arange(tokens).unsqueeze(0),
                                            torch.ones(1, tokens, dtype=torch.bool), mask)
    return torch.randn(tokens, heads, head_dim, generator=gen), *cache, inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REAL_MODEL, help="GGUF file or model directory")
    parser.add_argument("--prompt-tokens", type=int, default=350)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    query, keys, values, inputs = kernel_inputs(args.prompt_tokens, torch.Generator().manual_seed(0))
    generator = load_test_generator(args.model, num_blocks=-(-args.prompt_tokens // 16) + 4, dtype="float32")
    prompt = synthetic_prompt(args.prompt_tokens)
    kernel, prefill = {path: [] for path in PATHS}, {path: [] for path in PATHS}
    outs = {}
    for r in range(args.rounds):
        for path in PATHS if r % 2 == 0 else PATHS[::-1]:
            on_path(path)
            inputs.workspace.clear()
            outs[path] = attention.paged_attention(query, keys, values, inputs, 0.125)
            start = time.perf_counter()
            for _ in range(20):
                inputs.workspace.clear()
                attention.paged_attention(query, keys, values, inputs, 0.125)
            kernel[path].append((time.perf_counter() - start) / 20)
            prefill[path] += prefill_seconds(generator, prompt, rounds=2)
    on_path("native")
    difference = (outs["native"] - outs["sdpa"]).abs().max().item()
    print(f"{args.model.name}, float32, a {args.prompt_tokens}-token prompt, {args.threads} threads, "
          f"medians of {args.rounds} rounds (largest difference between the paths' outputs: {difference:.1e})\n"
          "| path | one layer's attention, ms | prefill step, ms |\n|---|---|---|")
    for path in PATHS:
        layer_ms, prefill_ms = statistics.median(kernel[path]) * 1e3, statistics.median(prefill[path]) * 1e3
        print(f"| {path} | {layer_ms:.2f} | {prefill_ms:.0f} |")
    print(f"| native / sdpa | {statistics.median(kernel['native']) / statistics.median(kernel['sdpa']):.2f} | "
          f"{statistics.median(prefill['native']) / statistics.median(prefill['sdpa']):.2f} |")


if __name__ == "__main__":
    main()
