"""Structured output in the worker: what a grammar costs a decode step, and what its forced tokens bring.

Three measurements, each side by side in one run:

- `step`: a batch of `--batch` requests decoding under a JSON schema with free-text strings (every step
  computes a real mask) vs the same batch unconstrained, on the 134M random Llama with a 32000-token byte-level
  BPE trained on Python's own sources (masks cost more the larger the vocabulary, so the test tokenizers'
  512 tokens would flatter them). The two batches take turns step by step, the order reversing every step;
  reported: median step time of each and the median paired ratio.
- `forced`: JSON extraction with long fixed keys on the demo model, greedy, one request at a time and
  `--concurrency` at once: speculation off, prompt lookup without the grammar's forced-token drafts, and with
  them. Reported: tokens per step and tokens per second (median over rounds), and the ratios.
- `compile`: time to compile each grammar of the test set against the 32000-token tokenizer (a fresh matcher
  each time: the worker's cache would make every repeat free).

    python benchmark/structured_output.py                 # all three
    python benchmark/structured_output.py --only forced --rounds 5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("server", "kernels", "proto", "router", "benchmark", "testing")]

import llguidance  # noqa: E402
import torch  # noqa: E402
from structured_output_grammars import EXTRACTION_SCHEMA, FREE_TEXT_SCHEMA, JSON_SCHEMAS, REGEXES  # noqa: E402

from specula_server.params import SamplingParams  # noqa: E402
from specula_server.request import StepPlan  # noqa: E402
from specula_testing.code_corpus import read_sources, source_files  # noqa: E402
from specula_testing.models import BENCHMARK_125M, build_tiny_model  # noqa: E402
from specula_testing.tokenizer import build_tokenizer  # noqa: E402
from specula_testing.worker import BlockPool, load_test_generator, make_spec  # noqa: E402

DEMO = REPO / "launcher" / "specula_launcher" / "demo_model"
JSON_OPTIONS = {"whitespace_flexible": False}  # what the router compiles schemas with

EXTRACTION_PROMPTS = [
    "def parse_order(record):\n    # returns the order as a dict\n    return ",
    "# Order 1182: Jane Doe, jane@example.com, ships to Lyon (FR), 45.10 EUR, priority, deliver mornings\norder = ",
    "class Customer:\n    def to_json(self):\n        return ",
    "import json\n\ndata = json.loads(text)\nresult = ",
]


def grammars_to_compile() -> dict[str, str]:
    """The benchmark's JSON schemas and regexes (`structured_output_grammars.py`) and a forced tool call."""
    out = {name: llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
           for name, schema in JSON_SCHEMAS.items()}
    out.update((name, llguidance.LLMatcher.grammar_from_regex(regex)) for name, regex in REGEXES.items())
    from specula_router.tool_call_grammar import HERMES, tool_call_grammar
    from specula_testing.chat_templates import WEATHER_TOOL

    out["tool call (Hermes, required)"] = tool_call_grammar([WEATHER_TOOL], "required", HERMES).text
    return out


def big_tokenizer_model(root: Path) -> Path:
    """The 134M random Llama with a 32000-token byte-level BPE trained on the standard library's sources."""
    model_dir = build_tiny_model(root / "model", "llama", **BENCHMARK_125M)
    texts = read_sources(source_files(held_out=False))
    size = build_tokenizer(model_dir, vocab_size=BENCHMARK_125M["vocab_size"], corpus=texts)
    print(f"tokenizer: {size} tokens trained on {sum(map(len, texts)) / 1e6:.1f} M characters", flush=True)
    return model_dir


def bench_step(model_dir: Path, batch: int, steps: int, threads: int) -> dict:
    generator = load_test_generator(model_dir, num_blocks=4096)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(FREE_TEXT_SCHEMA, defaults=JSON_OPTIONS)
    tok = generator.tokenizer
    prompt = [1] + tok.encode("# Summarise the module below as JSON\nimport os\n", add_special_tokens=False).ids
    # One generator per side: a worker runs every request it holds in each step.
    times: dict[str, list[float]] = {"free": [], "constrained": []}
    sides = {}
    for name, constrained in (("free", False), ("constrained", True)):
        g = generator if name == "free" else load_test_generator(model_dir, num_blocks=4096)
        offset = 0 if name == "free" else 1000
        specs = [make_spec(offset + i, prompt, BlockPool(4096, 16), max_new_tokens=steps + 8,
                           grammar=grammar if constrained else "",
                           sampling=SamplingParams(do_sample=True, temperature=1.0, seed=offset + i))
                 for i in range(batch)]
        g.step(StepPlan(new=specs))
        sides[name] = g
    for i in range(steps):
        order = ("free", "constrained") if i % 2 == 0 else ("constrained", "free")
        for name in order:
            start_ns = time.perf_counter_ns()
            result = sides[name].step(StepPlan())
            times[name].append((time.perf_counter_ns() - start_ns) / 1e6)
            assert not [o.error for o in result.outputs if o.error]
            assert len(sides[name].requests) == batch, "a request ended early: raise --steps' headroom"
    ratios = [c / f for c, f in zip(times["constrained"], times["free"])]
    out = {"batch": batch, "steps": steps, "threads": threads, "vocab": generator.model.config.vocab_size,
           "free_ms": statistics.median(times["free"]), "constrained_ms": statistics.median(times["constrained"]),
           "ratio": statistics.median(ratios)}
    print(f"step, {batch} requests: free {out['free_ms']:.2f} ms, constrained {out['constrained_ms']:.2f} ms, "
          f"median paired ratio {out['ratio']:.3f}", flush=True)
    return out


