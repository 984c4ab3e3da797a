"""Quantization (`--quantize`), side by side: float32 vs int8 vs w8a8 vs int4, speed and accuracy.

`decode`: single-stream greedy decode in the worker (prefill + decode steps over the paged KV cache) on a
Llama-shaped model with random weights (134M parameters with the 32000-token vocabulary, as
`worker_decode.py`), one generator per variant on the same weights, prompt and threads, taking turns round by
round. Reports median tokens/s, the ratio to float32, and each variant's own memory-bandwidth floor: a decode
step reads every linear weight, norm and scale once (the embedding table one row), so `peak read bandwidth /
those bytes` is the most tokens/s any implementation of that format can reach here.

`accuracy`: the bundled demo model on held-out standard-library code (files it never saw in training):
perplexity over the first `--windows` windows of `--window-tokens` tokens (every token after a window's first
scored from the prompt log-probabilities of one prefill), and greedy agreement with float32: how many of the
first `--agreement-tokens` tokens after a held-out code prompt are identical, up to the first difference.

`accuracy --real-model`: the same on SmolLM2-135M-Instruct's Q4_1 GGUF (`specula_testing.real_model`, dequantized to
float32 as served), with int4 at groups of 64 and of 32 (the file's own group), perplexity reported separately
on an English passage written for the tests (`server/tests/data/held_out_english.txt`, one window) and on the
held-out standard-library code.

    python benchmark/quantization.py decode --rounds 5 --pytorch-kernels
    python benchmark/quantization.py accuracy
    python benchmark/quantization.py accuracy --real-model --window-tokens 384 --windows 8
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("server", "kernels", "proto", "testing")]

import torch  # noqa: E402
from worker_decode import measure_bandwidth, time_worker  # noqa: E402

from specula_server.request import StepPlan  # noqa: E402
from specula_testing import code_corpus  # noqa: E402
from specula_testing.models import BENCHMARK_125M, build_tiny_model  # noqa: E402
from specula_testing.worker import (  # noqa: E402
    BlockPool,
    generate_alone,
    load_test_generator,
    make_spec,
    token_ids,
)

DEMO_MODEL = REPO / "launcher" / "specula_launcher" / "demo_model"


def variants(group_size: int, bfloat16: bool = False) -> dict[str, dict]:
    out = {"float32": {}, "int8": {"quantize": "int8"}, "w8a8": {"quantize": "w8a8"},
           "int4": {"quantize": "int4", "quantize_group_size": group_size}}
    if bfloat16:  # the whole model in bfloat16 (weights, activations, KV cache), not quantized
        out["bfloat16"] = {"dtype": "bfloat16"}
    return out


def bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes a decode step must read: linear weights (and their scales), norms, one embedding row."""
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if "rotary" in name:  # position tables: one row per token
            continue
        total += t.shape[-1] * t.element_size() if "embed_tokens" in name else t.numel() * t.element_size()
    return total


