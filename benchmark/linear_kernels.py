"""The float products of one decode step, per kernel, side by side: what `DenseLinear` should run.

The products a decoded token costs, with random weights far larger than the caches, timed for `--rows` activation
rows (the sequences of a batched step, or a prompt's tokens). `--model 134m`: the 134M Llama's 49 (12 layers of
fused q/k/v, o, fused gate/up and down, and the 32000-row LM head); `--model smollm2`: SmolLM2-135M's 121 (30
layers of hidden 576 with 3 KV heads of 64, intermediate 1536, the 49152-row LM head). Variants take turns round by
round, the order reversing every round; reported: the median over rounds of the time for all the products.

    panels fp32      float32 weights in Specula's panel layout on the native kernels (`pack_panels`, `panel_linear`)
    column blocks    float32 weights as one column block per thread, a batched GEMM (`specula_kernels.linear`)
    onednn fp32      float32 weights in oneDNN's packed layout (`onednn_pack`, `onednn_linear`)
    onednn fp32 hN   the same, packed for N rows instead of `PACK_ROWS_HINT` (with `--pack-hint N ...`)
    matmul bf16      bfloat16 weights, plain `x @ W^T`
    onednn bf16      bfloat16 weights in oneDNN's packed layout (only where oneDNN has native bfloat16)

With `--quantized`, also the weight-only formats of `--quantize` (int4 in groups of 64), on the native kernels
(`specula_kernels.native`, where they build) and on PyTorch's packed kernels:

    int8 native, int4 native, w8a8 native (int8 weights by int8 activations), q4_1 native (GGUF's Q4_1 blocks,
    quantized by the `gguf` package, as `--quantize gguf` serves them), int8 pytorch, int4 pytorch

    python benchmark/linear_kernels.py --rows 1 8 32 64 --rounds 15
    python benchmark/linear_kernels.py --rows 1 8 32 256 --rounds 7 --quantized
    python benchmark/linear_kernels.py --rows 1 4 8 32 64 --rounds 15 --pack-hint 1 64
    python benchmark/linear_kernels.py --model smollm2 --rows 1 4 8 32 64 350 --rounds 9

With `--baseline-tree DIR`, also the native kernels (float32 panels, int8, int4, w8a8, Q4_1) built from another
checkout's sources, taking turns with this tree's on the same weights (a change to `csrc/` measured in one
process):

    git worktree add /tmp/before HEAD~1
    python benchmark/linear_kernels.py --model smollm2 --rows 1 8 32 --variants "panels fp32" \
        "panels fp32 (baseline)" --baseline-tree /tmp/before
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
from specula_kernels.gguf_blocks import GGUFBlocks, gguf_linear_native  # noqa: E402
from specula_kernels.linear import (  # noqa: E402
    PACK_ROWS_HINT,
    default_num_parts,
    linear,
    onednn_linear,
    onednn_pack,
    onednn_supports,
    pack_panels,
    pack_weight,
    panel_linear,
    panels_supported,
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
    pack_w8a8_native,
    quantize_int4,
    quantize_int8,
    w8a8_linear_native,
)

GROUP = 64



def model_shapes(hidden: int, kv_width: int, intermediate: int, layers: int, vocab: int) -> list[tuple[int, int]]:
    """(out, in) of every product of one decoded token."""
    layer = [(hidden + 2 * kv_width, hidden), (hidden, hidden), (2 * intermediate, hidden), (hidden, intermediate)]
    return layer * layers + [(vocab, hidden)]


MODELS = {"134m": model_shapes(768, 768, 2048, 12, 32000), "smollm2": model_shapes(576, 192, 1536, 30, 49152)}
SHAPES = MODELS["134m"]


def pack_gguf(w: torch.Tensor, type_name: str, lanes: int) -> tuple[torch.Tensor, int]:
    """`w` quantized to a GGUF block type by the `gguf` package, packed for the native kernel."""
    from gguf import GGMLQuantizationType, quants

    data = quants.quantize(w.numpy(), GGMLQuantizationType[type_name])
    return GGUFBlocks(type_name, torch.from_numpy(data), w.shape[1]).pack_native(lanes), w.shape[0]


def quantized_variants() -> dict[str, tuple[torch.dtype, callable, callable]]:
    out = {}
    lib = native.library()
    if lib is not None:
        lanes = lib.specula_vector_lanes()
        out["int8 native"] = (torch.float32, lambda w: (pack_int8_native(*quantize_int8(w), lanes), w.shape[0]),
                              lambda x, p: int8_linear_native(lib, x, *p))
        out["int4 native"] = (torch.float32, lambda w: (pack_int4_native(*quantize_int4(w, GROUP), lanes), w.shape[0]),
                              lambda x, p: int4_linear_native(lib, x, p[0], GROUP, p[1]))
        out["w8a8 native"] = (torch.float32, lambda w: (pack_w8a8_native(*quantize_int8(w)), w.shape[0]),
                              lambda x, p: w8a8_linear_native(lib, x, *p))
        out["q4_1 native"] = (torch.float32, lambda w: pack_gguf(w, "Q4_1", lanes),
                              lambda x, p: gguf_linear_native(lib, x, "Q4_1", *p))
    else:
        print(f"native kernels unavailable: {native.unavailable_reason()}")

    def int8_pytorch(w):
        q, scale = quantize_int8(w)
        return q, scale.to(KERNEL_DTYPE)

    out["int8 pytorch"] = (torch.float32, int8_pytorch, lambda x, p: int8_linear(x, *p))
    out["int4 pytorch"] = (torch.float32, lambda w: (pack_int4(*quantize_int4(w, GROUP)), w.shape[0]),
                           lambda x, p: int4_linear(x, *p[0], GROUP, p[1]))
    return out


def baseline_variant(tree: Path) -> dict[str, tuple[torch.dtype, callable, callable]]:
    """`panels fp32 (baseline)`, `int8 native (baseline)`, `int4 native (baseline)` and `w8a8 native (baseline)`: the
    native kernels compiled
    from another checkout's sources (`tree`, e.g. a `git worktree` of the commit before a change to `csrc/`), taking
    turns with this tree's in one process, on the same packed weights."""
    lib = native.load_from(tree / "kernels" / "specula_kernels" / "csrc")

    def product(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:  # `panel_linear` on the other library
        own, native._library = native._library, lib
        try:
            return panel_linear(x, panels, panels.shape[0] * panels.shape[2])
        finally:
            native._library = own

    return {"panels fp32 (baseline)": (torch.float32, pack_panels, product),
            "int8 native (baseline)": (torch.float32, None, lambda x, p: int8_linear_native(lib, x, *p)),
            "int4 native (baseline)": (torch.float32, None, lambda x, p: int4_linear_native(lib, x, p[0], GROUP, p[1])),
            "w8a8 native (baseline)": (torch.float32, None, lambda x, p: w8a8_linear_native(lib, x, *p)),
            "q4_1 native (baseline)": (torch.float32, None, lambda x, p: gguf_linear_native(lib, x, "Q4_1", *p))}


def onednn_pack_for(rows: int):
    return lambda w: torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows)


