"""`--kv-cache-dtype`: KV blocks at a fixed memory budget, and what the conversions cost a decode step.

1. The gather of one layer's keys (the demo model: 4 KV heads of 32; 32 sequences x 256 context slots) from a
   float32, bfloat16 and fp8 cache into float32, the ways it can be done (median of 30).
2. Per `--kv-cache-dtype`: bytes per block and blocks in the worker's default 1 GiB, then decode steps of 32
   requests with 256-token random prompts on the bundled demo model (float32), the dtypes taking turns round by
   round (order reversed every round), median step time.

    python benchmark/kv_cache_dtype.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("server", "kernels", "proto", "launcher", "testing")]

import torch  # noqa: E402

from specula_kernels.paged_attention import PagedAttentionInputs, _gather  # noqa: E402
from specula_launcher.defaults import DEMO_MODEL_DIR  # noqa: E402
from specula_server.request import StepPlan  # noqa: E402
from specula_testing.worker import BlockPool, load_test_generator, make_spec  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--threads", type=int, default=1)
torch.set_num_threads(parser.parse_args().threads)
NAMES = ("auto", "bfloat16", "fp8_e4m3", "fp8_e5m2")
BUDGET = 2**30  # the worker's default --kv-cache-memory on CPU
BATCH, CONTEXT, STEPS, ROUNDS = 32, 256, 8, 7

# 1. gather variants, one layer of the demo model (4 KV heads of 32), 32 x 256 context slots
slots = torch.randperm(BATCH * 320)[: BATCH * CONTEXT].view(BATCH, CONTEXT)
inputs = PagedAttentionInputs(slots[:, -1], slots, torch.arange(BATCH).unsqueeze(1),
                              torch.ones(BATCH, 1, dtype=torch.bool), None)
cache32 = torch.randn(BATCH * 320, 4, 32)
variants = {
    "float32 cache (index_select)": lambda: _gather(cache32, inputs, "a", torch.float32),
    "fp8 cache, _gather (byte -> value table)": lambda: _gather(c8, inputs, "c", torch.float32),
}
c8 = cache32.to(torch.float8_e4m3fn)
cb = cache32.to(torch.bfloat16)
variants["bf16 cache -> float32"] = lambda: _gather(cb, inputs, "b", torch.float32)
def via_uint8():
    raw = inputs.workspace.get("u")
    if raw is None:
        raw = inputs.workspace["u"] = torch.empty(BATCH, CONTEXT, 4, 32, dtype=torch.uint8)
        inputs.workspace["uf"] = torch.empty(BATCH, CONTEXT, 4, 32)
    torch.index_select(c8.view(torch.uint8), 0, slots.reshape(-1), out=raw.view(-1, 4, 32))
    inputs.workspace["uf"].copy_(raw.view(torch.float8_e4m3fn))
variants["fp8 cache, gather as uint8, torch cast"] = via_uint8
def via_fp8_cast():
    raw = inputs.workspace.get("r")
    if raw is None:
        raw = inputs.workspace["r"] = torch.empty(BATCH, CONTEXT, 4, 32, dtype=torch.float8_e4m3fn)
        inputs.workspace["rf"] = torch.empty(BATCH, CONTEXT, 4, 32)
    torch.index_select(c8, 0, slots.reshape(-1), out=raw.view(-1, 4, 32))
    inputs.workspace["rf"].copy_(raw)
variants["fp8 cache, gather as fp8, torch cast"] = via_fp8_cast
times = {k: [] for k in variants}
for _ in range(30):
    for k, f in variants.items():
        t = time.perf_counter()
        f()
        times[k].append(time.perf_counter() - t)
print("gather of one layer's keys (32 seqs x 256 positions x 4 heads x 32), median of 30:")
for k, v in times.items():
    print(f"  {k:45s} {statistics.median(v) * 1e3:.3f} ms")

# 2. blocks at the budget, and decode steps
gens, blocks = {}, {}
for name in NAMES:
    g = load_test_generator(DEMO_MODEL_DIR, num_blocks=BATCH * 32 + 16, kv_cache_dtype=name)
    blocks[name] = BUDGET // g.bytes_per_block()
    pool = BlockPool(BATCH * 32 + 16, 16)
    gen = torch.Generator().manual_seed(0)
    specs = [make_spec(i, torch.randint(3, 2048, (CONTEXT,), generator=gen).tolist(), pool, max_new_tokens=200)
             for i in range(BATCH)]
    g.step(StepPlan(new=specs))
    gens[name] = g
print("blocks in --kv-cache-memory 1GiB (block_size 16, demo model: 4 layers, 4 KV heads of 32):")
for name in NAMES:
    print(f"  {name:10s} {gens[name].kv_cache_dtype}  bytes/block {gens[name].bytes_per_block()}  blocks {blocks[name]}"
          f"  (x{blocks[name] / blocks['auto']:.1f})")
step_times = {n: [] for n in NAMES}
for r in range(ROUNDS):
    order = NAMES if r % 2 == 0 else NAMES[::-1]
    for name in order:
        for _ in range(STEPS):
            t = time.perf_counter()
            gens[name].step(StepPlan())
            step_times[name].append(time.perf_counter() - t)
print(f"decode step, {BATCH} requests, contexts 257..{CONTEXT + ROUNDS * STEPS}, median of {ROUNDS * STEPS} steps "
      f"({ROUNDS} alternating rounds of {STEPS}), {torch.get_num_threads()} thread(s):")
base = statistics.median(step_times["auto"])
for name in NAMES:
    m = statistics.median(step_times[name])
    print(f"  {name:10s} {m * 1e3:7.2f} ms  ({(m / base - 1) * 100:+.0f}% vs float32)")
