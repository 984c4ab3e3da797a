"""EAGLE-3 at one stream in the worker: the real model answering the benchmark's open questions one after another,
plain decoding and each drafter setting taking turns, per round.

Reports per setting and round: tokens/s and its ratio to plain decoding, decode steps, steps that verified drafts,
drafts accepted per verifying step, and the median drafting time of a verifying step and of one draft-layer call.
Every answer is checked against plain decoding's (greedy: they must be identical).

    python benchmark/eagle3_one_stream.py --setting new=work/drafter:adaptive --setting fixed=work/drafter:fixed
    python benchmark/eagle3_one_stream.py --setting native=work/drafter:fixed \\
        --setting layers=work/drafter:fixed:layers          # the draft layers one operator at a time
    python benchmark/eagle3_one_stream.py --setting chain=work/drafter:adaptive \\
        --setting tree=work/drafter:adaptive:tree3         # top-3 trees, the best 6 nodes verified

A setting is NAME=DRAFTER_DIR:MODE[:FLAG...] (MODE: adaptive or fixed); the flag `layers` runs the draft layers one
operator at a time instead of as one native call (`Eagle3Model._native_stack`), `treeW` drafts trees of top-W
expansions and verifies the best `--tree-tokens` nodes (the server's `--draft-tree-width W`). The server's own
figures over HTTP are `real_model.py`'s (`--settings specula specula-eagle3-int8 ...`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("server", "kernels", "proto", "benchmark", "testing")]

from real_model import QUESTIONS, chat_ids  # noqa: E402

from specula_server.request import StepPlan  # noqa: E402
from specula_testing.real_model import fetch_smollm2  # noqa: E402
from specula_testing.worker import BlockPool, load_test_generator, make_spec  # noqa: E402

NUM_BLOCKS, BLOCK_SIZE = 200, 16


def chat_prompts(model) -> list[list[int]]:
    """The benchmark's questions as the router renders and tokenizes chats."""
    return chat_ids(model, QUESTIONS)


class Timed:
    """Times the drafter's `draft` calls (per step) and its draft layer's forward calls."""

    def __init__(self, generator) -> None:
        self.drafting: list[float] = []
        self.calls: list[float] = []
        self._step = 0.0
        drafter = generator.speculator.config.draft_model
        draft, forward = drafter.draft, drafter.model.forward

        def timed_draft(*args, **kwargs):
            start = time.perf_counter()
            try:
                return draft(*args, **kwargs)
            finally:
                self._step += time.perf_counter() - start

        def timed_forward(*args, **kwargs):
            start = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                self.calls.append(time.perf_counter() - start)

        drafter.draft, drafter.model.forward = timed_draft, timed_forward

    def end_step(self) -> None:
        if self._step:
            self.drafting.append(self._step)
        self._step = 0.0


def load(setting: str | None, model, args):
    if setting is None:
        return load_test_generator(model, num_blocks=NUM_BLOCKS), None
    drafter, mode, *flags = setting.split(":")
    widths = [int(flag[len("tree"):]) for flag in flags if flag.startswith("tree")]
    generator = load_test_generator(model, num_blocks=NUM_BLOCKS, speculator=drafter,
                                    speculative_tokens=args.tree_tokens if widths else args.speculative_tokens,
                                    draft_tree_width=widths[0] if widths else 1, speculation_mode=mode,
                                    speculator_quantize=args.speculator_quantize or None)
    if "layers" in flags:
        draft_model = generator.speculator.config.draft_model.model
        draft_model._native_stack()
        draft_model._stack = None  # tried, not used: the layer-by-layer path
    return generator, Timed(generator)


def answer(generator, timed, prompts, indices, max_new_tokens) -> tuple[float, dict, dict]:
    pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE)
    tokens = steps = verifying = accepted = 0
    answers = {}
    start = time.perf_counter()
    for i in indices:
        spec = make_spec(i, prompts[i], pool, max_new_tokens=max_new_tokens, lookahead=8, ignore_eos_token=False)
        answers[i] = [t.id for o in generator.step(StepPlan(new=[spec])).outputs for t in o.tokens]
        while generator.requests:
            outputs = generator.step(StepPlan()).outputs
            if timed is not None:
                timed.end_step()
            steps += 1
            for o in outputs:
                answers[i] += [t.id for t in o.tokens]
                tokens += len(o.tokens)
                verifying += o.num_drafted > 0
                accepted += o.num_accepted
        pool.give(spec.blocks)
    elapsed = time.perf_counter() - start
    return tokens / elapsed, answers, dict(steps=steps, verifying=verifying, accepted=accepted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", action="append", required=True, metavar="NAME=DRAFTER:MODE[:layers][:treeW]")
    parser.add_argument("--questions", type=int, default=5, help="Questions a round (distinct in every round).")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--speculative-tokens", type=int, default=3)
    parser.add_argument("--tree-tokens", type=int, default=6, help="Nodes a tree verifies (settings with treeW).")
    parser.add_argument("--speculator-quantize", default="int8", help="'' for the drafter's float weights.")
    args = parser.parse_args()
    if args.questions * args.rounds + 1 > len(QUESTIONS):
        parser.error(f"{args.questions} questions x {args.rounds} rounds: the benchmark has {len(QUESTIONS)} "
                     "(one more warms up)")
    model = fetch_smollm2()
    prompts = chat_prompts(model)
    settings = {"plain": None} | dict(s.split("=", 1) for s in args.setting)
    loaded = {name: load(setting, model, args) for name, setting in settings.items()}
    for generator, _ in loaded.values():  # the first steps of every path run cold: a question no round uses
        answer(generator, None, prompts, [len(QUESTIONS) - 1], 48)
    for _, timed in loaded.values():
        if timed is not None:
            timed.drafting.clear()
            timed.calls.clear()
    rates: dict[str, list[float]] = {name: [] for name in settings}
    for r in range(args.rounds):
        indices = list(range(r * args.questions, (r + 1) * args.questions))
        order = list(settings) if r % 2 == 0 else list(settings)[::-1]
        answers = {}
        for name in order:
            generator, timed = loaded[name]
            drafting_from = len(timed.drafting) if timed else 0
            calls_from = len(timed.calls) if timed else 0
            rate, answers[name], counts = answer(generator, timed, prompts, indices, args.max_new_tokens)
            rates[name].append(rate)
            line = f"round {r} {name:>10}: {rate:6.1f} tokens/s, {counts['steps']} steps"
            if timed is not None:
                per_step = counts["accepted"] / max(1, counts["verifying"])
                drafting = timed.drafting[drafting_from:] or [0.0]
                calls = timed.calls[calls_from:] or [0.0]
                line += (f", {counts['verifying']} verifying, {per_step:.2f} accepted a verifying step, drafting "
                         f"{1e3 * statistics.median(drafting):.2f} ms a step, a draft-layer call "
                         f"{1e3 * statistics.median(calls):.2f} ms")
            print(line, flush=True)
        same = {name: sum(answers[name][i] == answers["plain"][i] for i in indices) for name in settings}
        print(f"round {r}: answers identical to plain decoding: {same} of {len(indices)}", flush=True)
    for name in settings:
        if name != "plain":
            ratios = [rate / plain for rate, plain in zip(rates[name], rates["plain"])]
            print(f"{name}: ratio to plain decoding per round {[round(x, 3) for x in ratios]}, "
                  f"median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
