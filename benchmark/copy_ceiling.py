"""The most prompt-lookup speculation can gain on the copy workload at concurrency 1, on this machine.

Two measurements, multiplied:

- **Tokens per step, at best.** The greedy answers of the held-out edit tasks (`speculation.py --workload
  copy`) are replayed offline. At every step an oracle sees every earlier position of prompt + answer so far
  whose token equals the last one (every match any n-gram lookup could use: a longer n-gram match is one of
  these), and drafts the up to k tokens after the one whose continuation agrees longest with the true answer.
  A step then emits that agreement + 1 tokens. No single-chain prompt-lookup drafter can accept more.
- **What a step of k + 1 rows costs against a plain one.** One request of the workload, halfway through its
  answer, runs model forwards over 1 and k + 1 rows in turns (medians), and whole plain decode steps give the
  rest of a step (sampling, bookkeeping), which a verifying step pays too.

    ceiling(k) = oracle tokens per step(k) * plain step / (plain step - T(1) + T(k + 1))

is the speedup over speculation off that a perfect drafter with free drafting and free verification logic
would reach with k drafts. The same bound with the server's own prompt lookup (`PromptLookupDrafter`, its
defaults) in place of the oracle shows what the drafter leaves on the table.

    python benchmark/copy_ceiling.py --json benchmark/results/copy-ceiling.json
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

from specula_server.batch import build_step  # noqa: E402
from specula_server.request import StepPlan  # noqa: E402
from specula_server.speculation.drafters import PromptLookupDrafter  # noqa: E402
from specula_testing.worker import generate_alone, load_test_generator, token_ids  # noqa: E402


def oracle_steps(prompt: list[int], answer: list[int], k: int) -> int:
    """Decode steps an oracle prompt-lookup drafter of at most k drafts needs to emit `answer`."""
    context, steps, done = list(prompt), 0, 0
    while done < len(answer):
        last, best = context[-1], 0
        for j in range(len(context) - 1):
            if context[j] != last:
                continue
            run = 0
            while (run < k and j + 1 + run < len(context) and done + run < len(answer)
                   and context[j + 1 + run] == answer[done + run]):
                run += 1
            best = max(best, run)
        emitted = min(best + 1, len(answer) - done)
        context.extend(answer[done : done + emitted])
        done += emitted
        steps += 1
    return steps


def drafter_steps(drafter: PromptLookupDrafter, prompt: list[int], answer: list[int], k: int) -> int:
    """Decode steps the worker's own prompt-lookup drafter (up to k drafts, greedy acceptance) needs."""
    context, steps, done = torch.tensor(prompt + answer), 0, 0
    while done < len(answer):
        draft = drafter.lookup(context[: len(prompt) + done], k).tolist()
        run = 0
        while run < len(draft) and done + run < len(answer) and draft[run] == answer[done + run]:
            run += 1
        done += min(run + 1, len(answer) - done)
        steps += 1
    return steps


def forward_times(generator, request, rows: list[int], repeats: int) -> dict[int, float]:
    """Median seconds of a model forward (with logits) over `n` rows of `request`, each n in turn."""
    times: dict[int, list[float]] = {n: [] for n in rows}
    for rep in range(repeats):
        for n in rows if rep % 2 == 0 else rows[::-1]:
            start = time.perf_counter()
            step = build_step([request], [request.num_tokens - 1], [n], generator.device)
            with torch.inference_mode():
                hidden = generator.model(step.input_ids, step.positions, generator.kv_cache.layers, step.attn, None)
                generator.model.compute_logits(hidden)
            times[n].append(time.perf_counter() - start)
    return {n: statistics.median(t) for n, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=bench.DEMO_MODEL)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--drafts", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 16])
    parser.add_argument("--repeats", type=int, default=200, help="forwards per row count")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.new_tokens, args.prompt_tokens = 64, 32  # what workload_requests reads besides the seed
    requests = bench.workload_requests("copy", args.model_dir, args.requests, args)
    longest = max(len(r["ids"]) + r["max_new_tokens"] for r in requests) + max(args.drafts) + 1
    extra = 2 * args.repeats  # the plain steps run past the answer (EOS ignored)
    generator = load_test_generator(args.model_dir, num_blocks=-(-(longest + extra) // 16) + 4)

    answers = []
    for r in requests:
        spec = bench.batch_specs(generator, [r], 0, 0)[0]
        answers.append(token_ids(generate_alone(generator, spec)))
    total = sum(len(a) for a in answers)
    oracle = {k: total / sum(oracle_steps(r["ids"], a, k) for r, a in zip(requests, answers))
              for k in args.drafts}
    drafter = PromptLookupDrafter()  # the server's default: n-grams 3 down to 1, latest match
    lookup = {k: total / sum(drafter_steps(drafter, r["ids"], a, k) for r, a in zip(requests, answers))
              for k in args.drafts}

    # One request halfway through its answer; then whole plain decode steps from there on.
    middle = max(range(len(requests)), key=lambda i: len(answers[i]))
    r = requests[middle]
    spec = bench.batch_specs(generator, [r], 0, max(args.drafts) + 1,
                             max_new_tokens=len(answers[middle]) + extra)[0]
    generator.step(StepPlan(new=[spec]))
    for _ in range(len(answers[middle]) // 2):
        generator.step(StepPlan())
    request = generator.requests[spec.id]
    rows = sorted({1} | {k + 1 for k in args.drafts})
    forwards = forward_times(generator, request, rows, args.repeats)
    step_times = []
    for _ in range(min(args.repeats, 64)):
        start = time.perf_counter()
        generator.step(StepPlan())
        step_times.append(time.perf_counter() - start)
    generator.reset()
    plain = statistics.median(step_times)
    rest = max(plain - forwards[1], 0.0)

    results = []
    for k in args.drafts:
        step = rest + forwards[k + 1]
        results.append({"drafts": k, "oracle_tokens_per_step": oracle[k], "lookup_tokens_per_step": lookup[k],
                        "forward_ms": 1e3 * forwards[k + 1], "step_vs_plain": step / plain,
                        "ceiling": oracle[k] * plain / step, "lookup_bound": lookup[k] * plain / step})
    best = max(results, key=lambda x: x["ceiling"])
    print(f"{args.requests} edit tasks, {total} answer tokens; plain decode step {1e3 * plain:.2f} ms "
          f"(forward {1e3 * forwards[1]:.2f} ms); {args.threads} threads")
    print("| drafts | tokens/step: oracle | lookup | forward ms | verifying step / plain step | ceiling: oracle "
          "| lookup |")
    print("|---|---|---|---|---|---|---|")
    for x in results:
        print(f"| {x['drafts']} | {x['oracle_tokens_per_step']:.2f} | {x['lookup_tokens_per_step']:.2f} | "
              f"{x['forward_ms']:.2f} | {x['step_vs_plain']:.2f} | {x['ceiling']:.2f}x | {x['lookup_bound']:.2f}x |")
    lookup_best = max(results, key=lambda x: x["lookup_bound"])
    print(f"highest ceiling: {best['ceiling']:.2f}x with {best['drafts']} drafts (oracle); "
          f"{lookup_best['lookup_bound']:.2f}x with {lookup_best['drafts']} (the server's prompt lookup)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                         "plain_step_ms": 1e3 * plain, "forward_1_ms": 1e3 * forwards[1],
                                         "results": results}, indent=2))


if __name__ == "__main__":
    main()
