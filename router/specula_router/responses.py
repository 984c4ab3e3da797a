"""Turning scheduler events into the JSON bodies of TGI/LoRAX responses.

`collect` drains one request's events into a `Generation`; the `*_body` functions build the exact JSON the
published clients parse. Kept apart from the routes so both the streaming and non-streaming paths (and
best_of) share one definition of a token, a prefill token and the details object.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from specula_router.scheduler import Entry, ErrorEvent, FinalEvent, TokenOut, TokensEvent


class GenerationError(Exception):
    """The request failed: in the workers (424), or its adapter could not be loaded (the load's status)."""

    def __init__(self, message: str, status: int = 424, error_type: str = "generation") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.error_type = error_type


class ClientGone(Exception):
    """The client disconnected before the request finished."""


@dataclass
class Generation:
    """Everything one request produced, gathered from its events."""

    tokens: list[TokenOut] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    top_tokens: list[list[TokenOut]] = field(default_factory=list)
    prefill: list[TokenOut] = field(default_factory=list)
    final: FinalEvent | None = None

    def add(self, event: TokensEvent) -> None:
        self.tokens += event.tokens
        self.skipped += event.skipped
        self.top_tokens += event.top_tokens
        if event.prefill is not None:
            self.prefill = event.prefill

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped)

    @property
    def sum_logprob(self) -> float:
        return sum(t.logprob for t in self.tokens)


class DisconnectWatch:
    """Asks the server whether the client is gone, at most every `every_s` seconds."""

    def __init__(self, is_disconnected: Callable[[], Awaitable[bool]], every_s: float = 0.25) -> None:
        self._is_disconnected = is_disconnected
        self.every_s = every_s
        self._last = time.monotonic()

    async def gone(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.every_s:
            return False
        self._last = now
        return await self._is_disconnected()


# Seconds without an event after which a stream sends an SSE comment (`KEEPALIVE_COMMENT`, which clients skip), so
# proxies that cut idle connections keep a stream that waits in the queue (TGI's keep-alive: axum's 15 s).
KEEPALIVE_S = 15.0
KEEPALIVE_COMMENT = ": keep-alive\n\n"


async def next_event(entry: Entry, watch: DisconnectWatch, keepalive: bool = False):
    """The entry's next event; raises ClientGone when the client disconnects, even while tokens flow. With
    `keepalive`, None when no event came for `KEEPALIVE_S` (a stream then sends `KEEPALIVE_COMMENT`)."""
    get = asyncio.ensure_future(entry.events.get())
    deadline = asyncio.get_running_loop().time() + KEEPALIVE_S if keepalive else None
    try:
        while True:
            timeout = watch.every_s if deadline is None else min(watch.every_s, max(
                deadline - asyncio.get_running_loop().time(), 0.0))
            done, _ = await asyncio.wait({get}, timeout=timeout)
            if await watch.gone():
                raise ClientGone
            if done:
                return get.result()
            if deadline is not None and asyncio.get_running_loop().time() >= deadline:
                return None  # `get` is not done: cancelling it below takes nothing from the queue
    finally:
        if not get.done():
            get.cancel()  # a cancelled Queue.get takes nothing from the queue


async def collect(entry: Entry, is_disconnected: Callable[[], Awaitable[bool]]) -> Generation:
    generation = Generation()
    watch = DisconnectWatch(is_disconnected)
    while True:
        event = await next_event(entry, watch)
        if isinstance(event, TokensEvent):
            generation.add(event)
            if event.final is not None:
                generation.final = event.final
                return generation
        elif isinstance(event, FinalEvent):
            generation.final = event
            return generation
        elif isinstance(event, ErrorEvent):
            raise GenerationError(event.message, event.status, event.error_type)


def _logprob(value: float) -> float | None:
    """JSON has no NaN nor Infinity: the first prompt token's NaN, or a -inf, is written as null."""
    return value if math.isfinite(value) else None


def token_body(token: TokenOut, skipped: bool = False, alternatives: list[TokenOut] | None = None) -> dict:
    body = {"id": token.id, "text": token.text, "logprob": _logprob(token.logprob), "special": token.special,
            "skipped": skipped}
    if alternatives is not None:
        body["alternative_tokens"] = [{"id": t.id, "text": t.text, "logprob": _logprob(t.logprob)}
                                      for t in alternatives]
    return body


def top_tokens_body(tokens: list[TokenOut]) -> list[dict]:
    return [token_body(t) for t in tokens]


def prefill_body(prefill: list[TokenOut]) -> list[dict]:
    return [{"id": t.id, "text": t.text, "logprob": _logprob(t.logprob)} for t in prefill]


def sequence_details(g: Generation, with_top: bool) -> dict:
    assert g.final is not None
    details = {
        "finish_reason": g.final.finish_reason,
        "generated_tokens": g.final.generated_tokens,
        "seed": g.final.seed,
        "prefill": prefill_body(g.prefill),
        "tokens": [token_body(t, s, top if with_top else None)
                   for t, s, top in zip(g.tokens, g.skipped, g.top_tokens or [None] * len(g.tokens))],
    }
    if with_top:
        details["top_tokens"] = [top_tokens_body(top) for top in g.top_tokens]
    return details


def generate_body(
    text: str, best: Generation, others: list[tuple[str, Generation]], prompt_tokens: int, details: bool,
    with_top: bool, cached_tokens: int = 0,
) -> dict:
    if not details:
        return {"generated_text": text}
    body = sequence_details(best, with_top)
    body["prompt_tokens"] = prompt_tokens
    body["skipped_tokens"] = best.num_skipped
    body["cached_tokens"] = cached_tokens
    if others:
        body["best_of_sequences"] = [dict(sequence_details(g, with_top), generated_text=t) for t, g in others]
    return {"generated_text": text, "details": body}
