"""Decode tokens/s of the worker on CUDA: streams x speculation x step path, on a random-weight 1B Llama.

Writes a Llama-3.2-1B-shaped model (2048 hidden, 16 layers, 32 query and 8 KV heads, 8192 MLP, a 32000-token
vocabulary: 1.1B parameters) with random bfloat16 weights, loads one worker generator with prompt-lookup
speculation available, and for each step path (eager with the gathered context + SDPA; eager with the Triton
paged kernel; CUDA graphs, which replay the Triton kernel) and each speculation setting (off:
`speculative_tokens=0` per request; prompt lookup with up to 4 drafts, adaptive) runs 1, 16 and 64 streams
together: a prompt of `--prompt-tokens`, then `--new-tokens` greedy tokens each. Each configuration runs twice
and the second run is timed (the first compiles kernels, captures graphs and grows the allocator), from the
step after the one that prefilled the prompts. Also reports the share of greedy tokens each path chose equal to
the SDPA path's (bfloat16 rounding may flip a near tie of a random model, after which the texts differ; the
share is reported, not asserted: the exactness checks are the tests).

    python benchmark/cuda_decode.py --json OUT/benchmark.json [--streams 1 16 64] [--new-tokens 64]

A configuration that fails is reported with its error and the others still run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("server", "kernels", "proto", "testing")]

import torch  # noqa: E402

from specula_kernels import paged_attention as paged_attention_module  # noqa: E402

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=32000)
TINY = dict(LLAMA_1B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)  # `--tiny`: the script's own check on CPU (tests/test_gpu_check.py)


def write_model(out_dir: Path, device: torch.device, shape: dict, seed: int = 0, std: float = 0.02) -> Path:
    """A random Llama checkpoint in the Hugging Face layout (bfloat16 safetensors, config, a small tokenizer),
    its weights drawn on `device` (drawing 1.1B values on the CPU takes longer than the whole benchmark)."""
    from safetensors.torch import save_file

    from specula_testing.tokenizer import build_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir)  # ids beyond its vocabulary detokenize as nothing; the model's vocabulary is larger
    tok = json.loads((out_dir / "tokenizer.json").read_text())
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    hidden, inter, heads, kv_heads = (shape[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                         "num_key_value_heads"))
    head_dim = hidden // heads
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", max_position_embeddings=4096,
                  rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
                  bos_token_id=special.get("<s>"), eos_token_id=special.get("</s>"), **shape)
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    gen = torch.Generator(device).manual_seed(seed)

    def draw(*size: int, mean: float = 0.0) -> torch.Tensor:
        return (torch.randn(size, generator=gen, device=device) * std + mean).to(torch.bfloat16).cpu()

    tensors = {"model.embed_tokens.weight": draw(shape["vocab_size"], hidden),
               "model.norm.weight": draw(hidden, mean=1.0), "lm_head.weight": draw(shape["vocab_size"], hidden)}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}"
        tensors |= {f"{p}.self_attn.q_proj.weight": draw(heads * head_dim, hidden),
                    f"{p}.self_attn.k_proj.weight": draw(kv_heads * head_dim, hidden),
                    f"{p}.self_attn.v_proj.weight": draw(kv_heads * head_dim, hidden),
                    f"{p}.self_attn.o_proj.weight": draw(hidden, heads * head_dim),
                    f"{p}.mlp.gate_proj.weight": draw(inter, hidden), f"{p}.mlp.up_proj.weight": draw(inter, hidden),
                    f"{p}.mlp.down_proj.weight": draw(hidden, inter),
                    f"{p}.input_layernorm.weight": draw(hidden, mean=1.0),
                    f"{p}.post_attention_layernorm.weight": draw(hidden, mean=1.0)}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def prompts(num_streams: int, length: int) -> list[list[int]]:
    """Per stream a prompt that repeats a phrase of its own, so prompt lookup finds n-grams to draft from."""
    return [[1] + [(37 * s + 11 * (j % 24)) % 30000 + 3 for j in range(length - 1)] for s in range(num_streams)]


def run_streams(generator, num_streams: int, args, speculative_tokens: int) -> dict:
    from specula_server.request import StepPlan
    from specula_testing.worker import BlockPool, make_spec

    pool = BlockPool(generator.kv_cache.num_blocks, generator.block_size)
    specs = [make_spec(i, prompt, pool, max_new_tokens=args.new_tokens, lookahead=args.speculative_tokens,
                       speculative_tokens=speculative_tokens)
             for i, prompt in enumerate(prompts(num_streams, args.prompt_tokens))]
    tokens: dict[int, list[int]] = {i: [] for i in range(num_streams)}
    drafted = accepted = steps = 0

    def collect(outputs) -> None:
        nonlocal drafted, accepted
        for o in outputs:
            if o.error:
                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
            tokens[o.request_id].extend(t.id for t in o.tokens)
            drafted, accepted = drafted + o.num_drafted, accepted + o.num_accepted

    collect(generator.step(StepPlan(new=specs)).outputs)  # the prefill step and the first tokens: not timed
    first = sum(map(len, tokens.values()))
    sync(generator.device)
    start = time.perf_counter()
    while generator.requests:
        collect(generator.step(StepPlan()).outputs)
        steps += 1
    sync(generator.device)
    elapsed = time.perf_counter() - start
    decoded = sum(map(len, tokens.values())) - first
    return dict(streams=num_streams, decode_tokens=decoded, steps=steps, seconds=round(elapsed, 4),
                tokens_per_s=round(decoded / elapsed, 1), ms_per_step=round(1000 * elapsed / max(steps, 1), 2),
                drafted=drafted, accepted=accepted, tokens=tokens)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="an existing model directory (default: write the 1B model)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--speculative-tokens", type=int, default=4)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model on CPU: checks the script, times nothing")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from specula_testing.worker import load_test_generator

    shape = TINY if args.tiny else LLAMA_1B
    report: dict = dict(gpu=torch.cuda.get_device_name(0) if device.type == "cuda" else "none (CPU)",
                        torch=torch.__version__, model=shape,
                        prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, runs=[], errors=[])
    real_use_triton = paged_attention_module.use_triton
    paths = {"sdpa": (False, False), "triton": (True, False), "graphs": (True, True)}  # (triton, graphs)

    def never(*args) -> bool:
        return False

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        model_dir = args.model_dir or write_model(Path(tmp) / "model", device, shape)
        report["model_write_s"] = round(time.perf_counter() - start, 1)
        per_seq = args.prompt_tokens + args.new_tokens + args.speculative_tokens
        num_blocks = max(args.streams) * -(-per_seq // 16) + 16
        start = time.perf_counter()
        # Graphs for the benchmark's batch sizes only (each is in the server's default list), to keep the capture short.
        generator = load_test_generator(model_dir, num_blocks=num_blocks, dtype="bfloat16", device=device.type,
                                        speculative_tokens=args.speculative_tokens, cuda_graphs=tuple(args.streams))
        report["load_s"] = round(time.perf_counter() - start, 1)
        start = time.perf_counter()
        generator.capture_graphs()  # as a server's warmup does: no timed step waits for a capture
        report["capture_s"] = round(time.perf_counter() - start, 1)
        runner = generator.graphs
        report["graphs_unavailable"] = generator.graphs_unavailable()
        # Each configuration under every path in turn, so a time limit leaves complete sets.
        for speculation in ("off", "prompt_lookup"):
            k = 0 if speculation == "off" else args.speculative_tokens
            for num_streams in args.streams:
                for attention, (triton, graphs) in paths.items():
                    if graphs and runner is None:
                        continue
                    paged_attention_module.use_triton = real_use_triton if triton else never
                    generator.graphs = runner if graphs else None
                    name = f"{attention}/{speculation}/{num_streams}"
                    try:
                        run_streams(generator, num_streams, args, k)  # warm-up: compiles, captures, allocates
                        result = run_streams(generator, num_streams, args, k)
                    except Exception as error:  # noqa: BLE001 - reported, the other configurations still run
                        report["errors"].append(dict(run=name, error=repr(error), trace=traceback.format_exc()))
                        print(f"{name}: FAILED {error!r}", flush=True)
                        generator.requests.clear()
                        save(report, args.json)
                        continue
                    result |= dict(attention=attention, speculation=speculation)
                    report["runs"].append(result)
                    save(report, args.json)  # what ran so far survives a time limit
                    print(f"{name}: {result['tokens_per_s']} tokens/s, {result['ms_per_step']} ms/step, "
                          f"{result['accepted']}/{result['drafted']} drafts accepted", flush=True)
        paged_attention_module.use_triton = real_use_triton
        generator.graphs = runner
        if runner is not None:
            report["graphs_captured"] = len(runner.graphs)
    save(report, args.json)
    print(json.dumps(summary(report), indent=1))


def summary(report: dict) -> dict:
    """The report without the token ids, each run past SDPA's with the share of its tokens equal to SDPA's."""
    runs = report["runs"]
    by_key = {(r["speculation"], r["streams"], r["attention"]): r for r in runs}
    out = []
    for r in runs:
        r = dict(r)
        other = by_key.get((r["speculation"], r["streams"], "sdpa"))
        if r["attention"] != "sdpa" and other is not None:
            pairs = [(a, b) for i in r["tokens"] for a, b in zip(r["tokens"][i], other["tokens"][i])]
            r["same_tokens_as_sdpa"] = round(sum(a == b for a, b in pairs) / max(len(pairs), 1), 4)
        del r["tokens"]
        out.append(r)
    return {**report, "runs": out}


def save(report: dict, path: Path | None) -> None:
    if path is not None:
        path.write_text(json.dumps(summary(report), indent=1))


if __name__ == "__main__":
    main()
