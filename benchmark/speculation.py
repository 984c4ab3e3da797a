"""Speculative decoding in the worker, side by side: off vs fixed vs adaptive over concurrency.

Runs the worker in-process for each speculation setting on the same model, prompts and thread count, taking
turns batch by batch (`side_by_side`), and reports generated tokens/s, mean emitted tokens per decode step and
the ratio to speculation off. At each concurrency c the prompts are run in batches of c, each batch to completion
(`--batching static`, the default), or with c requests in flight, each finished one replaced at once by the
next as the server's continuous batching does, timing the steady part (`--batching continuous`). In a static
batch a request that finishes early leaves its slot empty until the whole batch ends, so speculation that
speeds up some requests of a batch and not others gains less there than in a server.
Workloads:

- `copy`: held-out code-editing tasks (a block of code from a standard-library file the model never saw, then
  "# after: rename X to Y"), greedy, each answer ending at the model's EOS: answers reuse their prompt's text;
- `novel`: sampling at temperature 1 after the beginning of a held-out code block: new text, little to copy,
  so speculation must not slow anything down;
- `repetitive`: greedy decoding from random token prompts; a random model's output falls into loops;
- `rewrite`, `summary`, `question`: the real model's chat requests of `real_model.py` (code rewrites, summaries,
  open questions; greedy, ending at EOS or `--new-tokens`), for `--model-dir` the real model's GGUF file.

`copy` and `novel` need a model trained on code (the bundled demo model, the default); `repetitive` works with
any model. At concurrency 1 the `copy` and `repetitive` workloads also time transformers `generate()` with and
without `prompt_lookup_num_tokens` on the same weights and prompts.

    python benchmark/speculation.py --workload copy novel --concurrency 1 2 4 8 16 32 64 \\
        --json benchmark/results/speculation.json --plot benchmark/results/speculation.png
    python benchmark/speculation.py --model-dir ~/.cache/specula/real-model/SmolLM2-135M-Instruct.Q4_1.gguf \
        --workload rewrite --quantize w8a8 --concurrency 8 --min-requests 32 --batching continuous \
        --new-tokens 128 --speculative-tokens 4
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("server", "kernels", "proto", "testing")]

import torch  # noqa: E402

from specula_server.params import SamplingParams  # noqa: E402
from specula_server.request import StepPlan  # noqa: E402
from specula_server.warmup import calibrate_step_cost  # noqa: E402
from specula_testing import code_corpus  # noqa: E402
from specula_testing.models import BENCHMARK_125M, build_tiny_model  # noqa: E402
from specula_testing.worker import BlockPool, load_test_generator, make_spec  # noqa: E402

DEMO_MODEL = REPO / "launcher" / "specula_launcher" / "demo_model"


def settings(speculative_tokens: int) -> dict[str, dict]:
    return {"off": {}, "fixed": {"speculative_tokens": speculative_tokens, "speculation_mode": "fixed"},
            "adaptive": {"speculative_tokens": speculative_tokens, "speculation_mode": "adaptive"}}


CHAT_WORKLOADS = ("rewrite", "summary", "question")  # the real model's chat requests (`real_model.py`)


def chat_requests(workload: str, model_dir: Path, count: int, new_tokens: int) -> list[dict]:
    """`count` of `real_model.py`'s chat prompts of one kind (code rewrites, summaries, open questions) as the
    router renders and tokenizes them: greedy, ending at EOS or after `new_tokens`."""
    import real_model

    texts = real_model.make_prompts([count], 1, [workload])[workload][count][:count]
    return [{"ids": ids, "max_new_tokens": new_tokens, "greedy": True, "eos": True}
            for ids in real_model.chat_ids(model_dir, texts)]


def workload_requests(workload: str, model_dir: Path, count: int, args) -> list[dict]:
    """Per request: prompt ids, max_new_tokens, sampling, whether EOS ends it."""
    if workload in CHAT_WORKLOADS:
        return chat_requests(workload, model_dir, count, args.new_tokens)
    if workload == "repetitive":
        rng = random.Random(count)
        return [{"ids": [1] + [rng.randrange(3, 500) for _ in range(args.prompt_tokens - 1)],
                 "max_new_tokens": args.new_tokens, "greedy": True, "eos": False} for _ in range(count)]
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    if workload == "copy":
        edits = code_corpus.held_out_edits(count, seed=args.seed)
        return [{"ids": tokenizer.encode(e.prompt).ids, "greedy": True, "eos": True,
                 "max_new_tokens": len(tokenizer.encode(e.answer, add_special_tokens=False).ids) + 16}
                for e in edits]
    texts = code_corpus.held_out_code(count, num_chars=300, seed=args.seed)
    return [{"ids": tokenizer.encode(t).ids, "max_new_tokens": args.new_tokens, "greedy": False, "eos": False}
            for t in texts]


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Options every speculation benchmark takes: rounds, threads, device, dtype, seed, JSON output."""
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA by default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)


