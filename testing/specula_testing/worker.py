"""Driving a `TextGenerator` directly, as the router would, for tests and benchmarks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from specula_server.distributed import ShardGroup
from specula_server.generator import TextGenerator
from specula_server.params import SamplingParams, StoppingParams
from specula_server.request import RequestSpec, RequestUpdate, StepOutput, StepPlan
from specula_server.server import ServerConfig, load_generator


def load_test_generator(
    model_dir: Path, num_blocks: int = 256, block_size: int = 16, dtype: str = "float32",
    group: ShardGroup | None = None, **settings,
) -> TextGenerator:
    """A generator with its KV cache; `settings` are further `ServerConfig` fields (e.g. speculative_tokens)."""
    config = ServerConfig(model_id=str(model_dir), uds_path="/tmp/unused", dtype=dtype, block_size=block_size,
                          rank=(group or ShardGroup()).rank, world_size=(group or ShardGroup()).world_size,
                          **settings)
    generator, _ = load_generator(config, group or ShardGroup())
    generator.allocate_kv_cache(num_blocks)
    return generator


class BlockPool:
    """Hands out KV blocks the way the router does (a free list), so tests exercise non-contiguous tables."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.free = list(range(num_blocks - 1, -1, -1))
        self.block_size = block_size

    def take(self, num_tokens: int) -> tuple[int, ...]:
        count = -(-num_tokens // self.block_size)
        assert count <= len(self.free), "test KV pool exhausted"
        return tuple(self.free.pop() for _ in range(count))[::-1]

    def give(self, blocks: Sequence[int]) -> None:
        self.free.extend(blocks)


def make_spec(
    request_id: int,
    input_ids: Sequence[int],
    pool: BlockPool,
    max_new_tokens: int = 16,
    sampling: SamplingParams | None = None,
    stop_sequences: Sequence[str] = (),
    ignore_eos_token: bool = True,
    lookahead: int = 0,
    **kwargs,
) -> RequestSpec:
    """A request as the router sends it; its KV blocks cover the prompt, `max_new_tokens` and `lookahead`
    extra positions (what the router reserves for speculative tokens)."""
    return RequestSpec(
        id=request_id,
        input_ids=tuple(input_ids),
        sampling=sampling or SamplingParams(),
        stopping=StoppingParams(max_new_tokens, tuple(stop_sequences), ignore_eos_token),
        blocks=pool.take(len(input_ids) + max_new_tokens + lookahead),
        **kwargs,
    )


def generate_alone(generator: TextGenerator, spec: RequestSpec) -> list[StepOutput]:
    """Runs one request to completion alone; returns its output of every step."""
    return run_steps(generator, [spec])


def run_steps(generator: TextGenerator, specs: Sequence[RequestSpec], max_steps: int = 10_000) -> list[StepOutput]:
    """Starts `specs` together and runs steps until the generator holds no request; returns every output."""
    outputs = list(generator.step(StepPlan(new=specs)).outputs)
    for _ in range(max_steps):
        if not generator.requests:
            return outputs
        outputs.extend(generator.step(StepPlan()).outputs)
    raise AssertionError(f"requests still running after {max_steps} steps")


def step(generator: TextGenerator, new: Sequence[RequestSpec] = (), finished: Sequence[int] = (),
         updates: Sequence[RequestUpdate] = ()) -> list[StepOutput]:
    """One step; returns its outputs."""
    return generator.step(StepPlan(new, updates, finished)).outputs


def token_ids(outputs: Sequence[StepOutput]) -> list[int]:
    return [t.id for o in outputs for t in o.tokens]


def token_texts(outputs: Sequence[StepOutput]) -> list[str]:
    return [t.text for o in outputs for t in o.tokens]


def stop_ending_inside_a_token(pieces: Sequence[str], span_tokens: bool, first: int = 1) -> tuple[str, int, int]:
    """A stop sequence for a generation whose token texts are `pieces`, that ends strictly inside a piece.

    Returns `(stop, k, cut)`: the first occurrence of `stop` in the joined pieces ends after `pieces[k][:cut]`
    (0 < cut < len(pieces[k]), k >= first), so generation stops at token k with text
    `"".join(pieces[:k]) + pieces[k][:cut]`. With `span_tokens` the stop starts in the text before piece k (as
    little of it as makes this the first occurrence), otherwise it is two characters within piece k.
    """
    before = "".join(pieces[:first])
    for k in range(first, len(pieces)):
        piece = pieces[k]
        for cut in range(1 if span_tokens else 2, len(piece)):
            starts = range(len(before) - 1, -1, -1) if span_tokens else [len(before) + cut - 2]
            prefix = before + piece[:cut]
            for start in starts:
                if prefix.find(prefix[start:]) == start:
                    return prefix[start:], k, cut
        before += piece
    raise AssertionError(f"no piece to cut in {pieces!r}")


def assert_same_greedy_output(
    plain: TextGenerator, drafted: TextGenerator, prompts: Sequence[Sequence[int]],
    run: Callable[..., list[StepOutput]], **kwargs,
) -> list[list[StepOutput]]:
    """Runs each prompt alone on both generators with `run(generator, prompt, **kwargs)` and asserts that
    `drafted` (speculating) emits exactly `plain`'s tokens, log-probabilities (to 1e-4) and text; returns
    `drafted`'s outputs, one list per prompt."""
    results = []
    for prompt in prompts:
        expected, got = run(plain, prompt, **kwargs), run(drafted, prompt, **kwargs)
        assert token_ids(got) == token_ids(expected), prompt
        logprobs = [(t.logprob, e.logprob) for t, e in zip((t for o in got for t in o.tokens),
                                                              (t for o in expected for t in o.tokens))]
        assert all(abs(a - b) <= 1e-4 for a, b in logprobs), logprobs
        assert got[-1].generated_text.text == expected[-1].generated_text.text
        results.append(got)
    return results
