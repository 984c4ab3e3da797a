"""One HTTP request's life in the router, whichever API it came by.

The routes translate: `server.py` (TGI, LoRAX) and `openai_api.py` (OpenAI) turn their bodies into `/generate`
parameters and their answers back into their own shapes. Everything between is a `RequestSession`:

    session = RequestSession(state, request.is_disconnected)
    job = await session.admit(inputs, parameters, stream)   concurrency limit (an in-flight slot), validation in
                                                            a thread, the grammar's check, admission metrics
    session.submit(job, copies)                             the n / best_of fan-out: one entry per seed
    first = await session.adapter_loaded()                  a stream waits for its adapter, so a failed load is
                                                            an HTTP status like any refusal
    generations = await session.collect()                   or the route streams the entries' events
    session.timing_headers(job, entry, generation)          TGI's x-* headers
    session.close()                                         in-flight slots given back, unfinished entries
                                                            cancelled (their KV blocks freed); idempotent

`async with` closes the session on the way out, unless the route handed it to a stream (`keep_open`), whose
generator closes it when the stream ends. So `in_flight` is raised in `hold` and lowered in `close`, nowhere else.
Refusals are typed (`Refused`, with the field for a validation error); each route words them in its own shape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specula_router.entries import Entry, EntryState, ErrorEvent
from specula_router.grammar import Grammar, GrammarError, generate_parameters_field
from specula_router.requests import ValidGenerateRequest
from specula_router.responses import DisconnectWatch, Generation, GenerationError, collect, next_event
from specula_router.validation_limits import ValidationError

if TYPE_CHECKING:
    from specula_router.schemas import GenerateParameters
    from specula_router.server import RouterState

__all__ = ["Job", "Refused", "RequestSession"]


class Refused(Exception):
    """A request the router does not admit: `status` (422 validation, 429 overloaded), `error_type`, and for a
    validation error the `field` it names (as `/generate` calls it)."""

    def __init__(self, status: int, message: str, error_type: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.field = field


@dataclass
class Job:
    """One admitted prompt and the entries of its choices (`best_of` or `n` of them, one seed each)."""

    valid: ValidGenerateRequest
    validation_s: float
    entries: list[Entry] = field(default_factory=list)


class RequestSession:
    """See the module docstring. `is_disconnected`: the HTTP request's check (None: never gone)."""

    def __init__(self, state: RouterState, is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> None:
        self.state = state
        self.is_disconnected = is_disconnected or _connected
        self.arrived = time.monotonic()
        self.jobs: list[Job] = []
        self._held = 0  # in-flight slots this session holds
        self._kept_open = False

    async def __aenter__(self) -> RequestSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if not self._kept_open:
            self.close()

    def keep_open(self) -> RequestSession:
        """Hands the session to a stream: leaving `async with` no longer closes it; the stream must."""
        self._kept_open = True
        return self

    @property
    def entries(self) -> list[Entry]:
        return [entry for job in self.jobs for entry in job.entries]

    # --- admission -------------------------------------------------------------------------------------------

    def hold(self) -> None:
        """Takes an in-flight slot, or refuses with 429 when `--max-concurrent-requests` are in flight."""
        state = self.state
        if state.in_flight >= state.max_concurrent_requests:
            state.metrics.request_failure.labels("overloaded", "").inc()
            raise Refused(429, "Model is overloaded", "overloaded")
        state.in_flight += 1  # counted before the first await, so concurrent arrivals see it
        self._held += 1

    async def admit(self, inputs: str, parameters: GenerateParameters, stream: bool,
                    add_special_tokens: bool = True) -> Job:
        """Holds a slot, validates `inputs` and `parameters` (in a thread: tokenising a long prompt is slow), then
        checks the request's grammar against the tokenizer (`grammar.py`: in a thread, cached) and counts the
        request. Raises `Refused`; a refused prompt's slot is given back with the others' at `close`."""
        self.hold()
        state = self.state
        start = time.monotonic()
        try:
            valid = await state.in_validation_worker(state.validator.validate, inputs, parameters, stream,
                                                     add_special_tokens)
            if valid.grammar:
                try:
                    field = generate_parameters_field(parameters.grammar, parameters.response_format)
                    await state.check_grammar(Grammar(valid.grammar, field))
                except GrammarError as e:
                    raise ValidationError(e.message, e.field) from None
        except ValidationError as e:
            state.metrics.request_failure.labels("validation", "").inc()
            raise Refused(422, e.message, "validation", e.field) from None
        elapsed = time.monotonic() - start
        m, adapter = state.metrics, state.metrics.adapter_label(valid.adapter_id)
        m.request_validation_duration.observe(elapsed)
        m.request_count.labels(adapter).inc()
        m.request_input_length.labels(adapter).observe(valid.input_length)
        m.request_max_new_tokens.observe(valid.stopping.max_new_tokens)
        job = Job(valid, elapsed)
        self.jobs.append(job)
        return job

    def submit(self, job: Job, copies: int = 1) -> list[Entry]:
        """Queues `copies` entries of `job`, the i-th with the seed `seed + i` (best_of, n)."""
        for i in range(copies):
            sampling = dataclasses.replace(job.valid.sampling, seed=(job.valid.sampling.seed + i) % 2**64)
            job.entries.append(self.state.scheduler.submit(dataclasses.replace(job.valid, sampling=sampling)))
        return job.entries

    # --- answers ---------------------------------------------------------------------------------------------

    async def adapter_loaded(self, watch: DisconnectWatch | None = None) -> object | None:
        """When the first entry waits for its adapter: waits, and returns the first event it then got (for the
        stream to send first); None when no entry waited. Raises `GenerationError` when the load failed and
        `ClientGone` when the client left meanwhile."""
        entries = self.entries
        if not any(e.state is EntryState.WAITING_ADAPTER for e in entries):
            return None
        event = await next_event(entries[0], watch or DisconnectWatch(self.is_disconnected))
        if isinstance(event, ErrorEvent):
            raise GenerationError(event.message, event.status, event.error_type)
        return event

    async def collect(self) -> list[list[Generation]]:
        """Every entry's generation, per job ([job][choice]). Raises `GenerationError` (the first entry that
        failed) or `ClientGone`; the session's `close` then cancels the others."""
        flat = await asyncio.gather(*(collect(e, self.is_disconnected) for e in self.entries))
        per_job, at = [], 0
        for job in self.jobs:
            per_job.append(flat[at:at + len(job.entries)])
            at += len(job.entries)
        return per_job

    def observe_duration(self) -> None:
        """`request_duration` of every job, from arrival to now (its answer's end)."""
        metrics, now = self.state.metrics, time.monotonic()
        for job in self.jobs:
            metrics.request_duration.labels(metrics.adapter_label(job.valid.adapter_id)).observe(now - self.arrived)

    def timing_headers(self, job: Job, entry: Entry, generation: Generation) -> dict[str, str]:
        """TGI's `x-*` headers of a finished answer: times in milliseconds from arrival, admission and queueing."""
        now = time.monotonic()
        admitted = entry.admitted_at or now
        inference = now - admitted
        generated = len(generation.tokens)

        def ms(seconds: float) -> str:
            return str(int(seconds * 1000))

        return {
            "x-compute-type": self.state.compute_type,
            "x-compute-time": f"{inference:.6f}",
            "x-total-time": ms(now - self.arrived),
            "x-validation-time": ms(job.validation_s),
            "x-queue-time": ms(admitted - entry.queued_at),
            "x-inference-time": ms(inference),
            "x-time-per-token": ms(inference / max(generated, 1)),
            "x-prompt-tokens": str(job.valid.input_length),
            "x-generated-tokens": str(generated),
            "x-skipped-tokens": str(generation.num_skipped),
        }

    def stream_headers(self) -> dict[str, str]:
        return {"x-compute-type": self.state.compute_type, "x-accel-buffering": "no", "cache-control": "no-cache"}

    # --- end -------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Gives back the session's in-flight slots and cancels its unfinished entries (a no-op for finished
        ones). Safe to call twice."""
        self.state.in_flight -= self._held
        self._held = 0
        for entry in self.entries:
            self.state.scheduler.cancel(entry)


async def _connected() -> bool:
    return False
