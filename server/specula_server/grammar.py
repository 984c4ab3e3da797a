"""Structured output in the worker: a request's grammar, compiled once, masking every position it samples.

The router turns a request's JSON schema, regex or tool-call format into an llguidance grammar and checks it
against the tokenizer (`Request.grammar`). Here llguidance (a Rust core: lexer derivatives and an Earley parser
over the tokenizer's token trie) does the work a hand-written engine would get wrong; what is Specula's own is
how its state follows the engine's steps:

    admit       `GrammarCompiler.start(grammar)`: the compiled matcher comes from a cache keyed by the grammar
                text (each request gets a copy), or is compiled on the compiler's thread, so the step that
                admits the request goes on; the request's first mask waits for it (its prompt's forward runs
                meanwhile), and a resumed request's earlier tokens are replayed into it
    plan        `forced_tokens()`: what the grammar allows exactly one way (a JSON key, a closing brace),
                proposed as drafts; `valid_prefix(tokens)` cuts a drafter's draft at the first token the grammar
                forbids
    forward     `MaskJob`, on a worker thread while the forward runs: one allowed-token bitmask per position the
                step chooses a token at (the request's next position, and after each draft node's path)
    sample      `apply_masks`: disallowed tokens' logits become -inf before penalties, warpers and the draw,
                so every later stage (greedy argmax, sampling, speculative acceptance, reported log-probs)
                sees the masked distribution
    commit      `consume(token)`; when the grammar can take nothing more (`is_complete`) the request ends
                (finish reason `eos_token`, as if the model had chosen EOS, which is all the mask would allow)

Each tensor-parallel rank keeps its own matchers: they see the same tokens, so they agree.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future

import llguidance
import tokenizers
import torch

from specula_server.threads import helper_executor

logger = logging.getLogger("specula.grammar")

__all__ = ["GrammarCompiler", "GrammarError", "MaskJob", "RequestGrammar", "apply_masks", "mask_words", "reason"]


class GrammarError(ValueError):
    """A grammar that does not compile, or a matcher that left the grammar (fails its own request alone)."""


def mask_words(vocab_size: int) -> int:
    """32-bit words of one allowed-token bitmask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


class GrammarCompiler:
    """Compiles grammars against the worker's tokenizer, once per distinct grammar text (LRU of `max_cached`).

    Compiling (`llguidance.LLMatcher(...)`) runs on one background thread, which llguidance lets run without
    the GIL, so a step never waits for another request's grammar; a request gets a fresh copy of the compiled
    matcher (`deep_copy`, microseconds).
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 max_cached: int = 256) -> None:
        self.vocab_size = vocab_size
        self._hf_tokenizer, self._eos = tokenizer, sorted(eos_token_ids) or None
        self._tokenizer: llguidance.LLTokenizer | None = None
        self.max_cached = max_cached
        self._compiled: OrderedDict[str, Future[llguidance.LLMatcher]] = OrderedDict()
        self._lock = threading.Lock()  # the cache
        self._tokenizer_lock = threading.Lock()  # apart: `start` must not wait while the tokenizer is built
        self._executor = helper_executor("specula-grammar")

    def start(self, grammar: str, replay: Sequence[int] = ()) -> RequestGrammar:
        """A request's grammar state; `replay`: tokens it generated before (a resumed request)."""
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is None:
                compiled = self._executor.submit(self._compile, grammar)
                self._compiled[grammar] = compiled
                while len(self._compiled) > self.max_cached:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(grammar)
        return RequestGrammar(compiled, tuple(replay))

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer, built on first use: by the compile thread, since it takes a tenth of
        a second at a 32000-token vocabulary (more for larger ones), which the step admitting the first constrained
        request must not wait for."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self._hf_tokenizer.to_str(), n_vocab=self.vocab_size,
                                                         eos_token=self._eos)
            return self._tokenizer

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the grammar does not compile: {reason(matcher.get_error())}")
        return matcher

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One request's position in its grammar. Its methods run on the step's thread, except `fill_masks`, which
    a `MaskJob` runs while the step's thread waits for the forward; never both at once."""

    def __init__(self, compiled: Future[llguidance.LLMatcher], replay: tuple[int, ...] = ()) -> None:
        self._compiled = compiled
        self._replay = replay
        self._matcher: llguidance.LLMatcher | None = None

    @property
    def matcher(self) -> llguidance.LLMatcher:
        """The request's own matcher; waits for the compile. Raises GrammarError if it failed or left the grammar."""
        if self._matcher is None:
            try:
                template = self._compiled.result()
            except GrammarError:
                raise
            except Exception as e:  # llguidance reports misuse as exceptions: the request fails, not the worker
                raise GrammarError(f"the grammar does not compile: {reason(str(e))}") from None
            matcher = template.deep_copy()
            if self._replay and not matcher.consume_tokens(list(self._replay)):
                raise GrammarError(f"the tokens generated before the request resumed leave its grammar: "
                                   f"{reason(matcher.get_error())}")
            self._matcher = matcher
        if self._matcher.is_error():
            raise GrammarError(f"the grammar cannot be enforced: {reason(self._matcher.get_error())}")
        return self._matcher

    @property
    def is_ready(self) -> bool:
        return self._matcher is not None or self._compiled.done()

    @property
    def is_complete(self) -> bool:
        """Nothing but EOS may follow: the output is a complete sentence of the grammar."""
        return self._matcher is not None and self._matcher.is_stopped() and not self._matcher.is_error()

    def consume(self, token_id: int) -> None:
        """Advances past a committed token: always one its mask allowed (a failure shows at its next mask)."""
        if self._matcher is not None and not self._matcher.is_error():
            self._matcher.consume_token(token_id)

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar allows exactly one way from here (its fast-forward tokens); [] when none."""
        if self._matcher is None and not self._compiled.done():
            return []
        try:
            return self.matcher.compute_ff_tokens()
        except GrammarError:
            return []

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order from the current state, the grammar allows (0 once the grammar failed:
        the step's mask reports the failure)."""
        if not tokens:
            return 0
        try:
            return self.matcher.validate_tokens(list(tokens))
        except GrammarError:
            return 0

    def fill_masks(self, out: torch.Tensor, first_row: int, tokens: Sequence[int], parents: Sequence[int]) -> None:
        """Writes the allowed-token bitmask of the current state into `out[first_row]`, and of the state after
        the path to each draft node i (tokens[i], parent parents[i], -1: the root) into `out[first_row + 1 + i]`.

        Nodes come after their parents, so one walk moves the matcher along each path, rolling back to the
        branch point, and leaves it where it started. A node whose path leaves the grammar (a sampled draft is
        kept whole, see `Speculator`) can never be accepted: its row repeats its parent's mask, so it holds a
        proper distribution that nothing reads.
        """
        matcher = self.matcher
        row_bytes = out.shape[1] * out.element_size()
        matcher.unsafe_compute_mask_ptr(out[first_row].data_ptr(), row_bytes)
        if matcher.is_error():  # a limit tripped: its mask allows only EOS, which would end the answer silently
            raise GrammarError(f"the grammar cannot be enforced: {reason(matcher.get_error())}")
        paths: list[tuple[int, ...] | None] = []  # each node's path from the root; None: it left the grammar
        current: tuple[int, ...] = ()  # the tokens the matcher has consumed past its starting state
        for i, (token, parent) in enumerate(zip(tokens, parents)):
            base = () if parent < 0 else paths[parent]
            row = first_row + 1 + i
            if base is not None:  # a reachable parent's path was consumed before: move the matcher onto it
                common = _common_prefix(current, base)
                if common < len(current):
                    matcher.rollback(len(current) - common)
                if not matcher.consume_tokens(list(base[common:])):
                    raise GrammarError(f"a draft path it accepted before was refused: {matcher.get_error()}")
                current = base
                if matcher.validate_tokens([token]) == 1:
                    matcher.consume_token(token)
                    current = base + (token,)
                    paths.append(current)
                    matcher.unsafe_compute_mask_ptr(out[row].data_ptr(), row_bytes)
                    if matcher.is_error():
                        raise GrammarError(f"the grammar cannot be enforced: {reason(matcher.get_error())}")
                    continue
            paths.append(None)  # unreachable: its parent's mask
            out[row] = out[first_row + 1 + parent] if parent >= 0 else out[first_row]
        if current:
            matcher.rollback(len(current))


