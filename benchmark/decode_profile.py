"""Where one decode step's milliseconds go: a per-operator profile of the worker at one stream, against the
memory-bandwidth floor of its precision.

Loads a model into the worker (by default the real model, SmolLM2-135M-Instruct from its GGUF), prefills one
prompt, then decodes one stream step by step. Two passes over the same steps:

- untimed: the worker as it serves (all layers in one native call where the model fits it, unless
  `SPECULA_NATIVE_STACK=0`), `ms/step` the median over the steps;
- timed: layer by layer, every operator of the decode path wrapped with a wall-clock timer (the four products of
  each layer and the LM head, the norms, rotary + cache write, attention, SiLU, the embedding), so the step splits
  into operators, the model's Python between them (`layer glue`), and the step's own work around the model
  (`step outside the model`: batch building, sampling, outputs). The timers cost a little (reported: the timed
  pass's step against the untimed one).

Between the two, the step that prefills the prompt (`--prompt-tokens`) is timed three times (median; and three
times more with the timed pass's timers, which split it by operator as they split a decode step), and where
the layers run as one native call, the untimed steps run again with the native stack reading its clock after each
operator of each layer (the team's first thread, after the barrier that ends the operator), which splits that call
without leaving it.

Each product is reported with the bytes it reads and the bandwidth it reaches; the floor is the step's weight
bytes at the bandwidth of a large sum (`worker_decode.measure_bandwidth`).

With several precisions, one after another, a drift of the machine between them reads as a difference of the
precisions (on a shared VM, a tenth or more). So the precisions' untimed steps then also take turns, step by step
(the order reversing every step), `--rounds` times `--steps` steps, the bandwidth measured again before each
round; each round's medians and shares of that round's floor are reported last.

    python benchmark/decode_profile.py                          # real model, float32, 2 threads
    python benchmark/decode_profile.py --quantize int8 int4     # several precisions, then taking turns
    python benchmark/decode_profile.py --quantize gguf          # the file's own Q4_1 / Q8_0 blocks
    python benchmark/decode_profile.py --quantize --eagle3 DIR  # only what an EAGLE-3 drafter's capture costs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("server", "kernels", "proto", "benchmark", "testing")]

import torch  # noqa: E402
from worker_decode import measure_bandwidth  # noqa: E402

from specula_kernels.decode_layers import OPERATORS  # noqa: E402
from specula_server.request import StepPlan  # noqa: E402
from specula_testing.worker import BlockPool, load_test_generator, make_spec  # noqa: E402

REAL_MODEL = Path.home() / ".cache" / "specula" / "real-model" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PRODUCTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


class Timers:
    """Wall-clock totals per operator name; wraps callables and module forwards in place."""

    def __init__(self) -> None:
        self.total = defaultdict(float)
        self.calls = defaultdict(int)
        self.enabled = False
        self._undo = []

    def wrap(self, owner, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)

        def timed(*args, **kwargs):
            if not self.enabled:
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.total[name] += time.perf_counter() - start
                self.calls[name] += 1

        setattr(owner, attribute, timed)
        self._undo.append((owner, attribute, original))

    def restore(self) -> None:
        for owner, attribute, original in reversed(self._undo):
            setattr(owner, attribute, original)
        self._undo.clear()

    def reset(self) -> None:
        self.total.clear()
        self.calls.clear()


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes held by a module's tensors (parameters, buffers, and plain tensor attributes of its submodules such as
    packed or quantized weights)."""
    seen, total = set(), 0
    for sub in module.modules():
        for value in list(vars(sub).values()) + list(sub._parameters.values()) + list(sub._buffers.values()):
            if isinstance(value, torch.Tensor) and id(value) not in seen:
                seen.add(id(value))
                try:
                    total += value.numel() * value.element_size()
                except (RuntimeError, NotImplementedError):  # opaque tensors: fall back on the dense shape
                    total += value.numel() * 4
    return total


def instrument(model, timers: Timers) -> dict[str, int]:
    """Wraps the decode path's operators; returns the weight bytes each product reads per step."""
    from specula_server.models import llama

    for fn in ("rotary_and_cache", "paged_attention", "silu_and_mul"):
        timers.wrap(llama, fn, fn)
    bytes_read = defaultdict(int)
    for layer in model.layers:
        for name, module in (("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                             ("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)):
            timers.wrap(module, "forward", name)
            bytes_read[name] += weight_bytes(module)
        timers.wrap(layer.input_layernorm, "forward", "rms_norm")
        timers.wrap(layer.post_attention_layernorm, "add_and_norm", "add_rms_norm")
        timers.wrap(layer, "forward", "layer")
    timers.wrap(model.norm, "forward", "rms_norm")
    timers.wrap(model.embed_tokens, "forward", "embedding")
    timers.wrap(model.rotary, "tables", "rotary_tables")
    timers.wrap(model.lm_head, "forward", "lm_head")
    bytes_read["lm_head"] = weight_bytes(model.lm_head)
    timers.wrap(model, "forward_with_aux", "model")
    timers.wrap(model, "compute_logits", "logits")
    return bytes_read


