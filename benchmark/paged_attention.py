"""Decode attention over the paged KV cache, per path, side by side: what `paged_attention` should run.

One decode step's attention for the 134M Llama's 12 layers (12 heads of 64, float32 cache): `--seqs` sequences,
each one query row over `--context` cached positions scattered over the cache's blocks (16 slots each, in
shuffled order as a long-running server's are), the contexts `--spread` apart in length. Paths take turns round
by round, the order reversing every round; reported: the median over rounds of the time for 12 layers (ms).

    native     `csrc/paged_attention.cpp`: keys and values read where they lie in the cache
    pytorch    the context gathered into a reused dense buffer, then `scaled_dot_product_attention`

    python benchmark/paged_attention.py --seqs 1 8 32 64 --context 64 256 1024
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("kernels", "server", "proto")]

import torch  # noqa: E402

from specula_kernels import native  # noqa: E402
from specula_kernels import paged_attention as attention  # noqa: E402
from specula_server.batch import _causal_mask, _padded_slots  # noqa: E402

LAYERS, HEADS, HEAD_DIM, BLOCK = 12, 12, 64, 16


def decode_inputs(seqs: int, context: int, spread: int, num_blocks: int, gen: torch.Generator):
    order = torch.randperm(num_blocks, generator=gen)
    lengths = [max(1, context - spread * i // max(1, seqs - 1)) for i in range(seqs)]
    tables, used = [], 0
    for n in lengths:
        blocks = order[used : used + (n + BLOCK - 1) // BLOCK]
        used += len(blocks)
        tables.append((blocks.unsqueeze(1) * BLOCK + torch.arange(BLOCK)).flatten()[:n])
    context_slots = _padded_slots(tables)
    starts = [n - 1 for n in lengths]
    rows = torch.arange(seqs)
    return attention.PagedAttentionInputs(context_slots[rows, torch.tensor(starts)], context_slots,
                                          rows.unsqueeze(1), torch.ones(seqs, 1, dtype=torch.bool),
                                          _causal_mask(starts, [1] * seqs, context_slots.shape[1], torch.device("cpu")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--spread", type=int, default=32, help="longest minus shortest context of a step")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if native.library() is None:
        raise SystemExit(f"native kernels unavailable: {native.unavailable_reason()}")
    original = attention._native_library
    paths = {"native": original, "pytorch": lambda *a: None}
    gen = torch.Generator().manual_seed(0)
    print(f"{LAYERS} layers x {HEADS} heads of {HEAD_DIM}, float32, {args.threads} threads, median of {args.rounds} "
          "alternating rounds (ms)")
    print("| sequences | context | native | pytorch | pytorch / native |")
    print("|---|---|---|---|---|")
    for seqs in args.seqs:
        for context in args.context:
            num_blocks = seqs * ((context + BLOCK - 1) // BLOCK) + 8
            caches = [(torch.randn(num_blocks * BLOCK, HEADS, HEAD_DIM, generator=gen),
                       torch.randn(num_blocks * BLOCK, HEADS, HEAD_DIM, generator=gen)) for _ in range(LAYERS)]
            inputs = decode_inputs(seqs, context, min(args.spread, context - 1), num_blocks, gen)
            query = torch.randn(seqs, HEADS, HEAD_DIM, generator=gen)
            times = {name: [] for name in paths}
            for round_index in range(args.rounds + 2):  # two warm-up rounds
                for name in (list(paths) if round_index % 2 == 0 else list(paths)[::-1]):
                    attention._native_library = paths[name]
                    inputs.workspace.clear()  # the gather's buffers, allocated by each step's first layer
                    start = time.perf_counter()
                    for k_cache, v_cache in caches:
                        attention.paged_attention(query, k_cache, v_cache, inputs, HEAD_DIM**-0.5)
                    if round_index >= 2:
                        times[name].append((time.perf_counter() - start) * 1e3)
            attention._native_library = original
            native_ms, pytorch_ms = (statistics.median(times[n]) for n in ("native", "pytorch"))
            print(f"| {seqs} | {context} | {native_ms:.2f} | {pytorch_ms:.2f} | {pytorch_ms / native_ms:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
