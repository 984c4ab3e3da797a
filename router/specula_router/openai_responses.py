"""The OpenAI-compatible API's answers: the router's generations written in OpenAI's exact shapes.

`openai_api.py` runs the requests and calls these builders; they know nothing of the scheduler. Shapes (as the
official `openai` client parses them):

    chat.completion        {id: chatcmpl-*, object, created, model, system_fingerprint,
                            choices: [{index, message: {role, content, tool_calls?}, logprobs, finish_reason}], usage}
    chat.completion.chunk  {..., choices: [{index, delta: {role, content}, logprobs, finish_reason}], usage?}
    text_completion        {id: cmpl-*, ..., choices: [{index, text, logprobs, finish_reason}], usage}

`finish_reason` is `stop` (end of sequence or a stop sequence), `length` or `tool_calls`. As in OpenAI, a stop
sequence ends the text and is not part of it (`StopTrimmer`). Every delta carries `role` (TGI's habit, which
text-generation's `Client.chat` requires). Log-probabilities are finite floats: JSON has no -inf, and the
official client wants a number, so -inf is written as -9999.0 (vLLM's value).
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Sequence

from specula_router.entries import TokenOut

FINISH_REASONS = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}
MIN_LOGPROB = -9999.0


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def finish_reason(worker_reason: str) -> str:
    return FINISH_REASONS.get(worker_reason, "stop")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def _top_entry(token: TokenOut) -> dict:
    return {"token": token.text, "logprob": logprob(token.logprob), "bytes": list(token.text.encode("utf-8"))}


def chat_logprobs(tokens: Sequence[TokenOut], top_tokens: Sequence[Sequence[TokenOut]]) -> dict:
    """`choices[].logprobs` of a chat answer: one entry per generated token that is text (not EOS)."""
    content = []
    for i, token in enumerate(tokens):
        if token.special:
            continue
        entry = _top_entry(token)
        entry["top_logprobs"] = [_top_entry(t) for t in top_tokens[i]] if i < len(top_tokens) else []
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(tokens: Sequence[TokenOut], top_tokens: Sequence[Sequence[TokenOut] | None],
                        num_top: int, text_offset: int = 0) -> dict:
    """`choices[].logprobs` of a completion (the legacy shape): parallel lists over the text tokens.

    `top_tokens[i]` None (a prompt token under `echo`) gives a null entry; `text_offset` is where the first
    token's text starts in the choice's text.
    """
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for i, token in enumerate(tokens):
        if token.special:
            continue
        top = top_tokens[i] if i < len(top_tokens) else None
        out["tokens"].append(token.text)
        out["token_logprobs"].append(None if math.isnan(token.logprob) else logprob(token.logprob))
        out["top_logprobs"].append(None if top is None or num_top == 0 else
                                   {t.text: logprob(t.logprob) for t in top[:num_top]})
        out["text_offset"].append(offset)
        offset += len(token.text)
    return out


def trim_at_stop(text: str, stops: Sequence[str]) -> str:
    """`text` up to the first occurrence of any stop sequence (OpenAI leaves the stop sequence out).

    A worker's text ends where the stop sequence that ended it ends (docs/api.md), and none ends earlier in
    it, so on such text this drops just the stop sequence at its end (the longest, where several end there).
    """
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


class StopTrimmer:
    """A stream's text with stop sequences left out: text that may be the start of a stop sequence is held
    back until the next token shows whether it is.

    Example, stop "\\n\\n": push("a\\n") -> "a" (the "\\n" may start the stop), push("\\nb") -> "" (stopped).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self.pending += text
        trimmed = trim_at_stop(self.pending, self.stops)
        if len(trimmed) < len(self.pending):
            self.stopped, self.pending = True, ""
            return trimmed
        hold = self._held_length()
        ready, self.pending = self.pending[:len(self.pending) - hold], self.pending[len(self.pending) - hold:]
        return ready

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out

    def _held_length(self) -> int:
        """The longest end of `pending` that is a proper prefix of a stop sequence."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(stop[:k]):
                    longest = k
                    break
        return longest


class ChunkWriter:
    """Server-sent events of one streamed answer: every chunk shares its id, object, created, model."""

    def __init__(self, object_name: str, response_id: str, created: int, model: str, fingerprint: str,
                 include_usage: bool) -> None:
        head = {"id": response_id, "object": object_name, "created": created, "model": model,
                "system_fingerprint": fingerprint}
        # Serialised once: only the choices change from chunk to chunk.
        self._head = json.dumps(head, ensure_ascii=False)[:-1] + ', "choices": '
        self._tail = ', "usage": null}' if include_usage else "}"

    def choice(self, choice: dict) -> str:
        return f"data: {self._head}[{json.dumps(choice, ensure_ascii=False, allow_nan=False)}]{self._tail}\n\n"

    def usage(self, prompt_tokens: int, completion_tokens: int) -> str:
        return f"data: {self._head}[], \"usage\": {json.dumps(usage(prompt_tokens, completion_tokens))}}}\n\n"


DONE = "data: [DONE]\n\n"


def error_event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
