"""The requests that do not run yet, and the rule that lets them in (TGI's semantics, KV blocks that grow).

The scheduler asks `Admission` which requests may join the step it is building:

    submit ─ adapter ready? ─ yes ─> FIFO (`queue`) ─ blocks for its prompt and first step free,
                  │                                   prefill budget fits ─> joins this step
                  └─ no ──> its adapter's own queue (`waiting`); joins the FIFO when the adapter is loaded,
                            or ends with the load's error, so it never holds up the head of the FIFO

Admission is FIFO: nobody overtakes the head of the queue. A request is taken when blocks for its prompt plus
one step's tokens (1 + speculative lookahead) are free beyond `reserve` (what the running requests need for their
next step, so a newcomer never forces a preemption right away); its prompt's cached prefix is reused. Later,
before every step, the scheduler gives each running request the blocks that step may write (step_planner.py),
preempting the newest requests when the cache is full: a preempted request goes back to the head of the FIFO
and resumes with its tokens so far (once no step on the wire still runs it). A step's new prompts stay within
`max_batch_prefill_tokens` tokens not already cached; a longer one (after its cached prefix) is taken alone and
prefilled in chunks. While requests run, newcomers join once enough of them wait (`waiting_served_ratio`) or one
has waited `max_waiting_tokens` steps. From joining the FIFO until it ends, a request keeps its adapter counted
as in use, and an adapter in use is never offloaded.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field

from specula_router.adapters import AdapterFailure, AdapterManager
from specula_router.block_allocator import Allocation, BlockAllocator
from specula_router.entries import Entry, EntryState, ErrorEvent
from specula_router.metrics import Metrics


@dataclass(frozen=True)
class AdmissionConfig:
    max_batch_prefill_tokens: int
    waiting_served_ratio: float = 1.2
    max_waiting_tokens: int = 20
    max_batch_size: int | None = None
    lookahead: int = 0  # draft tokens a decode step may verify: it writes up to 1 + lookahead positions


@dataclass
class Admitted:
    """What may start now: a prefill batch, or a long prompt to prefill in chunks."""

    batch: list[Entry] = field(default_factory=list)
    long: Entry | None = None

    def __bool__(self) -> bool:
        return bool(self.batch) or self.long is not None


class Admission:
    def __init__(self, allocator: BlockAllocator, adapters: AdapterManager, metrics: Metrics,
                 config: AdmissionConfig, wake: asyncio.Event) -> None:
        self.allocator = allocator
        self.adapters = adapters
        self.metrics = metrics
        self.config = config
        self._wake = wake  # set when a request joins the FIFO
        self.queue: deque[Entry] = deque()
        self.waiting: dict[str, deque[Entry]] = {}  # adapter id -> its requests, while it is not ready
        adapters.on_settled = self._adapter_settled

    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted: in the FIFO or waiting for their adapter."""
        return len(self.queue) + sum(len(w) for w in self.waiting.values())

    def add(self, entry: Entry) -> None:
        """A new request: into the FIFO, or into its adapter's queue while the adapter loads."""
        if entry.request.merge is not None:
            self.adapters.count_merge(entry.adapter)
        if self.adapters.is_ready(entry.adapter):
            self._enqueue(entry)
        else:
            entry.move(EntryState.WAITING_ADAPTER)
            self.waiting.setdefault(entry.adapter, deque()).append(entry)
            self.adapters.request(entry.adapter, entry.request.adapter_source, entry.request.api_token,
                                  entry.request.merge)
        self.count_waiting()

    def remove(self, entry: Entry) -> None:
        """Takes a request that is waiting or queued out (its client went away, or a step that ran it before it
        was preempted finished it)."""
        if entry.state is EntryState.WAITING_ADAPTER:
            waiting = self.waiting[entry.adapter]
            waiting.remove(entry)
            if not waiting:
                del self.waiting[entry.adapter]
                self.adapters.withdraw(entry.adapter)
        else:
            assert entry.state in (EntryState.QUEUED, EntryState.PREEMPTED)
            self.queue.remove(entry)
            self.adapters.release(entry.adapter)
        self.count_waiting()

    def count_waiting(self) -> None:
        self.metrics.queue_size.set(self.num_waiting)
        self.metrics.adapter_waiting_requests.set(sum(len(w) for w in self.waiting.values()))

    def first(self) -> Admitted:
        """What may start when nothing runs."""
        return self._take(min_size=None, max_size=self.config.max_batch_size, reserve=0)

    def more(self, num_running: int, waiting_steps: int, reserve: int = 0, prefill_tokens: int = 0) -> Admitted:
        """Newcomers that may join `num_running` running requests now (TGI's waiting-served-ratio rule), after
        `waiting_steps` steps without newcomers, leaving `reserve` blocks free for the running requests, in a
        step that already computes `prefill_tokens` prompt tokens (a chunk)."""
        if not self.queue:
            return Admitted()
        waited_enough = waiting_steps >= self.config.max_waiting_tokens
        min_size = None if waited_enough else math.floor(num_running * self.config.waiting_served_ratio)
        if self.queue[0].state is EntryState.PREEMPTED:
            min_size = None  # it was admitted once already: it resumes as soon as its blocks fit
        max_size = None
        if self.config.max_batch_size is not None:
            max_size = self.config.max_batch_size - num_running
            if max_size <= 0:
                return Admitted()
        admitted = self._take(min_size, max_size, reserve, prefill_tokens)
        if admitted.batch:
            self.metrics.batch_concat.labels("wait_exceeded" if waited_enough else "backpressure").inc()
        return admitted

    def _take(self, min_size: int | None, max_size: int | None, reserve: int, prefill_tokens: int = 0) -> Admitted:
        """Takes requests from the head of the queue while their prompts and first steps' blocks fit."""
        batch: list[Entry] = []
        budget = self.config.max_batch_prefill_tokens
        for entry in self.queue:
            if max_size is not None and len(batch) >= max_size:
                break
            if not entry.resumable:
                break  # preempted, and a step on the wire still runs it: its last tokens are not known yet
            allocation = self._allocate(entry, reserve)
            if allocation is None:
                break  # FIFO: nobody overtakes the head of the queue
            new_tokens = len(entry.context_ids) - allocation.num_cached_tokens
            if new_tokens <= budget < prefill_tokens + new_tokens:
                self.allocator.free(allocation.blocks)
                break
            entry.blocks, entry.num_cached_tokens = allocation.blocks, allocation.num_cached_tokens
            if new_tokens > budget:  # a long prompt: alone (no other prompt, no other chunk), and in chunks
                if batch or prefill_tokens:
                    self._give_back(entry)
                    break
                self._leave_queue(entry)
                return Admitted(long=entry)
            batch.append(entry)
            prefill_tokens += new_tokens
        if not batch or (min_size is not None and len(batch) < min_size):
            for entry in batch:
                self._give_back(entry)
            return Admitted()
        for entry in batch:
            self._leave_queue(entry)
        self.metrics.batch_next_size.observe(len(batch))
        return Admitted(batch=batch)

    def _allocate(self, entry: Entry, reserve: int) -> Allocation | None:
        """Blocks for the request's context (prompt, and tokens generated before a preemption) and its first
        step's tokens, reusing the cached blocks its context starts with."""
        request = entry.request
        if entry.prompt_hashes is None:  # once, not at every step the head of the queue waits for blocks
            entry.prompt_hashes = self.allocator.chain(request.input_ids, entry.adapter)
        if entry.state is EntryState.PREEMPTED:  # every token it got before it left the workers is known now
            entry.num_resumed = len(entry.token_ids)
        context = entry.context_ids
        hashes = entry.prompt_hashes
        if entry.num_resumed:
            hashes = self.allocator.chain(context, entry.adapter, known=hashes)
        reusable = () if entry.wants_prefill_logprobs else hashes  # its logprobs need every row
        lookahead = self.config.lookahead
        num_tokens = min(len(context) + 1 + lookahead, request.max_total_tokens + lookahead)
        return self.allocator.allocate(num_tokens, reusable, len(context), reserve)

    def _give_back(self, entry: Entry) -> None:
        self.allocator.free(entry.blocks)
        entry.blocks, entry.num_cached_tokens = [], 0

    def _leave_queue(self, entry: Entry) -> None:
        """The head of the queue got its blocks: it leaves the queue (the scheduler decides its state)."""
        assert self.queue[0] is entry
        self.queue.popleft()
        if entry.admitted_at is None:  # a resumed request was counted when it was first admitted
            entry.admitted_at = now = time.monotonic()
            label = self.metrics.adapter_label(entry.adapter)
            self.metrics.request_queue_duration.labels(label).observe(now - entry.queued_at)
            if self.allocator.prefix_caching:
                self.metrics.observe_prefix_cache(entry.request.input_length, entry.num_cached_tokens)
        self.count_waiting()

    def requeue(self, entry: Entry) -> None:
        """A preempted request (blocks freed, tokens kept) goes back to the head of the FIFO. It keeps its
        adapter counted as in use. Several preempted in one step: call from the newest to the oldest."""
        entry.move(EntryState.PREEMPTED)
        self.queue.appendleft(entry)
        self.count_waiting()

    def _enqueue(self, entry: Entry) -> None:
        entry.move(EntryState.QUEUED)
        self.queue.append(entry)
        self.adapters.acquire(entry.adapter)
        self._wake.set()

    def _adapter_settled(self, adapter_id: str, failure: AdapterFailure | None) -> None:
        """An adapter load ended: its waiting requests join the FIFO, or are answered with the failure."""
        for entry in self.waiting.pop(adapter_id, deque()):
            if failure is None:
                self._enqueue(entry)
            else:
                event = ErrorEvent(failure.message, failure.error_type, failure.status)
                entry.move(EntryState.DONE)
                self.metrics.observe_end(entry, event, time.monotonic())
                entry.events.put_nowait(event)  # at once: no step is needed to answer it
        self.count_waiting()

