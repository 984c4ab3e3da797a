"""Continuous batching: the loop that drives the workers, one Step RPC per engine step (TGI's admission rule,
vLLM's step contract).

One `Entry` per admitted HTTP request carries its validated request, its KV blocks and a queue of events for
the HTTP handler. Which requests may start is `Admission`'s rule (admission.py); what each step carries is
`StepPlanner`'s (step_planner.py); the loop runs the steps:

    wait for a request
      └─ while requests are held by the workers (or steps are on the wire):
           plan and send steps until `pipeline_depth` are on the wire: each lists the requests that leave
             (cancelled, failed on the router's side, preempted), gives running requests the blocks they may
             write, the next chunk of a long prompt, and newcomers; every request whose prompt is done decodes
           hand the last step's tokens to the HTTP handlers while the workers compute
           process the oldest step's answer: deliver tokens, end the requests that finished in the workers
             (their written blocks cached for prefix reuse), fail the requests of a step that failed

With `pipeline_depth` 2 the next step is sent before the current one's result is processed, so the workers
start step k+1 as soon as step k ends instead of waiting a router round trip. New requests never wait for the
running ones to finish. Nothing a request carries stops the loop: a failure ends the requests it concerns
and the loop goes on; only a shard that does not answer within `step_timeout` ends it (`ShardUnresponsive`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from specula_router.adapters import AdapterManager
from specula_router.admission import Admission, AdmissionConfig
from specula_router.block_allocator import BlockAllocator
from specula_router.client import ShardedClient, ShardError
from specula_router.entries import Entry, EntryState, ErrorEvent, FinalEvent, TokenOut, TokensEvent
from specula_router.metrics import Metrics
from specula_router.requests import ValidGenerateRequest
from specula_router.step_messages import GenerationOut, StepResponse
from specula_router.step_planner import PlannedStep, StepPlanner

__all__ = ["Entry", "EntryState", "ErrorEvent", "FinalEvent", "TokenOut", "TokensEvent", "Scheduler",
           "SchedulerConfig", "ShardUnresponsive"]

T = TypeVar("T")

logger = logging.getLogger("specula.router.scheduler")

@dataclass(frozen=True)
class SchedulerConfig(AdmissionConfig):
    """The admission rule's settings, and the loop's own."""

    pipeline_depth: int = 2  # steps queued in the workers at once (1: wait for each result)
    num_scheduler_steps: int = 1  # decode steps a call may run when every request decodes and none waits
    speculation_method: str = "none"  # label of the speculation metrics
    step_timeout: float | None = None  # seconds a shard may take to answer one step (None: no limit)


class ShardUnresponsive(Exception):
    """A shard did not answer a step within `step_timeout`, or cannot be reached at all (its process is gone, on
    this node or another): the router cannot go on and stops, and its launcher with it."""


@dataclass
class _SentStep:
    pending: Awaitable[StepResponse]
    plan: PlannedStep
    sent_at: float


class Scheduler:
    def __init__(
        self, client: ShardedClient, allocator: BlockAllocator, config: SchedulerConfig, metrics: Metrics,
        adapters: AdapterManager | None = None,
    ) -> None:
        self.client = client
        self.allocator = allocator
        self.config = config
        self.metrics = metrics
        metrics.watch_kv_blocks(allocator)
        self.adapters = adapters if adapters is not None else AdapterManager(client, metrics)
        self._wake = asyncio.Event()
        self.admission = Admission(allocator, self.adapters, metrics, config, self._wake)
        self.planner = StepPlanner(allocator, self.admission, config, metrics, self._finish)
        self._ids = itertools.count()
        self._outbox: list[tuple[Entry, object]] = []  # events held until the next step is on the wire
        self._ahead: deque[_SentStep] = deque()  # steps on the wire, oldest first
        self.last_step_ok: float | None = None  # monotonic time of the last successful worker step
        self.failure: str | None = None  # set once a shard stopped answering: the router is unhealthy for good

    # --- called by the HTTP handlers ----------------------------------------------------------------------

    def submit(self, request: ValidGenerateRequest) -> Entry:
        entry = Entry(next(self._ids), request)
        if self.failure is not None:
            entry.move(EntryState.DONE)
            entry.events.put_nowait(ErrorEvent(self.failure, "unhealthy", 503))
            return entry
        self.admission.add(entry)
        return entry

    @property
    def queue(self) -> deque[Entry]:
        return self.admission.queue

    @property
    def running(self) -> dict[int, Entry]:
        """Requests the workers hold, in admission order (the planner's)."""
        return self.planner.running

    @property
    def chunking(self) -> deque[Entry]:
        return self.planner.chunking

    @property
    def waiting(self) -> dict[str, deque[Entry]]:
        return self.admission.waiting

    @property
    def num_waiting(self) -> int:
        return self.admission.num_waiting

    def cancel(self, entry: Entry, event: ErrorEvent | None = None) -> None:
        """The client went away (or, with `event`, the request is ended for it): drop a waiting request now;
        one the workers hold leaves them at the next step sent (and its blocks are freed then)."""
        if entry.state in (EntryState.WAITING_ADAPTER, EntryState.QUEUED, EntryState.PREEMPTED):
            self.admission.remove(entry)
        elif entry.state in (EntryState.PREFILLING, EntryState.RUNNING):
            entry.cancelled = True
            return
        else:
            return
        entry.move(EntryState.DONE)
        self.metrics.observe_end(entry, event, time.monotonic())
        if event is not None:
            entry.events.put_nowait(event)

    def abort_all(self, event: ErrorEvent) -> int:
        """Ends every request now with `event` (e.g. the drain at shutdown ran out); returns how many.

        Waiting and queued requests end at once. Those the workers hold are answered at once and leave the
        workers at the next step, as for a client that went away; their blocks are freed then.
        """
        num_ended = 0
        for entries in list(self.waiting.values()):
            for entry in list(entries):
                self.cancel(entry, event)
                num_ended += 1
        for entry in list(self.queue):
            self.cancel(entry, event)
            num_ended += 1
        for entry in list(self.running.values()):
            if not entry.cancelled:
                self._fail_running(entry, event)
                num_ended += 1
        self._flush()
        return num_ended

    # --- the loop -----------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Serves requests until cancelled. Nothing a request carries can end it: an unexpected error fails the
        requests running at that moment and the loop goes on. It ends only by raising `ShardUnresponsive`, after
        failing every request, when a shard did not answer within `step_timeout`."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._serve_or_recover()
            except ShardUnresponsive as e:
                self._give_up(str(e))
                raise
            if self.queue or self.running or self._ahead:
                self._wake.set()

    async def _serve_or_recover(self) -> None:
        try:
            await self._serve_until_idle()
        except ShardUnresponsive:
            raise
        except Exception as e:  # a defect must cost the requests of this moment, never the server
            logger.exception("batching loop error; failing the running requests")
            event = ErrorEvent(f"internal error: {type(e).__name__}: {e}", "internal", 500)
            try:
                await self._recover(event)
            except ShardUnresponsive:
                raise
            except Exception as again:  # nor a defect met while recovering from it
                logger.exception("error while recovering from a batching loop error; failing the running requests")
                self._fail_all_running(ErrorEvent(
                    f"{event.message}; then, while recovering: {type(again).__name__}: {again}", "internal", 500))

    async def _serve_until_idle(self) -> None:
        """Steps until the workers hold no request and no step is on the wire."""
        ahead = self._ahead
        while True:
            while len(ahead) < self.config.pipeline_depth:
                on_wire = sum(sent.plan.decode_steps for sent in ahead)
                plan = self.planner.plan(on_wire, self.config.num_scheduler_steps)
                if not plan:
                    break
                self.metrics.batch_inference_count.labels(plan.method).inc()
                pending = self.client.step(plan.finished, list(plan.updates.values()), plan.new_requests,
                                           plan.decode_steps)
                self.planner.sent()
                ahead.append(_SentStep(pending, plan, time.monotonic()))
            self._flush()  # handlers stream the last step's tokens while the workers compute
            if not ahead:
                return
            await self._process(ahead.popleft())

    async def _recover(self, event: ErrorEvent) -> None:
        """After an unexpected error: wait out the steps on the wire, fail every request the workers hold (they
        leave them at the next step)."""
        while self._ahead:
            sent = self._ahead.popleft()
            try:
                await self._timed("a step", sent.pending)
            except ShardUnresponsive:
                raise
            except Exception as e:  # its requests are failed below, whatever it raised
                if not isinstance(e, ShardError):
                    logger.exception("a step on the wire failed too while recovering")
            self._settle_preempted(sent.plan)
        self._fail_all_running(event)

    def _fail_all_running(self, event: ErrorEvent) -> None:
        """Fails every request the workers hold with `event` (they leave them, and free their blocks, at the next
        step sent). Steps still on the wire, if any, are processed by the loop as usual."""
        for entry in list(self.running.values()):
            if not entry.cancelled:
                self._fail_running(entry, event)
        self._flush()

    def _give_up(self, reason: str) -> None:
        """A shard hangs: fail everything, and every later request, with `reason` (the router then exits)."""
        self.failure = reason
        logger.error("%s; failing every request", reason)
        for sent in self._ahead:  # never to be awaited: the shard does not answer
            if asyncio.iscoroutine(sent.pending):
                sent.pending.close()
            elif isinstance(sent.pending, asyncio.Future):
                sent.pending.cancel()
        self._ahead.clear()
        for entry in list(self.running.values()):
            self._end(entry, ErrorEvent(reason))
        self.abort_all(ErrorEvent(reason, "unhealthy", 503))
        self._flush()

    async def _timed(self, what: str, pending: Awaitable[T]) -> T:
        """Awaits a worker call, raising `ShardUnresponsive` when it takes longer than `step_timeout` or a shard
        cannot be reached (a shard of another node whose process died: no launcher here sees it die)."""
        try:
            if self.config.step_timeout is None:
                return await pending
            return await asyncio.wait_for(pending, self.config.step_timeout)
        except asyncio.TimeoutError:
            raise ShardUnresponsive(f"a shard did not answer {what} within --step-timeout "
                                    f"({self.config.step_timeout:g}s)") from None
        except ShardError as e:
            if e.unreachable:
                raise ShardUnresponsive(f"a shard cannot be reached ({e}); its process is gone") from e
            raise

    async def _process(self, sent: _SentStep) -> None:
        """Waits for a step's answer and delivers its tokens; a failed step fails every request it ran."""
        method, plan = sent.plan.method, sent.plan
        try:
            response = await self._timed(f"a {method} step", sent.pending)
        except ShardUnresponsive:
            raise
        except ShardError as e:
            logger.error("%s step failed: %s", method, e)
            self.metrics.batch_inference_failure.labels(method).inc()
            self.planner.finish_again += plan.finished  # in case it never ran: workers that did ignore them
            self._settle_preempted(plan)
            for entry in plan.entries:
                self._fail_held(entry, ErrorEvent(str(e)))
            self._flush()
            return
        except Exception:  # it answered, if with an unexpected error: the requests it preempted may resume
            self._settle_preempted(plan)
            raise
        self._settle_preempted(plan)
        now = time.monotonic()
        m = self.metrics
        m.batch_inference_success.labels(method).inc()
        # A pipelined step was queued behind the previous one: count from when the worker could start it. A call
        # of several decode steps is observed once per step, at its mean.
        steps = response.decode_steps
        inference = (now - max(sent.sent_at, self.last_step_ok or sent.sent_at)) / steps
        for _ in range(steps):
            m.batch_inference_duration.labels(method).observe(inference)
            m.batch_forward_duration.labels(method).observe(response.timings.forward_ns / 1e9 / steps)
            m.batch_decode_duration.labels(method).observe(response.timings.decode_ns / 1e9 / steps)
        self.last_step_ok = now
        for entry, until in plan.chunks:
            if entry.state is EntryState.PREFILLING or (entry.state is EntryState.RUNNING and
                                                       until < len(entry.context_ids)):
                entry.num_cached_tokens = max(entry.num_cached_tokens, until)
                self.planner.cache_written(entry)  # the chunk's full blocks may be reused
        self._deliver_all(response.generations, {e.id: e for e in plan.entries})
        m.batch_current_size.set(len(self.running))
        m.batch_current_max_tokens.set(self.allocator.num_used_tokens)
        m.prefix_cache_blocks.set(self.allocator.num_cached_blocks)
        m.suffix_cache_tokens.set(response.suffix_cache_tokens)
        m.suffix_cache_nodes.set(response.suffix_cache_nodes)

    def _deliver_all(self, generations: list[GenerationOut], ran: dict[int, Entry]) -> None:
        for generation in generations:
            entry = ran.get(generation.request_id)
            if entry is None or entry.state is EntryState.DONE or entry.cancelled:
                continue
            try:
                self._deliver(entry, generation)
            except Exception as e:  # one request's result must not fail the others'
                logger.exception("could not deliver the result of request %d", generation.request_id)
                self._fail_held(entry, ErrorEvent(f"internal error: {type(e).__name__}: {e}", "internal", 500))

    def _settle_preempted(self, plan: PlannedStep) -> None:
        """The step that preempted these requests has answered, so has every step before it that ran them:
        their tokens are all known, and they may resume."""
        for entry in plan.preempted:
            entry.resumable = True
        if plan.preempted:
            self._wake.set()

    def _fail_held(self, entry: Entry, event: ErrorEvent) -> None:
        """Fails a request a step ran: at once when preempted meanwhile (the workers dropped it), else it leaves
        the workers at the next step."""
        if entry.state is EntryState.PREEMPTED:
            self.cancel(entry, event)
        elif entry.state in (EntryState.PREFILLING, EntryState.RUNNING) and not entry.cancelled:
            self._fail_running(entry, event)

    def _deliver(self, entry: Entry, generation: GenerationOut) -> None:
        """One request's result of a step (a request preempted since still gets the tokens it made)."""
        if generation.error:  # it failed alone in the worker, which has already dropped it
            self._finish(entry, ErrorEvent(generation.error))
            return
        now = time.monotonic()
        tokens = generation.tokens
        first = len(entry.token_ids) == entry.num_resumed
        entry.token_ids += [t.id for t in tokens]
        if first and entry.blocks:  # its prefill: the context's KV is written, its full blocks may be reused
            self.planner.cache_written(entry)
        final = generation.final
        if tokens:
            self.metrics.observe_tokens(entry, len(tokens), now)
            entry.first_token_at = entry.first_token_at or now
            entry.last_token_at = now
            entry.num_generated += len(tokens)
            skipped = generation.skipped
            entry.num_skipped += sum(skipped)
            if self.config.speculation_method != "none":
                # Labelled by this step's drafter: requests of one batch may use different ones (an adapter's
                # Medusa heads, prompt lookup).
                method = generation.draft_method or self.config.speculation_method
                for drafted, accepted in generation.drafts_per_step:
                    self.metrics.observe_speculation(method, entry.adapter, drafted, accepted)
            self._outbox.append((entry, TokensEvent(tokens, generation.top_tokens, skipped, generation.prefill_tokens,
                                                    final)))
        if final is not None:
            self._finish(entry, final, send=not tokens)

    def _finish(self, entry: Entry, event: FinalEvent | ErrorEvent | None, send: bool = True) -> None:
        """Ends a request: frees its blocks and its adapter, and sends its last event (None: its client left)."""
        if entry.state is EntryState.DONE:
            return
        if entry.state is EntryState.PREEMPTED:  # it finished in a step sent before it was preempted
            self.admission.remove(entry)
        elif entry.state is not EntryState.WAITING_ADAPTER:
            self.adapters.release(entry.adapter)
        entry.move(EntryState.DONE)
        self.planner.leave(entry)
        if isinstance(event, FinalEvent) and entry.blocks:
            # Every token but the last was fed back to the model: their KV is written and may be reused (a
            # chat's next turn resends them). Rejected drafts lie past these positions.
            self.planner.cache_written(entry)
        self.allocator.free(entry.blocks)
        entry.blocks = []
        self.metrics.observe_end(entry, event, time.monotonic())
        if event is not None and send:
            self._outbox.append((entry, event))

    def _end(self, entry: Entry, event: ErrorEvent) -> None:
        """Ends a request the workers no longer hold with `event`, unless it already left or failed."""
        self._finish(entry, entry.failure if entry.cancelled else event, send=not entry.cancelled)

    def _fail_running(self, entry: Entry, event: ErrorEvent) -> None:
        """Answers a request the workers hold with `event` now; it leaves them (and frees its blocks) at the
        next step sent."""
        entry.cancelled, entry.failure = True, event
        self._outbox.append((entry, event))

    def _flush(self) -> None:
        for entry, event in self._outbox:
            entry.events.put_nowait(event)
        self._outbox.clear()