def synthetic_prompt(num_tokens: int) -> list[int]:
    """The prompt every pass decodes after: `num_tokens` ids spread over the vocabulary's first 4,000."""
    return [1] + [(7 * i) % 4000 + 3 for i in range(num_tokens - 1)]


def decode_steps(generator, prompt: list[int], steps: int, timers: Timers | None = None, **request) -> list[float]:
    """Prefills `prompt` and decodes `steps` tokens one step at a time; returns each decode step's seconds.
    `timers` run during the decode steps only; `request`: more fields of the request (`RequestSpec`)."""
    spec = make_spec(0, prompt, BlockPool(generator.kv_cache.num_blocks, generator.block_size),
                     max_new_tokens=steps + 1, **request)
    generator.step(StepPlan(new=[spec]))
    times = []
    if timers is not None:
        timers.enabled = True
    for _ in range(steps):
        start = time.perf_counter()
        generator.step(StepPlan())
        times.append(time.perf_counter() - start)
    if timers is not None:
        timers.enabled = False
    while generator.requests:
        generator.step(StepPlan())
    return times


def prefill_seconds(generator, prompt: list[int], rounds: int = 3) -> list[float]:
    """Seconds of the step that prefills `prompt` (and samples its first token), `rounds` times."""
    times = []
    for _ in range(rounds):
        spec = make_spec(0, prompt, BlockPool(generator.kv_cache.num_blocks, generator.block_size), max_new_tokens=1)
        start = time.perf_counter()
        generator.step(StepPlan(new=[spec]))
        times.append(time.perf_counter() - start)
        while generator.requests:
            generator.step(StepPlan())
    return times


