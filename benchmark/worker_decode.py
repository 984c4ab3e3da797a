"""Single-stream decode speed of the Specula worker against transformers `generate()`, side by side.

Builds a Llama-shaped model with random weights (about 125M parameters by default, in the exact Hugging Face
layout), then alternates rounds of transformers greedy `generate()` and the worker's prefill + decode loop on
the same weights, prompt and thread count. Reports median tokens/s of each, their ratio, and the
memory-bandwidth floor: every decode step must stream every weight once, so `bandwidth / weight bytes` is the
most tokens/s any implementation can reach on this machine at this dtype.

    python benchmark/worker_decode.py                 # 125M, fp32, CPU, 2 threads, 128 new tokens, 5 rounds
    python benchmark/worker_decode.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("server", "kernels", "proto", "testing")]

import torch  # noqa: E402

from specula_testing.models import BENCHMARK_125M, build_tiny_model  # noqa: E402
from specula_testing.worker import (  # noqa: E402
    BlockPool,
    generate_alone,
    load_test_generator,
    make_spec,
    token_ids,
)


def measure_bandwidth(device: torch.device, num_bytes: int = 1 << 30, repeats: int = 9) -> float:
    """Peak read bandwidth in bytes/s: fastest sum of a tensor far larger than any cache.

    The fastest run, not the median: the floor is a physical limit, and slower runs only measure noise.

    Random data, not a constant: identical pages may be deduplicated by the host and read faster than memory.
    """
    data = torch.randn(num_bytes // 4, dtype=torch.float32, device=device)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        data.sum()
        sync(device)
        times.append(time.perf_counter() - start)
    return num_bytes / min(times)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes a decode step must read: every weight, except that the embedding table contributes one row."""
    total = 0
    for name, p in model.named_parameters():
        total += p.shape[-1] * p.element_size() if "embed_tokens" in name else p.numel() * p.element_size()
    return total


def time_transformers(model, prompt: list[int], num_new: int, device: torch.device) -> tuple[float, list[int]]:
    ids = torch.tensor([prompt], device=device)
    sync(device)
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False)
    sync(device)
    return time.perf_counter() - start, out[0, len(prompt):].tolist()


def time_worker(generator, prompt: list[int], num_new: int, device: torch.device) -> tuple[float, list[int]]:
    spec = make_spec(0, prompt, BlockPool(generator.kv_cache.num_blocks, generator.block_size),
                     max_new_tokens=num_new)
    sync(device)
    start = time.perf_counter()
    outputs = generate_alone(generator, spec)
    sync(device)
    return time.perf_counter() - start, token_ids(outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="existing model directory (default: build a 125M model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    import transformers

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or build_tiny_model(Path(tmp) / "model", "llama", **BENCHMARK_125M)
        dtype = getattr(torch, args.dtype)
        reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        num_blocks = -(-(args.prompt_tokens + args.new_tokens) // 16)
        generator = load_test_generator(model_dir, num_blocks=num_blocks, dtype=args.dtype)
        if device.type != generator.device.type:
            raise SystemExit("the worker test loader runs on CPU; pass --model-dir and use the server for CUDA")

        prompt = [1] + [(7 * i) % 400 + 3 for i in range(args.prompt_tokens - 1)]
        num_params = sum(p.numel() for p in reference.parameters())
        time_transformers(reference, prompt, 8, device)  # warm both paths up
        time_worker(generator, prompt, 8, device)
        hf_rates, worker_rates, same_tokens = [], [], True
        with torch.inference_mode():
            for _ in range(args.rounds):
                hf_time, hf_tokens = time_transformers(reference, prompt, args.new_tokens, device)
                worker_time, worker_tokens = time_worker(generator, prompt, args.new_tokens, device)
                hf_rates.append(args.new_tokens / hf_time)
                worker_rates.append(args.new_tokens / worker_time)
                same_tokens &= hf_tokens == worker_tokens

        bandwidth = measure_bandwidth(device)
        per_token = weight_bytes_per_token(reference)
        floor = bandwidth / per_token
        result = {
            "params_m": round(num_params / 1e6, 1), "dtype": args.dtype, "device": args.device,
            "threads": args.threads, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
            "rounds": args.rounds, "transformers_tok_s": statistics.median(hf_rates),
            "worker_tok_s": statistics.median(worker_rates), "bandwidth_gb_s": bandwidth / 1e9,
            "weight_mb_per_token": per_token / 1e6, "floor_tok_s": floor, "same_tokens": same_tokens,
        }
        result["speedup"] = result["worker_tok_s"] / result["transformers_tok_s"]

    print(f"model {result['params_m']}M params, {args.dtype}, {args.device}, {args.threads} threads, "
          f"{args.prompt_tokens} prompt + {args.new_tokens} new tokens, median of {args.rounds} alternating rounds")
    print("| implementation | tokens/s | of bandwidth floor |\n|---|---|---|")
    for name, key in (("transformers generate()", "transformers_tok_s"), ("specula worker", "worker_tok_s")):
        print(f"| {name} | {result[key]:.1f} | {result[key] / floor:.0%} |")
    print(f"speedup {result['speedup']:.2f}x; floor {floor:.1f} tok/s = {result['bandwidth_gb_s']:.1f} GB/s read "
          f"/ {result['weight_mb_per_token']:.0f} MB of weights per token; identical tokens: {same_tokens}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