def request_spec(index: int, request: dict, pool: BlockPool, seed: int, lookahead: int,
                 max_new_tokens: int | None = None):
    """Request `index`'s spec with KV blocks from `pool`: it samples with seed `seed` (unless greedy);
    `max_new_tokens`, when given, replaces the request's own and makes it ignore EOS."""
    return make_spec(index, request["ids"], pool, lookahead=lookahead,
                     sampling=SamplingParams() if request["greedy"] else SamplingParams(do_sample=True, seed=seed),
                     max_new_tokens=max_new_tokens or request["max_new_tokens"],
                     ignore_eos_token=max_new_tokens is not None or not request["eos"])


def batch_specs(generator, requests: list[dict], seed: int, lookahead: int,
                max_new_tokens: int | None = None) -> list:
    """One batch's request specs on fresh KV blocks: request i samples with seed `seed + i` (unless greedy);
    `max_new_tokens`, when given, replaces each request's own and makes every request ignore EOS."""
    pool = BlockPool(generator.kv_cache.num_blocks, generator.block_size)
    return [request_spec(i, r, pool, seed + i, lookahead, max_new_tokens) for i, r in enumerate(requests)]


def run_requests(generator, requests: list[dict], concurrency: int, seed: int, lookahead: int):
    """Runs `requests` in batches of `concurrency`; returns seconds, generated tokens, per-request decode steps."""
    seconds = tokens = steps = 0
    for first in range(0, len(requests), concurrency):
        specs = batch_specs(generator, requests[first : first + concurrency], seed + first, lookahead)
        start = time.perf_counter()
        tokens += emitted(generator.step(StepPlan(new=specs)))
        while generator.requests:  # finished requests leave on their own
            steps += len(generator.requests)  # each decodes once this step
            tokens += emitted(generator.step(StepPlan()))
        seconds += time.perf_counter() - start
    return seconds, tokens, steps


def emitted(result) -> int:
    """Tokens a step emitted; a failed request stops the benchmark."""
    for o in result.outputs:
        if o.error:
            raise RuntimeError(o.error)
    return sum(len(o.tokens) for o in result.outputs)


def run_continuous(generator, requests: list[dict], concurrency: int, seed: int, lookahead: int):
    """Runs `requests` as `concurrency` clients in a closed loop would, the way the server batches them: a
    finished request is replaced at once by the next, which joins the next step (its prompt is computed while
    the others decode: continuous batching). Counts the steady part only, up to the first step after which a
    finished request has no successor: the drain that follows runs a shrinking batch that a server at this
    load does not see. Returns seconds, generated tokens and per-request decode steps of that part."""
    pool = BlockPool(generator.kv_cache.num_blocks, generator.block_size)
    queue = list(enumerate(requests))
    blocks: dict[int, tuple[int, ...]] = {}
    tokens, steps = 0, 0
    start = time.perf_counter()
    while True:
        specs = []
        if len(blocks) < concurrency and queue:
            admitted, queue = queue[: concurrency - len(blocks)], queue[concurrency - len(blocks) :]
            specs = [request_spec(i, r, pool, seed + i, lookahead) for i, r in admitted]
            blocks.update((s.id, s.blocks) for s in specs)
        if not specs and not generator.requests:
            break
        steps += len(generator.requests)  # the running requests decode once this step; newcomers prefill
        tokens += emitted(generator.step(StepPlan(new=specs)))
        finished = [i for i in blocks if i not in generator.requests]  # they left on their own
        for i in finished:
            pool.give(blocks.pop(i))
        if finished and not queue:
            break
    seconds = time.perf_counter() - start
    generator.reset()  # the drain is not run
    return seconds, tokens, steps