def run_extraction(generator, prompts: list[list[int]], grammar: str, concurrency: int) -> tuple[int, int, float]:
    """Runs the prompts `concurrency` at a time (greedy); returns (tokens, steps, seconds)."""
    pool = BlockPool(4096, 16)
    tokens = steps = 0
    start = time.perf_counter()
    for at in range(0, len(prompts), concurrency):
        specs = [make_spec(at + i, p, pool, max_new_tokens=160, lookahead=8, grammar=grammar, ignore_eos_token=False)
                 for i, p in enumerate(prompts[at : at + concurrency])]
        outputs = list(generator.step(StepPlan(new=specs)).outputs)
        steps += 1
        while generator.requests:
            outputs += generator.step(StepPlan()).outputs
            steps += 1
        assert not [o.error for o in outputs if o.error]
        for o in outputs:
            tokens += len(o.tokens)
            if o.generated_text is not None:
                json.loads(o.generated_text.text)  # every output is a complete record
        for s in specs:
            pool.give(s.blocks)
    return tokens, steps, time.perf_counter() - start


def bench_forced(rounds: int, concurrency: list[int]) -> list[dict]:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(EXTRACTION_SCHEMA, defaults=JSON_OPTIONS)
    off = load_test_generator(DEMO, num_blocks=4096)
    ngram = load_test_generator(DEMO, num_blocks=4096, speculative_tokens=6, speculation_mode="adaptive")
    forced = load_test_generator(DEMO, num_blocks=4096, speculative_tokens=6, speculation_mode="adaptive")
    ngram.speculator.config = dataclasses.replace(ngram.speculator.config, grammar_drafts=False)
    variants = {"off": off, "ngram": ngram, "ngram+forced": forced}
    tok = off.tokenizer
    prompts = [[1] + tok.encode(p, add_special_tokens=False).ids for p in EXTRACTION_PROMPTS] * 4
    for generator in variants.values():  # warm up: first forwards, the grammar's compile, the mask thread
        run_extraction(generator, prompts[:4], grammar, 4)
    results = []
    for c in concurrency:
        per = {name: [] for name in variants}
        for r in range(rounds):
            names = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in names:
                per[name].append(run_extraction(variants[name], prompts, grammar, c))
        row = {"concurrency": c}
        for name, runs in per.items():
            row[name] = {"tokens_per_step": statistics.median(t / s for t, s, _ in runs),
                         "tokens_per_s": statistics.median(t / sec for t, _, sec in runs)}
        row["forced_vs_ngram"] = row["ngram+forced"]["tokens_per_s"] / row["ngram"]["tokens_per_s"]
        row["forced_vs_off"] = row["ngram+forced"]["tokens_per_s"] / row["off"]["tokens_per_s"]
        print(f"forced, concurrency {c}: " + ", ".join(
            f"{n} {row[n]['tokens_per_step']:.2f} tok/step {row[n]['tokens_per_s']:.1f} tok/s" for n in variants)
            + f"; with forced drafts {row['forced_vs_ngram']:.2f}x prompt lookup alone, "
              f"{row['forced_vs_off']:.2f}x no speculation", flush=True)
        results.append(row)
    return results


def bench_compile(model_dir: Path, repeats: int) -> dict:
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    start = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.to_str(), n_vocab=BENCHMARK_125M["vocab_size"], eos_token=2)
    tokenizer_ms = (time.perf_counter() - start) * 1e3
    out = {"tokenizer_ms": tokenizer_ms, "grammars": {}}
    for name, grammar in grammars_to_compile().items():
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
            matcher.compute_ff_tokens()
            times.append((time.perf_counter() - start) * 1e3)
            assert not matcher.is_error(), matcher.get_error()
        out["grammars"][name] = statistics.median(times)
    values = list(out["grammars"].values())
    out["median_ms"], out["max_ms"] = statistics.median(values), max(values)
    print(f"compile ({len(values)} grammars, 32000-token tokenizer, median of {repeats}): median "
          f"{out['median_ms']:.2f} ms, max {out['max_ms']:.2f} ms; tokenizer {tokenizer_ms:.0f} ms once", flush=True)
    for name, ms in out["grammars"].items():
        print(f"  {name}: {ms:.2f} ms")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["step", "forced", "compile"], nargs="*")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep-tokenizer", type=Path, help="also copy the 32000-token tokenizer's files here")
    parser.add_argument("--out", type=Path, default=REPO / "benchmark" / "results" / "structured_output.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    only = set(args.only or ["step", "forced", "compile"])
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = big_tokenizer_model(Path(tmp)) if only & {"step", "compile"} or args.keep_tokenizer else None
        if args.keep_tokenizer:
            args.keep_tokenizer.mkdir(parents=True, exist_ok=True)
            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                shutil.copy(model_dir / name, args.keep_tokenizer / name)
        if "compile" in only:
            results["compile"] = bench_compile(model_dir, repeats=5)
        if "step" in only:
            results["step"] = bench_step(model_dir, args.batch, args.steps, args.threads)
        if "forced" in only:
            results["forced"] = bench_forced(args.rounds, args.concurrency)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
