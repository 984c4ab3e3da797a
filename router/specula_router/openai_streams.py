"""Streamed OpenAI answers: the scheduler's events of every choice, as server-sent chunks, then `data: [DONE]`.

`openai_api.py` admits the request and calls `stream_response`; each choice has a `ChatChoiceStream` or a
`CompletionChoiceStream` that turns its events into chunks:

    entry events (one queue per choice) ──merged──> choice k's stream ──> "data: {chunk}\\n\\n"
    every choice finished ──> usage chunk (with stream_options.include_usage) ──> "data: [DONE]\\n\\n"

As for `/generate_stream`, a request whose adapter is still loading is answered only once it is loaded, so a
failed load is an HTTP status; an error after the stream started is an event `{"error": {...}}` before
`[DONE]`. Stop sequences are held back and left out (`StopTrimmer`); with tools, text that may still become a
tool call is held back until it is clearly content, or until the end, when it is parsed into `tool_calls`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

from fastapi.responses import StreamingResponse

from specula_router.entries import Entry, ErrorEvent, FinalEvent, TokensEvent
from specula_router.openai_errors import OpenAIError, error_body
from specula_router.openai_responses import (
    DONE,
    ChunkWriter,
    StopTrimmer,
    chat_logprobs,
    completion_logprobs,
    error_event,
    finish_reason,
)
from specula_router.responses import KEEPALIVE_COMMENT, ClientGone, DisconnectWatch, GenerationError, next_event
from specula_router.session import RequestSession
from specula_router.tool_calls import could_be_tool_call, parse_tool_calls


def _final(event: TokensEvent | FinalEvent) -> FinalEvent | None:
    return event if isinstance(event, FinalEvent) else event.final


class ChatChoiceStream:
    """The chunks of one chat choice: `delta.content` per step, `tool_calls` when the answer is a call."""

    def __init__(self, index: int, stops: Sequence[str], logprobs: bool, tool_names: set[str]) -> None:
        self.index = index
        self.trimmer = StopTrimmer(stops)
        self.logprobs = logprobs
        self.tool_names = tool_names
        self.holding = bool(tool_names)  # text held back while it may still be a tool call
        self.held_text = ""
        self.held_logprobs: list[dict] = []

    def chunks(self, event: TokensEvent | FinalEvent, writer: ChunkWriter) -> list[str]:
        tokens = event.tokens if isinstance(event, TokensEvent) else []
        final = _final(event)
        text = self.trimmer.push("".join(t.text for t in tokens if not t.special))
        if final is not None:
            text += self.trimmer.flush()
        lps = chat_logprobs(tokens, event.top_tokens)["content"] if self.logprobs and tokens else []
        if self.holding:
            self.held_text += text
            self.held_logprobs += lps
            if final is None and could_be_tool_call(self.held_text):
                return []
            self.holding = False
            text, lps = self.held_text, self.held_logprobs
            if final is not None:
                content, calls = parse_tool_calls(text, self.tool_names)
                if calls:
                    delta = {"role": "assistant", "content": content,
                             "tool_calls": [call.body(j) for j, call in enumerate(calls)]}
                    return [writer.choice(self._choice(delta, lps, "tool_calls"))]
        reason = finish_reason(final.finish_reason) if final is not None else None
        if not text and not lps and reason is None:
            return []
        # `tool_calls: null` in every delta: text-generation's Client.chat requires the key.
        return [writer.choice(self._choice({"role": "assistant", "content": text, "tool_calls": None}, lps, reason))]

    def _choice(self, delta: dict, lps: list[dict], reason: str | None) -> dict:
        return {"index": self.index, "delta": delta,
                "logprobs": {"content": lps, "refusal": None} if self.logprobs else None, "finish_reason": reason}


class CompletionChoiceStream:
    """The chunks of one completion choice: `text` per step (the prompt first, with `echo`)."""

    def __init__(self, index: int, stops: Sequence[str], num_logprobs: int | None, echo: str) -> None:
        self.index = index
        self.trimmer = StopTrimmer(stops)
        self.num_logprobs = num_logprobs
        self.prefix = echo  # sent with the first chunk
        self.offset = 0  # characters of the choice's text sent so far

    def chunks(self, event: TokensEvent | FinalEvent, writer: ChunkWriter) -> list[str]:
        tokens = event.tokens if isinstance(event, TokensEvent) else []
        final = _final(event)
        text = self.trimmer.push("".join(t.text for t in tokens if not t.special))
        if final is not None:
            text += self.trimmer.flush()
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = completion_logprobs(tokens, event.top_tokens if tokens else [], self.num_logprobs,
                                           self.offset + len(self.prefix))
        text, self.prefix = self.prefix + text, ""
        self.offset += len(text)
        reason = finish_reason(final.finish_reason) if final is not None else None
        if not text and not (logprobs and logprobs["tokens"]) and reason is None:
            return []
        return [writer.choice({"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": reason})]


class _EventSource:
    """The events of several entries as one sequence of (entry index, event); one entry is read directly."""

    def __init__(self, entries: list[Entry], watch: DisconnectWatch, first: object | None) -> None:
        self.entries = entries
        self.watch = watch
        self.pending = [(0, first)] if first is not None else []
        self.events: asyncio.Queue = asyncio.Queue()  # several entries: what their pumps forward
        self.pumps = [asyncio.ensure_future(self._pump(k, e)) for k, e in enumerate(entries)] \
            if len(entries) > 1 else []

    async def _pump(self, k: int, entry: Entry) -> None:
        while True:
            event = await entry.events.get()
            self.events.put_nowait((k, event))
            if isinstance(event, (ErrorEvent, FinalEvent)) or (isinstance(event, TokensEvent) and event.final):
                return

    async def next(self) -> tuple[int, object] | None:
        """The next (choice, event); None when none came for a while (the stream sends a keep-alive)."""
        if self.pending:
            return self.pending.pop(0)
        if not self.pumps:
            event = await next_event(self.entries[0], self.watch, keepalive=True)
            return None if event is None else (0, event)
        return await next_event(self, self.watch, keepalive=True)  # reads only `.events`: the merged queue

    def close(self) -> None:
        for pump in self.pumps:
            pump.cancel()


async def stream_response(session: RequestSession, choices: list, object_name: str, response_id: str, model: str,
                          fingerprint: str, include_usage: bool):
    """The SSE response of the session's admitted jobs (whose entries are `choices`, in order), or an error
    response when their adapter failed to load before the stream started. The stream closes the session."""
    watch = DisconnectWatch(session.is_disconnected)
    try:
        first = await session.adapter_loaded(watch)
    except GenerationError as e:
        return OpenAIError(e.status, e.message, None, e.error_type).response()
    except ClientGone:
        return OpenAIError(499, "client disconnected", None, "cancelled").response()
    writer = ChunkWriter(object_name, response_id, int(time.time()), model, fingerprint, include_usage)
    source = _EventSource(session.entries, watch, first)
    return StreamingResponse(_events(session.keep_open(), choices, source, writer, include_usage),
                             media_type="text/event-stream", headers=session.stream_headers())


async def _events(session: RequestSession, choices: list, source: _EventSource, writer: ChunkWriter,
                  include_usage: bool) -> AsyncIterator[str]:
    num_done, completion_tokens = 0, 0
    try:
        while num_done < len(source.entries):
            got = await source.next()
            if got is None:  # waiting (in the queue, preempted): a comment, which SSE clients skip
                yield KEEPALIVE_COMMENT
                continue
            k, event = got
            if isinstance(event, ErrorEvent):
                yield error_event(error_body(event.status, event.message, None, event.error_type))
                yield DONE
                return
            if not isinstance(event, (TokensEvent, FinalEvent)):
                continue
            for chunk in choices[k].chunks(event, writer):
                yield chunk
            final = _final(event)
            if final is not None:
                num_done += 1
                completion_tokens += final.generated_tokens
        session.observe_duration()
        if include_usage:
            yield writer.usage(sum(job.valid.input_length for job in session.jobs), completion_tokens)
        yield DONE
    except ClientGone:
        return
    finally:
        source.close()
        session.close()
