"""A change to the native kernels, measured where it counts: the decode steps of one worker, this tree's kernels and
another checkout's taking turns step by step.

Loads a model into the worker (by default the real model, SmolLM2-135M-Instruct from its GGUF), builds the native
kernels of `--baseline-tree` (e.g. a `git worktree` of the commit before a change to `csrc/`) beside this tree's,
prefills `--streams` requests of `--prompt-tokens` tokens, then decodes `--steps` steps, the two libraries taking
turns step by step (the order reversing every round) over the same weights and KV cache; `--rounds` times. Both run
the same Python, so the difference is the kernels'. Reported per round: each library's median step and its ratio,
and where the decoder stack runs as one native call, each operator's milliseconds a step from the stack's own clock
(`NativeStack.time_operators`; so the baseline must be a tree that has that clock, 0ca0333 or later).

    git worktree add /tmp/before HEAD~1
    python benchmark/kernel_turns.py --baseline-tree /tmp/before --quantize w8a8 --streams 1 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("kernels", "server", "proto", "testing")]

import torch  # noqa: E402
from decode_profile import REAL_MODEL, synthetic_prompt  # noqa: E402

from specula_kernels import native  # noqa: E402
from specula_kernels.decode_layers import OPERATORS  # noqa: E402
from specula_server.request import StepPlan  # noqa: E402
from specula_testing.worker import BlockPool, load_test_generator, make_spec  # noqa: E402


def turns(generator, libraries: dict, streams: int, prompt: list[int], steps: int, rounds: int) -> None:
    stack = generator.model._native_stack()
    clocked = stack is not None  # the layers as one native call: its clock splits them
    print("| streams | round | this tree ms/step | baseline ms/step | ratio |\n|---|---|---|---|---|")
    ratios = []
    totals = {name: torch.zeros(len(OPERATORS), dtype=torch.float64) for name in libraries}
    for r in range(rounds):
        pool = BlockPool(generator.kv_cache.num_blocks, generator.block_size)
        specs = [make_spec(i, [prompt[0] + i, *prompt[1:]], pool, max_new_tokens=steps + 1) for i in range(streams)]
        generator.step(StepPlan(new=specs))
        seconds = {name: [] for name in libraries}
        order = list(libraries)
        for i in range(steps):
            name = order[(i + r) % 2]
            native._library = libraries[name]
            if clocked:
                stack.time_operators()
            start = time.perf_counter()
            generator.step(StepPlan())
            seconds[name].append(time.perf_counter() - start)
            if clocked:
                totals[name] += stack.operator_seconds
                stack.time_operators(False)
        native._library = libraries["this tree"]
        while generator.requests:
            generator.step(StepPlan())
        medians = {name: statistics.median(s) * 1e3 for name, s in seconds.items()}
        ratios.append(medians["this tree"] / medians["baseline"])
        print(f"| {streams} | {r} | {medians['this tree']:.2f} | {medians['baseline']:.2f} | {ratios[-1]:.3f} |")
    print(f"| {streams} | median |  |  | **{statistics.median(ratios):.3f}** |\n")
    per_step = rounds * steps / 2
    if clocked:
        print(f"{streams} streams, ms a step inside the stack:\n| operator | this tree | baseline |\n|---|---|---|")
        for i, op in enumerate(OPERATORS):
            cells = [f"{float(totals[n][i]) / per_step * 1e3:.3f}" for n in libraries]
            print(f"| {op} | {' | '.join(cells)} |")
        print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-tree", type=Path, required=True, help="a checkout whose native kernels to "
                        "compare against (its kernels/specula_kernels/csrc)")
    parser.add_argument("--model", type=Path, default=REAL_MODEL, help="GGUF file or model directory")
    parser.add_argument("--quantize", choices=["none", "int8", "w8a8", "int4", "gguf"], default="none")
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=350)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if native.library() is None:
        sys.exit(f"native kernels unavailable: {native.unavailable_reason()}")
    try:
        baseline = native.load_from(args.baseline_tree / "kernels" / "specula_kernels" / "csrc")
    except AttributeError as error:  # a tree from before an entry point this one binds (the stack's clock)
        sys.exit(f"{args.baseline_tree}'s kernels lack an entry point this tree needs: {error}")
    libraries = {"this tree": native.library(), "baseline": baseline}
    settings = {} if args.quantize == "none" else {"quantize": args.quantize, "quantize_group_size": args.group_size}
    per_stream = -(-(args.prompt_tokens + args.steps + 8) // 16) + 1
    generator = load_test_generator(args.model, num_blocks=max(args.streams) * per_stream, dtype="float32",
                                    **settings)
    prompt = synthetic_prompt(args.prompt_tokens)
    print(f"{args.model.name}, {args.quantize}, {args.prompt_tokens}-token prompts, {args.steps} steps a round, "
          f"this tree against {args.baseline_tree}\n")
    for streams in args.streams:
        turns(generator, libraries, streams, prompt, args.steps, args.rounds)


if __name__ == "__main__":
    main()