def reason(message: str, limit: int = 200) -> str:
    """The first line of an llguidance error, bounded: its messages go on with the parser's state (hundreds of
    bytes: `<state>`, the tokens, the rows), which is for llguidance's developers, not for a client.

    Example: reason("lexer error: too many expressions constructed\\n<state>\\nTokens: ...")
             -> "lexer error: too many expressions constructed"
    """
    line = next((line.strip() for line in message.splitlines() if line.strip()), "") or "unknown error"
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class MaskJob:
    """The allowed-token masks of one step, computed on a worker thread while the forward runs.

    `items`: (request index, grammar, draft tokens, draft parents) per constrained request. `bitmask` holds their
    masks one request after another (`spans`); `errors` the messages of the requests whose grammar failed, by
    request index (they fail alone).
    """

    _executor = helper_executor("specula-masks")

    def __init__(self, items: Sequence[tuple[int, RequestGrammar, Sequence[int], Sequence[int]]],
                 vocab_size: int, background: bool = True) -> None:
        self.items = list(items)
        num_rows = sum(1 + len(tokens) for _, _, tokens, _ in self.items)
        self.bitmask = torch.zeros(num_rows, mask_words(vocab_size), dtype=torch.int32)
        self.errors: dict[int, str] = {}
        self._future = self._executor.submit(self._run) if background else None
        if not background:
            self._run()

    def spans(self) -> list[tuple[int, int, int]]:
        """(request index, its first row in `bitmask`, rows) per constrained request."""
        spans, at = [], 0
        for index, _, tokens, _ in self.items:
            spans.append((index, at, 1 + len(tokens)))
            at += 1 + len(tokens)
        return spans

    @torch.inference_mode()  # the step allocated `bitmask` in inference mode, which is per thread
    def _run(self) -> None:
        for (index, grammar, tokens, parents), (_, at, _) in zip(self.items, self.spans()):
            try:
                grammar.fill_masks(self.bitmask, at, tokens, parents)
            except GrammarError as e:
                logger.warning("a request's grammar failed: %s", e)
                self.errors[index] = str(e)
            except Exception as e:  # a bug in one grammar must not take the step down
                logger.exception("computing a token mask failed")
                self.errors[index] = f"its grammar failed: {e}"

    def wait(self) -> MaskJob:
        if self._future is not None:
            self._future.result()
        return self


def apply_masks(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets `logits[rows[j], t]` to -inf for every token t the bitmask row j does not allow (in place).

    Bit t % 32 of word t // 32 is token t (llguidance's layout); words cover ids past the logits' width with zeros.
    """
    if rows.numel() == 0:
        return
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)[:, :vocab]
    rows = rows.to(logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))

