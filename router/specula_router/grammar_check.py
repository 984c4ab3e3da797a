"""Admission-time checking of structured-output grammars (built by `grammar.py`) against the model's tokenizer.

`GrammarChecker` runs `LLMatcher.validate_grammar` on a thread of its own, under a wall-clock limit, then walks
the grammar's first positions as a worker would (`_probe`: limits that trip only once tokens are consumed, masks
too slow to compute, grammars that accept nothing or only an empty answer), and keeps the results (errors
included) of the last 256 distinct grammars, so a repeated grammar costs a dict lookup.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import numpy as np
import tokenizers

from specula_router.grammar import Grammar, GrammarError, first_lines, json_schema_grammar, shown
from specula_router.tool_call_grammar import special_token_texts

__all__ = ["DEFAULT_GRAMMAR_COMPILE_TIMEOUT", "MAX_MASK_SECONDS", "PROBE_STEPS", "GrammarChecker"]

DEFAULT_GRAMMAR_COMPILE_TIMEOUT = 10.0
_TIMED_OUT = "did not compile within"
# The admission probe (`GrammarChecker._probe`): positions walked, and the slowest token mask a grammar may need.
PROBE_STEPS = 8
MAX_MASK_SECONDS = 1.0
MAX_PROBED_PATTERNS = 64


def _schema_patterns(grammar: str) -> list[str]:
    """The distinct `pattern` strings of the JSON schemas in an llguidance grammar's text (its `json_schema`
    grammars and the `%json{...}` lines of its Lark ones)."""
    try:
        entries = json.loads(grammar).get("grammars", ())
        schemas: list[Any] = [entry.get("json_schema") for entry in entries]
        for entry in entries:
            for line in (entry.get("lark_grammar") or "").splitlines():
                at = line.find("%json")
                if at >= 0:
                    schemas.append(json.loads(line[at + len("%json"):]))
    except (ValueError, AttributeError, RecursionError):
        return []
    patterns: dict[str, None] = {}
    stack = schemas
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                patterns[node["pattern"]] = None
            if isinstance(node.get("patternProperties"), dict):
                patterns.update(dict.fromkeys(node["patternProperties"]))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return list(patterns)


def _anchored(pattern: str) -> str:
    """A JSON Schema pattern (which matches anywhere in the string) as one matching the whole string."""
    body = pattern.removeprefix("^")
    if body.endswith("$") and not body.endswith("\\$"):
        body = body[:-1]
    return f"^(?:{body})$"


class GrammarChecker:
    """Checks grammars against the model's tokenizer, off the event loop, once per distinct grammar text.

    `check` answers "" for a grammar that compiles, else a short error message. The LLTokenizer is built on first
    use (in the checking thread: a large vocabulary takes a while). `validations` counts the grammars actually
    handed to llguidance, so a cache hit shows as no change.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, vocab_size: int | None = None,
                 eos_token_ids: Iterable[int] = (), timeout_s: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT,
                 cache_size: int = 256, workers: int = 2) -> None:
        if timeout_s <= 0:
            raise ValueError(f"--grammar-compile-timeout must be positive; got {timeout_s}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.special_tokens = special_token_texts(tokenizer)
        self.validations = 0
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._token_lengths: np.ndarray | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future[str]] = OrderedDict()
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="grammar-check")

    async def check(self, grammar: str) -> str:
        """"" when `grammar` compiles against the tokenizer and its first positions can be enforced (`_probe`);
        else why not, as a predicate of the field ("does not compile: <llguidance's first lines>", "cannot be
        enforced: ...", "accepts only an empty answer", the time limit). Concurrent checks of one grammar share
        one validation; its result stays cached."""
        future = self._cache.get(grammar)
        if future is None or future.cancelled():
            future = self._executor.submit(self._validate, grammar)
            self._cache[grammar] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(grammar)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout_s)
        except asyncio.TimeoutError:
            return f"{_TIMED_OUT} {self.timeout_s:g} s (--grammar-compile-timeout)"

    async def check_or_raise(self, grammar: Grammar) -> None:
        """Raises `GrammarError` naming `grammar.field` when the grammar does not compile or cannot be enforced."""
        message = await self.check(grammar.text)
        if message:
            raise GrammarError(f"`{grammar.field}` {message}", grammar.field)

    def lltokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._lltokenizer is None:
                self._lltokenizer = llguidance.LLTokenizer(self.tokenizer.to_str(), n_vocab=self.vocab_size,
                                                           eos_token=self.eos_token_ids or None)
            return self._lltokenizer

    def token_lengths(self) -> np.ndarray:
        """Each token's length in bytes, [vocab_size] (built once, with the LLTokenizer)."""
        with self._lock:
            if self._token_lengths is None:
                self._token_lengths = np.array([len(self._lltokenizer.decode_bytes([i]))  # type: ignore[union-attr]
                                                for i in range(self.vocab_size)], dtype=np.int32)
            return self._token_lengths

    def _validate(self, grammar: str) -> str:
        self.validations += 1
        try:
            message = llguidance.LLMatcher.validate_grammar(grammar, self.lltokenizer(),
                                                            limits=llguidance.LLParserLimits())
            if message:
                return f"does not compile: {first_lines(message)}"
            return self._probe(grammar)
        except Exception as e:  # a tokenizer llguidance cannot read, a grammar it cannot parse at all
            return f"does not compile: {first_lines(str(e) or type(e).__name__)}"

    def _probe(self, grammar: str) -> str:
        """"" when the grammar's first positions can be enforced as a worker enforces them; else why not.

        A grammar that compiles may still fail where it is used: llguidance builds its lexer lazily, so a regex
        like `a{1000000}` trips a limit ("too many expressions constructed") only when a mask is computed after
        some token, and a schema that can never end (an object whose required property is that object) runs out
        of parser items a few tokens in. The worker would then fail the request mid-answer (or, before this
        check, end it with an empty answer). So the router walks `PROBE_STEPS` positions as the worker would
        (`_walk`), then each JSON Schema `pattern` on its own (an optional property's pattern is not on the
        walked path), and refuses:

            a limit tripped or the grammar left      "cannot be enforced: <llguidance's reason, one line>"
            a mask slower than MAX_MASK_SECONDS      "cannot be enforced in time: ..." (every step of every
                                                     request in the batch would wait for it)
            no token allowed at the start            "can never be satisfied: ..."
            only the end allowed at the start        "accepts only an empty answer"
        """
        matcher = llguidance.LLMatcher(self.lltokenizer(), grammar, log_level=0)
        if matcher.is_error():
            return f"does not compile: {first_lines(matcher.get_error())}"
        # The walk stops at the time limit too: the waiting request is answered then, and a thread still busy with
        # an abandoned grammar would hold up the next ones.
        deadline = time.monotonic() + self.timeout_s
        message = self._walk(matcher, deadline)
        if message:
            return message
        for pattern in _schema_patterns(grammar)[:MAX_PROBED_PATTERNS]:
            alone = llguidance.LLMatcher(self.lltokenizer(), json_schema_grammar(
                {"type": "string", "pattern": _anchored(pattern)}, "pattern").text, log_level=0)
            message = "" if alone.is_error() else self._walk(alone, deadline)  # a form it cannot take alone: skip
            if message.startswith(_TIMED_OUT):
                return message
            if message.startswith("cannot be enforced"):  # not "never satisfied": an optional property's may be
                return f"{message} (the pattern {shown(pattern)})"
        return ""

    def _walk(self, matcher: llguidance.LLMatcher, deadline: float) -> str:
        """Follows the longest allowed token (the most lexer work) for up to `PROBE_STEPS` positions, computing
        the forced tokens and the mask at each, as a worker does; "" when nothing failed (see `_probe`)."""
        lengths = self.token_lengths()
        ends = np.asarray(self.lltokenizer().eos_tokens, dtype=np.int64)
        for step in range(PROBE_STEPS):
            if time.monotonic() > deadline:
                return f"{_TIMED_OUT} {self.timeout_s:g} s (--grammar-compile-timeout)"
            start = time.perf_counter()
            matcher.compute_ff_tokens()  # what the worker drafts for free: it has limits of its own
            bitmask = matcher.compute_bitmask()
            seconds = time.perf_counter() - start
            allowed = np.flatnonzero(np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8),
                                                   bitorder="little")[:self.vocab_size])
            text = np.setdiff1d(allowed, ends, assume_unique=True)
            if matcher.is_error():
                reason = first_lines(matcher.get_error())
                if step == 0 and not text.size and reason.startswith("NoExtensionBias"):
                    return "can never be satisfied: no answer matches it"
                return f"cannot be enforced: {reason}"
            if seconds > MAX_MASK_SECONDS:
                return (f"cannot be enforced in time: a token mask took {seconds:.1f} s to compute "
                        f"(at most {MAX_MASK_SECONDS:g} s)")
            if not text.size:
                if step > 0:
                    return ""  # a complete answer
                return "accepts only an empty answer" if matcher.is_accepting() else \
                    "can never be satisfied: no token can start an answer"
            if not matcher.consume_token(int(text[np.argmax(lengths[text])])):
                return f"cannot be enforced: {first_lines(matcher.get_error())}"
        return ""

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
