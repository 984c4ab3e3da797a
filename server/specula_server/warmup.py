"""Warmup of a worker: size the KV cache, and calibrate the step cost model of adaptive speculation.

Called once by the Warmup RPC, before the router sends any request: it runs the largest prefill the router may
send (so an out-of-memory shows now, not under load), then gives the KV cache the memory that is left.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from specula_server.generator import InvalidRequestError, TextGenerator
from specula_server.params import SamplingParams, StoppingParams
from specula_server.request import RequestSpec, StepPlan

logger = logging.getLogger("specula.warmup")


def warmup(
    generator: TextGenerator,
    max_input_tokens: int,
    max_prefill_tokens: int,
    max_total_tokens: int,
    kv_cache_memory: int | None,
) -> int:
    """Runs the largest prefill step the router may send, then sizes the KV cache; returns its block count.

    On CPU the cache gets `kv_cache_memory` bytes. On CUDA, when no budget is given, it gets 90% of the
    device memory left free after the warmup forward pass.
    """
    # Warmup requests prefill what one step may (a longer prompt is prefilled in chunks of max_prefill_tokens) and
    # decode once (2 new tokens), within the total limit.
    max_input_tokens = max(1, min(max_input_tokens, max_prefill_tokens, max_total_tokens - 2))
    per_request = -(-(max_input_tokens + 2) // generator.block_size)
    num_requests = -(-max_prefill_tokens // max_input_tokens)
    generator.allocate_kv_cache(per_request * num_requests)
    _warmup_prefill(generator, max_input_tokens, max_prefill_tokens, per_request)
    if kv_cache_memory is None:
        if generator.device.type != "cuda":
            raise InvalidRequestError("a KV cache memory budget is required on CPU")
        torch.cuda.synchronize(generator.device)
        generator.release_kv_cache()  # the draft model's cache too, so free memory is measured without them
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(generator.device)
        kv_cache_memory = int(free * 0.9)
    # The router lowers its limits to what the cache holds (or refuses limits a flag set too high).
    num_blocks = kv_cache_memory // generator.bytes_per_block()
    if num_blocks < 1:
        raise InvalidRequestError(f"the KV cache budget of {kv_cache_memory} bytes holds no block of "
                                  f"{generator.block_size} tokens ({generator.bytes_per_block()} bytes)")
    generator.allocate_kv_cache(num_blocks)
    generator.capture_graphs()  # before calibrating: the cost model then times the steps requests will run
    if generator.speculation is not None and num_blocks * generator.block_size > 64:
        calibrate_step_cost(generator)
    logger.info("KV cache: %d blocks of %d tokens (%d bytes)", num_blocks, generator.block_size,
                num_blocks * generator.bytes_per_block())
    return num_blocks

def calibrate_step_cost(generator: TextGenerator, sizes: Sequence[int] = (1, 4, 16, 64), repeats: int = 2) -> None:
    """Times forwards over N tokens for several N (one dummy sequence each, blocks 0..) as the cost anchors
    of adaptive speculation. Needs a KV cache holding max(sizes) tokens."""
    assert generator.kv_cache is not None
    blocks = tuple(range(-(-(max(sizes) + 1) // generator.block_size)))
    for size in sizes:
        spec = RequestSpec(-2, (0,) * size, SamplingParams(), StoppingParams(1, (), True), blocks)
        for _ in range(repeats + 1):  # the first run of a size warms caches up; not counted
            start = time.perf_counter_ns()
            generator.step(StepPlan(new=[spec]))  # one token: it ends in this step
            seconds = generator.agreed_seconds(time.perf_counter_ns() - start)  # the same anchors on every rank
        generator.speculator.step_cost.anchor(size, seconds)

def _warmup_prefill(generator: TextGenerator, max_input_tokens: int, max_prefill_tokens: int,
                    blocks_per_request: int) -> None:
    specs, remaining, next_block = [], max_prefill_tokens, 0
    while remaining > 0:
        length = min(max_input_tokens, remaining)
        blocks = tuple(range(next_block, next_block + blocks_per_request))
        specs.append(RequestSpec(len(specs), (0,) * length, SamplingParams(), StoppingParams(2, (), True), blocks))
        next_block += blocks_per_request
        remaining -= length
    # A big forward and a one-token-per-request forward: both ends of the step cost model get a measurement.
    generator.step(StepPlan(new=specs))
    generator.step(StepPlan())  # their second and last token
    generator.reset()