def profile(model_path: Path, quantize: str | None, args, keep: list | None = None) -> dict:
    """The untimed and timed passes of one precision (`keep`, when given, receives the generator)."""
    settings = {"quantize": quantize} if quantize else {}
    if quantize:
        settings["quantize_group_size"] = args.group_size
    num_blocks = -(-(args.prompt_tokens + args.steps + 8) // 16) + 1
    generator = load_test_generator(model_path, num_blocks=num_blocks, dtype="float32", **settings)
    model = generator.model
    prompt = synthetic_prompt(args.prompt_tokens)
    decode_steps(generator, prompt, 8)  # warm up
    untimed = decode_steps(generator, prompt, args.steps)
    prefill = prefill_seconds(generator, prompt)
    stack = model._native_stack()
    inside = None
    if stack is not None:  # the same steps again, the native stack reading its clock after every operator
        stack.time_operators()
        stamped = decode_steps(generator, prompt, args.steps)
        inside = {"stamped": stamped, "seconds": dict(zip(OPERATORS, stack.operator_seconds.tolist()))}
        stack.time_operators(False)

    timers = Timers()
    bytes_read = instrument(model, timers)
    stack, model._stack = model._native_stack(), None  # the timers see operators, not inside the one native call
    decode_steps(generator, prompt, 4, timers)
    timers.reset()
    timed = decode_steps(generator, prompt, args.steps, timers)
    per_step = {name: seconds / args.steps for name, seconds in timers.total.items()}
    calls = dict(timers.calls)
    timers.reset()  # the prefill step, its operators timed the same way
    timers.enabled = True
    prefill_timed = prefill_seconds(generator, prompt)
    timers.enabled = False
    prefill_split = {name: seconds / len(prefill_timed) for name, seconds in timers.total.items()}
    timers.restore()
    model._stack = stack

    if keep is not None:
        keep.append(generator)
    return {"untimed": untimed, "prefill": prefill, "inside": inside, "timed": timed, "per_step": per_step,
            "prefill_timed": prefill_timed, "prefill_split": prefill_split, "calls": calls,
            "bytes": dict(bytes_read), "prompt_tokens": len(prompt),
            "total_bytes": weight_bytes(model) - weight_bytes(model.embed_tokens)}


def taking_turns(generators: dict, prompt: list[int], steps: int, rounds: int
                 ) -> tuple[dict[str, list[list[float]]], list[float]]:
    """Untimed decode steps of every generator, one step each in turn (the order reversing every step), over
    `rounds` requests of `steps` steps after `prompt`; returns each one's step seconds per round, and the
    bandwidth measured before each round (the machine's pace moves between rounds, the floor with it)."""
    names = list(generators)
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    bandwidths = []
    for _ in range(rounds):
        bandwidths.append(measure_bandwidth(torch.device("cpu"), repeats=5))
        for name in names:
            times[name].append([])
        for generator in generators.values():
            spec = make_spec(0, prompt, BlockPool(generator.kv_cache.num_blocks, generator.block_size),
                             max_new_tokens=steps + 1)
            generator.step(StepPlan(new=[spec]))
        for step in range(steps):
            for name in names if step % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                generators[name].step(StepPlan())
                times[name][-1].append(time.perf_counter() - start)
        for generator in generators.values():
            while generator.requests:
                generator.step(StepPlan())
    return times, bandwidths


def capture_cost(model_path: Path, args) -> dict[str, list[float]]:
    """Decode steps of one stream (float32) without a drafter, and with an EAGLE-3 drafter loaded (`--eagle3`) on a
    request that drafts nothing, so each step only captures the hidden states the drafter reads: on the native
    stack (one call between captured layers) and layer by layer (how such a server ran every step before). The
    three take turns, `--rounds` times; returns each one's step seconds."""
    num_blocks = -(-(args.prompt_tokens + args.steps + 8) // 16) + 1
    plain = load_test_generator(model_path, num_blocks=num_blocks, dtype="float32")
    eagle = load_test_generator(model_path, num_blocks=num_blocks, dtype="float32", speculator=str(args.eagle3),
                                speculative_tokens=4)
    stack = eagle.model._native_stack()
    assert stack is not None, "the model does not run on the native stack here"
    prompt = synthetic_prompt(args.prompt_tokens)
    settings = {"no drafter": (plain, stack), "EAGLE-3 capture, on the stack": (eagle, stack),
                "EAGLE-3 capture, layer by layer": (eagle, None)}
    times: dict[str, list[float]] = {name: [] for name in settings}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for name, (generator, native_stack) in settings.items():
            generator.model._stack = native_stack
            steps = decode_steps(generator, prompt, args.steps if round_ else 8, speculative_tokens=0)
            if round_:
                times[name] += steps
    eagle.model._stack = stack
    for name, seconds in times.items():
        print(f"| {name} | {statistics.median(seconds) * 1e3:.2f} | "
              f"{statistics.median(times['no drafter']) / statistics.median(seconds):.2f} |")
    return times


def report(label: str, result: dict, bandwidth: float, steps: int) -> None:
    step_ms = statistics.median(result["untimed"]) * 1e3
    timed_ms = statistics.median(result["timed"]) * 1e3
    per = {k: v * 1e3 for k, v in result["per_step"].items()}
    floor_ms = result["total_bytes"] / bandwidth * 1e3
    print(f"\n### {label}: {step_ms:.2f} ms/step ({1e3 / step_ms:.1f} tokens/s); floor {floor_ms:.2f} ms "
          f"({result['total_bytes'] / 1e6:.0f} MB at {bandwidth / 1e9:.1f} GB/s), {floor_ms / step_ms:.0%} of it; "
          f"timed pass {timed_ms:.2f} ms/step; prefill of the {result['prompt_tokens']}-token prompt "
          f"{statistics.median(result['prefill']) * 1e3:.0f} ms")
    if result["inside"] is not None:
        inside = result["inside"]
        stamped_ms = statistics.median(inside["stamped"]) * 1e3
        total = sum(inside["stamped"]) / len(inside["stamped"]) * 1e3
        rows = [(name, seconds / steps * 1e3) for name, seconds in inside["seconds"].items()]
        print(f"Inside the one native call of the layers (the stack's own clock after each operator; {stamped_ms:.2f} "
              "ms/step with it read)\n| operator | ms/step | share | MB read | GB/s |\n|---|---|---|---|---|")
        rows.append(("outside the layers' call (embedding, LM head, sampling, the step's Python)",
                     total - sum(ms for _, ms in rows)))
        for name, ms in rows:
            mb = result["bytes"].get(name, 0) / 1e6
            print(f"| {name} | {ms:.2f} | {ms / total:.0%} | " + (f"{mb:.0f} | {mb / ms:.1f} |" if mb else " |  |"))
        print("Operator by operator (the layers from Python, each operator timed):")
    print("| operator | ms/step | share | calls/step | MB read | GB/s |\n|---|---|---|---|---|---|")
    rows = [(name, per.get(name, 0.0)) for name in PRODUCTS]
    rows += [(name, per.get(name, 0.0)) for name in ("paged_attention", "rotary_and_cache", "rms_norm",
                                                       "add_rms_norm", "silu_and_mul", "embedding", "rotary_tables")]
    model_ms, logits_ms = per.get("model", 0.0), per.get("logits", 0.0)
    inside = sum(ms for name, ms in rows if name != "lm_head")
    total = sum(t for t in result["timed"]) / len(result["timed"]) * 1e3
    rows.append(("layer glue (model Python between operators)", model_ms - inside))
    rows.append(("logits glue", logits_ms - per.get("lm_head", 0.0)))
    rows.append(("step outside the model (batch, sampling, outputs)", total - model_ms - logits_ms))
    for name, ms in rows:
        mb = result["bytes"].get(name, 0) / 1e6
        calls = result["calls"].get(name, 0) / steps
        rate = f"{mb / ms:.1f}" if mb and ms > 0 else ""
        print(f"| {name} | {ms:.2f} | {ms / total:.0%} | {calls:.0f} | {mb:.0f} | {rate} |" if mb else
              f"| {name} | {ms:.2f} | {ms / total:.0%} | {calls:.0f} |  |  |")


def report_prefill(result: dict) -> None:
    """The prefill step by operator (timed as the decode steps' operators are)."""
    split = {name: seconds * 1e3 for name, seconds in result["prefill_split"].items()}
    total = sum(result["prefill_timed"]) / len(result["prefill_timed"]) * 1e3
    print(f"The prefill step of the {result['prompt_tokens']}-token prompt by operator ({total:.0f} ms with the "
          "timers)\n| operator | ms | share |\n|---|---|---|")
    rows = [(name, split.get(name, 0.0)) for name in (*PRODUCTS, "paged_attention", "rotary_and_cache", "rms_norm",
                                                      "add_rms_norm", "silu_and_mul", "embedding")]
    rows.append(("the rest (the model's Python, the step around it)", total - sum(ms for _, ms in rows)))
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} | {ms / total:.0%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REAL_MODEL, help="GGUF file or model directory")
    parser.add_argument("--quantize", nargs="*", default=["none"], choices=["none", "int8", "w8a8", "int4", "gguf"],
                        help="precisions to profile (none: float32; an empty list: none)")
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--eagle3", type=Path, help="an EAGLE-3 drafter for the model: also time what capturing the "
                        "hidden states it reads costs a decode step (float32), against no drafter")
    parser.add_argument("--rounds", type=int, default=3, help="turns of each setting with --eagle3, and requests "
                        "of --steps steps taking turns with several precisions")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = measure_bandwidth(torch.device("cpu"))
    results, generators = {}, []
    for quantize in args.quantize:
        q = None if quantize == "none" else quantize
        results[quantize] = profile(args.model, q, args, generators if len(args.quantize) > 1 else None)
        report(f"{args.model.name}, {quantize if q else 'float32'}", results[quantize], bandwidth, args.steps)
        report_prefill(results[quantize])
    if len(generators) > 1:
        prompt = synthetic_prompt(args.prompt_tokens)
        turns, bandwidths = taking_turns(dict(zip(args.quantize, generators)), prompt, args.steps, args.rounds)
        print(f"\n### taking turns step by step ({args.rounds} rounds of {args.steps} steps; bandwidth before each "
              f"round {', '.join(f'{b / 1e9:.1f}' for b in bandwidths)} GB/s)\n"
              "| precision | ms/step, each round's median | share of its floor, each round |\n|---|---|---|")
        for quantize, rounds in turns.items():
            step_ms = [statistics.median(seconds) * 1e3 for seconds in rounds]
            shares = [results[quantize]["total_bytes"] / b * 1e3 / ms for b, ms in zip(bandwidths, step_ms)]
            results[quantize]["turns"] = {"seconds": rounds, "bandwidths": bandwidths}
            print(f"| {quantize if quantize != 'none' else 'float32'} | {', '.join(f'{ms:.2f}' for ms in step_ms)} "
                  f"| {', '.join(f'{share:.0%}' for share in shares)} |")
    capture = None
    if args.eagle3:
        print(f"\n### {args.model.name}, float32, one stream: an EAGLE-3 drafter's capture, {args.rounds} rounds of "
              f"{args.steps} steps\n| setting | ms/step (median) | speed against no drafter |\n|---|---|---|")
        capture = capture_cost(args.model, args)
    if args.json:
        args.json.write_text(json.dumps({"bandwidth": bandwidth, "results": results, "eagle3_capture": capture},
                                        indent=1))


if __name__ == "__main__":
    main()
