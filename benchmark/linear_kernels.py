"""The float products of one decode step, per kernel, side by side: what `DenseLinear` should run.

The 49 products a decoded token costs on the 134M Llama (12 layers of fused q/k/v, o, fused gate/up and down,
and the 32000-row LM head) with random weights far larger than the caches, timed for `--rows` activation rows
(the sequences of a batched step). Variants take turns round by round, the order reversing every round;
reported: the median over rounds of the time for all 49 products.

    column blocks    float32 weights as one column block per thread, a batched GEMM (`specula_kernels.linear`)
    onednn fp32      float32 weights in oneDNN's packed layout (`onednn_pack`, `onednn_linear`)
    onednn fp32 hN   the same, packed for N rows instead of `PACK_ROWS_HINT` (with `--pack-hint N ...`)
    matmul bf16      bfloat16 weights, plain `x @ W^T`
    onednn bf16      bfloat16 weights in oneDNN's packed layout (only where oneDNN has native bfloat16)

With `--quantized`, also the weight-only formats of `--quantize` (int4 in groups of 64), on the native kernels
(`specula_kernels.native`, where they build) and on PyTorch's packed kernels:

    int8 native, int4 native, int8 pytorch, int4 pytorch

    python benchmark/linear_kernels.py --rows 1 8 32 64 --rounds 15
    python benchmark/linear_kernels.py --rows 1 8 32 256 --rounds 7 --quantized
    python benchmark/linear_kernels.py --rows 1 4 8 32 64 --rounds 15 --pack-hint 1 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("kernels",)]

import torch  # noqa: E402

from specula_kernels import native  # noqa: E402
from specula_kernels.linear import (  # noqa: E402
    PACK_ROWS_HINT,
    default_num_parts,
    linear,
    onednn_linear,
    onednn_pack,
    onednn_supports,
    pack_weight,
)
from specula_kernels.quantized_linear import (  # noqa: E402
    KERNEL_DTYPE,
    int4_linear,
    int4_linear_native,
    int8_linear,
    int8_linear_native,
    pack_int4,
    pack_int4_native,
    pack_int8_native,
    quantize_int4,
    quantize_int8,
)

GROUP = 64

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 768, 2048, 12, 32000
SHAPES = [(3 * HIDDEN, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * LAYERS + [
    (VOCAB, HIDDEN)]


def quantized_variants() -> dict[str, tuple[torch.dtype, callable, callable]]:
    out = {}
    lib = native.library()
    if lib is not None:
        out["int8 native"] = (torch.float32, lambda w: pack_int8_native(*quantize_int8(w)),
                              lambda x, p: int8_linear_native(lib, x, *p))
        out["int4 native"] = (torch.float32, lambda w: (pack_int4_native(*quantize_int4(w, GROUP)), w.shape[0]),
                              lambda x, p: int4_linear_native(lib, x, *p[0], GROUP, p[1]))
    else:
        print(f"native kernels unavailable: {native.unavailable_reason()}")

    def int8_pytorch(w):
        q, scale = quantize_int8(w)
        return q, scale.to(KERNEL_DTYPE)

    out["int8 pytorch"] = (torch.float32, int8_pytorch, lambda x, p: int8_linear(x, *p))
    out["int4 pytorch"] = (torch.float32, lambda w: (pack_int4(*quantize_int4(w, GROUP)), w.shape[0]),
                           lambda x, p: int4_linear(x, *p[0], GROUP, p[1]))
    return out


def onednn_pack_for(rows: int):
    return lambda w: torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows)


def variants(quantized: bool = False, pack_hints: list[int] = ()) -> dict[str, tuple[torch.dtype, callable, callable]]:
    """name -> (dtype, pack(weight), product(x, packed))."""
    cpu = torch.device("cpu")
    out = {
        "column blocks fp32": (torch.float32, lambda w: pack_weight(w, default_num_parts(w.shape[0], cpu)), linear),
        "onednn fp32": (torch.float32, onednn_pack, onednn_linear),
        "matmul bf16": (torch.bfloat16, lambda w: w.t().contiguous(), torch.matmul),
    }
    for hint in pack_hints:
        if hint != PACK_ROWS_HINT:
            out[f"onednn fp32 h{hint}"] = (torch.float32, onednn_pack_for(hint), onednn_linear)
    if onednn_supports(torch.bfloat16, cpu):
        out["onednn bf16"] = (torch.bfloat16, onednn_pack, onednn_linear)
    if quantized:
        out.update(quantized_variants())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantized", action="store_true", help="also the int8/int4 weight-only kernels")
    parser.add_argument("--pack-hint", type=int, nargs="*", default=[],
                        help=f"also float32 oneDNN weights packed for these row counts (default {PACK_ROWS_HINT})")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen) * 0.02 for o, i in SHAPES]
    kinds = variants(args.quantized, args.pack_hint)
    packed = {name: [pack(w.to(dtype)) for w in weights] for name, (dtype, pack, _) in kinds.items()}
    results: dict[int, dict[str, float]] = {}
    print(f"{len(SHAPES)} products per token, {args.threads} threads, median of {args.rounds} alternating rounds "
          f"(ms); oneDNN bfloat16 native: {onednn_supports(torch.bfloat16, torch.device('cpu'))}")
    print("| rows | " + " | ".join(kinds) + " |")
    print("|---" * (len(kinds) + 1) + "|")
    for rows in args.rows:
        inputs = {dtype: {i: torch.randn(rows, i, generator=gen).to(dtype) for _, i in SHAPES}
                  for dtype in {d for d, _, _ in kinds.values()}}
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for round_index in range(args.rounds + 2):  # two warm-up rounds
            order = list(kinds) if round_index % 2 == 0 else list(kinds)[::-1]
            for name in order:
                dtype, _, product = kinds[name]
                xs = inputs[dtype]
                start = time.perf_counter()
                for (_, i), p in zip(SHAPES, packed[name]):
                    product(xs[i], p)
                if round_index >= 2:
                    times[name].append((time.perf_counter() - start) * 1e3)
        results[rows] = {name: statistics.median(t) for name, t in times.items()}
        print(f"| {rows} | " + " | ".join(f"{results[rows][n]:.1f}" for n in kinds) + " |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "rounds": args.rounds, "ms": results}, indent=2))


if __name__ == "__main__":
    main()
