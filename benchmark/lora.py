"""Multi-LoRA batching, side by side: one batch on the base model vs the same batch spread over N adapters.

Builds a Llama-shaped model with random weights (default: the 134M-parameter benchmark shape) and N random
PEFT LoRA adapters (rank 16 on all seven projections by default), then decodes a batch of B requests:

- `base`: every request on the base model;
- `mixed`: request i uses adapter i mod N (so a step runs N adapters and the batch has N segments per
  projection), the case LoRAX users report at half the base throughput.

Rounds alternate between the two in one process, the order swapping each round; reported: median generated
tokens/s of the decode steps and the median over rounds of each round's mixed / base (a paired ratio, so a
round in which the machine ran fast or slow counts as one round, not as a shift of either median).

    python benchmark/lora.py --adapters 8 --batch 32 --rounds 5 --json benchmark/results/lora.json
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

from specula_server.request import StepPlan  # noqa: E402
from specula_testing.adapters import ALL_PROJECTIONS, build_lora_adapter  # noqa: E402
from specula_testing.models import BENCHMARK_125M, build_tiny_model  # noqa: E402
from specula_testing.worker import BlockPool, load_test_generator, make_spec  # noqa: E402


def decode_rate(generator, adapter_ids: list[str], prompt_len: int, new_tokens: int, seed: int) -> float:
    """Prefills the batch, then times its decode steps; returns generated tokens/s over the decode steps."""
    pool = BlockPool(generator.kv_cache.num_blocks, generator.block_size)
    gen = torch.Generator().manual_seed(seed)
    specs = [make_spec(i, [1] + torch.randint(3, 500, (prompt_len - 1,), generator=gen).tolist(), pool,
                       max_new_tokens=new_tokens, adapter_id=a) for i, a in enumerate(adapter_ids)]
    generator.step(StepPlan(new=specs))
    tokens, start = 0, time.perf_counter()
    while generator.requests:  # finished requests leave on their own
        result = generator.step(StepPlan())
        tokens += sum(len(o.tokens) for o in result.outputs)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="model to use (default: a random 134M Llama)")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", nargs="+", default=list(ALL_PROJECTIONS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA by default")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or build_tiny_model(Path(tmp) / "model", "llama", **BENCHMARK_125M)
        root = Path(tmp) / "adapters"
        names = [f"adapter{i}" for i in range(args.adapters)]
        for i, name in enumerate(names):
            build_lora_adapter(model_dir, root / name, rank=args.rank, alpha=2 * args.rank,
                               target_modules=args.targets, seed=i, std=0.01)
        blocks = args.batch * -(-(args.prompt_tokens + args.new_tokens) // 16) + 8
        generator = load_test_generator(model_dir, num_blocks=blocks, dtype=dtype, device=args.device,
                                        adapter_dirs=(root,), max_active_adapters=max(args.adapters, 1))
        for name in names:
            generator.adapters.load(name, "local")
        batches = {"base": [""] * args.batch, "mixed": [names[i % len(names)] for i in range(args.batch)]}
        decode_rate(generator, batches["mixed"], args.prompt_tokens, 4, seed=0)  # warm up both paths
        decode_rate(generator, batches["base"], args.prompt_tokens, 4, seed=0)
        samples: dict[str, list[float]] = {k: [] for k in batches}
        for r in range(args.rounds):
            order = list(batches) if r % 2 == 0 else list(batches)[::-1]
            for name in order:
                samples[name].append(decode_rate(generator, batches[name], args.prompt_tokens, args.new_tokens, r))
            print(json.dumps({"round": r, **{k: round(v[-1], 1) for k, v in samples.items()}}), flush=True)

    base, mixed = statistics.median(samples["base"]), statistics.median(samples["mixed"])
    ratios = [m / b for m, b in zip(samples["mixed"], samples["base"])]
    ratio = statistics.median(ratios)
    summary = {"adapters": args.adapters, "rank": args.rank, "targets": args.targets, "batch": args.batch,
               "device": args.device, "dtype": dtype, "threads": args.threads, "rounds": args.rounds,
               "base_tok_s": base, "mixed_tok_s": mixed, "ratio": ratio, "round_ratios": ratios,
               "samples": samples}
    print(f"batch {args.batch}, {args.adapters} adapters of rank {args.rank} on {len(args.targets)} projections: "
          f"base {base:.1f} tok/s, mixed {mixed:.1f} tok/s, ratio {ratio:.3f} "
          f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
