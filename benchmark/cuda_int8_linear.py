"""`--quantize int8` products on CUDA: the Triton kernel against PyTorch's int8 kernel and the bfloat16 product.

Each product runs inside a CUDA graph of `--calls` back-to-back calls (as the worker's decode step replays them,
so launch costs do not count), replayed `--repeats` times; the median replay gives microseconds per call and the
weight bytes read per second. Shapes are a Llama layer's products (fused QKV, output, gate/up, down) and an LM
head, at the batch rows of a decode step.

    python benchmark/cuda_int8_linear.py [--hidden 2048 --intermediate 8192 --vocab 32000] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from specula_kernels.quantized_linear import int8_linear, quantize_int8
from specula_kernels.triton_int8_linear import int8_linear_triton, tiling


def time_call(fn, calls: int, repeats: int) -> float:
    """Median microseconds per call of `fn` (no arguments) replayed in a CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--kv-hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    h = args.hidden
    shapes = {"qkv": (h + 2 * args.kv_hidden, h), "o": (h, h), "gate_up": (2 * args.intermediate, h),
              "down": (h, args.intermediate), "lm_head": (args.vocab, h)}
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print("| product | rows | bfloat16 us | aten int8 us | Triton int8 us, unsplit | Triton int8 us (split) | "
          "Triton/aten | Triton/bf16 | Triton GB/s |\n|---|---|---|---|---|---|---|---|---|")
    results = []
    for name, (out_features, in_features) in shapes.items():
        weight = torch.randn(out_features, in_features, device=device) / in_features**0.5
        q, scale = quantize_int8(weight)
        scale16 = scale.to(torch.bfloat16)
        w16 = weight.to(torch.bfloat16)
        for rows in args.rows:
            x = torch.randn(rows, in_features, device=device, dtype=torch.bfloat16)
            torch.testing.assert_close(int8_linear_triton(x, q, scale16).float(), int8_linear(x, q, scale16).float(),
                                       rtol=2e-2, atol=2e-2)
            bf16 = time_call(lambda: F.linear(x, w16), args.calls, args.repeats)  # noqa: B023
            aten = time_call(lambda: int8_linear(x, q, scale16), args.calls, args.repeats)  # noqa: B023
            unsplit = time_call(lambda: int8_linear_triton(x, q, scale16, split_k=1),  # noqa: B023
                                args.calls, args.repeats)
            triton = time_call(lambda: int8_linear_triton(x, q, scale16), args.calls, args.repeats)  # noqa: B023
            split = tiling(rows, out_features, in_features, device)[2]
            gbps = q.numel() / triton / 1e3
            results.append(dict(product=name, rows=rows, out=out_features, inputs=in_features, bf16_us=bf16,
                                aten_int8_us=aten, triton_int8_unsplit_us=unsplit, triton_int8_us=triton,
                                split_k=split, triton_gb_per_s=gbps))
            print(f"| {name} {out_features}x{in_features} | {rows} | {bf16:.1f} | {aten:.1f} | {unsplit:.1f} | "
                  f"{triton:.1f} ({split}) | {triton / aten:.2f} | {triton / bf16:.2f} | {gbps:.0f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, results=results), f,
                      indent=1)


if __name__ == "__main__":
    main()
