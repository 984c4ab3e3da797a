"""Building one Step: which requests leave the workers, the blocks the others get, the prompt chunk that runs,
and the newcomers that join. The scheduler (scheduler.py) sends the plan and processes its result.

A plan is built in the order the worker applies it:

    1. finished   requests whose client went away or that failed on the router's side. Their blocks are freed
                  at once: this step drops them before it runs, and every step before it (those on the wire,
                  which may still write to them) runs first, so only later writers can get the blocks.
    2. growth     every running request gets blocks (`RequestUpdate.new_blocks`) covering every position this
                  step and the steps on the wire may write. A request with g tokens received, s decode steps on
                  the wire plus this call's, and 1 + lookahead tokens per step at most, writes fewer than
                  min(prompt + g + s * (1 + lookahead), prompt + max_new_tokens + lookahead) positions.
                  A call runs several decode steps (`decode_steps`, vLLM's multi-step scheduling) only when no
                  prompt is in chunks, none waits in the queue, and the free blocks cover them all; else one.
                  When the cache cannot provide them, the most recently admitted requests are preempted (vLLM's
                  recompute preemption): listed in `finished`, their written full blocks cached for the resume,
                  their blocks freed, and they go back to the head of the FIFO with their tokens so far.
    3. chunk      the next chunk of the oldest prompt prefilled in chunks (at most one chunk per step).
    4. newcomers  admitted by `Admission` (TGI's rule) within what the chunk left of `max_batch_prefill_tokens`,
                  leaving free the blocks the running requests need for their next step. A long prompt joins
                  with its first chunk, in a step without another chunk.

Tokens of a preempted request from steps still on the wire are real: the scheduler delivers and keeps them, and
the request resumes (as a new request with `generated_ids`) only once no step on the wire runs it any more.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specula_router.admission import Admission, AdmissionConfig, Admitted
from specula_router.block_allocator import BlockAllocator
from specula_router.client import encode_request
from specula_router.entries import Entry, EntryState, ErrorEvent
from specula_router.metrics import Metrics
from specula_router.step_messages import NewRequest, RequestUpdate

logger = logging.getLogger("specula.router.scheduler")

_UNENCODABLE = (ValueError, TypeError, OverflowError)


@dataclass
class PlannedStep:
    finished: list[int] = field(default_factory=list)
    updates: dict[int, RequestUpdate] = field(default_factory=dict)
    new_requests: list[NewRequest] = field(default_factory=list)
    chunks: list[tuple[Entry, int]] = field(default_factory=list)  # (request, context position its chunk ends)
    preempted: list[Entry] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)  # every request the workers hold once it is applied
    decode_steps: int = 1  # decode steps the workers may run in this call

    @property
    def method(self) -> str:
        """The metrics' label: "prefill" for a step that computes prompts, "decode" for one that only decodes."""
        return "prefill" if self.new_requests or self.chunks else "decode"

    def update(self, entry: Entry) -> RequestUpdate:
        if entry.id not in self.updates:
            self.updates[entry.id] = RequestUpdate(entry.id)
        return self.updates[entry.id]

    def __bool__(self) -> bool:
        return bool(self.finished or self.new_requests or self.entries)


