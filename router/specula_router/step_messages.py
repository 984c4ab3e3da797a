"""The Step RPC's messages as the router reads and writes them: its own dataclasses, not protobuf.

`client.py` is the router's only protobuf edge (as `service.py` is the worker's): it encodes a step's
`NewRequest`s and `RequestUpdate`s into `pb.StepRequest` and decodes `pb.StepResponse` into a `StepResponse` of
`GenerationOut`s. The planner builds these, the scheduler reads them, and the fake worker in the router's tests
speaks them. Each field is the `.proto` field of the same name (proto/generate.proto comments every one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # entries.py builds NewRequest: these are annotations only
    from specula_router.entries import FinalEvent, TokenOut
    from specula_router.requests import SamplingParameters, StoppingParameters

__all__ = ["GenerationOut", "NewRequest", "RequestUpdate", "StepResponse", "StepTimings"]


@dataclass(frozen=True)
class NewRequest:
    """A request a step starts in the workers (`pb.Request`)."""

    id: int
    input_ids: tuple[int, ...]
    sampling: SamplingParameters
    stopping: StoppingParameters
    prefill_logprobs: bool = False
    top_n_tokens: int = 0
    blocks: tuple[int, ...] = ()
    adapter_id: str = ""  # "": the base model
    speculative_tokens: int | None = None  # None: the server's setting
    cached_tokens: int = 0  # context positions whose KV a cached prefix already holds
    prefill_until: int = 0  # short of the context's end: its first step computes one chunk; 0: all of it
    generated_ids: tuple[int, ...] = ()  # tokens it generated before a preemption (resumed after them)
    grammar: str = ""


@dataclass
class RequestUpdate:
    """A change to a running request (`pb.RequestUpdate`): blocks appended, and for a prompt prefilled in chunks,
    where its next chunk ends (0: the rest of the prompt). The planner fills it in as it plans the step."""

    id: int
    new_blocks: list[int] = field(default_factory=list)
    prefill_until: int = 0


@dataclass(frozen=True)
class GenerationOut:
    """One request's result of a step (`pb.Generation`)."""

    request_id: int
    tokens: list[TokenOut] = field(default_factory=list)  # accepted this step, in order
    top_tokens: list[list[TokenOut]] = field(default_factory=list)  # alternatives per token (top_n_tokens)
    prefill_tokens: list[TokenOut] | None = None  # the prompt's tokens with log-probabilities, when asked
    final: FinalEvent | None = None  # set: the request finished in the worker
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_method: str = ""  # "": the server's configured method
    error: str = ""  # set: it failed alone in the worker, which has already dropped it
    step_tokens: list[int] = field(default_factory=list)  # tokens of each decode step of the call ([]: one step)
    step_drafted: list[int] = field(default_factory=list)  # per decode step, the draft tokens it verified...
    step_accepted: list[int] = field(default_factory=list)  # ...and accepted ([]: one step, the totals above)

    @property
    def drafts_per_step(self) -> list[tuple[int, int]]:
        """(drafted, accepted) of each decode step of the call."""
        if not self.step_drafted:
            return [(self.drafted_tokens, self.accepted_tokens)]
        return list(zip(self.step_drafted, self.step_accepted))

    @property
    def skipped(self) -> list[bool]:
        """Per token: produced by the same decode step as the token before it (an accepted draft)."""
        counts = self.step_tokens or [len(self.tokens)]
        return [i > 0 for count in counts for i in range(count)]


@dataclass(frozen=True)
class StepTimings:
    forward_ns: int = 0
    decode_ns: int = 0
    total_ns: int = 0


@dataclass(frozen=True)
class StepResponse:
    generations: list[GenerationOut]
    timings: StepTimings
    suffix_cache_tokens: int = 0  # suffix decoding's global trees, on shard 0 (every shard holds the same)
    suffix_cache_nodes: int = 0
    decode_steps: int = 1  # decode steps the call ran (`StepRequest.decode_steps`)
