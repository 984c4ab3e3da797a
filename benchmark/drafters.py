"""Drafters side by side: prompt lookup, Medusa chain / tree, MLP speculator chain / tree, draft model.

Runs the worker in-process once per method on the same model, prompts and thread count, taking turns
batch by batch (`speculation.side_by_side`), and reports per method and concurrency: generated tokens/s, the
ratio to speculation off, and mean tokens emitted per decode step of a request (1 without speculation; accepted drafts
+ 1 with it). Draft lengths are fixed (`--speculative-tokens`) so the drafters are compared, not the
controller. Workloads are those of `speculation.py` (`copy`: held-out code edits, greedy; `novel`: sampling
after held-out code beginnings).

    python benchmark/drafters.py --concurrency 1 16 --json benchmark/results/drafters.json

Speculators default to the demo family's (`launcher/specula_launcher/demo_adapters`); a method whose files
are missing is skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("server", "kernels", "proto", "benchmark", "testing")]

import torch  # noqa: E402
from speculation import DEMO_MODEL, add_run_arguments, paired_ratio, side_by_side, workload_requests  # noqa: E402

from specula_testing.worker import load_test_generator  # noqa: E402

DEMO_ADAPTERS = REPO / "launcher" / "specula_launcher" / "demo_adapters"
METHODS = ["off", "ngram", "medusa-chain", "medusa-tree", "mlp-chain", "mlp-tree", "draft-model"]


def method_settings(method: str, args) -> dict | None:
    """ServerConfig settings of a method, or None when its speculator is not there."""
    if method == "off":
        return {}
    spec = {"speculative_tokens": args.speculative_tokens, "speculation_mode": "fixed"}
    if method == "ngram":
        return spec
    kind, _, shape = method.partition("-")
    path = {"medusa": args.medusa, "mlp": args.mlp_speculator, "draft": args.draft_model}[kind]
    if path is None or not Path(path).is_dir():
        return None
    width = args.tree_width if shape == "tree" else 1
    return spec | {"speculator": str(path), "draft_tree_width": width}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=DEMO_MODEL)
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--medusa", type=Path, default=DEMO_ADAPTERS / "medusa")
    parser.add_argument("--mlp-speculator", type=Path, default=DEMO_ADAPTERS / "mlp-speculator")
    parser.add_argument("--draft-model", type=Path, default=DEMO_ADAPTERS / "draft-model")
    parser.add_argument("--workload", nargs="+", default=["copy"], choices=["copy", "novel"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--speculative-tokens", type=int, default=4)
    parser.add_argument("--tree-width", type=int, default=3, help="candidates per head for the tree methods")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per request (novel)")
    add_run_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")

    methods = {}
    for method in args.methods:
        settings = method_settings(method, args)
        if settings is None:
            print(f"skipping {method}: no speculator at the given path", file=sys.stderr)
        else:
            methods[method] = settings
    count = max(max(args.concurrency), args.min_requests)
    requests = {w: workload_requests(w, args.model_dir, count, args) for w in args.workload}
    longest = max(len(r["ids"]) + r["max_new_tokens"] for rs in requests.values() for r in rs)
    blocks = max(args.concurrency) * -(-(longest + args.speculative_tokens + 1) // 16) + 8
    generators = {name: load_test_generator(args.model_dir, num_blocks=blocks, dtype=dtype, device=args.device,
                                            **settings) for name, settings in methods.items()}
    results = []
    for workload in args.workload:
        for c in args.concurrency:
            batch = requests[workload][: max(c, args.min_requests)]
            samples = side_by_side(generators, batch, c, args.rounds, args.speculative_tokens + 1)
            for name, values in samples.items():
                row = {"workload": workload, "concurrency": c, "method": name,
                       "tok_s": statistics.median(v[0] for v in values),
                       "tokens_per_step": statistics.median(v[1] for v in values)}
                results.append(row)
            for row in results[-len(samples):]:
                row["vs_off"] = paired_ratio(samples[row["method"]], samples["off"]) if "off" in samples else None
                print(json.dumps(row), flush=True)

    print("| workload | concurrency | method | tok/s | vs off | tokens/step |")
    print("|---|---|---|---|---|---|")
    for row in results:
        ratio = f"{row['vs_off']:.2f}x" if row["vs_off"] else "-"
        print(f"| {row['workload']} | {row['concurrency']} | {row['method']} | {row['tok_s']:.1f} | {ratio} | "
              f"{row['tokens_per_step']:.2f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"device": args.device, "dtype": dtype, "threads": args.threads, "model": str(args.model_dir),
                "speculative_tokens": args.speculative_tokens, "tree_width": args.tree_width, "rounds": args.rounds,
                "methods": methods}
        args.json.write_text(json.dumps({"settings": meta, "results": results}, indent=2, default=str))


if __name__ == "__main__":
    main()