class StepPlanner:
    """Builds each Step, and owns what the workers hold: `running` and, of those, `chunking` (the scheduler ends
    a request through `leave`)."""

    def __init__(self, allocator: BlockAllocator, admission: Admission, config: AdmissionConfig, metrics: Metrics,
                 finish: Callable[[Entry, ErrorEvent | None, bool], None]) -> None:
        self.allocator = allocator
        self.admission = admission
        self.config = config
        self.metrics = metrics
        self.running: dict[int, Entry] = {}  # requests the workers hold (prefilling or decoding), in admission order
        self.chunking: deque[Entry] = deque()  # of those, prompts still prefilled in chunks, oldest first
        self._finish = finish  # the scheduler's: ends a request (frees its blocks and its adapter)
        self.waiting_steps = 1  # steps since newcomers last joined
        # The `finished` of the next step, kept until it is sent (`sent`): a request whose blocks were freed must
        # reach the workers even when building its step failed; those of a step that failed are listed again.
        self.finish_again: list[int] = []

    @property
    def chunk_tokens(self) -> int:
        """Prompt tokens per chunk: the prefill budget, in whole blocks (the next chunk starts on a block)."""
        size = self.allocator.block_size
        return max(size, self.config.max_batch_prefill_tokens // size * size)

    def plan(self, steps_on_wire: int, decode_steps: int = 1) -> PlannedStep:
        """The next call, to be sent after the calls not yet answered, which run up to `steps_on_wire` decode
        steps; it runs up to `decode_steps` of them when `_decode_steps` allows, else one."""
        plan = PlannedStep(finished=self.finish_again)
        self._drop_cancelled(plan)
        plan.decode_steps = self._decode_steps(steps_on_wire, decode_steps)
        self._grow(plan, steps_on_wire + plan.decode_steps)
        self._admit_from_queue(plan, steps_on_wire + 1, self._next_chunk(plan))
        plan.entries = list(self.running.values())
        return plan

    def leave(self, entry: Entry) -> None:
        """`entry` no longer runs in the workers (finished, failed or cancelled)."""
        self.running.pop(entry.id, None)
        if entry in self.chunking:
            self.chunking.remove(entry)

    def sent(self) -> None:
        """The plan is on the wire."""
        self.finish_again = []

    def cache_written(self, entry: Entry) -> None:
        """Marks the full blocks whose KV the answered steps wrote as reusable (automatic prefix caching)."""
        written = entry.written_ids()
        known = (entry.prompt_hashes or [])[: len(written) // self.allocator.block_size]
        self.allocator.cache(entry.blocks, self.allocator.chain(written, entry.adapter, known=known))

    def _decode_steps(self, steps_on_wire: int, most: int) -> int:
        """`most` when every running request decodes, none waits for admission, and the free blocks cover what
        the running requests may write in that many steps (so that no request is preempted for it); else 1."""
        if most <= 1 or not self.running or self.chunking or self.admission.queue:
            return 1
        missing = sum(self._missing(entry, steps_on_wire + most) for entry in self.running.values())
        return most if missing <= self.allocator.num_free_blocks else 1

    # --- the four parts of a step -----------------------------------------------------------------------------

    def _drop_cancelled(self, plan: PlannedStep) -> None:
        for entry in [e for e in self.running.values() if e.cancelled]:
            plan.finished.append(entry.id)
            self._finish(entry, entry.failure, False)  # a failure was sent when it happened

    def _positions(self, entry: Entry, num_steps: int) -> int:
        """Positions a decoding request may have written by the end of `num_steps` more steps (see above)."""
        lookahead = self.config.lookahead
        request = entry.request
        return min(request.input_length + len(entry.token_ids) + num_steps * (1 + lookahead),
                   request.max_total_tokens + lookahead)

    def _missing(self, entry: Entry, num_steps: int) -> int:
        """Blocks a request needs beyond its own for `num_steps` more steps (0 for a prompt still in chunks,
        whose blocks cover its prompt and first step)."""
        if entry.state is not EntryState.RUNNING:
            return 0
        return max(0, self.allocator.blocks_for(self._positions(entry, num_steps)) - len(entry.blocks))

    def _grow(self, plan: PlannedStep, num_steps: int) -> None:
        """Gives every running request the blocks this step may write, oldest first; preempts the newest when
        the cache is full (possibly the request itself, when it is the newest)."""
        for entry in list(self.running.values()):
            missing = self._missing(entry, num_steps) if entry.id in self.running else 0
            while missing:
                fresh = self.allocator.extend(missing)
                if fresh is not None:
                    entry.blocks += fresh
                    plan.update(entry).new_blocks.extend(fresh)
                    break
                victim = next(reversed(self.running.values()))
                self._preempt(victim, plan)
                if victim is entry:
                    break

    def _preempt(self, entry: Entry, plan: PlannedStep) -> None:
        logger.info("preempting request %d (%d tokens generated) to free %d blocks", entry.id,
                    len(entry.token_ids), len(entry.blocks))
        self.cache_written(entry)  # its resume finds them, unless others need the space first
        self.allocator.free(entry.blocks)
        entry.blocks, entry.num_cached_tokens, entry.prefill_sent = [], 0, 0
        entry.resumable = False  # until the steps on the wire that run it have answered
        self.leave(entry)
        plan.finished.append(entry.id)
        plan.updates.pop(entry.id, None)
        plan.preempted.append(entry)
        self.admission.requeue(entry)
        self.metrics.request_preemptions.inc()

    def _next_chunk(self, plan: PlannedStep) -> int:
        """Schedules the next chunk of the oldest prompt prefilled in chunks, returning its tokens; the last one
        yields its first token, and the request decodes from the next step on."""
        if not self.chunking:
            return 0
        entry = self.chunking[0]
        context_len = len(entry.context_ids)
        if context_len - entry.prefill_sent <= self.config.max_batch_prefill_tokens:
            self.chunking.popleft()
            entry.move(EntryState.RUNNING)
            until = 0
        else:
            until = entry.prefill_sent + self.chunk_tokens
        start, entry.prefill_sent = entry.prefill_sent, until or context_len
        plan.update(entry).prefill_until = until
        plan.chunks.append((entry, entry.prefill_sent))
        return entry.prefill_sent - start

    def _admit_from_queue(self, plan: PlannedStep, num_steps: int, chunk_tokens: int) -> None:
        if not self.running:
            admitted = self.admission.first()
        else:
            reserve = sum(self._missing(e, num_steps + 1) for e in self.running.values())
            admitted = self.admission.more(len(self.running), self.waiting_steps, reserve, chunk_tokens)
        if not admitted:
            self.waiting_steps += 1
            return
        self.waiting_steps = 1
        self._join(plan, admitted)

    def _join(self, plan: PlannedStep, admitted: Admitted) -> None:
        """Admitted requests join the step: a batch of whole prompts, or a long prompt's first chunk.

        A request the workers' message cannot encode (validation should have refused it) fails alone."""
        starts = [(e, 0) for e in admitted.batch]
        if admitted.long is not None:
            starts.append((admitted.long, admitted.long.num_cached_tokens + self.chunk_tokens))
        for entry, until in starts:
            entry.move(EntryState.PREFILLING if until else EntryState.RUNNING)
            request = entry.new_request(prefill_until=until)
            try:
                encode_request(request)
            except _UNENCODABLE as e:
                logger.error("request %d cannot be sent to the workers: %s", entry.id, e)
                self._finish(entry, ErrorEvent(f"the request cannot be sent to the workers: {e}", "validation",
                                               422), True)
                continue
            entry.prefill_sent = until or len(entry.context_ids)
            self.running[entry.id] = entry
            if until:
                self.chunking.append(entry)
                plan.chunks.append((entry, until))
            plan.new_requests.append(request)
