"""A batched decode step, before and after three changes, timed side by side step by step.

The changes, added one at a time (`before`; `gather`; `both`: gather + sampling; `all`: + inputs):

- `gather`: the paged KV gather as one `index_select` over the flattened slots into a buffer every layer of
  the step reuses (`paged_attention._gather`) instead of advanced indexing with a `[num_seqs, max_context]`
  index, which allocates a new tensor per layer;
- `sampling`: sampled tokens drawn by inverse CDF with one uniform per row (`Sampler.choose`) instead of an
  exponential race with one random number per vocabulary entry, each row from its own seeded generator;
- `inputs`: a plain decode step's inputs built with a few batched operations (`batch._single_token_step`)
  instead of several small tensors per request (`batch._spans_step`, which every other step still uses).

The earlier implementations are the baselines (in this script, or `batch._spans_step`). One generator holds
one batch of sampling requests (temperature 1, each with its own seed); the variants take turns decode step by
decode step, the order reversing every step, each step running with one variant's implementations patched
in. Reported per concurrency: the median step time of each variant and its median paired ratio to `before`.

    python benchmark/batch_step.py --concurrency 1 8 32 64               # the 134M random Llama, vocab 32000
    python benchmark/batch_step.py --model-dir launcher/specula_launcher/demo_model   # vocab 2048
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

import specula_kernels.paged_attention as paged_attention  # noqa: E402
import specula_server.generator as generator_module  # noqa: E402
from specula_server import batch as batch_module  # noqa: E402
from specula_server.params import SamplingParams  # noqa: E402
from specula_server.request import StepPlan  # noqa: E402
from specula_server.sampling import Sampler  # noqa: E402
from specula_testing.models import BENCHMARK_125M, build_tiny_model  # noqa: E402
from specula_testing.worker import BlockPool, load_test_generator, make_spec  # noqa: E402


def gather_by_advanced_indexing(cache: torch.Tensor, inputs, name: str) -> torch.Tensor:
    return cache[inputs.context_slots]


def choose_by_exponential_race(self, logprobs: torch.Tensor, rows) -> torch.Tensor:
    """The earlier `Sampler.choose`: argmax_i (log p_i - log E_i), E_i ~ Exp(1) from the row's generator."""
    token_ids = logprobs.argmax(dim=-1)
    sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if not sampled:
        return token_ids
    noise = torch.empty(len(sampled), logprobs.shape[-1], dtype=torch.float32, device=logprobs.device)
    for j, i in enumerate(sampled):
        noise[j].exponential_(generator=rows[i].generator)
    noise.clamp_(min=torch.finfo(torch.float32).tiny)
    index = torch.tensor(sampled, device=logprobs.device)
    token_ids[index] = (logprobs[index] - noise.log()).argmax(dim=-1)
    return token_ids


CURRENT = {"gather": paged_attention._gather, "choose": Sampler.choose, "build": batch_module.build_step}
BEFORE = {"gather": gather_by_advanced_indexing, "choose": choose_by_exponential_race,
          "build": batch_module._spans_step}  # every step's inputs built request by request
VARIANTS = {  # each adds one change to the one before
    "before": BEFORE,
    "gather": BEFORE | {"gather": CURRENT["gather"]},
    "both": BEFORE | {"gather": CURRENT["gather"], "choose": CURRENT["choose"]},
    "all": CURRENT,
}


def install(variant: dict) -> None:
    paged_attention._gather = variant["gather"]
    Sampler.choose = variant["choose"]
    generator_module.build_step = variant["build"]


def measure(generator, prompts: list[list[int]], steps: int) -> dict:
    pool = BlockPool(generator.kv_cache.num_blocks, generator.block_size)
    specs = [make_spec(i, p, pool, max_new_tokens=steps + 8, ignore_eos_token=True,
                       sampling=SamplingParams(do_sample=True, seed=i)) for i, p in enumerate(prompts)]
    install(CURRENT)
    generator.step(StepPlan(new=specs))
    names = list(VARIANTS)
    times: dict[str, list[float]] = {name: [] for name in names}
    for step in range(steps // len(names)):
        for name in names if step % 2 == 0 else names[::-1]:
            install(VARIANTS[name])
            start = time.perf_counter()
            generator.step(StepPlan())
            times[name].append(time.perf_counter() - start)
    install(CURRENT)
    generator.reset()
    row = {name: {"step_ms": 1e3 * statistics.median(t)} for name, t in times.items()}
    for name in names[1:]:
        row[name]["vs_before"] = statistics.median(a / b for a, b in zip(times[name], times["before"]))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="existing model directory (default: build the 134M model)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=48, help="decode steps per concurrency, all variants")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or build_tiny_model(Path(tmp) / "model", "llama", **BENCHMARK_125M)
        longest = args.prompt_tokens + args.steps + 8
        generator = load_test_generator(model_dir, num_blocks=max(args.concurrency) * -(-longest // 16) + 8)
        vocab = generator.model.config.vocab_size
        results = []
        for c in args.concurrency:
            g = torch.Generator().manual_seed(c)
            prompts = [torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist() for _ in range(c)]
            row = {"concurrency": c, **measure(generator, prompts, args.steps)}
            results.append(row)
            print(json.dumps(row), flush=True)
    print(f"vocab {vocab}, {args.prompt_tokens}-token prompts, sampling at temperature 1, {args.threads} threads")
    print("| concurrency | before ms | gather ms (vs before) | + sampling | + inputs |")
    print("|---|---|---|---|---|")
    for r in results:
        cells = [f"{r[n]['step_ms']:.1f} ({r[n]['vs_before']:.2f}x)" for n in ("gather", "both", "all")]
        print(f"| {r['concurrency']} | {r['before']['step_ms']:.1f} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                         "vocab": vocab, "results": results}, indent=2))


if __name__ == "__main__":
    main()
