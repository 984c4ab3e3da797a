"""Suffix decoding vs prompt lookup vs both vs off, in the worker, side by side, on the demo model.

Settings (adaptive draft lengths, `--speculative-tokens` drafts at most, as the server runs by default):

    off      no speculation
    ngram    prompt lookup (the default drafter)
    suffix   `--speculator suffix` without prompt lookup behind it
    both     `--speculator suffix` as served: suffix trees, prompt lookup where they have nothing

Workloads:

- `agentic`: a replay of an agent writing code (`agentic_requests`): per session it writes a continuation of a
  held-out block, retries the same request, rewrites the file it wrote (a rename edit, as the demo model was
  trained on) and writes the first one again after a line of feedback. The answers were recorded with greedy
  decoding; every setting replays the same requests, c sessions at a time (continuous batching, c requests in
  flight). The global suffix trees start empty at every measurement.
- `copy` and `novel`: `benchmark/speculation.py`'s (an edit task alone; sampling new code at temperature 1).

Reports generated tokens/s and tokens per decode step per setting and concurrency, the ratios, a second
identical request's time against the first's (concurrency 1, greedy, in the worker, prefix caching aside),
tokens per step by kind of agentic request, what suffix drafting costs per request it drafts for, and the share
of each setting's time its speculator takes (choosing, drafting, letting requests go: on novel text, what
speculation costs where nothing verifies). With `--served-retry N`, also the second identical request through
the HTTP API of launched servers (off, and `--speculator suffix`), where prefix caching spares the retry its
prefill too. `--novel-spread` gives novel requests different lengths.

    python benchmark/suffix_decoding.py --suffix-backend native --concurrency 1 4 16 64 --served-retry 8 \
        --json benchmark/results/suffix_decoding.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from speculation import (  # noqa: E402
    DEMO_MODEL,
    add_run_arguments,
    paired_ratio,
    run_continuous,
    side_by_side,
    workload_requests,
)

from specula_server.speculation.speculator import Speculator  # noqa: E402
from specula_server.speculation.suffix import SuffixDrafter  # noqa: E402
from specula_server.warmup import calibrate_step_cost  # noqa: E402
from specula_testing import code_corpus  # noqa: E402
from specula_testing.worker import BlockPool, generate_alone, load_test_generator, make_spec  # noqa: E402

SETTINGS = ("off", "ngram", "suffix", "both")


def suffix_drafter(generator) -> SuffixDrafter | None:
    drafter = generator.speculation.drafter if generator.speculation is not None else None
    inner = getattr(drafter, "fallback", None)
    return inner if isinstance(inner, SuffixDrafter) else None


def load(model_dir: Path, name: str, tokens: int, blocks: int, dtype: str, device: str):
    extra = {} if name == "off" else {"speculative_tokens": tokens, "speculation_mode": "adaptive"}
    if name in ("suffix", "both"):
        extra["speculator"] = "suffix"
    generator = load_test_generator(model_dir, num_blocks=blocks, dtype=dtype, device=device, **extra)
    if name == "suffix":
        suffix_drafter(generator).fallback = None  # suffix trees alone
    if generator.speculation is not None:
        calibrate_step_cost(generator)  # what the server's warmup does
    return generator


def forget(generator) -> None:
    """Empties the global suffix trees: each measurement starts without outputs of earlier ones."""
    drafter = suffix_drafter(generator)
    if drafter is not None:
        drafter.cache.__init__(drafter.cache.cache_tokens, drafter.cache.depth)


def alone(generator, ids: list[int], max_new_tokens: int):
    """One request run to completion alone, stopping at EOS or `max_new_tokens`: its output of every step."""
    spec = make_spec(0, ids, BlockPool(generator.kv_cache.num_blocks, generator.block_size),
                     max_new_tokens=max_new_tokens, ignore_eos_token=False)
    return generate_alone(generator, spec)


def answer(generator, ids: list[int], max_new_tokens: int) -> list[int]:
    return [t.id for o in alone(generator, ids, max_new_tokens) for t in o.tokens]


def agentic_requests(plain, tokenizer, sessions: int, seed: int, concurrency: int, new_tokens: int) -> list[dict]:
    """Sessions of an agent writing code, 4 requests each, replayed from greedy answers recorded with `plain`:

        1. write: continue a held-out code block (new text: little to copy from the prompt)
        2. retry: the same request again (a tool call that timed out, a failed parse)
        3. rewrite: a rename edit of the file it wrote (prompt and answer = its own output, one name changed)
        4. regenerate: the first request again after a line of feedback (the answer mostly repeats the first)

    Grouped by `concurrency` sessions: the group's first requests, then their retries, and so on, so each request
    follows the ones it repeats."""
    import random

    starts = code_corpus.held_out_code(sessions, num_chars=300, seed=seed)
    names = code_corpus.identifier_pool(code_corpus.read_sources(code_corpus.source_files(held_out=True)), seed=seed)
    rng = random.Random(seed)
    rounds: list[list[dict]] = [[], [], [], []]
    for start in starts:
        ids = tokenizer.encode(start).ids
        written = tokenizer.decode(answer(plain, ids, new_tokens), skip_special_tokens=True)
        edit = None
        for _ in range(20):
            edit = edit or code_corpus.rename_edit(start + written, rng, names)
        edit_ids = tokenizer.encode(edit.prompt).ids if edit else ids
        edit_tokens = len(tokenizer.encode(edit.answer, add_special_tokens=False).ids) + 16 if edit else new_tokens
        feedback = tokenizer.encode("# the previous version failed its tests; write it again\n" + start).ids
        for r, (prompt, limit) in enumerate([(ids, new_tokens), (ids, new_tokens), (edit_ids, edit_tokens),
                                             (feedback, new_tokens)]):
            rounds[r].append({"ids": prompt, "greedy": True, "eos": True, "max_new_tokens": limit})
    ordered = []
    for group in range(0, sessions, concurrency):
        for r in rounds:
            ordered += r[group : group + concurrency]
    return ordered


def retry_speedup(generator, requests: list[dict], count: int, repeats: int = 3) -> float:
    """Median over sessions of (first request's seconds / its retry's seconds), alone, the cache emptied before
    each first request. Each pair runs `repeats` times and each request's median time counts: one 64-token
    request takes 30-120 ms here, and a single pause of the VM would decide a single pair."""
    ratios = []
    for i in range(count):
        first, retry = requests[4 * i], requests[4 * i + 1]  # concurrency-1 grouping: 4 per session
        times: list[list[float]] = [[], []]
        for _ in range(repeats):
            forget(generator)
            for k, request in enumerate((first, retry)):
                start = time.perf_counter()
                alone(generator, request["ids"], request["max_new_tokens"])
                times[k].append(time.perf_counter() - start)
        ratios.append(statistics.median(times[0]) / statistics.median(times[1]))
    return statistics.median(ratios)


def spread(requests: list[dict], tokens: int, seed: int) -> None:
    """Gives each request its own length, within `tokens` of its own (seeded, the same for every setting)."""
    import random

    rng = random.Random(seed)
    for r in requests:
        r["max_new_tokens"] = max(1, r["max_new_tokens"] + rng.randint(-tokens, tokens))


KINDS = ("write", "retry", "rewrite", "regenerate")  # an agentic session's requests, in order


def tokens_per_step_by_kind(generator, requests: list[dict], sessions: int) -> dict[str, float]:
    """The concurrency-1 replay (`requests` grouped one session at a time), each request alone: tokens per
    step (prefill included) of each kind of request, over all sessions. Tells which requests a drafter speeds."""
    forget(generator)
    tokens, steps = [0] * len(KINDS), [0] * len(KINDS)
    for i in range(sessions):
        for k in range(len(KINDS)):
            request = requests[4 * i + k]
            outputs = alone(generator, request["ids"], request["max_new_tokens"])
            tokens[k] += sum(len(o.tokens) for o in outputs)
            steps[k] += len(outputs)
    return {kind: t / max(n, 1) for kind, t, n in zip(KINDS, tokens, steps)}


def served_retry(model_dir: Path, sessions: int, new_tokens: int, speculative_tokens: int, seed: int
                 ) -> dict[str, float]:
    """A second identical request against the first, through the HTTP API of a launched server (prefix caching
    on, as by default): median over `sessions` distinct code prompts of the first request's seconds over its
    retry's, for a server without speculation (`off`: what prefix caching alone saves the retry) and one with
    `--speculator suffix` (`both`, as served). Greedy, stopping at EOS or `new_tokens`; both requests of a pair
    must generate the same text."""
    import httpx
    from http_load import served

    prompts = code_corpus.held_out_code(sessions, num_chars=300, seed=seed)
    servers = {"off": [], "both": ["--speculator", "suffix", "--speculative-tokens", str(speculative_tokens)]}
    medians = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in servers.items():
            with served(model_dir, Path(tmp), extra) as url, httpx.Client(timeout=600) as client:
                def generate(prompt: str) -> tuple[float, str]:
                    start = time.perf_counter()
                    r = client.post(f"{url}/generate", json={"inputs": prompt,
                                                             "parameters": {"max_new_tokens": new_tokens}})
                    r.raise_for_status()
                    return time.perf_counter() - start, r.json()["generated_text"]

                generate("def warm_up():")
                ratios = []
                for prompt in prompts:
                    (first, text), (retry, again) = generate(prompt), generate(prompt)
                    assert text == again, "a retry answered differently"
                    ratios.append(first / retry)
                medians[name] = statistics.median(ratios)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=DEMO_MODEL)
    parser.add_argument("--workload", nargs="+", default=["agentic", "copy", "novel"],
                        choices=["agentic", "copy", "novel"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--speculative-tokens", type=int, default=6)
    parser.add_argument("--min-sessions", type=int, default=4, help="agentic sessions per measurement at least")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per request (novel, agentic writes)")
    parser.add_argument("--suffix-backend", choices=["auto", "native", "python"], default="auto",
                        help="suffix trees: Arctic Inference's C++ (native, the default where installed) or Python")
    parser.add_argument("--novel-spread", type=int, default=0, metavar="TOKENS",
                        help="novel requests generate --new-tokens give or take up to this many (seeded): without "
                             "it, every request of a turn ends at the same step unless drafts were accepted, so "
                             "requests without speculation join and prefill in batches of c, and with it one by one")
    parser.add_argument("--served-retry", type=int, default=0, metavar="SESSIONS",
                        help="also time a second identical request through the HTTP API of launched servers, over "
                             "this many prompts (prefix caching on, as served)")
    add_run_arguments(parser)
    args = parser.parse_args()
    args.min_requests = 4 * args.min_sessions
    if args.suffix_backend != "auto":
        import os

        os.environ["SPECULA_SUFFIX_BACKEND"] = args.suffix_backend  # read when the drafters are built
    torch.set_num_threads(args.threads)
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.model_dir / "tokenizer.json"))
    blocks = max(args.concurrency) * 40 + 64
    generators = {name: load(args.model_dir, name, args.speculative_tokens, blocks, dtype, args.device)
                  for name in SETTINGS}
    draft_ns = [0, 0]  # suffix drafting: nanoseconds, requests drafted for
    original = SuffixDrafter.propose

    def timed(self, requests, max_tokens):
        start = time.perf_counter_ns()
        out = original(self, requests, max_tokens)
        draft_ns[0] += time.perf_counter_ns() - start
        draft_ns[1] += sum(1 for k in max_tokens if k > 0)
        return out

    SuffixDrafter.propose = timed
    # Per setting, the seconds of its turns and of its speculator's own work in them (choosing drafts, drafting,
    # and letting finished requests go): on novel text, where nothing is verified, that work is what speculation
    # costs, measured without the turn-to-turn noise of the machine that a throughput ratio carries.
    names = {id(g): name for name, g in generators.items()}
    speculator_names = {id(g.speculator): name for name, g in generators.items() if g.speculator is not None}
    turn_s: dict[str, float] = {}
    speculator_s: dict[str, float] = {}

    def timed_turn(generator, *turn_args):
        start = time.perf_counter()
        out = run_continuous(generator, *turn_args)
        name = names[id(generator)]
        turn_s[name] = turn_s.get(name, 0.0) + time.perf_counter() - start
        return out

    def timing(method):
        def timed_method(self, *method_args):
            start = time.perf_counter()
            try:
                return method(self, *method_args)
            finally:
                name = speculator_names[id(self)]
                speculator_s[name] = speculator_s.get(name, 0.0) + time.perf_counter() - start
        return timed_method

    Speculator.plan, Speculator.release = timing(Speculator.plan), timing(Speculator.release)
    results = []
    with tempfile.TemporaryDirectory():
        for workload in args.workload:
            for c in args.concurrency:
                sessions = max(c, args.min_sessions)
                if workload == "agentic":
                    requests = agentic_requests(generators["off"], tokenizer, sessions, args.seed, c, args.new_tokens)
                else:
                    requests = workload_requests(workload, args.model_dir, 4 * sessions, args)
                    if workload == "novel" and args.novel_spread:
                        spread(requests, args.novel_spread, args.seed)
                turn_s.clear()
                speculator_s.clear()
                samples = side_by_side(generators, requests, c, args.rounds, args.speculative_tokens + 1,
                                       continuous=True, before=forget, run=timed_turn)
                row = {"workload": workload, "concurrency": c, "requests": len(requests)}
                for name in SETTINGS[1:]:
                    row[f"{name}_speculator_share"] = speculator_s.get(name, 0.0) / turn_s[name]
                for name, values in samples.items():
                    row[f"{name}_tok_s"] = statistics.median(v[0] for v in values)
                    row[f"{name}_tokens_per_step"] = statistics.median(v[1] for v in values)
                for name in SETTINGS[1:]:
                    row[f"{name}_vs_off"] = paired_ratio(samples[name], samples["off"])
                row["suffix_vs_ngram"] = paired_ratio(samples["suffix"], samples["ngram"])
                row["both_vs_ngram"] = paired_ratio(samples["both"], samples["ngram"])
                results.append(row)
                print(json.dumps(row), flush=True)
        retry, by_kind = {}, {}
        if "agentic" in args.workload:
            requests = agentic_requests(generators["off"], tokenizer, args.min_sessions, args.seed, 1, args.new_tokens)
            retry = {name: retry_speedup(generators[name], requests, args.min_sessions) for name in SETTINGS}
            print(json.dumps({"retry_speedup": retry}), flush=True)
            by_kind = {name: tokens_per_step_by_kind(generators[name], requests, args.min_sessions)
                       for name in SETTINGS}
            print(json.dumps({"tokens_per_step_by_kind": by_kind}), flush=True)
    served = {}
    if args.served_retry:
        served = served_retry(args.model_dir, args.served_retry, args.new_tokens, args.speculative_tokens, args.seed)
        print(json.dumps({"served_retry_speedup": served}), flush=True)
    cost_us = draft_ns[0] / max(draft_ns[1], 1) / 1e3
    print("\n| workload | c | off tok/s | ngram | suffix | both | suffix/ngram | both/ngram | tokens/step "
          "(ngram / suffix / both) | speculator's share of the time (ngram / suffix / both) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['workload']} | {r['concurrency']} | {r['off_tok_s']:.0f} | {r['ngram_vs_off']:.2f}x | "
              f"{r['suffix_vs_off']:.2f}x | {r['both_vs_off']:.2f}x | {r['suffix_vs_ngram']:.2f}x | "
              f"{r['both_vs_ngram']:.2f}x | {r['ngram_tokens_per_step']:.2f} / {r['suffix_tokens_per_step']:.2f} / "
              f"{r['both_tokens_per_step']:.2f} | "
              + " / ".join(f"{100 * r[f'{name}_speculator_share']:.1f}%" for name in SETTINGS[1:]) + " |")
    if retry:
        print("\nsecond identical request vs the first, alone (time ratio): "
              + ", ".join(f"{k} {v:.2f}x" for k, v in retry.items()))
    if by_kind:
        print("\nagentic replay, one request at a time: tokens per step by kind of request")
        print("| setting | " + " | ".join(KINDS) + " |")
        print("|---|" + "---|" * len(KINDS))
        for name, row in by_kind.items():
            print(f"| {name} | " + " | ".join(f"{row[k]:.2f}" for k in KINDS) + " |")
    if served:
        print("second identical request vs the first, through the HTTP API (prefix caching on): "
              + ", ".join(f"{k} {v:.2f}x" for k, v in served.items()))
    backend = suffix_drafter(generators["suffix"]).backend
    print(f"suffix drafting ({backend} trees): {cost_us:.0f} us per request drafted for")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                         "results": results, "retry_speedup": retry,
                                         "served_retry_speedup": served,
                                         "tokens_per_step_by_kind": by_kind,
                                         "suffix_draft_us_per_request": cost_us}, indent=2))


if __name__ == "__main__":
    main()