def side_by_side(generators: dict, requests: list[dict], concurrency: int, rounds: int,
                 lookahead: int, continuous: bool = False, before=None, run=None
                 ) -> dict[str, list[tuple[float, float]]]:
    """Per setting and round: (generated tokens/s, tokens per request per decode step).

    The settings take turns batch by batch, in an order that rotates from one batch to the next, so a change
    in the machine's speed (these machines drift by tens of percent over minutes) hits them all alike; a
    round's figure sums its batches. Each batch sees the same prompts and sampling seeds in every setting.
    `continuous`: each turn runs 4 x `concurrency` requests with `concurrency` in flight (`run_continuous`)
    instead of one batch run to completion. `before(generator)`, when given, runs before each turn (untimed);
    `run`, when given, runs each turn in place of `run_continuous` / `run_requests` (with their arguments).
    """
    names = list(generators)
    samples = {name: [] for name in names}
    span = 4 * concurrency if continuous else concurrency
    run = run or (run_continuous if continuous else run_requests)
    for r in range(rounds):
        totals = {name: [0.0, 0, 0] for name in names}
        for turn, first in enumerate(range(0, len(requests), span)):
            chunk = requests[first : first + span]
            for j in range(len(names)):
                name = names[(turn + r + j) % len(names)]
                if before is not None:
                    before(generators[name])
                seconds, tokens, steps = run(generators[name], chunk, concurrency, 1000 * r + first, lookahead)
                for k, value in enumerate((seconds, tokens, steps)):
                    totals[name][k] += value
        for name, (seconds, tokens, steps) in totals.items():
            samples[name].append((tokens / seconds, tokens / max(steps, 1)))
    return samples


def paired_ratio(samples: list[tuple[float, float]], baseline: list[tuple[float, float]]) -> float:
    """Median over rounds of a setting's tokens/s over the baseline's in the same round (the two took turns
    batch by batch, so each round's ratio is a paired measurement)."""
    return statistics.median(a[0] / b[0] for a, b in zip(samples, baseline))


