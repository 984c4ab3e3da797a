"""One admitted HTTP request inside the router (`Entry`) and the events it sends to its HTTP handler.

The scheduler owns entries; a handler only reads `entry.events`, which yields, in order:

    TokensEvent*  then  FinalEvent (or the last TokensEvent carrying `final`)   a request that completed
    TokensEvent*  then  ErrorEvent                                              a request that failed

`Entry.new_request` is where a validated request becomes what a step starts in the workers (`step_messages.py`).
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from specula_router.requests import ValidGenerateRequest
from specula_router.step_messages import NewRequest


@dataclass(frozen=True)
class TokenOut:
    id: int
    text: str
    logprob: float  # NaN where undefined (the first prompt token): encoded as JSON null
    special: bool


@dataclass(frozen=True)
class FinalEvent:
    generated_text: str
    finish_reason: str
    generated_tokens: int
    seed: int | None


@dataclass(frozen=True)
class TokensEvent:
    """Tokens of one step, or of the decode steps of one call: one per step, and under speculation the drafts
    each accepted (`skipped`: produced by the same step as the token before).

    `final` is set when the request finished in this step, so the last token and the end arrive together.
    """

    tokens: list[TokenOut]
    top_tokens: list[list[TokenOut]]
    skipped: list[bool]  # per token
    prefill: list[TokenOut] | None = None
    final: FinalEvent | None = None


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed: `/generate` answers `status`; a started stream sends `{error, error_type}`."""

    message: str
    error_type: str = "generation"
    status: int = 424


class EntryState(enum.IntEnum):
    """A request's states in the order of its life; PREEMPTED leads back to PREFILLING (or RUNNING) on resuming,
    and any state may end in DONE."""

    WAITING_ADAPTER = 0  # in its adapter's queue until the adapter is loaded
    QUEUED = 1  # in the FIFO
    PREFILLING = 2  # admitted, held by the workers, its prompt computed a chunk per step
    RUNNING = 3  # held by the workers, its prompt sent whole: it decodes every step
    PREEMPTED = 4  # its blocks were taken back: at the head of the FIFO, to resume with its tokens so far
    DONE = 5


_NEXT = {  # the life cycle: the states each state may move to (`Entry.move`)
    EntryState.WAITING_ADAPTER: {EntryState.QUEUED, EntryState.DONE},
    # A new request starts QUEUED and is queued (again QUEUED) or waits for its adapter.
    EntryState.QUEUED: {EntryState.QUEUED, EntryState.WAITING_ADAPTER, EntryState.PREFILLING, EntryState.RUNNING,
                        EntryState.DONE},
    EntryState.PREFILLING: {EntryState.RUNNING, EntryState.PREEMPTED, EntryState.DONE},
    EntryState.RUNNING: {EntryState.PREEMPTED, EntryState.DONE},
    EntryState.PREEMPTED: {EntryState.PREFILLING, EntryState.RUNNING, EntryState.DONE},
    EntryState.DONE: set(),
}


@dataclass(eq=False)
class Entry:
    id: int
    request: ValidGenerateRequest
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    state: EntryState = EntryState.QUEUED
    blocks: list[int] = field(default_factory=list)
    # Leading context positions (see `context_ids`) whose KV its blocks hold: a cached prefix, then the chunks
    # whose step has answered. `prefill_sent`: context positions the steps sent so far compute.
    num_cached_tokens: int = 0
    prefill_sent: int = 0
    token_ids: list[int] = field(default_factory=list)  # generated so far (across preemptions)
    num_resumed: int = 0  # of those, the ones sent as `generated_ids` when it was last admitted
    prompt_hashes: list[bytes] | None = None  # hash chain of its prompt's full blocks, once computed
    # Set while PREEMPTED: no step on the wire holds it any more (its last tokens are known), it may resume.
    resumable: bool = True
    # Set while held by the workers when the request must leave them at the next step: its client went away,
    # or it failed on the router's side (then `failure` was already sent to its handler).
    cancelled: bool = False
    failure: ErrorEvent | None = None
    queued_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_generated: int = 0
    num_skipped: int = 0

    def move(self, state: EntryState) -> None:
        """The one way a request changes state, along its life cycle: the queue side (`Admission`) moves it into
        and out of the queue, the planner into the workers, the scheduler to DONE."""
        assert state in _NEXT[self.state], f"request {self.id} cannot go from {self.state.name} to {state.name}"
        self.state = state

    @property
    def adapter(self) -> str:
        return self.request.adapter_id or ""

    @property
    def context_ids(self) -> tuple[int, ...]:
        """What its prefill computes: the prompt, then the tokens it generated before a preemption."""
        return self.request.input_ids + tuple(self.token_ids[: self.num_resumed])

    @property
    def wants_prefill_logprobs(self) -> bool:
        """Its prompt log-probabilities are still owed (they come with its first token)."""
        return self.request.decoder_input_details and not self.token_ids

    def written_ids(self) -> tuple[int, ...]:
        """The tokens whose KV the steps that answered wrote: its context up to the chunks done, or, once it has
        a token since it was admitted, the context and every token but the last (which was not fed back yet)."""
        if len(self.token_ids) > self.num_resumed:
            return self.request.input_ids + tuple(self.token_ids[:-1])
        return self.context_ids[: self.num_cached_tokens]

    def new_request(self, prefill_until: int = 0) -> NewRequest:
        """The request as a step starts it in the workers. `prefill_until` short of the context's end makes its
        first step one chunk of the prefill."""
        r = self.request
        return NewRequest(
            id=self.id, input_ids=r.input_ids, sampling=r.sampling, stopping=r.stopping,
            prefill_logprobs=self.wants_prefill_logprobs, top_n_tokens=r.top_n_tokens, blocks=tuple(self.blocks),
            adapter_id=r.adapter_id or "", speculative_tokens=r.speculative_tokens,
            cached_tokens=self.num_cached_tokens, prefill_until=prefill_until,
            generated_ids=tuple(self.token_ids[: self.num_resumed]), grammar=r.grammar)
