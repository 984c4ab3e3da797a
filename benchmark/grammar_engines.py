"""llguidance vs xgrammar on the grammars of the test set: compile time, and one token mask.

Not a dependency of Specula: run it in a virtualenv that has both engines and transformers (xgrammar reads the
tokenizer through transformers), e.g.

    python -m venv /tmp/engines && /tmp/engines/bin/pip install torch==2.13.0 xgrammar llguidance transformers
    /tmp/engines/bin/python benchmark/grammar_engines.py --tokenizer-dir DIR

DIR holds a `tokenizer.json` (and `tokenizer_config.json`); `benchmark/structured_output.py` trains the
32000-token byte-level BPE it uses into a directory it names with `--keep-tokenizer DIR`. Each engine compiles
each grammar afresh (no cache) `--repeats` times, alternating engines; reported: median ms per grammar, and
median ms for the first token mask of a compiled grammar. llguidance compiles with `whitespace_flexible: false`
and xgrammar with `any_whitespace=False`, so both produce compact JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import llguidance
import torch
import transformers
import xgrammar

sys.path.insert(0, str(Path(__file__).resolve().parent))
from structured_output_grammars import JSON_SCHEMAS, REGEXES  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hf = transformers.AutoTokenizer.from_pretrained(args.tokenizer_dir)
    vocab = len(hf)
    start = time.perf_counter()
    xg_info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    xg_tok_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    ll_tok = llguidance.LLTokenizer(hf.backend_tokenizer.to_str(), n_vocab=vocab, eos_token=hf.eos_token_id)
    ll_tok_ms = (time.perf_counter() - start) * 1e3
    print(f"vocabulary {vocab}; tokenizer setup: llguidance {ll_tok_ms:.0f} ms, xgrammar {xg_tok_ms:.0f} ms (once)")

    def ll_compile(kind: str, text: str):
        grammar = (llguidance.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
                   if kind == "json" else llguidance.LLMatcher.grammar_from_regex(text))
        matcher = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def ll_mask(matcher) -> None:
        matcher.compute_bitmask()

    def xg_compile(kind: str, text: str):
        compiler = xgrammar.GrammarCompiler(xg_info, cache_enabled=False)
        compiled = (compiler.compile_json_schema(text, any_whitespace=False) if kind == "json"
                    else compiler.compile_regex(text))
        return xgrammar.GrammarMatcher(compiled)

    bitmask = xgrammar.allocate_token_bitmask(1, vocab)

    def xg_mask(matcher) -> None:
        matcher.fill_next_token_bitmask(bitmask)

    engines = {"llguidance": (ll_compile, ll_mask), "xgrammar": (xg_compile, xg_mask)}
    grammars = [("json", name, json.dumps(schema)) for name, schema in JSON_SCHEMAS.items()]
    grammars += [("regex", name, regex) for name, regex in REGEXES.items()]
    results = {name: {"compile_ms": {}, "mask_ms": {}} for name in engines}
    print("| grammar | llguidance compile | xgrammar compile | llguidance mask | xgrammar mask |")
    print("|---|---|---|---|---|")
    for kind, name, text in grammars:
        times = {engine: ([], []) for engine in engines}
        for r in range(args.repeats):
            for engine in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                compile_, mask = engines[engine]
                start = time.perf_counter()
                matcher = compile_(kind, text)
                middle = time.perf_counter()
                mask(matcher)
                end = time.perf_counter()
                times[engine][0].append((middle - start) * 1e3)
                times[engine][1].append((end - middle) * 1e3)
        for engine, (compiles, masks) in times.items():
            results[engine]["compile_ms"][name] = statistics.median(compiles)
            results[engine]["mask_ms"][name] = statistics.median(masks)
        ll, xg = results["llguidance"], results["xgrammar"]
        print(f"| {name} | {ll['compile_ms'][name]:.2f} | {xg['compile_ms'][name]:.2f} | {ll['mask_ms'][name]:.3f} | "
              f"{xg['mask_ms'][name]:.3f} |", flush=True)
    for engine in engines:
        values = list(results[engine]["compile_ms"].values())
        print(f"{engine}: compile median {statistics.median(values):.2f} ms, max {max(values):.2f} ms")


if __name__ == "__main__":
    main()