def run_decode(args) -> dict:
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or build_tiny_model(Path(tmp) / "model", "llama", **BENCHMARK_125M)
        num_blocks = -(-(args.prompt_tokens + args.new_tokens) // 16)
        generators = {name: load_test_generator(model_dir, num_blocks=num_blocks, **settings)
                      for name, settings in variants(args.group_size, args.bfloat16).items()}
        if args.pytorch_kernels:  # the quantized formats again, on PyTorch's packed kernels
            from unittest import mock

            from specula_server.layers import quantization
            with mock.patch.object(quantization, "_native_kernels", lambda device: None):
                for name, settings in variants(args.group_size).items():
                    if settings and name != "w8a8":  # w8a8 has no PyTorch kernel (its definition: slow)
                        generators[f"{name}, PyTorch kernels"] = load_test_generator(
                            model_dir, num_blocks=num_blocks, **settings)
        prompt = [1] + [(7 * i) % 400 + 3 for i in range(args.prompt_tokens - 1)]
        device = torch.device("cpu")
        for generator in generators.values():  # warm every path up
            time_worker(generator, prompt, 8, device)
        rates: dict[str, list[float]] = {name: [] for name in generators}
        with torch.inference_mode():
            for round_index in range(args.rounds):
                order = list(generators) if round_index % 2 == 0 else list(generators)[::-1]
                for name in order:
                    seconds, _ = time_worker(generators[name], prompt, args.new_tokens, device)
                    rates[name].append(args.new_tokens / seconds)
        bandwidth = measure_bandwidth(device)
        result = {"threads": args.threads, "rounds": args.rounds, "prompt_tokens": args.prompt_tokens,
                  "new_tokens": args.new_tokens, "group_size": args.group_size, "bandwidth_gb_s": bandwidth / 1e9,
                  "variants": {}}
        for name, generator in generators.items():
            weight_bytes = bytes_per_token(generator.model)
            tok_s = statistics.median(rates[name])
            result["variants"][name] = {"tok_s": tok_s, "rounds_tok_s": rates[name], "mb_per_token": weight_bytes / 1e6,
                                        "floor_tok_s": bandwidth / weight_bytes}
    base = result["variants"]["float32"]["tok_s"]
    print(f"{args.threads} threads, {args.prompt_tokens} prompt + {args.new_tokens} new tokens, median of "
          f"{args.rounds} alternating rounds; read bandwidth {result['bandwidth_gb_s']:.1f} GB/s")
    print("| weights | tokens/s | vs float32 | MB read per token | floor tok/s | of floor |\n|---|---|---|---|---|---|")
    for name, v in result["variants"].items():
        print(f"| {name} | {v['tok_s']:.1f} | {v['tok_s'] / base:.2f}x | {v['mb_per_token']:.0f} | "
              f"{v['floor_tok_s']:.0f} | {v['tok_s'] / v['floor_tok_s']:.0%} |")
    return result


def held_out_windows(tokenizer, count: int, length: int) -> list[list[int]]:
    """The first `count` non-overlapping `length`-token windows of the held-out files, in a fixed order."""
    windows = []
    for text in code_corpus.read_sources(code_corpus.source_files(held_out=True)):
        ids = tokenizer.encode(text).ids
        windows.extend(ids[i : i + length] for i in range(0, len(ids) - length + 1, length))
        if len(windows) >= count:
            return windows[:count]
    return windows


def perplexity(generator, windows: list[list[int]]) -> float:
    pool = BlockPool(generator.kv_cache.num_blocks, generator.block_size)
    total, count = 0.0, 0
    for i, window in enumerate(windows):
        spec = make_spec(i, window, pool, max_new_tokens=1, prefill_logprobs=True)
        (out,) = generator.step(StepPlan(new=[spec])).outputs  # one token: it finishes in this step
        if out.error:
            raise RuntimeError(out.error)
        scored = [t.logprob for t in out.prefill_tokens[1:]]
        total, count = total - sum(scored), count + len(scored)
        generator.reset()
        pool.give(spec.blocks)
    return math.exp(total / count)


def greedy_tokens(generator, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    pool = BlockPool(generator.kv_cache.num_blocks, generator.block_size)
    results = []
    for i, prompt in enumerate(prompts):
        spec = make_spec(i, prompt, pool, max_new_tokens=num_new)
        results.append(token_ids(generate_alone(generator, spec)))
        pool.give(spec.blocks)
    return results


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_accuracy(args) -> dict:
    from tokenizers import Tokenizer

    torch.set_num_threads(args.threads)
    if args.real_model:
        from specula_server.hub import resolve_model_dir
        from specula_testing.real_model import fetch_smollm2

        model_id = fetch_smollm2()
        model_dir = resolve_model_dir(str(model_id))
        settings_by_name = {**variants(64), "int4 g32": {"quantize": "int4", "quantize_group_size": 32}}
    else:
        model_id = model_dir = args.model_dir or DEMO_MODEL
        settings_by_name = variants(args.group_size)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    texts = {"code": held_out_windows(tokenizer, args.windows, args.window_tokens)}
    if args.real_model:
        english = tokenizer.encode((REPO / "server/tests/data/held_out_english.txt").read_text()).ids
        texts = {"english": [english[:args.window_tokens]], **texts}
    prompts = [tokenizer.encode(t).ids for t in code_corpus.held_out_code(args.prompts, num_chars=300, seed=0)]
    result = {"windows": {k: len(v) for k, v in texts.items()}, "window_tokens": args.window_tokens,
              "prompts": len(prompts), "agreement_tokens": args.agreement_tokens, "variants": {}}
    reference = None
    for name, settings in settings_by_name.items():
        generator = load_test_generator(model_id, num_blocks=64, **settings)
        tokens = greedy_tokens(generator, prompts, args.agreement_tokens)
        reference = reference or tokens
        prefixes = [common_prefix(t, r) for t, r in zip(tokens, reference)]
        result["variants"][name] = {
            "perplexity": {kind: perplexity(generator, windows) for kind, windows in texts.items()},
            "mean_identical_prefix": statistics.mean(prefixes),
            "all_identical": sum(p == args.agreement_tokens for p in prefixes) / len(prefixes),
        }
    base = result["variants"]["float32"]["perplexity"]
    print(f"{'SmolLM2-135M-Instruct' if args.real_model else 'demo model'}, windows of {args.window_tokens} "
          f"tokens {result['windows']}; greedy agreement over {len(prompts)} held-out prompts, first "
          f"{args.agreement_tokens} tokens")
    print("| weights | " + " | ".join(f"perplexity, {kind} | vs float32" for kind in texts)
          + " | identical prefix (mean tokens) | prompts with all identical |\n|---|"
          + "---|---|" * len(texts) + "---|---|")
    for name, v in result["variants"].items():
        cells = " | ".join(f"{v['perplexity'][k]:.3f} | {v['perplexity'][k] / base[k] - 1:+.2%}" for k in texts)
        print(f"| {name} | {cells} | {v['mean_identical_prefix']:.1f} / {args.agreement_tokens} | "
              f"{v['all_identical']:.0%} |")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["decode", "accuracy"])
    parser.add_argument("--model-dir", type=Path, help="decode: default a random 134M model; accuracy: the demo")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=64, help="int4 inputs per scale and zero")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bfloat16", action="store_true", help="decode: also the whole model in bfloat16")
    parser.add_argument("--pytorch-kernels", action="store_true",
                        help="decode: also int8 and int4 on PyTorch's packed kernels instead of the native ones")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--window-tokens", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--agreement-tokens", type=int, default=32)
    parser.add_argument("--real-model", action="store_true",
                        help="accuracy: SmolLM2-135M-Instruct's GGUF instead of the demo model")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    result = run_decode(args) if args.part == "decode" else run_accuracy(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