def transformers_baseline(model_dir: Path, requests: list[dict], num_tokens: int, rounds: int, device) -> dict:
    """transformers `generate()` alone and with prompt lookup, one request at a time, greedy."""
    import transformers

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    rates = {}
    for name, extra in (("plain", {}), ("prompt_lookup", {"prompt_lookup_num_tokens": num_tokens})):
        samples = []
        for _ in range(rounds):
            seconds = tokens = 0
            for r in requests:
                ids = torch.tensor([r["ids"]], device=device)
                eos = {} if r["eos"] else {"min_new_tokens": r["max_new_tokens"]}
                start = time.perf_counter()
                out = model.generate(ids, max_new_tokens=r["max_new_tokens"], do_sample=False, **eos, **extra)
                seconds += time.perf_counter() - start
                tokens += out.shape[1] - ids.shape[1]
            samples.append(tokens / seconds)
        rates[name] = statistics.median(samples)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=DEMO_MODEL,
                        help="model to use (default: the bundled demo model); 'random' for a ~125M random Llama")
    parser.add_argument("--workload", nargs="+", default=["copy", "novel"],
                        choices=["copy", "novel", "repetitive", *CHAT_WORKLOADS],
                        help="rewrite, summary, question: the real model's chat requests (give its --model-dir)")
    parser.add_argument("--quantize", default=None, help="every setting's --quantize (e.g. int8, w8a8)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--min-requests", type=int, default=8, help="requests per measurement at least")
    parser.add_argument("--batching", choices=["static", "continuous"], default="static",
                        help="static: the prompts in batches of c, each run to completion; continuous: c requests "
                             "in flight, a finished one replaced at once (as the server does), steady part timed")
    parser.add_argument("--speculative-tokens", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per request (novel, repetitive)")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="prompt length (repetitive)")
    add_run_arguments(parser)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = args.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    configs = settings(args.speculative_tokens)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if str(model_dir) == "random":
            model_dir = build_tiny_model(Path(tmp) / "model", "llama", **BENCHMARK_125M)
        count = max(max(args.concurrency), args.min_requests)
        requests = {w: workload_requests(w, model_dir, count, args) for w in args.workload}
        longest = max(len(r["ids"]) + r["max_new_tokens"] for rs in requests.values() for r in rs)
        blocks = max(args.concurrency) * -(-(longest + args.speculative_tokens + 1) // 16) + 8
        quantize = {"quantize": args.quantize} if args.quantize else {}
        generators = {name: load_test_generator(model_dir, num_blocks=blocks, dtype=dtype, device=args.device,
                                                **quantize, **s)
                      for name, s in configs.items()}
        for g in generators.values():
            if g.speculation is not None:  # what the server's warmup does (a plain generator has no cost model)
                calibrate_step_cost(g)
        results = []
        for workload in args.workload:
            for c in args.concurrency:
                batch = requests[workload][: max(c, args.min_requests)]
                samples = side_by_side(generators, batch, c, args.rounds, args.speculative_tokens + 1,
                                       continuous=args.batching == "continuous")
                row = {"workload": workload, "concurrency": c, "requests": len(batch)}
                for name, values in samples.items():
                    row[f"{name}_tok_s"] = statistics.median(v[0] for v in values)
                    row[f"{name}_tokens_per_step"] = statistics.median(v[1] for v in values)
                for name in ("fixed", "adaptive"):
                    row[f"{name}_vs_off"] = paired_ratio(samples[name], samples["off"])
                results.append(row)
                print(json.dumps(row), flush=True)
        baselines = {}
        if 1 in args.concurrency:
            for workload in set(args.workload) & {"copy", "repetitive"}:
                baselines[workload] = transformers_baseline(model_dir, requests[workload][: args.min_requests],
                                                            args.speculative_tokens, args.rounds, device)
                print(json.dumps({"transformers": baselines[workload], "workload": workload}), flush=True)

    report(results, baselines, args.speculative_tokens)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"device": args.device, "dtype": dtype, "threads": args.threads, "model": str(args.model_dir),
                "batching": args.batching,
                "speculative_tokens": args.speculative_tokens, "rounds": args.rounds}
        args.json.write_text(json.dumps({"settings": meta, "results": results, "transformers": baselines}, indent=2))
    if args.plot:
        plot(results, args.plot, list(configs))


def report(results: list[dict], baselines: dict, num_tokens: int) -> None:
    print("| workload | concurrency | off tok/s | fixed | adaptive | tokens/step (fixed / adaptive) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['workload']} | {r['concurrency']} | {r['off_tok_s']:.1f} | {r['fixed_vs_off']:.2f}x | "
              f"{r['adaptive_vs_off']:.2f}x | {r['fixed_tokens_per_step']:.2f} / {r['adaptive_tokens_per_step']:.2f} |")
    for workload, rates in baselines.items():
        print(f"transformers, {workload}, concurrency 1: generate() {rates['plain']:.1f} tok/s, "
              f"prompt_lookup_num_tokens={num_tokens} {rates['prompt_lookup']:.1f} tok/s")


def plot(results: list[dict], path: Path, names: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in results))
    fig, axes = plt.subplots(2, len(workloads), figsize=(6 * len(workloads), 7), squeeze=False)
    for col, workload in enumerate(workloads):
        rows = [r for r in results if r["workload"] == workload]
        xs = [r["concurrency"] for r in rows]
        top, bottom = axes[0][col], axes[1][col]
        for name in names:
            top.plot(xs, [r[f"{name}_tok_s"] for r in rows], marker="o", label=name)
            bottom.plot(xs, [r.get(f"{name}_vs_off", 1.0) for r in rows], marker="o", label=name)
        top.set(title=f"{workload} workload", ylabel="generated tokens/s")
        bottom.set(xlabel="concurrent requests", ylabel="throughput vs off (median of paired rounds)")
        bottom.axhline(0.97, color="grey", linestyle=":", linewidth=1)
        for ax in (top, bottom):
            ax.set_xscale("log")
            ax.set_xticks(xs)
            ax.set_xticklabels([str(x) for x in xs])
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