def variants(quantized: bool = False, pack_hints: list[int] = ()) -> dict[str, tuple[torch.dtype, callable, callable]]:
    """name -> (dtype, pack(weight), product(x, packed))."""
    cpu = torch.device("cpu")
    out = {}
    if panels_supported(torch.float32, cpu):
        out["panels fp32"] = (torch.float32, pack_panels, lambda x, p: panel_linear(x, p, p.shape[0] * p.shape[2]))
    out |= {
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
    parser.add_argument("--model", choices=sorted(MODELS), default="134m")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantized", action="store_true", help="also the int8/int4 weight-only kernels")
    parser.add_argument("--pack-hint", type=int, nargs="*", default=[],
                        help=f"also float32 oneDNN weights packed for these row counts (default {PACK_ROWS_HINT})")
    parser.add_argument("--variants", nargs="+", help="only these variants (names as in the table's header)")
    parser.add_argument("--baseline-tree", type=Path, help="also `panels fp32 (baseline)`, `int8 native (baseline)`, "
                        "`int4 native (baseline)` and `w8a8 native (baseline)`: the native kernels built from this "
                        "checkout's sources (a "
                        "change to them measured in one process)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    global SHAPES
    SHAPES = MODELS[args.model]
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen) * 0.02 for o, i in SHAPES]
    kinds = variants(args.quantized, args.pack_hint)
    if args.baseline_tree:
        kinds |= baseline_variant(args.baseline_tree)
    if args.variants:
        kinds = {name: kind for name, kind in kinds.items() if name in args.variants}
    # A baseline multiplies its variant's tensors: two copies of the weights read at different speeds.
    twins = {f"{name} (baseline)": name
             for name in ("panels fp32", "int8 native", "int4 native", "w8a8 native", "q4_1 native")}
    packed = {name: [pack(w.to(dtype)) for w in weights] for name, (dtype, pack, _) in kinds.items()
              if name not in twins}
    for baseline, twin in twins.items():
        if baseline in kinds:
            if twin not in packed:  # the twin not timed itself: its packing alone
                dtype, pack, _ = variants(True)[twin]
                packed[twin] = [pack(w.to(dtype)) for w in weights]
            packed[baseline] = packed[twin]
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
