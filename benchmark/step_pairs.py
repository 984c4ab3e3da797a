"""Speculation off vs adaptive, decode step by decode step: is adaptive speculation ever slower?

`speculation.py` times whole batches, which on a shared 2-core VM drift by tens of percent within minutes;
with nothing to copy the difference to measure is a few percent. Here every setting holds the same batch
(same prompts, same sampling seeds) and the settings run one decode step each in turn, the order reversing
every step, so two consecutive steps of different settings see the same machine. Reported per concurrency:

- `step_time`: the median over steps of (adaptive step time / off step time, the neighbouring step);
- `tokens_per_step`: adaptive's emitted tokens per request per step over off's (1.0 when nothing is accepted);
- `throughput`: their quotient, adaptive's tokens/s over off's;
- the same for a second, identical `off` generator (`off2`): what the method reads when nothing differs.

    python benchmark/step_pairs.py --workload novel --concurrency 1 4 16 32 64 --repeats 4

The real model's chat requests (`real_model.py`'s rewrites, summaries and questions, rendered with the model's chat
template, greedy, ending at EOS or `--new-tokens`), with a quantization and `fixed` beside `adaptive`:

    python benchmark/step_pairs.py --model-dir ~/.cache/specula/real-model/SmolLM2-135M-Instruct.Q4_1.gguf \
        --workload rewrite --quantize w8a8 --modes adaptive fixed --concurrency 8 --speculative-tokens 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import speculation as bench  # noqa: E402  (puts the repo's packages on the path)
import torch  # noqa: E402

from specula_server.request import StepPlan  # noqa: E402
from specula_server.warmup import calibrate_step_cost  # noqa: E402
from specula_testing.worker import load_test_generator  # noqa: E402


def measure(generators: dict, batches: list[list[dict]], new_tokens: int, lookahead: int, eos: bool = False) -> dict:
    """Runs each batch in every generator, one decode step each in turn, while every request of it runs."""
    times: dict[str, list[float]] = {name: [] for name in generators}
    tokens = {name: 0 for name in generators}
    names = list(generators)
    for rep, requests in enumerate(batches):
        for g in generators.values():
            g.step(StepPlan(new=bench.batch_specs(g, requests, 1000 * rep, lookahead,
                                                  max_new_tokens=None if eos else new_tokens)))
        for step in range(new_tokens - 1):
            order = names if step % 2 == 0 else names[::-1]
            step_times, step_tokens = {}, {}
            for name in order:
                start = time.perf_counter()
                result = generators[name].step(StepPlan())
                step_times[name] = time.perf_counter() - start
                step_tokens[name] = sum(len(o.tokens) for o in result.outputs)
            if any(len(generators[name].requests) < len(requests) for name in names):
                break  # a request finished (in some setting): only steps over the whole batch compare
            for name in names:
                times[name].append(step_times[name])
                tokens[name] += step_tokens[name]
        for g in generators.values():
            g.reset()
    row = {}
    for name in names[1:]:
        step_time = statistics.median(a / b for a, b in zip(times[name], times["off"]))
        per_step = tokens[name] / tokens["off"]
        row[name] = {"step_time": step_time, "tokens_per_step": per_step, "throughput": per_step / step_time,
                     "steps": len(times[name])}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=bench.DEMO_MODEL)
    parser.add_argument("--workload", default="novel", choices=["copy", "novel", "repetitive", *bench.CHAT_WORKLOADS],
                        help="rewrite, summary, question: the real model's chat requests (give its --model-dir)")
    parser.add_argument("--quantize", default=None, help="every generator's --quantize (e.g. int8, w8a8)")
    parser.add_argument("--modes", nargs="+", default=["adaptive"], choices=["adaptive", "fixed"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=4, help="batches per concurrency (each a new batch)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32, help="prompt length (repetitive)")
    parser.add_argument("--speculative-tokens", type=int, default=16)
    bench.add_run_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    chat = args.workload in bench.CHAT_WORKLOADS
    if chat:
        # distinct prompts for every batch (a batch of repeated prompts would measure one prompt)
        requests = bench.chat_requests(args.workload, args.model_dir, max(args.concurrency) * args.repeats,
                                       args.new_tokens)
    else:
        requests = bench.workload_requests(args.workload, args.model_dir, max(args.concurrency), args)
    longest = max(len(r["ids"]) for r in requests) + args.new_tokens + args.speculative_tokens + 1
    blocks = max(args.concurrency) * -(-longest // 16) + 8
    modes = bench.settings(args.speculative_tokens)
    configs = {"off": {}, "off2": {}} | {mode: modes[mode] for mode in args.modes}
    quantize = {"quantize": args.quantize} if args.quantize else {}
    generators = {name: load_test_generator(args.model_dir, num_blocks=blocks, dtype=dtype, device=args.device,
                                            **quantize, **s)
                  for name, s in configs.items()}
    for g in generators.values():
        if g.speculation is not None:  # as the server's warmup does (a plain generator has no cost model)
            calibrate_step_cost(g)
    results = []
    for c in args.concurrency:
        batches = [requests[rep * c:(rep + 1) * c] if chat else requests[:c] for rep in range(args.repeats)]
        row = {"workload": args.workload, "concurrency": c,
               **measure(generators, batches, args.new_tokens, args.speculative_tokens + 1, eos=chat)}
        results.append(row)
        print(json.dumps(row), flush=True)
    print("| concurrency | setting | / off: step time | tokens per step | throughput | steps |")
    print("|---|---|---|---|---|---|")
    for row in results:
        for name in ("off2", *args.modes):
            r = row[name]
            print(f"| {row['concurrency']} | {name} | {r['step_time']:.3f} | {r['tokens_per_step']:.3f} "
                  f"| {r['throughput']:.3f}x | {r['steps']} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": vars(args) | {"model_dir": str(args.model_dir),
                                                                   "json": str(args.json)},
                                         "results": results}, indent=2))


if __name__ == "__main__":
    main()
