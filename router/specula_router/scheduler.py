"""Continuous batching: the loop that drives the workers (TGI semantics).

One `Entry` per admitted HTTP request carries its validated request, its KV blocks and a queue of events for
the HTTP handler. Which requests may start is `Admission`'s rule (admission.py); the loop runs them:

    wait for a request ──> prefill a first batch
        └─ while requests are running:
             decode every running batch together (the worker concatenates them); the next step is sent
               before this one's result is processed
             free finished requests' blocks; filter out requests whose client went away
             prefill one chunk of a long prompt, if one is being prefilled in chunks
             maybe prefill newcomers (when enough wait, or one has waited max_waiting_tokens steps)

New requests never wait for the running batch to finish. Nothing a request carries stops the loop: a
failure ends the requests it concerns and the loop goes on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, TypeVar

from specula_proto import generate_pb2 as pb
from specula_router.admission import Admission, AdmissionConfig, Admitted
from specula_router.adapters import AdapterManager
from specula_router.block_allocator import BlockAllocator
from specula_router.client import ShardedClient, ShardError, StepResponse
from specula_router.entries import Entry, EntryState, ErrorEvent, FinalEvent, TokenOut, TokensEvent
from specula_router.metrics import Metrics
from specula_router.requests import ValidGenerateRequest

__all__ = ["Entry", "EntryState", "ErrorEvent", "FinalEvent", "TokenOut", "TokensEvent", "Scheduler",
           "SchedulerConfig", "ShardUnresponsive"]

T = TypeVar("T")

logger = logging.getLogger("specula.router.scheduler")

_FINISH_REASONS = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_EOS_TOKEN: "eos_token",
    pb.FINISH_REASON_STOP_SEQUENCE: "stop_sequence",
}


@dataclass(frozen=True)
class SchedulerConfig(AdmissionConfig):
    """The admission rule's settings, and the loop's own."""

    pipeline_depth: int = 2  # decode steps queued in the workers at once (1: wait for each result)
    speculation_method: str = "none"  # label of the speculation metrics
    step_timeout: float | None = None  # seconds a shard may take to answer one step (None: no limit)


class ShardUnresponsive(Exception):
    """A shard did not answer a step within `step_timeout`: the router cannot go on and stops."""


def _tokens(tokens: pb.Tokens) -> list[TokenOut]:
    return [TokenOut(i, t, lp, sp) for i, t, lp, sp in zip(tokens.ids, tokens.texts, tokens.logprobs, tokens.is_special)]


class Scheduler:
    def __init__(
        self, client: ShardedClient, allocator: BlockAllocator, config: SchedulerConfig, metrics: Metrics,
        adapters: AdapterManager | None = None,
    ) -> None:
        self.client = client
        self.allocator = allocator
        self.config = config
        self.metrics = metrics
        self.adapters = adapters if adapters is not None else AdapterManager(client, metrics)
        self._wake = asyncio.Event()
        self.admission = Admission(allocator, self.adapters, metrics, config, self._wake)
        self.running: dict[int, Entry] = {}
        self.chunking: deque[Entry] = deque()  # admitted long prompts prefilled in chunks, oldest first
        self._ids = itertools.count()
        self._batch_ids = itertools.count()
        self._outbox: list[tuple[Entry, object]] = []  # events held until the next step is on the wire
        self._ahead: deque[tuple[Awaitable[StepResponse], tuple[int, ...], float]] = deque()  # decodes on the wire
        self.last_step_ok: float | None = None  # monotonic time of the last successful worker step
        self.failure: str | None = None  # set once a shard stopped answering: the router is unhealthy for good

    # --- called by the HTTP handlers ----------------------------------------------------------------------

    def submit(self, request: ValidGenerateRequest) -> Entry:
        entry = Entry(next(self._ids), request)
        if self.failure is not None:
            entry.state = EntryState.DONE
            entry.events.put_nowait(ErrorEvent(self.failure, "unhealthy", 503))
            return entry
        self.admission.add(entry)
        return entry

    @property
    def queue(self) -> deque[Entry]:
        return self.admission.queue

    @property
    def waiting(self) -> dict[str, deque[Entry]]:
        return self.admission.waiting

    @property
    def num_waiting(self) -> int:
        return self.admission.num_waiting

    def cancel(self, entry: Entry, event: ErrorEvent | None = None) -> None:
        """The client went away (or, with `event`, the request is ended for it): drop a waiting request now,
        a running one after the current step."""
        if entry.state in (EntryState.WAITING_ADAPTER, EntryState.QUEUED):
            self.admission.remove(entry)
        elif entry.state is EntryState.PREFILLING:
            # No worker holds it. Its blocks may go at once: a chunk still on the wire runs before any step
            # that could give them to another request.
            self.chunking.remove(entry)
            self.adapters.release(entry.adapter)
            self.allocator.free(entry.blocks)
            entry.blocks = []
        elif entry.state is EntryState.RUNNING:
            entry.cancelled = True
            return
        else:
            return
        entry.state = EntryState.DONE
        self.metrics.observe_end(entry, event, time.monotonic())
        if event is not None:
            entry.events.put_nowait(event)

    def abort_all(self, event: ErrorEvent) -> int:
        """Ends every request now with `event` (e.g. the drain at shutdown ran out); returns how many.

        Waiting and queued requests end at once. Running ones are answered at once and leave the workers'
        batches at the next step, as for a client that went away; their blocks are freed only then.
        """
        num_ended = 0
        for entries in list(self.waiting.values()):
            for entry in list(entries):
                self.cancel(entry, event)
                num_ended += 1
        for entry in [*self.queue, *self.chunking]:
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
            if self.queue or self.chunking:
                self._wake.set()

    async def _serve_or_recover(self) -> None:
        try:
            await self._serve_until_idle()
        except ShardUnresponsive:
            raise
        except Exception as e:  # a defect must cost the requests of this moment, never the server
            logger.exception("batching loop error; failing the running requests")
            await self._recover(ErrorEvent(f"internal error: {type(e).__name__}: {e}", "internal", 500))

    async def _serve_until_idle(self) -> None:
        live = await self._start(self.admission.first())
        if live or self.chunking:
            await self._decode_while_running(live)
        self._flush()

    async def _start(self, admitted: Admitted) -> list[int]:
        """Admitted requests begin: a batch is prefilled (its batch id returned while some of it runs), a long
        prompt starts its chunks."""
        if admitted.long is not None:
            admitted.long.state = EntryState.PREFILLING
            self.chunking.append(admitted.long)
        for entry in admitted.batch:
            entry.state = EntryState.RUNNING
            self.running[entry.id] = entry
        return await self._prefill(admitted.batch) if admitted.batch else []

    async def _recover(self, event: ErrorEvent) -> None:
        """After an unexpected error: wait out the steps on the wire, clear the workers, fail what ran."""
        await self._abandon(self._ahead)
        self._ahead.clear()
        for entry in list(self.running.values()):
            self._end(entry, event)
        self._flush()

    def _give_up(self, reason: str) -> None:
        """A shard hangs: fail everything, and every later request, with `reason` (the router then exits)."""
        self.failure = reason
        logger.error("%s; failing every request", reason)
        for pending, _, _ in self._ahead:  # never to be awaited: the shard does not answer
            if asyncio.iscoroutine(pending):
                pending.close()
            elif isinstance(pending, asyncio.Future):
                pending.cancel()
        self._ahead.clear()
        for entry in list(self.running.values()):
            self._end(entry, ErrorEvent(reason))
        self.abort_all(ErrorEvent(reason, "unhealthy", 503))
        self._flush()

    async def _timed(self, what: str, pending: Awaitable[T]) -> T:
        """Awaits a worker call, raising `ShardUnresponsive` when it takes longer than `step_timeout`."""
        if self.config.step_timeout is None:
            return await pending
        try:
            return await asyncio.wait_for(pending, self.config.step_timeout)
        except asyncio.TimeoutError:
            raise ShardUnresponsive(f"a shard did not answer {what} within --step-timeout "
                                    f"({self.config.step_timeout:g}s)") from None

    async def _decode_while_running(self, live: list[int]) -> None:
        """Decode steps until no request runs; `live` holds the ids of batches cached in the workers.

        With `pipeline_depth` 2 the next Decode is sent before the current one's result is processed, so the
        workers start step k+1 as soon as step k ends instead of waiting a router round trip. The workers
        skip batches that ended in the step before (see `TextGenerator.decode`).
        """
        ahead = self._ahead
        waiting_steps = 1
        while live or ahead or self.chunking:
            while live and len(ahead) < self.config.pipeline_depth:
                ids = tuple(live)
                self.metrics.batch_inference_count.labels("decode").inc()
                ahead.append((self.client.decode([pb.CachedBatch(id=i) for i in ids]), ids, time.monotonic()))
            self._flush()  # handlers stream the last step's tokens while the workers compute
            if ahead:
                pending, sent, sent_at = ahead.popleft()
                response = await self._await_step("decode", pending, sent_at, list(self.running.values()))
                if response is None:
                    await self._abandon(ahead)
                    ahead.clear()
                    return
                survivor = response.batch.id if response.batch is not None else None
                live = [i for i in live if i not in sent or i == survivor]
                live = await self._drop_cancelled(live)
            ready = await self._prefill_next_chunk()  # at most one chunk between two decode steps
            if ready:
                live += await self._prefill(ready)
            waiting_steps += 1
            admitted = self.admission.more(len(self.running), waiting_steps)
            if admitted:
                live += await self._start(admitted)
                waiting_steps = 1

    # --- chunked prefill ------------------------------------------------------------------------------------

    @property
    def chunk_tokens(self) -> int:
        """Prompt tokens per chunk: the prefill budget, in whole blocks (the next chunk starts on a block)."""
        size = self.allocator.block_size
        return max(size, self.config.max_batch_prefill_tokens // size * size)

    async def _prefill_next_chunk(self) -> list[Entry]:
        """Prefills the next chunk of the oldest long prompt; returns it once the rest fits one prefill.

        A prompt longer than one prefill is prefilled a chunk at a time between decode steps, so running
        requests wait for one chunk at most; its last part joins the batch as a plain prefill."""
        if not self.chunking:
            return []
        entry = self.chunking[0]
        if entry.request.input_length - entry.num_cached_tokens <= self.config.max_batch_prefill_tokens:
            self.chunking.popleft()
            entry.state = EntryState.RUNNING
            self.running[entry.id] = entry
            return [entry]
        until = entry.num_cached_tokens + self.chunk_tokens
        try:
            request = entry.to_pb(prefill_until=until)
        except (ValueError, TypeError, OverflowError) as e:
            self.cancel(entry, ErrorEvent(f"the request cannot be sent to the workers: {e}", "validation", 422))
            return []
        self.metrics.batch_inference_count.labels("prefill").inc()
        pending = self.client.prefill(pb.Batch(id=next(self._batch_ids), requests=[request]))
        self._flush()
        try:
            await self._timed("a prefill step", pending)
        except ShardError as e:
            logger.error("prefill chunk failed: %s", e)
            self.metrics.batch_inference_failure.labels("prefill").inc()
            if entry.state is EntryState.PREFILLING:
                self.cancel(entry, ErrorEvent(str(e)))
            return []
        self.metrics.batch_inference_success.labels("prefill").inc()
        if entry.state is EntryState.PREFILLING:  # not cancelled meanwhile
            entry.num_cached_tokens = until
            written = (entry.prompt_hashes or [])[: until // self.allocator.block_size]
            self.allocator.cache(entry.blocks, written)
        return []

    async def _prefill(self, entries: list[Entry]) -> list[int]:
        """Prefills new requests; returns the new batch id when some of them keep running.

        A request the workers' message cannot encode (validation should have refused it) fails alone.
        """
        requests = []
        for entry in list(entries):
            try:
                requests.append(entry.to_pb())
            except (ValueError, TypeError, OverflowError) as e:
                logger.error("request %d cannot be sent to the workers: %s", entry.id, e)
                self._finish(entry, ErrorEvent(f"the request cannot be sent to the workers: {e}", "validation", 422))
                entries.remove(entry)
        if not requests:
            self._flush()
            return []
        batch = pb.Batch(id=next(self._batch_ids), requests=requests)
        self.metrics.batch_inference_count.labels("prefill").inc()
        pending = self.client.prefill(batch)
        self._flush()
        response = await self._await_step("prefill", pending, time.monotonic(), entries)
        if response is None:
            await self._clear_quietly(batch.id)
            return []
        return [] if response.batch is None else [batch.id]

    async def _await_step(self, method: str, pending: Awaitable[StepResponse], sent_at: float,
                          failing: list[Entry]) -> StepResponse | None:
        """Waits for a step and delivers its tokens; on a worker failure fails `failing` and returns None."""
        try:
            response = await self._timed(f"a {method} step", pending)
        except ShardError as e:
            logger.error("%s failed: %s", method, e)
            self.metrics.batch_inference_failure.labels(method).inc()
            for entry in failing:
                self._end(entry, ErrorEvent(str(e)))
            self._flush()
            return None
        now = time.monotonic()
        m = self.metrics
        m.batch_inference_success.labels(method).inc()
        # A pipelined step was queued behind the previous one: count from when the worker could start it.
        m.batch_inference_duration.labels(method).observe(now - max(sent_at, self.last_step_ok or sent_at))
        m.batch_forward_duration.labels(method).observe(response.timings.forward_ns / 1e9)
        m.batch_decode_duration.labels(method).observe(response.timings.decode_ns / 1e9)
        self.last_step_ok = now
        for generation in response.generations:
            try:
                self._deliver(generation)
            except Exception as e:  # one request's result must not fail the others'
                logger.exception("could not deliver the result of request %d", generation.request_id)
                entry = self.running.get(generation.request_id)
                if entry is not None and not entry.cancelled:
                    self._fail_running(entry, ErrorEvent(f"internal error: {type(e).__name__}: {e}", "internal",
                                                         500))
        m.batch_current_size.set(len(self.running))
        m.batch_current_max_tokens.set(self.allocator.num_used_tokens)
        m.prefix_cache_blocks.set(self.allocator.num_cached_blocks)
        return response

    async def _drop_cancelled(self, live: list[int]) -> list[int]:
        """Removes requests whose clients went away from every live batch, then frees their blocks.

        The blocks are freed only after FilterBatch answers: the workers run RPCs in order, so by then no
        queued step can still write to them.
        """
        cancelled = [e for e in self.running.values() if e.cancelled]
        if not cancelled:
            return live
        keep = [e.id for e in self.running.values() if not e.cancelled]
        survivors = []
        for batch_id in live:
            try:
                batch = await self._timed("FilterBatch", self.client.filter_batch(batch_id, keep))
            except ShardError as e:
                for entry in list(self.running.values()):
                    self._end(entry, ErrorEvent(str(e)))
                return []
            if batch.request_ids:
                survivors.append(batch_id)
        for entry in cancelled:
            self._finish(entry, entry.failure, send=False)  # a failure was sent when it happened
        return survivors

    async def _abandon(self, ahead: deque) -> None:
        """After a failed step: wait out the steps still queued and clear the workers' batches."""
        for pending, _, _ in ahead:
            try:
                await self._timed("a decode step", pending)
            except ShardError:
                pass
        await self._clear_quietly(None)

    def _deliver(self, generation: pb.Generation) -> None:
        entry = self.running.get(generation.request_id)
        if entry is None:
            return
        if generation.error:  # it failed alone in the worker, which has already dropped it
            self._finish(entry, ErrorEvent(generation.error), send=not entry.cancelled)
            return
        if not entry.num_generated:  # its prefill: the prompt's KV is written, its full blocks may be reused
            self.allocator.cache(entry.blocks, entry.prompt_hashes or ())
        now = time.monotonic()
        tokens = _tokens(generation.tokens)
        entry.token_ids += [t.id for t in tokens]
        final = None
        if generation.HasField("generated_text"):
            g = generation.generated_text
            seed = g.seed if g.HasField("seed") else None
            final = FinalEvent(g.text, _FINISH_REASONS[g.finish_reason], g.generated_tokens, seed)
        if tokens:
            self.metrics.observe_tokens(entry, len(tokens), now)
            entry.first_token_at = entry.first_token_at or now
            entry.last_token_at = now
            entry.num_generated += len(tokens)
            entry.num_skipped += len(tokens) - 1
            if self.config.speculation_method != "none":
                # Labelled by this step's drafter: requests of one batch may use different ones (an adapter's
                # Medusa heads, prompt lookup).
                self.metrics.observe_speculation(
                    generation.draft_method or self.config.speculation_method, entry.adapter,
                    generation.drafted_tokens, generation.accepted_tokens)
            prefill = _tokens(generation.prefill_tokens) if generation.HasField("prefill_tokens") else None
            top = [_tokens(t) for t in generation.top_tokens]
            self._outbox.append((entry, TokensEvent(tokens, top, prefill, final)))
        if final is not None:
            self._finish(entry, final, send=not tokens)

    def _finish(self, entry: Entry, event: FinalEvent | ErrorEvent | None, send: bool = True) -> None:
        """Ends a request: frees its blocks and its adapter, and sends its last event (None: its client left)."""
        if entry.state is EntryState.DONE:
            return
        if entry.state is not EntryState.WAITING_ADAPTER:
            self.adapters.release(entry.adapter)
        entry.state = EntryState.DONE
        self.running.pop(entry.id, None)
        if isinstance(event, FinalEvent) and entry.token_ids:
            # Every token but the last was fed back to the model: their KV is written and may be reused (a
            # chat's next turn resends them). Rejected drafts lie past these positions.
            written = entry.request.input_ids + tuple(entry.token_ids[:-1])
            hashes = self.allocator.chain(written, entry.adapter, known=entry.prompt_hashes or ())
            self.allocator.cache(entry.blocks, hashes)
        self.allocator.free(entry.blocks)
        entry.blocks = []
        self.metrics.observe_end(entry, event, time.monotonic())
        if event is not None and send:
            self._outbox.append((entry, event))

    def _end(self, entry: Entry, event: ErrorEvent) -> None:
        """Ends a request the workers no longer hold with `event`, unless it already left or failed."""
        self._finish(entry, entry.failure if entry.cancelled else event, send=not entry.cancelled)

    def _fail_running(self, entry: Entry, event: ErrorEvent) -> None:
        """Answers a running request with `event` now; it leaves the workers' batch (and frees its blocks) at
        the next step, since a step on the wire may still write to them."""
        entry.cancelled, entry.failure = True, event
        self._outbox.append((entry, event))

    def _flush(self) -> None:
        for entry, event in self._outbox:
            entry.events.put_nowait(event)
        self._outbox.clear()

    async def _clear_quietly(self, batch_id: int | None) -> None:
        try:
            await self._timed("ClearCache", self.client.clear_cache(batch_id))
        except ShardError as e:
            logger.warning("could not clear %s: %s", "every batch" if batch_id is None else f"batch {batch_id}", e)
