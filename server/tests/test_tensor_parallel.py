"""Two tensor-parallel ranks over gloo give the same tokens as one rank."""

from __future__ import annotations

import socket
from pathlib import Path

import llguidance
import pytest
import torch
import torch.multiprocessing as mp

from specula_server.params import SamplingParams
from specula_testing.worker import BlockPool, generate_alone, load_test_generator, make_spec, token_ids

PROMPTS = [[1, 50, 60, 70, 80, 90, 100], [1, 7, 8, 7, 8, 7], [1] + list(range(100, 140))]
SAMPLED = SamplingParams(do_sample=True, temperature=0.8, top_p=0.9, seed=99)
JSON_GRAMMAR = llguidance.LLMatcher.grammar_from_json_schema(
    {"type": "object", "properties": {"key_one": {"type": "string", "maxLength": 5}, "key_two": {"enum": ["x", "yy"]}},
     "required": ["key_one", "key_two"], "additionalProperties": False}, defaults={"whitespace_flexible": False})


def run_requests(model_dir, group=None, grammar: str = "", prompts=PROMPTS, max_new_tokens: int = 24,
                 samplings=(SamplingParams(), SAMPLED), num_blocks: int = 256, **settings) -> list[list[int]]:
    """Each prompt alone with each sampling setting, in order; the tokens of each."""
    generator = load_test_generator(model_dir, group=group, num_blocks=num_blocks, **settings)
    results = []
    for i, prompt in enumerate(prompts):
        for sampling in samplings:
            spec = make_spec(i, prompt, BlockPool(num_blocks, 16), max_new_tokens=max_new_tokens, sampling=sampling,
                             grammar=grammar, lookahead=settings.get("speculative_tokens", 0))
            results.append(token_ids(generate_alone(generator, spec)))
    return results


def _rank_main(rank: int, world_size: int, port: int, model_dir, settings, queue) -> None:
    from specula_server.distributed import init_distributed

    torch.set_num_threads(1)
    settings = dict(settings)
    if settings.pop("skew_clock", False) and rank == 1:
        # Rank 1 measures every step 2 ms longer than it took: left to its own timings, the adaptive
        # controller there would choose other draft lengths than rank 0 and the ranks' forwards would differ.
        import itertools
        import time

        real, calls = time.perf_counter_ns, itertools.count()
        time.perf_counter_ns = lambda: real() + next(calls) * 2_000_000
    group = init_distributed(rank, world_size, "127.0.0.1", port, torch.device("cpu"))
    try:
        queue.put((rank, run_requests(model_dir, group, **settings)))
    finally:
        torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(model_dir: Path, settings: dict) -> dict[int, object]:
    return run_ranks(model_dir, settings, world_size=2)


def spawn_ranks(target, world_size: int, *args, timeout: float = 300) -> dict[int, object]:
    """`target(rank, world_size, port, *args, queue)` on `world_size` spawned processes, which join one gloo group
    on `port`; each puts `(rank, result)` on `queue`. Returns the results by rank once every process exited 0."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world_size, port, *args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return results


def run_ranks(model_dir: Path, settings: dict, world_size: int) -> dict[int, object]:
    """`run_requests(**settings)` on `world_size` spawned tensor-parallel ranks over gloo; each rank's result by
    rank."""
    return spawn_ranks(_rank_main, world_size, model_dir, settings)


@pytest.mark.parametrize("kind,settings", [
    ("llama", {}),
    ("qwen2", {}),
    ("llama", {"speculative_tokens": 3, "speculation_mode": "fixed"}),  # ranks accept the same drafts
    ("llama", {"speculative_tokens": 3, "speculation_mode": "adaptive", "skew_clock": True}),  # and agree on lengths
    ("llama", {"speculative_tokens": 3, "speculation_mode": "fixed", "speculator": "suffix"}),  # same suffix trees
    # Each rank's own matchers mask alike and draft the same forced tokens.
    ("llama", {"speculative_tokens": 3, "speculation_mode": "fixed", "grammar": JSON_GRAMMAR}),
])
def test_two_ranks_match_one_rank(model_dirs, kind, settings):
    expected = run_requests(model_dirs[kind], **{k: v for k, v in settings.items() if k != "skew_clock"})
    results = run_two_ranks(model_dirs[kind], settings)
    assert results[0] == expected
    assert results[1] == expected  # every rank accepts the same tokens
